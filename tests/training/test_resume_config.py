"""Resuming into an output_dir under a changed configuration (medusa_train/checkpoint.py docstring),
and rerunning a training that is already complete."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import base_overrides, clean_env, console_script
from inference.errors import UserError
from medusa_train import checkpoint
from medusa_train import trainer as T
from medusa_train.tracking import read_metrics

RUN = ["trainer.log_every=1", "trainer.max_steps=4", "trainer.save_every=2", "logger.plot=false"]


def records(out: Path) -> list[dict]:
    return list(read_metrics(Path(out) / "metrics.jsonl"))


def snapshot(out: Path) -> dict:
    """Every file under ``out`` with its bytes: to prove a refused or idle rerun changed nothing."""
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(Path(out).rglob("*")) if p.is_file()}


def forbid_loading(monkeypatch) -> None:
    """Make loading the backbone or touching the data fail the test (the check must come first)."""
    def boom(*a, **k):
        raise AssertionError("weights or data were loaded")

    monkeypatch.setattr(T, "load_backbone", boom)
    monkeypatch.setattr(T, "RankData", boom)
    monkeypatch.setattr(checkpoint, "load", boom)


def interrupted_run(compose_tiny, out: Path, monkeypatch, *extra: str, run: list = RUN) -> None:
    """A 4-step run (``run``'s keys) killed right after its step-2 checkpoint (so it is resumable, not finished)."""
    original = T.MedusaTrainer.save_checkpoint

    def save_then_die(self):
        path = original(self)
        if self.step == 2:
            raise RuntimeError("killed after the step-2 checkpoint")
        return path

    monkeypatch.setattr(T.MedusaTrainer, "save_checkpoint", save_then_die)
    with pytest.raises(RuntimeError, match="killed"):
        T.run(compose_tiny(*run, *extra, out=out))
    monkeypatch.undo()


@pytest.mark.parametrize("change, key", [
    (["heads.num_heads=2"], "heads.num_heads"),
    (["heads.truncated_vocab_size=64"], "heads.truncated_vocab_size"),
    (["optim.lr=1e-4"], "optim.lr"),
    (["data.max_length=128", "trainer.seed=3"], "data.max_length"),
    # same effective batch, but the saved data position counts micro-batches: other rows would be trained
    (["trainer.micro_batch_size=1", "trainer.global_batch_size=2"], "trainer.micro_batch_size (2 -> 1)"),
], ids=["num_heads", "truncated_vocab", "lr", "data-and-seed", "micro_batch_size"])
def test_resume_under_changed_heads_or_training_is_refused(change, key, compose_tiny, tmp_path, monkeypatch):
    """Guards against: resuming a 3-head checkpoint with heads.num_heads=2 silently continuing the 3-head
    run (metrics.jsonl then mixes both runs' losses), a changed truncated_vocab_size crashing with a
    size-mismatch traceback, or a changed lr / data order resumed as if nothing changed. The refusal is
    one line naming the keys, comes before any weights or data are loaded, and changes no file."""
    out = tmp_path / "run"
    interrupted_run(compose_tiny, out, monkeypatch)
    before = snapshot(out)
    forbid_loading(monkeypatch)
    with pytest.raises(UserError) as err:
        T.run(compose_tiny(*RUN, *change, out=out))
    msg = str(err.value)
    assert "\n" not in msg and key in msg and "step-000002" in msg and "output_dir" in msg, msg
    if "trainer.seed=3" in change:
        assert "trainer.seed" in msg, msg
    assert snapshot(out) == before


def test_safe_changes_resume(compose_tiny, tmp_path, monkeypatch):
    """Guards against: refusing changes that do not change what is trained (more steps, checkpoint and
    log cadence, logger, threads, ZeRO stage, the output_dir of an explicit trainer.resume=<dir>)."""
    a = tmp_path / "a"
    interrupted_run(compose_tiny, a, monkeypatch)
    summary = T.run(compose_tiny(*RUN, "trainer.max_steps=6", "trainer.save_every=3", "trainer.log_every=2",
                                 "trainer.eval_every=3", "trainer.keep_last=3", "logger.plot=true",
                                 "trainer.zero_stage=1", out=a))
    assert summary["step"] == 6
    steps = [r["step"] for r in records(a) if r["kind"] == "train"]
    assert steps == [1, 2, 4, 6]  # steps 1-2 from the first run (log_every=1), then every 2
    b = tmp_path / "b"  # another output_dir, resuming a's checkpoint explicitly
    ckpt = a / "checkpoints" / "step-000006"
    assert T.run(compose_tiny(*RUN, "trainer.max_steps=7", f"trainer.resume={ckpt}", out=b))["step"] == 7


def test_resume_never_starts_fresh_with_new_heads(compose_tiny, tmp_path, monkeypatch):
    """Guards against: the resume check blocking trainer.resume=never, which must still start over in an
    existing output_dir (metrics rewritten from step 1, the new heads exported) whatever was there."""
    out = tmp_path / "run"
    interrupted_run(compose_tiny, out, monkeypatch)
    T.run(compose_tiny(*RUN, "heads.num_heads=2", "trainer.resume=never", out=out))
    assert [r["step"] for r in records(out) if r["kind"] == "train"] == [1, 2, 3, 4]
    assert json.loads((out / "heads" / "config.json").read_text())["num_heads"] == 2
    state = checkpoint.read_state(checkpoint.find_resume(out, "auto"))
    assert state["step"] == 4 and state["config"]["heads"]["num_heads"] == 2


def test_safe_unsafe_split():
    """Guards against: the safe/unsafe split drifting from the documented one (a key that changes the
    heads, data order, loss or optimizer passing, or a cadence/logging key refused), and a new config
    key being treated as safe before anyone decided it is."""
    saved = {"heads": {"num_heads": 3, "loss_decay": 0.8}, "optim": {"lr": 1e-3, "betas": [0.9, 0.95]},
             "trainer": {"max_steps": 10, "seed": 0, "grad_clip": 1.0, "save_every": 5, "precision": "fp32"},
             "data": {"shuffle_buffer": 16}, "logger": {"wandb": "offline"}, "output_dir": "a",
             "backbone": {"dtype": "float32", "attn_implementation": "sdpa"}, "features": {"cache_dir": None}}
    flat = checkpoint.flatten(saved)

    def changed(key, value):
        new = dict(flat)
        new[key] = value
        return checkpoint.unsafe_changes(flat, new)

    for key, value in [("heads.num_heads", 2), ("heads.loss_decay", 0.5), ("optim.lr", 1e-4),
                       ("optim.betas", [0.9, 0.99]), ("trainer.seed", 1), ("trainer.grad_clip", 0.5),
                       ("data.shuffle_buffer", 8), ("backbone.dtype", "bfloat16")]:
        assert changed(key, value) == [key], key
    # the saved data position counts micro-batches: another micro-batch size reads other rows
    micro = {**flat, "trainer.micro_batch_size": 2}
    assert checkpoint.unsafe_changes(micro, {**micro, "trainer.micro_batch_size": 1}) == ["trainer.micro_batch_size"]
    # a key nobody has classified yet is unsafe; one the checkpoint's version did not have is not compared
    assert checkpoint.unsafe_changes({**flat, "lora.new_key": 1}, {**flat, "lora.new_key": 2}) == ["lora.new_key"]
    assert checkpoint.unsafe_changes(flat, {**flat, "lora.new_key": 2}) == []
    # ... unless it is set away from its default: the checkpoint's version trained with the default
    defaults = {"heads.train_on": "assistant"}
    assert checkpoint.unsafe_changes(flat, {**flat, "heads.train_on": "all"}, defaults) == ["heads.train_on"]
    assert checkpoint.unsafe_changes(flat, {**flat, "heads.train_on": "assistant"}, defaults) == []
    with pytest.raises(UserError, match=r'heads.train_on \("assistant" -> "all"\)'):
        checkpoint.check_resume_config(Path("ck"), {"config": saved}, {**saved, "heads": {**saved["heads"],
                                                                                     "train_on": "all"}}, 4)
    # a section that was empty (None) and is now set, or the reverse, is a change of that section
    assert checkpoint.unsafe_changes({**flat, "backbone.random_init": None},
                                     {**flat, "backbone.random_init.hidden_size": 64}) == ["backbone.random_init"]
    for key, value in [("trainer.max_steps", 20), ("trainer.save_every", 2), ("logger.wandb", "disabled"),
                       ("output_dir", "b"), ("trainer.precision", "bf16"), ("backbone.attn_implementation", "eager"),
                       ("features.cache_dir", "/c")]:
        assert changed(key, value) == [], key
    assert checkpoint.unsafe_changes(flat, {**flat, "optim.betas": (0.9, 0.95)}) == []  # tuple == list
    with pytest.raises(UserError, match=r"global_batch_size \(effective\) \(2 -> 4\)"):
        checkpoint.check_resume_config(Path("ck"), {"config": saved, "global_batch_size": 2}, saved, 4)
    checkpoint.check_resume_config(Path("ck"), {"config": saved, "global_batch_size": 2}, saved, 2)
    # a checkpoint written before configurations were stored: its heads spec is still compared
    with pytest.raises(UserError, match="heads.num_heads"):
        checkpoint.check_resume_config(Path("ck"), {"heads": {"num_heads": 3, "projection": "own"}},
                                       {"heads": {"num_heads": 2, "projection": "own"}}, 2)


def test_rerun_of_a_finished_training_does_nothing(compose_tiny, tmp_path, monkeypatch, capsys):
    """Guards against: rerunning the same command on a completed run reading the data again and printing
    "data: 0 conversations usable" (or retraining / re-exporting): it must say it is already done,
    touch nothing (not even metrics.jsonl or the heads) and succeed."""
    out = tmp_path / "run"
    T.run(compose_tiny(*RUN, out=out))
    before = snapshot(out)
    capsys.readouterr()
    forbid_loading(monkeypatch)
    summary = T.run(compose_tiny(*RUN, out=out))
    printed = capsys.readouterr().out
    assert summary["step"] == 4
    assert f"already trained to step 4/4; nothing to do (heads in {out / 'heads'})" in printed, printed
    assert "conversations usable" not in printed
    assert snapshot(out) == before


def test_finished_training_killed_before_its_export_exports_on_rerun(compose_tiny, tmp_path, monkeypatch, capsys):
    """Guards against: a run killed after its last checkpoint but before (or during) its export being
    called finished on rerun while heads/ is missing or holds an older run's export."""
    out = tmp_path / "run"
    T.run(compose_tiny(*RUN, out=out))
    old_heads = (out / "heads" / "model.safetensors").read_bytes()
    monkeypatch.setattr(T.MedusaTrainer, "export", lambda self: (_ for _ in ()).throw(RuntimeError("killed")))
    with pytest.raises(RuntimeError):
        T.run(compose_tiny(*RUN, "trainer.resume=never", "trainer.seed=1", out=out))  # heads/ now stale
    monkeypatch.undo()
    capsys.readouterr()
    T.run(compose_tiny(*RUN, "trainer.seed=1", out=out))
    assert "nothing to do" not in capsys.readouterr().out
    assert (out / "heads" / "model.safetensors").read_bytes() != old_heads


def test_cli_rerun_of_a_finished_training_exits_zero(compose_tiny, tmp_path):
    """Guards against: the medusa-train command failing or reading data when rerun on a finished run."""
    out = tmp_path / "cli"
    T.run(compose_tiny(*RUN, out=out))
    proc = subprocess.run([console_script("medusa-train"), "debug_tiny", *base_overrides(out), *RUN],
                          capture_output=True, text=True, env=clean_env(), cwd=tmp_path, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "already trained to step 4/4; nothing to do" in proc.stdout, proc.stdout
    assert "Traceback" not in proc.stderr and "conversations usable" not in proc.stdout


def test_resume_never_keeps_its_own_newest_checkpoints(compose_tiny, tmp_path):
    """Guards against: a fresh run (trainer.resume=never) in a directory holding an older run's higher
    steps pruning its own newest checkpoint by name (keep_last) and leaving `latest` dangling, so the
    next resume=auto would fall back to the older run's checkpoint."""
    out = tmp_path / "run"
    args = ["trainer.save_every=2", "trainer.keep_last=2", "logger.plot=false"]
    T.run(compose_tiny(*args, "trainer.max_steps=8", out=out))
    T.run(compose_tiny(*args, "trainer.max_steps=4", "trainer.resume=never", out=out))
    root = out / "checkpoints"
    assert sorted(p.name for p in root.glob("step-*")) == ["step-000002", "step-000004"]
    assert checkpoint.find_resume(out, "auto").name == "step-000004"


def test_a_resumed_truncated_run_maps_targets_through_the_checkpoints_token_map(compose_tiny, tmp_path, monkeypatch):
    """Guards against: a resumed run with a truncated vocabulary mapping its targets through the inverse of the map
    its own start scanned, while the heads carry the checkpoint's map. Both were the same until a version ranked the
    tokens otherwise (the end-of-turn ids forced first): every target then trained the neighbouring token's row."""
    from medusa_train.losses import vocab_to_local

    truncated = ["heads.projection=truncated", "heads.truncated_vocab_size=16"]
    a = tmp_path / "a"
    interrupted_run(compose_tiny, a, monkeypatch, *truncated)
    scanned = T.MedusaTrainer._token_map
    monkeypatch.setattr(T.MedusaTrainer, "_token_map", lambda self, *a: scanned(self, *a).roll(1))   # another order
    trainer = T.MedusaTrainer(compose_tiny(*RUN, *truncated, out=a))
    trainer.setup()
    try:
        assert trainer.step == 2
        heads = trainer.module.heads
        assert torch.equal(trainer.module.inv_map.cpu(), vocab_to_local(heads.token_map, trainer.spec.vocab_size).cpu())
    finally:
        trainer.cleanup(plot=False)


def test_a_resumed_truncated_run_takes_its_map_without_scanning_the_data(compose_tiny, tmp_path, monkeypatch):
    """Guards against: a resumed run with a truncated vocabulary scanning the data for a token map (minutes on the
    real recipe: 3,000 conversations) only to replace it with the checkpoint's; a checkpoint that did not keep one
    still gets the scan."""
    truncated = ["heads.projection=truncated", "heads.truncated_vocab_size=16"]
    a = tmp_path / "a"
    interrupted_run(compose_tiny, a, monkeypatch, *truncated)
    ckpt = checkpoint.find_resume(a, "auto")
    assert checkpoint.holds_token_map(ckpt) and not checkpoint.holds_token_map(tmp_path / "nowhere")
    saved = load_file(str(ckpt / "heads.safetensors"))
    scans = []
    scanned = T.MedusaTrainer._token_map
    monkeypatch.setattr(T.MedusaTrainer, "_token_map", lambda self, *a: scans.append(1) or scanned(self, *a))
    trainer = T.MedusaTrainer(compose_tiny(*RUN, *truncated, out=a))
    trainer.setup()
    try:
        assert trainer.step == 2 and scans == []
        key = next(k for k in saved if k.endswith("token_map"))
        assert torch.equal(trainer.module.heads.token_map.cpu(), saved[key])
    finally:
        trainer.cleanup(plot=False)


def test_a_resume_under_another_world_size_starts_the_next_epoch(capsys):
    """Guards against a checkpoint's position inside an epoch (micro-batches of one rank's shard) applied to another
    layout of the data over the ranks: resumed with fewer processes, 12 of 32 conversations of that epoch trained
    twice; with more, 8 never. The resume starts the next epoch instead and says so; the same world size keeps its
    own positions, and a position at an epoch's start needs no change."""
    from types import SimpleNamespace

    def position(world, saved):
        me = SimpleNamespace(world_size=world, rank=0, is_main=True,
                             source=SimpleNamespace(stats=SimpleNamespace(restore_batch_counts=lambda c: None)))
        return T.MedusaTrainer._rank_data_state(me, {"data": saved[0], "data_per_rank": saved})

    two = [{"epoch": 1, "index": 2}, {"epoch": 1, "index": 2}]
    assert position(1, two) == {"epoch": 2, "index": 0}
    assert "starts epoch 2 (the rest of epoch 1 is not trained" in capsys.readouterr().out
    assert position(2, two) == {"epoch": 1, "index": 2}
    assert position(4, [{"epoch": 3, "index": 0}]) == {"epoch": 3, "index": 0}
    # a rank with a shorter shard already inside the next epoch: no batch of it trained again
    assert position(1, [{"epoch": 0, "index": 7}, {"epoch": 1, "index": 1}]) == {"epoch": 2, "index": 0}
    assert position(3, [{"epoch": 1, "index": 1}, {"epoch": 0, "index": 7}]) == {"epoch": 2, "index": 0}


def test_a_trained_runs_record_is_kept_only_when_it_is_that_runs(compose_tiny, out_dir):
    """Guards against ``keeps_trained_record`` keeping a record that is not the heads' own (one a command refused
    after it accepted its data wrote, with another head count): the original command's idle rerun must rewrite
    it, or it is refused there later as "another configuration" once the checkpoints are gone. A record that
    differs in safe keys only (precision), or a build's in its own ``features.*``, is the heads' and is kept."""
    from omegaconf import OmegaConf

    cfg = compose_tiny()
    (out_dir / "heads").mkdir(parents=True)
    (out_dir / ".hydra").mkdir()
    record = out_dir / ".hydra" / "config.yaml"
    assert not checkpoint.keeps_trained_record(cfg)   # no record: write one
    record.write_text(OmegaConf.to_yaml(compose_tiny("trainer.log_every=7")))
    assert checkpoint.keeps_trained_record(cfg)
    record.write_text(OmegaConf.to_yaml(compose_tiny("heads.num_heads=2")))
    assert not checkpoint.keeps_trained_record(cfg)
    record.write_text(OmegaConf.to_yaml(compose_tiny()))
    build = compose_tiny("features.mode=build")
    assert checkpoint.keeps_trained_record(build, ignoring=("features.",))
    assert not checkpoint.keeps_trained_record(build)
