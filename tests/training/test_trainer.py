"""The trainer in-process on the tiny random backbone: what trains, what stays frozen, attention
isolation of packed rows, checkpoints and resume, the export, NaN handling."""

from __future__ import annotations

import json
import math
import os
import re
import signal
from pathlib import Path

import pytest
import torch

from inference.errors import UserError
from inference.loading import load_heads
from medusa_train import checkpoint
from medusa_train import trainer as T
from medusa_train.data.masks import block_causal_mask
from medusa_train.data.tokenize import encode_conversation
from medusa_train.data.stream import collate
from medusa_train.sources import HeadsWithLoss
from medusa_train.tracking import read_metrics

RESUME_OVERRIDES = ["trainer.log_every=1", "trainer.max_steps=8", "trainer.save_every=4", "logger.plot=false"]


def train_losses(out: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(Path(out) / "metrics.jsonl") if r["kind"] == "train"]


def train_steps(out: Path) -> list[int]:
    return [r["step"] for r in read_metrics(Path(out) / "metrics.jsonl") if r["kind"] == "train"]


def make_trainer(cfg) -> T.MedusaTrainer:
    trainer = T.MedusaTrainer(cfg)
    trainer.setup()
    return trainer


# -- what trains and what stays frozen -----------------------------------------------------------
@pytest.mark.parametrize("projection, extra", [
    ("truncated", []), ("own", []), ("shared", []),
    ("shared", ["trainer.precision=bf16", "trainer.zero_stage=1"]),  # bf16 engine casts the module it wraps
    ("shared", ["trainer.precision=bf16", "trainer.zero_stage=1", "backbone.dtype=bfloat16"]),
    ("shared", ["backbone.dtype=bfloat16"]),   # heads in fp32 over a bf16 backbone
], ids=["truncated", "own", "shared", "shared-bf16", "shared-bf16-backbone", "shared-fp32-bf16-backbone"])
def test_backbone_frozen_heads_learn(projection, extra, compose_tiny):
    """Guards against: gradient or optimizer updates reaching the backbone (Medusa-1 must leave it
    bit-identical, including a shared lm_head), a head parameter that never trains (e.g. a block left
    out of the optimizer), and a loss that does not fall when the same batch is seen again."""
    trainer = make_trainer(compose_tiny(f"heads.projection={projection}", "heads.num_layers=2",
                                        "trainer.max_steps=3", "trainer.save_every=0", "logger.plot=false", *extra))
    model = trainer.backbone.model
    backbone_before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    heads_before = {k: p.detach().clone() for k, p in trainer.module.heads.named_parameters()}
    assert heads_before and all(p.requires_grad for p in trainer.module.heads.parameters())
    assert not any(p.requires_grad for p in model.parameters())
    if projection == "shared":   # in the heads' dtype (no cast per head's forward), the backbone's own where it can
        from inference.backbone import lm_head_weight
        shared, weight = trainer.module.heads.shared_weight, lm_head_weight(model)
        assert shared.dtype == trainer.compute_dtype
        assert (shared.data_ptr() == weight.data_ptr()) == (weight.dtype == trainer.compute_dtype)

    batch = next(iter(trainer.batches))
    labels, docs = batch["labels"], batch["doc_ids"]
    losses = []
    for _ in range(6):  # the same batch again and again
        loss = trainer.engine(trainer.source.frozen.hidden_states(batch), labels, docs)
        trainer.engine.backward(loss)
        trainer.engine.step()
        losses.append(float(loss.detach()))
    assert all(math.isfinite(l) for l in losses)
    assert losses[-1] < losses[0] - 0.05, losses
    trainer.train()  # and the trainer's own loop
    assert trainer.step == 3

    for k, v in model.state_dict().items():
        assert v.dtype == backbone_before[k].dtype and torch.equal(v, backbone_before[k]), f"backbone {k} changed"
    assert not model.training  # eval mode survives engine.train()
    for k, p in trainer.module.heads.named_parameters():
        assert not torch.equal(p.detach(), heads_before[k]), f"head parameter {k} never changed"
    optimized = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    assert not optimized & {id(p) for p in model.parameters()}
    trainer.cleanup(plot=False)


