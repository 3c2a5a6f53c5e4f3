"""The ``medusa-train`` command line, as a user runs it (subprocesses): help, bad input, a real run."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from conftest import base_overrides, clean_env, console_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"].get("scripts", {})


def run_cli(args, env, cwd, timeout=180, command=None):
    cmd = command or [console_script("medusa-train")]
    return subprocess.run([*cmd, *map(str, args)], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=timeout)


def assert_one_line_error(proc, *words):
    """Non-zero exit, no traceback, exactly one stderr line: ``medusa-train: error: ...`` naming ``words``."""
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout, proc.stderr[-3000:]
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("medusa-train: error: "), lines[0]
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


# -- help ---------------------------------------------------------------------------------------
def test_pyproject_declares_console_scripts():
    """Guards against: the [project.scripts] table disappearing (then the --help test would cover nothing)."""
    assert "medusa-train" in SCRIPTS


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_every_console_command_has_help(name, subprocess_env, tmp_path):
    """Guards against: a console command that is not installed, crashes on --help, or imports torch /
    DeepSpeed before printing help (commands added later to pyproject are covered automatically)."""
    proc = run_cli(["--help"], subprocess_env, tmp_path, timeout=60, command=[console_script(name)])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert proc.stdout.strip()
    assert not list(tmp_path.iterdir())  # --help writes nothing


def test_help_lists_every_recipe(subprocess_env, tmp_path):
    """Guards against: --help omitting recipes (users cannot discover them) or a bare call failing."""
    from medusa_train.cli import available_recipes

    for args in (["--help"], [], ["-h"]):
        proc = run_cli(args, subprocess_env, tmp_path, timeout=60)
        assert proc.returncode == 0
        for name in available_recipes():
            assert name in proc.stdout


def test_help_shows_recipe_descriptions_whole():
    """Guards against: --help cutting a recipe's description mid-sentence ("eagle3_smollm2 ... one Llama decoder
    layer over", "hydra_smollm2 ... but") by showing only its header's first line: each description, wrapped,
    reads as the header paragraph's whole first sentence."""
    from importlib import resources

    from medusa_train.cli import RECIPE_PACKAGE, available_recipes, usage

    text = usage()
    assert max(map(len, text.splitlines())) <= 120
    entries: dict[str, str] = {}
    name = None
    for line in text.split("recipes:\n", 1)[1].split("\n\n", 1)[0].splitlines():
        if not line.startswith("   "):   # "  <name> <words>" starts a recipe; deeper lines continue it
            name, _, line = line.strip().partition(" ")
        entries[name] = (entries.get(name, "") + " " + line.strip()).strip()
    assert sorted(entries) == available_recipes()
    for name, shown in entries.items():
        header = resources.files(RECIPE_PACKAGE).joinpath(f"{name}.yaml").read_text().split("\n#\n", 1)[0]
        paragraph = " ".join(l.lstrip("#").strip() for l in header.splitlines())
        assert shown.endswith(".") and paragraph.startswith(shown), (name, shown)
    assert entries["eagle3_smollm2"].endswith("for the 60-minute budget on 2 CPU cores and for decoding on a CPU.")
    assert entries["hydra_smollm2"].endswith("the embeddings of the tokens it extends (inference/heads/hydra.py).")


def test_help_does_not_import_heavy_modules():
    """Guards against: --help becoming slow because torch / DeepSpeed / transformers load at import."""
    code = ("import sys; from medusa_train import cli; cli.main(['--help']); "
            "heavy = [m for m in ('torch', 'deepspeed', 'transformers', 'hydra') if m in sys.modules]; "
            "print('HEAVY', heavy)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=clean_env())
    assert proc.returncode == 0, proc.stderr
    assert "HEAVY []" in proc.stdout


# -- bad input ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("args, words", [
    (["nope"], ["unknown recipe 'nope'", "debug_tiny"]),
    (["debug_tiny", "trainer.nope=1"], ["trainer.nope"]),
    (["debug_tiny", "trainer.max_steps=abc"], ["trainer.max_steps", "abc"]),
    (["debug_tiny", "heads.projection=bogus"], ["heads.projection", "bogus"]),
    (["debug_tiny", "heads.kind=hydar"], ["heads.kind must be one of ['medusa', 'hydra', 'mlp_speculator', 'eagle3']", "hydar"]),
    (["debug_tiny", "trainer.precision=bf16", "trainer.zero_stage=0"], ["trainer.precision=bf16", "zero_stage"]),
    (["debug_tiny", "trainer.max_steps=0"], ["trainer.max_steps"]),
], ids=["unknown-recipe", "unknown-key", "wrong-type", "bad-enum", "bad-heads-kind", "bf16-zero0", "bad-range"])
def test_config_mistakes_fail_in_one_line(args, words, subprocess_env, tmp_path):
    """Guards against: config mistakes (unknown recipe or key, wrong type, refused combination such as
    bf16 without ZeRO) producing a traceback or Hydra's multi-line dump instead of one line naming the key."""
    proc = run_cli([*args, *base_overrides(tmp_path / "out")], subprocess_env, tmp_path)
    assert_one_line_error(proc, *words)
    assert not (tmp_path / "out" / "checkpoints").exists()


