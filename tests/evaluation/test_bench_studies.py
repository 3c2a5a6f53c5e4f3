"""The benchmark studies (benchmarks/studies/*.yaml, run by ``python scripts/bench.py study <name>``) stay runnable.

Guards against a study that fails only after an hour of training: a study file that no longer parses, a recipe
it names that was renamed or removed, a medusa-train override the composed recipe refuses (a key that moved into
another config group), a medusa-eval key that is not a field of ``inference.cli.EvalConfig`` (a key renamed in
the CLI), or a dry run that runs something. No model is built: the recipes are composed, the keys looked up.
"""

import dataclasses
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import study  # noqa: E402

STUDIES = study.names()


def dry_run(name: str) -> list[list[str]]:
    """The commands ``bench.py study <name> --dry-run`` prints, each as argv (comment lines dropped)."""
    proc = subprocess.run([sys.executable, "scripts/bench.py", "study", name, "--dry-run", "--bin", "/nonexistent"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return [shlex.split(line) for line in proc.stdout.splitlines() if line and not line.startswith("#")]


def test_there_are_studies_and_each_parses():
    """Guards against an empty or unreadable studies folder: bench.py list would then show nothing to run."""
    assert {"families", "batch", "quickstart", "eagle3_lookup"} <= set(STUDIES)
    for name in STUDIES:
        s = study.load(name)
        assert s["title"] and s.get("eval"), name


@pytest.mark.parametrize("name", STUDIES)
def test_dry_run_commands_are_ones_the_clis_accept(name):
    """Guards against a study whose commands the CLIs would refuse: unknown recipe, override or medusa-eval key."""
    from inference.cli import EvalConfig
    from medusa_train.launch import compose_recipe

    eval_keys = {f.name for f in dataclasses.fields(EvalConfig)}
    commands = dry_run(name)
    assert commands and all(Path(c[0]).name in ("medusa-train", "medusa-eval") for c in commands), commands
    for cmd in commands:
        cli, args = Path(cmd[0]).name, cmd[1:]
        if cli == "medusa-train":
            recipe, overrides = args[0], args[1:]
            assert (ROOT / "recipes" / f"{recipe}.yaml").is_file(), f"{name}: no recipe {recipe}"
            compose_recipe(recipe, overrides)  # raises on an unknown key or a wrong type
        else:
            keys = {a.split("=", 1)[0] for a in args}
            assert keys <= eval_keys, f"{name}: medusa-eval keys not in EvalConfig: {sorted(keys - eval_keys)}"
            assert any(a.startswith("out=") for a in args)


def test_dry_run_runs_nothing():
    """Guards against --dry-run starting a training: its --bin names no folder, so a command it ran would fail;
    it must print the commands in order (training first) and exit 0."""
    commands = dry_run("quickstart")
    assert [Path(c[0]).name for c in commands] == ["medusa-train", "medusa-eval"]
    assert commands[0][1] == "medusa1_smollm2" and "heads=runs/medusa1_smollm2/heads" in commands[1]


def test_unknown_study_is_one_line():
    """Guards against a typo in a study's name ending in a traceback instead of the list of known studies."""
    proc = subprocess.run([sys.executable, "scripts/bench.py", "study", "no_such_study"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "no study 'no_such_study'" in proc.stderr and "families" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_section_gives_median_and_spread_over_repeats(tmp_path, monkeypatch):
    """Guards against the generated section misreporting repeated runs: the speedup is the median of the runs,
    with their [min-max], and a batched report gets one row per (batch size, method)."""
    monkeypatch.setattr(study, "RESULTS", tmp_path / "results")
    s = {"title": "T", "history": "H", "out": str(tmp_path / "runs"),
         "eval": {"one": {"heads": "runs/x/heads", "repeats": 3, "args": {"methods": ["eagle3"]}},
                  "b": {"args": {"batch_size": [1, 2]}}}}
    machine = {"cpu": "x86_64", "cores": 2, "threads": 2, "torch": "2.x"}
    for r, speed in zip((1, 2, 3), (1.30, 1.41, 1.35)):
        d = tmp_path / "runs" / "one" / f"r{r}"
        d.mkdir(parents=True)
        row = {"tokens_per_s": 20 * speed, "tau": 1.804, "speedup_vs_autoregressive": speed,
               "speedup_vs_hf_generate": 1.9, "greedy_identical_fraction": 1.0}
        (d / "report.json").write_text(json.dumps({
            "machine": machine, "per_method": {"eagle3": row, "autoregressive": {"tokens_per_s": 20, "tau": 1.0}},
            "eagle3_tree": {"name": "n4-d1-k4"}}))
    d = tmp_path / "runs" / "b"
    d.mkdir(parents=True)
    per = {"autoregressive": {"tokens_per_s": 30.0, "tau": 1.0, "greedy_identical": True}}
    (d / "report.json").write_text(json.dumps({"machine": machine, "batched": {
        "per_batch_size": {"1": {"per_method": per}, "2": {"per_method": per}}}}))
    text = study.write_section("t", s).read_text()
    assert "| eagle3 | 1.804 | 27.00 [26.00-28.20] | 1.35x [1.30x-1.41x] | 1.90x | 100% |" in text
    assert "Chosen: eagle3_tree: n4-d1-k4." in text and '"H"' in text
    assert "| 1 | autoregressive |" in text and "| 2 | autoregressive |" in text


def test_help_lists_every_subcommand_without_loading_torch():
    """Guards against the entry's --help importing the micro-benchmarks (torch, a model) before printing, or a
    subcommand missing from it."""
    code = ("import runpy, sys\nsys.argv = ['scripts/bench.py', '--help']\ntry:\n"
            "    runpy.run_path('scripts/bench.py', run_name='__main__')\nexcept SystemExit:\n    pass\n"
            "print('torch loaded:', 'torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "torch loaded: False" in proc.stdout, proc.stdout + proc.stderr
    for sub in ("list", "study", "machine", "kernels", "tree-attention", "train", "profile-gpu"):
        assert sub in proc.stdout


def test_every_micro_benchmark_imports():
    """Guards against a micro-benchmark importing a library name that moved (they run rarely, by hand, so a
    stale import would first show on the day someone needs the figure)."""
    import importlib
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_entry", ROOT / "scripts" / "bench.py")
    entry = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(entry)
    for name, (module, _) in entry.MICRO.items():
        assert callable(importlib.import_module(module).main), name


def test_an_evaluation_reruns_when_its_arguments_changed(tmp_path, monkeypatch):
    """Guards against a study skipping an evaluation because some report.json exists, though the study file now
    gives other arguments (the section then showed old figures under today's command line and today's date): the
    arguments are recorded beside the report, a change runs it again, and the section prints the report's own
    command line and date."""
    monkeypatch.chdir(tmp_path)   # run() changes into the repository: restored after the test
    monkeypatch.setattr(study, "RESULTS", tmp_path / "results")
    out = tmp_path / "runs"
    s = {"title": "T", "out": str(out), "eval": {"one": {"heads": "runs/x/heads", "args": {"max_new_tokens": 8}}}}
    monkeypatch.setattr(study, "load", lambda name: s)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "medusa-eval").write_text("")
    ran = []

    def fake_run(cmd, env=None):
        ran.append(cmd[1:])
        where = Path(next(a for a in cmd if a.startswith("out=")).split("=", 1)[1])
        where.mkdir(parents=True, exist_ok=True)
        (where / "report.json").write_text(json.dumps({"machine": {"cpu": "x"}, "per_method": {
            "autoregressive": {"tokens_per_s": 1.0, "tau": 1.0}}}))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(study.subprocess, "run", fake_run)
    assert study.run("t", bin_dir=tmp_path / "bin") == 0 and len(ran) == 1
    assert study.run("t", bin_dir=tmp_path / "bin") == 0 and len(ran) == 1          # same arguments: skipped
    s["eval"]["one"]["args"] = {"max_new_tokens": 16}
    assert study.run("t", bin_dir=tmp_path / "bin") == 0 and len(ran) == 2          # changed: run again
    assert "max_new_tokens=16" in ran[-1]
    record = json.loads((out / "one" / "study_job.json").read_text())
    record["finished"] = "2001-02-03 04:05:06"
    (out / "one" / "study_job.json").write_text(json.dumps(record))
    text = study.write_section("t", s).read_text()
    assert "reports of 2001-02-03." in text and "max_new_tokens=16" in text


def test_plain_loop_vs_generate_warms_both_alike(monkeypatch):
    """Guards against the machine benchmark timing transformers' generate's first call (its config and processors
    built on the first prompt) while the runtime's loop had been warmed by whatever ran before: both get one short
    untimed call first, and only the calls after it are timed."""
    from benchmarks import timing
    from inference.runtime.decode import GenerationOutput

    calls = []

    def fake(m, ids, name, max_new_tokens):
        calls.append((name, max_new_tokens))
        g = GenerationOutput(tokens=[1] * max_new_tokens, prompt_tokens=len(ids), finish_reason="length")
        g.decode_s = 1.0
        return g

    monkeypatch.setattr(timing, "generate", fake)
    out = timing.plain_loop_vs_generate(None, [[1, 2], [3, 4]], 32)
    assert calls[:2] == [("autoregressive", timing.WARMUP_TOKENS), ("hf_generate", timing.WARMUP_TOKENS)]
    assert len(calls) == 6 and out["prompts"] == 2 and out["new_tokens"] == [32, 32]