def test_hidden_states_carry_no_gradient(compose_tiny):
    """Guards against: the backbone forward building an autograd graph (memory blow-up, and a path
    for gradients into the backbone)."""
    trainer = make_trainer(compose_tiny("trainer.max_steps=1"))
    hidden = trainer.source.frozen.hidden_states(next(iter(trainer.batches)))
    assert not hidden.requires_grad and hidden.grad_fn is None
    trainer.cleanup(plot=False)


# -- attention isolation -------------------------------------------------------------------------------
def test_block_causal_mask_exact():
    """Guards against: packed documents attending to each other, future tokens being visible, or a
    fully masked padding row (NaN softmax)."""
    doc_ids = torch.tensor([[1, 1, 2, 2, 2, 0]])
    mask = block_causal_mask(doc_ids, torch.float32)
    assert mask.shape == (1, 1, 6, 6)
    allowed = (mask[0, 0] == 0).int().tolist()
    assert allowed == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [0, 0, 1, 0, 0, 0],
        [0, 0, 1, 1, 0, 0],
        [0, 0, 1, 1, 1, 0],
        [0, 0, 0, 0, 0, 1],
    ]
    assert (mask[0, 0][mask[0, 0] != 0] == torch.finfo(torch.float32).min).all()


CONVERSATIONS = [
    [{"role": "user", "content": "What is a cat?"}, {"role": "assistant", "content": "A small animal."}],
    [{"role": "system", "content": "Be short."}, {"role": "user", "content": "Sky colour?"},
     {"role": "assistant", "content": "Blue, mostly, by day."}],
    [{"role": "user", "content": "Count."}, {"role": "assistant", "content": "1 2 3 4 5 6 7 8 9"}],
]


@pytest.mark.parametrize("packing", [True, False])
def test_batched_hidden_states_equal_each_document_alone(packing, compose_tiny):
    """Guards against: cross-document attention leaks in packed rows (or padding leaking into a
    right-padded row): a document's hidden states in a batch must equal running it alone."""
    trainer = make_trainer(compose_tiny(f"data.packing={str(packing).lower()}", "trainer.max_steps=1"))
    tok = trainer.backbone.tokenizer
    docs = [encode_conversation(tok, m, 256) for m in CONVERSATIONS]
    rows = [docs] if packing else [[d] for d in docs]
    batch = collate(rows, trainer.pad_id, 256 if packing else None)
    hidden = trainer.source.frozen.hidden_states(batch)
    with torch.no_grad():
        at = 0
        for i, doc in enumerate(docs):
            alone = trainer.source.frozen.body(input_ids=torch.tensor([doc.input_ids]), use_cache=False).last_hidden_state[0]
            n = len(doc.input_ids)
            got = hidden[0, at:at + n] if packing else hidden[i, :n]
            torch.testing.assert_close(got, alone, atol=1e-5, rtol=0)
            at += n if packing else 0
        if packing:  # control: the same row under a plain causal mask does leak, so the check above can fail
            leaky = trainer.source.frozen.body(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False,
                                 attention_mask=block_causal_mask(torch.ones_like(batch["doc_ids"]), torch.float32))
            n0, n1 = len(docs[0].input_ids), len(docs[1].input_ids)
            alone = trainer.source.frozen.body(input_ids=torch.tensor([docs[1].input_ids]), use_cache=False).last_hidden_state[0]
            assert (leaky.last_hidden_state[0, n0:n0 + n1] - alone).abs().max() > 1e-3
    trainer.cleanup(plot=False)


