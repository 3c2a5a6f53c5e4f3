"""medusa-train refusals that must come before anything is written (issue 43, items 6, 8, 9): one
``medusa-train: error: ...`` line, exit 2, and no ``<output_dir>/.hydra`` record, backbone or folder left
behind; and a TTT unroll the memory estimate counts and the configuration bounds."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from conftest import TINY_DATA, clean_env, console_script
from inference.errors import UserError

REFUSED = [
    (["heads.truncated_vocab_size=0"], "heads.truncated_vocab_size must be >= 1"),
    (["heads.truncated_vocab_size=100000"], "heads.truncated_vocab_size=100000 exceeds the backbone vocabulary (320)"),
    (["trainer.micro_batch_size=0"], "trainer.micro_batch_size must be >= 1"),
    (["trainer.global_batch_size=3"], "trainer.global_batch_size=3 is not a multiple"),
    (["trainer.resume={tmp}/missing"], "is not a checkpoint directory"),
    (["heads.kind=eagle3", "backbone.random_init.num_hidden_layers=8", "heads.ttt_steps=100000"],
     "heads.ttt_steps must be in 1..32"),
    (["heads.kind=eagle3", "backbone.random_init.num_hidden_layers=8", "heads.num_heads=100000"], "heads.num_heads"),
]


def snapshot(root: Path) -> dict:
    """Every path under ``root`` with its bytes (folders as None): to prove a refusal wrote nothing."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def medusa_train(tmp: Path, *args: str, out: Path | None = None) -> subprocess.CompletedProcess:
    argv = ["debug_tiny", f"output_dir={out or tmp / 'out'}", f"data.source={TINY_DATA}", "logger.wandb=disabled",
            "trainer.progress_bar=false", "trainer.threads=1", *args]
    return subprocess.run([console_script("medusa-train"), *argv], capture_output=True, text=True, cwd=tmp,
                          env=clean_env(), timeout=240)


def assert_one_line_refusal(proc: subprocess.CompletedProcess, phrase: str) -> None:
    lines = [line for line in proc.stderr.splitlines() if line.strip() and not line.startswith("[transformers]")]
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("medusa-train: error: "), proc.stderr[-3000:]
    assert phrase in lines[0], (phrase, lines[0])


@pytest.mark.parametrize("args, phrase", REFUSED, ids=[a[-1] for a, _ in REFUSED])
def test_refused_configuration_writes_nothing(args, phrase, tmp_path):
    """Guards against: a configuration refused only once Hydra ran (or after the backbone loaded) leaving
    ``<output_dir>/.hydra/{config,hydra,overrides}.yaml`` (and a saved random backbone) behind, and an
    eagle3 TTT unroll of 100,000 steps running until the kernel kills it (exit -9, no message)."""
    before = snapshot(tmp_path)
    proc = medusa_train(tmp_path, *[a.replace("{tmp}", str(tmp_path)) for a in args])
    assert_one_line_refusal(proc, phrase)
    assert snapshot(tmp_path) == before, "a refused command wrote files"


def test_output_dir_that_cannot_be_created_is_one_line(tmp_path):
    """Guards against: ``output_dir=/proc/x`` (a folder the kernel will not let anyone create) ending in
    Hydra's FileNotFoundError traceback instead of one line."""
    proc = medusa_train(tmp_path, out=Path("/proc/medusa-train-x/run"))
    assert_one_line_refusal(proc, "output_dir=/proc/medusa-train-x/run cannot be created")
    assert not Path("/proc/medusa-train-x").exists()


def test_refused_resume_keeps_the_runs_record(tmp_path):
    """Guards against: a resume refused for changed keys overwriting the run's own ``.hydra/config.yaml`` and
    ``overrides.yaml`` with the refused settings (the record then no longer says how the run was trained);
    and an idle rerun of a finished run rewriting it. An accepted resume updates the record."""
    out = tmp_path / "out"
    run = ["trainer.max_steps=2", "trainer.save_every=1", "logger.plot=false"]
    proc = medusa_train(tmp_path, *run, "heads.num_heads=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = out / ".hydra"
    assert "heads.num_heads=2" in (record / "overrides.yaml").read_text()
    assert "num_heads: 2" in (record / "config.yaml").read_text() and (record / "hydra.yaml").is_file()
    before = snapshot(out)

    assert_one_line_refusal(medusa_train(tmp_path, *run, "heads.num_heads=3"), "heads.num_heads (2 -> 3)")
    assert snapshot(out) == before, "a refused resume changed the run's files"
    assert medusa_train(tmp_path, *run, "heads.num_heads=2").returncode == 0  # already trained: nothing to do
    assert snapshot(out) == before, "an idle rerun changed the run's files"

    proc = medusa_train(tmp_path, "trainer.max_steps=3", "trainer.save_every=1", "logger.plot=false",
                        "heads.num_heads=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "trainer.max_steps=3" in (record / "overrides.yaml").read_text()
    assert "max_steps: 3" in (record / "config.yaml").read_text()


# -- item 6: the TTT unroll in the memory estimate, bounded ------------------------------------------------
def test_ttt_unroll_is_counted_in_the_memory_estimate(compose_tiny, monkeypatch):
    """Guards against: the memory estimate counting one frozen forward only, so an eagle3 drafter unrolled over
    many TTT steps (each step's activations and its growing attention mask kept for backward) passes the
    check and then grows until the kernel kills the run without a word."""
    from medusa_train import backbone as B
    from medusa_train.config import MAX_TTT_STEPS, validate

    monkeypatch.setattr(B, "available_memory", lambda device: (64 * 2**20, "RAM available"))
    short = compose_tiny("heads.kind=eagle3", "heads.ttt_steps=1", "backbone.random_init.num_hidden_layers=8")
    B.check_fits(short)  # one step fits in 64 MB
    deep = compose_tiny("heads.kind=eagle3", f"heads.ttt_steps={MAX_TTT_STEPS}",
                        "backbone.random_init.num_hidden_layers=8")
    validate(deep)
    with pytest.raises(UserError, match=rf"heads.ttt_steps={MAX_TTT_STEPS}.*or heads.ttt_steps"):
        B.check_fits(deep)
    hf_config = B.backbone_config(deep.backbone)
    unroll = [B.ttt_unroll_bytes(cfg.heads, hf_config, 256, 2, 4) for cfg in (short, deep)]
    assert unroll[1] > 8 * unroll[0] > 0


def test_ttt_steps_is_bounded(compose_tiny):
    """Guards against: heads.ttt_steps (or an eagle3 heads.num_heads standing in for it) of 100000 accepted."""
    from medusa_train.config import MAX_TTT_STEPS, validate

    validate(compose_tiny("heads.kind=eagle3", f"heads.ttt_steps={MAX_TTT_STEPS}"))
    for args in (["heads.ttt_steps=100000"], ["heads.num_heads=100000"]):
        with pytest.raises(UserError, match=rf"heads.{args[0][6:].split('=')[0]}.*1..{MAX_TTT_STEPS}"):
            validate(compose_tiny("heads.kind=eagle3", *args))
