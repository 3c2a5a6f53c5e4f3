"""Resuming a run (issue 43, item 11): the run's own values written out explicitly are the same run, and the
counters behind the logged padding fraction continue over the whole run instead of restarting."""

from __future__ import annotations

from pathlib import Path

import pytest

from inference.errors import UserError
from medusa_train import checkpoint
from medusa_train import trainer as T
from medusa_train.tracking import read_metrics
from test_resume_config import RUN, interrupted_run

EAGLE = ["heads.kind=eagle3", "backbone.random_init.num_hidden_layers=8"]


def train_records(out: Path) -> list[dict]:
    return [r for r in read_metrics(Path(out) / "metrics.jsonl") if r["kind"] == "train"]


def test_resume_with_the_runs_resolved_values_written_out(compose_tiny, tmp_path, monkeypatch):
    """Guards against: resuming with the values the run already resolved given explicitly (heads.aux_layers
    equal to the default layers, heads.ttt_steps equal to num_heads, heads.draft_vocab_size equal to the
    truncated vocabulary) refused as "a different configuration"; a really different value is still refused."""
    out = tmp_path / "run"
    interrupted_run(compose_tiny, out, monkeypatch, *EAGLE)
    spec = checkpoint.read_state(checkpoint.find_resume(out, "auto"))["heads"]
    aux = ",".join(str(i) for i in spec["aux_layers"])
    explicit = [f"heads.aux_layers=[{aux}]", f"heads.ttt_steps={spec['num_heads']}",
                f"heads.draft_vocab_size={spec['truncated_vocab_size']}"]
    with pytest.raises(UserError, match="heads.ttt_steps"):
        T.run(compose_tiny(*RUN, *EAGLE, "heads.ttt_steps=2", out=out))
    assert T.run(compose_tiny(*RUN, *EAGLE, *explicit, out=out))["step"] == 4
    assert [r["step"] for r in train_records(out)] == [1, 2, 3, 4]


def test_resume_without_the_values_a_run_gave_explicitly(compose_tiny, tmp_path, monkeypatch):
    """Guards against: the reverse of the above: a run started with its defaults spelled out (here the loss
    weights decay^k and the mlp_speculator width) refused when resumed without them."""
    out = tmp_path / "run"
    interrupted_run(compose_tiny, out, monkeypatch, "heads.kind=mlp_speculator", "heads.inner_dim=64",
                       "heads.loss_decay=0.5", "heads.loss_weights=[0.5,0.25,0.125]")
    assert T.run(compose_tiny(*RUN, "heads.kind=mlp_speculator", "heads.loss_decay=0.5", out=out))["step"] == 4


def test_padding_fraction_continues_after_resume(compose_tiny, tmp_path, monkeypatch):
    """Guards against: the logged padding_fraction restarting its count after a resume (the resumed run
    reporting the fraction of its own batches only), so the log of a resumed run differs from the
    uninterrupted one; the counters are saved in the checkpoint and restored."""
    extra = ["data.packing=false"]  # length-bucketed rows: padding in every batch
    T.run(compose_tiny(*RUN, *extra, out=tmp_path / "a"))
    interrupted_run(compose_tiny, tmp_path / "b", monkeypatch, *extra)
    T.run(compose_tiny(*RUN, *extra, out=tmp_path / "b"))
    reference = [r["padding_fraction"] for r in train_records(tmp_path / "a")]
    resumed = [r["padding_fraction"] for r in train_records(tmp_path / "b")]
    assert len(set(reference)) > 1  # the fraction moves from step to step
    assert resumed == reference
    assert [r["loss"] for r in train_records(tmp_path / "b")] == [r["loss"] for r in train_records(tmp_path / "a")]


def test_a_resume_inside_a_logging_window_logs_what_the_uninterrupted_run_logs(compose_tiny, tmp_path, monkeypatch):
    """Guards against the first record after a resume averaging only the steps run since the resume: with
    log_every=3 and a checkpoint at step 2, the resumed run logged step 3's loss, accuracies and chain_tau over
    step 3 alone (6.70 where the uninterrupted run logged 6.51), so metrics.jsonl differed from it. The window's
    sums are kept in the checkpoint: every record is the same, to the last bit."""
    window = ["trainer.log_every=3", "trainer.max_steps=6", "trainer.save_every=2", "logger.plot=false"]
    T.run(compose_tiny(*window, out=tmp_path / "a"))
    interrupted_run(compose_tiny, tmp_path / "b", monkeypatch, run=window)
    T.run(compose_tiny(*window, out=tmp_path / "b"))
    drop = ("tokens_per_s", "time", "elapsed_s", "timestamp")   # wall-clock figures differ between any two runs
    a, b = ([{k: v for k, v in r.items() if k not in drop} for r in train_records(tmp_path / x)] for x in "ab")
    assert [r["step"] for r in a] == [3, 6] and a == b


# What every run recorded under ``heads`` before the heads keys were split by family: every family's keys, the
# ones its own family does not read at their unset values.
LEGACY_HEADS_KEYS = {"inner_dim": 0, "tie_weights": False, "scale_input": False, "aux_layers": None,
                     "draft_vocab_size": None, "ttt_steps": None}


@pytest.mark.parametrize("extra", [[], ["heads.kind=hydra"], EAGLE], ids=["medusa", "hydra", "eagle3"])
def test_a_run_recorded_before_the_family_split_resumes(extra, compose_tiny, tmp_path, monkeypatch):
    """Guards against: runs checkpointed before the heads config became one group per family (their record
    holds every family's keys under heads) refused as "a different configuration" on resume, or their
    automatic keys (eagle3's aux layers, TTT steps, draft vocabulary) compared as if spelled out."""
    import json

    out = tmp_path / "run"
    interrupted_run(compose_tiny, out, monkeypatch, *extra)
    path = checkpoint.find_resume(out, "auto")
    state = checkpoint.read_state(path)
    own = state["config"]["heads"]
    state["config"]["heads"] = {**LEGACY_HEADS_KEYS, **own}  # the family's own keys keep their values
    (path / checkpoint.STATE_FILE).write_text(json.dumps(state, indent=2))
    assert T.run(compose_tiny(*RUN, *extra, out=out))["step"] == 4
    assert [r["step"] for r in train_records(out)] == [1, 2, 3, 4]