# -- a whole run and its export ----------------------------------------------------------------------------
def test_run_exports_loadable_heads(compose_tiny, out_dir, tiny_backbone):
    """Guards against: a run whose export has extra/missing files, does not load against its own
    backbone, differs from the final trained weights, or lacks the promised curves and metrics log."""
    summary = T.run(compose_tiny("trainer.max_steps=4", "trainer.save_every=2", "trainer.eval_every=2"))
    assert summary["step"] == 4 and math.isfinite(summary["loss"])
    assert all(f"head{k}/top1" in summary for k in (1, 2, 3))

    heads_dir = out_dir / "heads"
    assert sorted(os.listdir(heads_dir)) == ["config.json", "model.safetensors"]
    assert not [p for p in os.listdir(out_dir) if ".tmp" in p or ".old" in p]
    assert (out_dir / "training_curves.png").stat().st_size > 1000
    records = read_metrics(out_dir / "metrics.jsonl")
    assert [r["step"] for r in records if r["kind"] == "eval"] == [2, 4]
    assert all(math.isfinite(r["loss"]) for r in records)

    model = tiny_backbone.model
    heads = load_heads(heads_dir, backbone_config=model.config)
    spec = json.loads((heads_dir / "config.json").read_text())
    assert spec["projection"] == "truncated" and spec["truncated_vocab_size"] == 128 and spec["num_heads"] == 3
    assert spec["base_model"] == str((out_dir / "backbone").resolve())  # the random backbone, kept with the run
    # the export holds the final weights: the same tensors as the last resumable checkpoint
    from safetensors.torch import load_file

    final = load_file(str(out_dir / "checkpoints" / "step-000004" / "heads.safetensors"))
    for name, tensor in heads.state_dict().items():
        assert torch.equal(tensor, final[f"heads.{name}"]), name


def test_gradient_accumulation_counts_optimizer_steps(compose_tiny, out_dir, monkeypatch):
    """Guards against: accumulation miscounted (the LR schedule or step counter advancing per
    micro-batch instead of per optimizer step, or fewer micro-batches than micro x accumulation)."""
    original = HeadsWithLoss.forward
    calls = {"n": 0}

    def forward(self, *args):
        calls["n"] += int(self.training)
        return original(self, *args)

    monkeypatch.setattr(HeadsWithLoss, "forward", forward)
    trainer = make_trainer(compose_tiny("trainer.max_steps=3", "trainer.global_batch_size=6", "logger.plot=false"))
    assert trainer.plan.grad_accum == 3
    trainer.train()
    trainer.cleanup(plot=False)
    assert calls["n"] == 9  # 3 steps x 3 micro-batches
    state = checkpoint.read_state(out_dir / "checkpoints" / "step-000003")
    assert state["step"] == 3 and state["optimizer_step"] == 3
    assert state["lr_scheduler"]["last_epoch"] == 3


def test_lr_schedule_warmup_then_cosine():
    """Guards against: a schedule that starts at zero LR, skips warm-up or does not end at min_lr_ratio."""
    from medusa_train.config import OptimConfig

    o = OptimConfig(warmup_steps=4, min_lr_ratio=0.1)
    f = [T.lr_factor(s, 20, o) for s in range(21)]
    assert f[:4] == [0.25, 0.5, 0.75, 1.0]
    assert f[4] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(f[4:], f[5:]))
    assert f[20] == pytest.approx(0.1)