@pytest.mark.parametrize("rest, overrides, flags", [
    (["a=1", "+b.c=2", "~d"], ["a=1", "+b.c=2", "~d"], []),
    (["--cfg", "job", "a=1"], ["a=1"], ["--cfg", "job"]),
    (["--cfg=hydra", "-m", "a=1,2"], ["a=1,2"], ["--cfg=hydra", "-m"]),
    (["--resolve", "-c", "all", "--info"], [], ["--resolve", "-c", "all", "--info", "all"]),
    (["--info", "a=1"], ["a=1"], ["--info", "all"]),   # the override is not --info's value once flags go first
    (["--info", "defaults"], [], ["--info", "defaults"]),
])
def test_split_args_keeps_overrides_and_supported_hydra_flags(rest, overrides, flags):
    """Guards against: the bare-word check refusing Hydra's own flags (--cfg job, -m) or override forms
    (+key=, ~key) that medusa-train passes on to Hydra."""
    from medusa_train.cli import split_args

    assert split_args(rest) == (overrides, flags)


def _no_assistant_file(tmp_path) -> Path:
    path = tmp_path / "questions.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"conversations": [{"from": "human", "value": "hello?"}]},
        {"messages": [{"role": "user", "content": "anyone?"}, {"role": "system", "content": "x"}]}]) + "\n")
    return path


def test_missing_data_file(subprocess_env, tmp_path):
    """Guards against: a missing data file being looked up on the dataset hub or crashing with a traceback."""
    proc = run_cli(["debug_tiny", *base_overrides(tmp_path / "out", "/nonexistent.jsonl")], subprocess_env, tmp_path)
    assert_one_line_error(proc, "/nonexistent.jsonl", "not found")


def test_dataset_without_assistant_turns(subprocess_env, tmp_path):
    """Guards against: a dataset with nothing to learn looping forever or crashing instead of saying why."""
    proc = run_cli(["debug_tiny", *base_overrides(tmp_path / "out", _no_assistant_file(tmp_path))],
                   subprocess_env, tmp_path)
    assert_one_line_error(proc, "no training conversations", "no assistant turn")


def test_missing_backbone_path(subprocess_env, tmp_path):
    """Guards against: a local backbone path that does not exist being sent to the hub (confusing
    repo-id errors, network waits) instead of 'not found'."""
    proc = run_cli(["debug_tiny", "backbone.random_init=null", "backbone.name_or_path=/nonexistent",
                    *base_overrides(tmp_path / "out")], subprocess_env, tmp_path)
    assert_one_line_error(proc, "/nonexistent", "not found")