# -- checkpoints and resume ------------------------------------------------------------------------------
@pytest.mark.parametrize("extra", [
    [],
    ["trainer.zero_stage=2"],
    ["trainer.zero_stage=3"],
    ["trainer.precision=bf16", "trainer.zero_stage=1"],
], ids=["zero0", "zero2", "zero3", "bf16-zero1"])
def test_resume_after_crash_matches_uninterrupted_run(extra, compose_tiny, tmp_path, monkeypatch):
    """Guards against: a resumed run that differs from the uninterrupted one (weights, AdamW moments,
    optimizer step, LR schedule, RNG or data position not restored), for every ZeRO stage."""
    T.run(compose_tiny(*RESUME_OVERRIDES, *extra, out=tmp_path / "a"))
    reference = train_losses(tmp_path / "a")
    assert len(reference) == 8

    original = T.MedusaTrainer.save_checkpoint

    def save_then_crash(self):
        path = original(self)
        if self.step == 4:
            raise RuntimeError("simulated crash right after the step-4 checkpoint")
        return path

    monkeypatch.setattr(T.MedusaTrainer, "save_checkpoint", save_then_crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        T.run(compose_tiny(*RESUME_OVERRIDES, *extra, out=tmp_path / "b"))
    monkeypatch.undo()
    assert checkpoint.find_resume(tmp_path / "b", "auto").name == "step-000004"
    summary = T.run(compose_tiny(*RESUME_OVERRIDES, *extra, out=tmp_path / "b"))  # resume=auto
    assert summary["step"] == 8
    assert train_steps(tmp_path / "b") == list(range(1, 9))
    assert train_losses(tmp_path / "b") == reference


def test_resume_after_kill_between_checkpoints(compose_tiny, tmp_path, monkeypatch):
    """Guards against: metrics logged after the last checkpoint staying in metrics.jsonl after a resume
    (duplicate / stale steps in the log and the curves)."""
    T.run(compose_tiny(*RESUME_OVERRIDES, out=tmp_path / "a"))
    original = T.Tracker.log

    def log_then_die(self, step, metrics, phase="train"):
        original(self, step, metrics, phase)
        if step == 6 and phase == "train":
            raise RuntimeError("killed at step 6")

    monkeypatch.setattr(T.Tracker, "log", log_then_die)
    with pytest.raises(RuntimeError):
        T.run(compose_tiny(*RESUME_OVERRIDES, out=tmp_path / "b"))
    monkeypatch.undo()
    assert train_steps(tmp_path / "b") == [1, 2, 3, 4, 5, 6]
    T.run(compose_tiny(*RESUME_OVERRIDES, out=tmp_path / "b"))
    assert train_steps(tmp_path / "b") == list(range(1, 9))
    assert train_losses(tmp_path / "b") == train_losses(tmp_path / "a")


def interrupt_at_forward(monkeypatch, n: int, signals: tuple = (signal.SIGINT,)) -> None:
    """Deliver ``signals`` to this process (a Ctrl-C is SIGINT) in the n-th training forward of the heads."""
    original = HeadsWithLoss.forward
    calls = {"n": 0}

    def forward(self, hidden, labels, doc_ids, input_ids=None):
        if self.training:
            calls["n"] += 1
            if calls["n"] == n:
                for sig in signals:
                    os.kill(os.getpid(), sig)
        return original(self, hidden, labels, doc_ids, input_ids)

    monkeypatch.setattr(HeadsWithLoss, "forward", forward)


def test_resume_after_ctrl_c_matches_uninterrupted_run(compose_tiny, tmp_path, monkeypatch):
    """Guards against: Ctrl-C mid-step (the README's 'rerun after a crash or Ctrl-C') losing training data:
    the interrupt checkpoint must resume exactly where the last completed step left off (the step in progress
    completes first)."""
    T.run(compose_tiny(*RESUME_OVERRIDES, out=tmp_path / "a"))
    interrupt_at_forward(monkeypatch, 6)
    with pytest.raises(UserError, match="interrupted at step 6"):
        T.run(compose_tiny(*RESUME_OVERRIDES, out=tmp_path / "b"))
    monkeypatch.undo()
    T.run(compose_tiny(*RESUME_OVERRIDES, out=tmp_path / "b"))
    assert train_losses(tmp_path / "b") == train_losses(tmp_path / "a")


def test_ctrl_c_saves_a_resumable_checkpoint(compose_tiny, out_dir, monkeypatch):
    """Guards against: Ctrl-C losing the run (no checkpoint) or ending with a traceback instead of a
    one-line message telling the user how to continue."""
    interrupt_at_forward(monkeypatch, 3)
    with pytest.raises(UserError, match="interrupted at step 3.*step-000003.*again to resume"):
        T.run(compose_tiny(*RESUME_OVERRIDES))
    monkeypatch.undo()
    assert checkpoint.read_state(out_dir / "checkpoints" / "step-000003")["step"] == 3
    assert T.run(compose_tiny(*RESUME_OVERRIDES))["step"] == 8


def test_sigterm_saves_a_checkpoint_and_restores_the_handler(compose_tiny, out_dir, monkeypatch):
    """Guards against: a scheduler's SIGTERM (preemption) killing a single-process run without a
    checkpoint, or run() leaving its SIGTERM / SIGINT handlers installed in the caller's process afterwards."""
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    interrupt_at_forward(monkeypatch, 3, (signal.SIGTERM,))
    with pytest.raises(UserError, match="interrupted at step 3"):
        T.run(compose_tiny(*RESUME_OVERRIDES))
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
    assert checkpoint.read_state(out_dir / "checkpoints" / "step-000003")["step"] == 3


def test_keep_last_latest_and_resume_never(compose_tiny, out_dir, capsys):
    """Guards against: old checkpoints never pruned (disk fills), `latest` pointing at an older step,
    a finished run retraining on rerun, and resume=never silently resuming."""
    cfg_args = ["trainer.max_steps=8", "trainer.save_every=2", "trainer.keep_last=2", "trainer.log_every=1",
                "logger.plot=false"]
    T.run(compose_tiny(*cfg_args))
    root = out_dir / "checkpoints"
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == ["latest", "step-000006",
                                                                                   "step-000008"]
    assert (root / "latest").read_text().strip() == "step-000008"
    assert not [p for p in root.iterdir() if p.name.startswith(".")]  # no temp leftovers
    first = train_losses(out_dir)
    capsys.readouterr()

    assert T.run(compose_tiny(*cfg_args))["step"] == 8  # resume=auto on a finished run: nothing to train
    assert "already trained to step 8/8; nothing to do" in capsys.readouterr().out
    assert train_losses(out_dir) == first

    T.run(compose_tiny(*cfg_args, "trainer.resume=never"))
    assert "resumed from" not in capsys.readouterr().out
    assert train_steps(out_dir) == list(range(1, 9))  # trained again from step 1, log rewritten
    assert train_losses(out_dir) == first  # a fresh start is deterministic


def test_checkpoint_is_pickle_free(compose_tiny, out_dir):
    """Guards against: resume state written as torch pickles (*.pt / *.bin: arbitrary code on load)."""
    T.run(compose_tiny("trainer.max_steps=2", "logger.plot=false"))
    ckpt = out_dir / "checkpoints" / "step-000002"
    assert sorted(os.listdir(ckpt)) == ["heads.safetensors", "optimizer.safetensors", "rng-rank0.safetensors",
                                        "trainer_state.json"]
    every = [p for p in out_dir.rglob("*") if p.is_file()]
    assert not [p for p in every if p.suffix in (".pt", ".pth", ".bin", ".pkl", ".pickle")]
    state = checkpoint.read_state(ckpt)
    assert state["step"] == 2 and state["heads"]["num_heads"] == 3


def _fake_checkpoint(root: Path, name: str, complete: bool = True) -> Path:
    d = root / name
    d.mkdir(parents=True)
    if complete:
        (d / checkpoint.STATE_FILE).write_text("{}")
    return d


def test_find_resume_ignores_partial_and_temp_checkpoints(tmp_path):
    """Guards against: resume=auto picking a checkpoint killed mid-write (.tmp-step-*, or a step dir
    without trainer_state.json), or trusting a stale `latest` pointer."""
    root = checkpoint.checkpoints_dir(tmp_path)
    assert checkpoint.find_resume(tmp_path, "auto") is None  # nothing yet: fresh start
    _fake_checkpoint(root, "step-000004")
    _fake_checkpoint(root, "step-000008")
    _fake_checkpoint(root, ".tmp-step-000012")
    _fake_checkpoint(root, "step-000010", complete=False)
    assert checkpoint.find_resume(tmp_path, "auto").name == "step-000008"
    (root / "latest").write_text("step-000004\n")
    assert checkpoint.find_resume(tmp_path, "auto").name == "step-000004"
    (root / "latest").write_text("step-000099\n")  # points at something deleted
    assert checkpoint.find_resume(tmp_path, "auto").name == "step-000008"
    assert checkpoint.find_resume(tmp_path, "never") is None
    assert checkpoint.find_resume(tmp_path, str(root / "step-000004")).name == "step-000004"
    with pytest.raises(UserError, match="not a checkpoint directory"):
        checkpoint.find_resume(tmp_path, str(root / "step-000010"))


def test_leftover_temp_checkpoint_does_not_break_a_run(compose_tiny, out_dir):
    """Guards against: a `.tmp-step-*` directory left by a kill mid-write being resumed from, or
    blocking the next checkpoint of the same step."""
    root = out_dir / "checkpoints"
    _fake_checkpoint(root, ".tmp-step-000002")
    (root / ".tmp-step-000002" / "heads.safetensors").write_bytes(b"half written")
    _fake_checkpoint(root, ".tmp-step-000006")
    summary = T.run(compose_tiny("trainer.max_steps=2", "trainer.log_every=1", "logger.plot=false"))
    assert summary["step"] == 2 and train_steps(out_dir)[0] == 1  # trained from scratch
    assert (root / "latest").read_text().strip() == "step-000002"
    assert sorted(os.listdir(root / "step-000002")) == ["heads.safetensors", "optimizer.safetensors",
                                                        "rng-rank0.safetensors", "trainer_state.json"]
    assert not (root / ".tmp-step-000002").exists()


def test_corrupt_checkpoint_is_a_user_error(compose_tiny, out_dir):
    """Guards against: resuming from a damaged checkpoint crashing with a library traceback."""
    T.run(compose_tiny("trainer.max_steps=2", "logger.plot=false"))
    (out_dir / "checkpoints" / "step-000002" / "optimizer.safetensors").write_bytes(b"\x00" * 10)
    with pytest.raises(UserError, match="corrupt"):
        T.run(compose_tiny("trainer.max_steps=4", "logger.plot=false"))


# -- NaN / inf ----------------------------------------------------------------------------------------------
def test_nan_loss_stops_with_last_good_checkpoint(compose_tiny, out_dir, monkeypatch):
    """Guards against: training on after the loss becomes NaN (poisoning the weights and the next
    checkpoint), or an error that does not say where the last good checkpoint is."""
    original = HeadsWithLoss.forward
    calls = {"n": 0}

    def forward(self, hidden, labels, doc_ids, input_ids=None):
        loss = original(self, hidden, labels, doc_ids, input_ids)
        if self.training:
            calls["n"] += 1
            if calls["n"] == 5:
                return loss * float("nan")
        return loss

    monkeypatch.setattr(HeadsWithLoss, "forward", forward)
    args = ["trainer.max_steps=8", "trainer.save_every=2", "trainer.keep_last=5", "logger.plot=false"]
    with pytest.raises(UserError) as info:
        T.run(compose_tiny(*args))
    message = str(info.value)
    assert "NaN" in message and "step 5" in message and "step-000004" in message
    assert "\n" not in message
    monkeypatch.undo()

    root = out_dir / "checkpoints"
    assert sorted(p.name for p in root.glob("step-*")) == ["step-000002", "step-000004"]
    from safetensors.torch import load_file

    for f in ("heads.safetensors", "optimizer.safetensors"):
        assert all(torch.isfinite(t).all() for t in load_file(str(root / "step-000004" / f)).values())
    assert T.run(compose_tiny(*args))["step"] == 8  # the kept checkpoint resumes


# -- bad settings that reach the trainer ---------------------------------------------------------------------
def test_log_every_zero_is_refused(compose_tiny, out_dir):
    """Guards against: trainer.log_every=0 crashing with a Python traceback (a modulo by zero) or training
    silently without logs: it is refused at validation, in one line naming the key, before anything runs."""
    with pytest.raises(UserError) as err:
        T.run(compose_tiny("trainer.log_every=0", "trainer.max_steps=2", "logger.plot=false"))
    msg = str(err.value)
    assert "trainer.log_every must be >= 1" in msg and "\n" not in msg, msg
    assert not (out_dir / "metrics.jsonl").exists()


def test_nothing_to_train_is_a_user_error(compose_tiny):
    """Guards against: a config with no trainable parameter crashing inside the optimizer."""
    with pytest.raises(UserError, match="num_layers"):
        T.run(compose_tiny("heads.projection=shared", "heads.num_layers=0", "trainer.max_steps=1"))


def test_truncated_vocab_larger_than_backbone_vocab(compose_tiny):
    """Guards against: a truncated vocabulary bigger than the backbone's crashing in the token map."""
    with pytest.raises(UserError, match="truncated_vocab_size"):
        T.run(compose_tiny("heads.truncated_vocab_size=1000", "trainer.max_steps=1"))


@pytest.mark.parametrize("extra", [[], ["trainer.precision=bf16", "trainer.zero_stage=1"]], ids=["fp32-stage0", "bf16-zero1"])
def test_logged_grad_norm_is_a_real_number(extra, compose_tiny, out_dir):
    """Guards against a grad_norm curve that is NaN on every step (DeepSpeed's plain fp32 path
    computes the norm for clipping and discards it), which hides exploding gradients."""
    T.run(compose_tiny("trainer.max_steps=2", "trainer.log_every=1", "trainer.save_every=0", "logger.plot=false",
                       *extra))
    norms = [r["grad_norm"] for r in read_metrics(out_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert len(norms) == 2 and all(math.isfinite(n) and n > 0 for n in norms), norms


def test_the_long_quiet_phases_say_what_they_do(compose_tiny, capsys):
    """Guards against a run silent for minutes where a user waits: the truncated vocabulary's pass over the data
    before anything else is printed, and the final evaluation and export after a progress bar that already reads
    100% (51 s of nothing for SmolLM2 on 2 cores): a line announces each before it starts."""
    T.run(compose_tiny("trainer.max_steps=1", "trainer.save_every=0", "logger.plot=false"))
    printed = capsys.readouterr()
    out = printed.out + printed.err   # the tracker writes beside its progress bar
    scan = out.index("truncated vocabulary: counting the assistant tokens of up to")
    assert scan < out.index("truncated vocabulary: top")
    assert re.search(r"final evaluation on \d+ held-out batch\(es\), then the export \.\.\.", out), out


def test_a_truncated_vocabulary_keeps_the_templates_end_of_turn_and_every_stop_id(compose_tiny):
    """Guards against: the truncated projection (and EAGLE-3's draft vocabulary) forcing only the tokenizer's eos
    into its map. Where the template ends a reply with another token (Llama-3's <|eot_id|> beside eos
    <|end_of_text|>, Gemma's <end_of_turn> beside <eos>), a small map on little data left the end of turn out, so
    the heads could never propose the end of a reply."""
    trainer = T.MedusaTrainer(compose_tiny("heads.projection=truncated", "heads.truncated_vocab_size=8",
                                           "trainer.max_steps=1", "logger.plot=false"))
    trainer.setup()
    try:
        tok, model = trainer.backbone.tokenizer, trainer.backbone.model
        im_end, endoftext = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
        tok.eos_token = "<|endoftext|>"   # eos names a token no reply holds; the template still ends with <|im_end|>
        model.config.eos_token_id = model.generation_config.eos_token_id = endoftext
        token_map = trainer._token_map(trainer.spec.vocab_size, 8).tolist()
        assert {im_end, endoftext} <= set(token_map[:2]) and len(set(token_map)) == 8
    finally:
        trainer.cleanup(plot=False)


def test_a_tokenizer_without_pad_or_eos_pads_with_the_models_stop_token(compose_tiny, monkeypatch):
    """Guards against: a tokenizer naming neither a pad nor an eos token (while the model's configs name eos ids)
    ending training in a TypeError traceback from the batch collation (pad id None)."""
    from medusa_train import backbone as frozen

    real = frozen.random_backbone

    def no_specials(*a, **k):
        b = real(*a, **k)
        b.tokenizer.pad_token, b.tokenizer.eos_token = None, None
        return b

    monkeypatch.setattr(frozen, "random_backbone", no_specials)
    loaded = frozen.load_backbone(compose_tiny().backbone, "cpu")
    assert loaded.tokenizer.pad_token_id == loaded.model.config.eos_token_id
    loaded.model.config.eos_token_id = loaded.model.generation_config.eos_token_id = None
    with pytest.raises(UserError, match="names no pad or eos token"):
        frozen._stop_token(loaded)


def test_a_rank_that_writes_no_checkpoint_keeps_no_copy_of_it(compose_tiny):
    """Guards against every rank holding the whole gathered checkpoint (12 bytes a trained parameter, ~32 GB a rank
    for heads with their own full-vocabulary projections at Llama-3.1-8B's shape, 8 ranks a node) at every save when
    only rank 0 writes it: the others take part in each gather and drop the result."""
    trainer = make_trainer(compose_tiny("trainer.max_steps=1", "trainer.save_every=0", "logger.plot=false"))
    trainer.train()
    weights, moments, step = checkpoint.gather(trainer.engine)
    assert weights and moments and step == 1
    assert checkpoint.gather(trainer.engine, keep=False) == ({}, {}, 1)
    trainer.cleanup(plot=False)