@pytest.mark.parametrize("args, words", [
    (["trainer.device=cuda"], ["trainer.device=cuda", "no CUDA"]),
    (["trainer.precision=fp16", "trainer.zero_stage=1"], ["fp16", "GPU"]),
], ids=["device-cuda", "fp16"])
def test_gpu_only_options_on_cpu(args, words, subprocess_env, tmp_path):
    """Guards against: GPU-only settings on a CPU machine failing deep inside torch / DeepSpeed."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    proc = run_cli(["debug_tiny", *args, *base_overrides(tmp_path / "out")], subprocess_env, tmp_path)
    assert_one_line_error(proc, *words)


def test_nan_loss_names_last_good_checkpoint(subprocess_env, tmp_path):
    """Guards against: a diverging run (optim.lr=1e30) crashing, or training on with NaN weights, instead
    of stopping with one line that names the last good checkpoint, which must still exist and load."""
    out = tmp_path / "out"
    proc = run_cli(["debug_tiny", "optim.lr=1e30", "optim.warmup_steps=0", "trainer.save_every=1",
                    "trainer.keep_last=10", *base_overrides(out)], subprocess_env, tmp_path)
    line = assert_one_line_error(proc, "NaN", "last good checkpoint")
    kept = Path(line.split("last good checkpoint kept: ")[1].split(")")[0])
    assert kept.parent == out / "checkpoints" and kept.is_dir()
    from safetensors.torch import load_file

    from medusa_train.checkpoint import read_state

    step = read_state(kept)["step"]
    assert f"at step {step + 1}" in line
    assert load_file(str(kept / "heads.safetensors")) and load_file(str(kept / "optimizer.safetensors"))
    assert not (out / "heads").exists()  # nothing was exported from a diverged run


# -- working commands ------------------------------------------------------------------------------------------
def test_cli_run_trains_and_exports(subprocess_env, tmp_path):
    """Guards against: the installed command failing where the in-process API works (Hydra wiring,
    output folder, exit code)."""
    out = tmp_path / "out"
    proc = run_cli(["debug_tiny", "trainer.max_steps=2", *base_overrides(out)], subprocess_env, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in (out / "heads").iterdir()) == ["config.json", "model.safetensors"]
    assert "heads exported to" in proc.stdout
    assert not (tmp_path / "outputs").exists()  # Hydra writes beside the run, never into the CWD


def test_wandb_offline_default_logs_beside_the_run(tmp_path):
    """Guards against: the main recipes' default tracker (wandb offline) failing without network or
    writing its run anywhere but the output folder."""
    out = tmp_path / "out"
    env = clean_env()
    env.pop("WANDB_MODE", None)
    args = ["debug_tiny", "trainer.max_steps=2", *base_overrides(out)]
    args[args.index("logger.wandb=disabled")] = "logger.wandb=offline"
    proc = run_cli(args, env, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "wandb disabled" not in proc.stderr  # the tracker did start
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
    assert not (tmp_path / "wandb").exists()


def test_print_config_does_not_train(subprocess_env, tmp_path):
    """Guards against: `--cfg job` (print the composed config) starting a training run."""
    out = tmp_path / "out"
    proc = run_cli(["debug_tiny", "--cfg", "job", "trainer.max_steps=7", f"output_dir={out}"], subprocess_env,
                   tmp_path, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "max_steps: 7" in proc.stdout
    assert not (out / "checkpoints").exists()


def test_multirun_jobs_write_separate_folders(subprocess_env, tmp_path):
    """Guards against: Hydra sweep jobs (-m) all training into the same output_dir and overwriting each other."""
    out = tmp_path / "sweep"
    proc = run_cli(["debug_tiny", "-m", "heads.num_layers=1,2", "trainer.max_steps=1", *base_overrides(out)],
                   subprocess_env, tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    layers = sorted(json.loads((out / "multirun" / str(i) / "heads" / "config.json").read_text())["num_layers"]
                    for i in (0, 1))
    assert layers == [1, 2]


def test_cli_works_after_an_in_process_run(compose_tiny, tmp_path):
    """Guards against: an in-process run (notebook, tests, tooling) leaving process-group variables in
    os.environ that break every training subprocess started afterwards."""
    import os

    from medusa_train import trainer as T

    T.run(compose_tiny("trainer.max_steps=1", "logger.plot=false"))
    env = dict(os.environ, WANDB_MODE="disabled")  # what a child of this process inherits
    proc = run_cli(["debug_tiny", "trainer.max_steps=1", *base_overrides(tmp_path / "cli")], env, tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_module_entry_point_runs(subprocess_env, tmp_path):
    """Guards against: the `-m medusa_train.cli` entry point (what `deepspeed --module` uses) failing
    where the console script works."""
    out = tmp_path / "out"
    proc = run_cli(["debug_tiny", "trainer.max_steps=1", *base_overrides(out)], subprocess_env, tmp_path,
                   command=[sys.executable, "-m", "medusa_train.cli"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "heads" / "model.safetensors").is_file()


@pytest.mark.parametrize("flags, words", [
    (["--resolve"], ["--resolve changes what --cfg prints"]),
    (["--package=trainer"], ["--package changes what --cfg prints"]),
    (["--info=bogus"], ["--info takes all, config", "'bogus'"]),
], ids=["resolve", "package", "info-topic"])
def test_hydra_flags_that_print_nothing_alone_are_one_line(flags, words, subprocess_env, tmp_path):
    """Guards against: ``--resolve`` without ``--cfg`` ending in Hydra's ValueError traceback after the output folder
    was made, ``--package`` without ``--cfg`` ignored while the run trained, an unknown ``--info`` topic answered
    with argparse's multi-line usage."""
    proc = run_cli(["debug_tiny", *base_overrides(tmp_path / "out"), *flags], subprocess_env, tmp_path)
    assert_one_line_error(proc, *words)
    assert not (tmp_path / "out").exists()
