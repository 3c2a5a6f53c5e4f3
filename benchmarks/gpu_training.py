"""The GPU check's training part (run by benchmarks/gpu_check.py): the real trainer's step against the backbone's
forward, Medusa heads and an EAGLE-3 drafter, at the check's small shape (SmolLM2-135M) and at Llama-3.1-8B's.

Each run is the real trainer (``MedusaTrainer``: the debug_tiny recipe with the backbone replaced by random weights
of the shape, synthetic chats, DeepSpeed ZeRO 1 — bf16 needs ZeRO >= 1 —, bf16, 3 heads / draft steps), then
``bench.py train``'s interleaved loop: the backbone's forward, then one training micro-step (the trainer's own loss:
features under no_grad, then the family's loss, backward, optimizer step) on the same batch; tokens/s of each.

The small shape's backbone comes through the recipe (``backbone.random_init``: built on the host in fp32 and kept
with the run). At 8B that path would allocate 32 GB on the host and write them to disk, minutes of the check's
eight, so there the backbone is made on the GPU in bf16 (``gpu_models.device_llama``, once for both families) and
handed to the trainer in place of its ``load_backbone`` (``handed_backbone``); data, heads, DeepSpeed, loss and
step stay the trainer's own. It runs last and only when the time left allows it (``BIG_PART_S``: in a call after
the gpu tier and the other parts it rarely does, so the summary names the call that runs it). Dry run (CPU):
the 8B stand-in is ``gpu_models.TINY``, through the same hand-over.
"""

from __future__ import annotations

import gc
import json
import random
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from benchmarks.gpu_models import LLAMA31_8B, TINY, device_llama
from benchmarks.timing import median, sync

# Seconds each section is expected to take on the GPU (estimates: never measured yet; gpu_check stops a section at
# 1.5x its estimate): a trainer set up (DeepSpeed, data) and run at the small shape, the 8B backbone made on the device
# and a trainer on it.
PART_S = {"train": 35, "train_eagle3": 35, "train_8b.build": 25, "train_8b": 40, "train_eagle3_8b": 35}
SMALL_S = PART_S["train"] + PART_S["train_eagle3"]       # the small trainings' share of a call
BIG_PART_S = sum(PART_S[k] for k in ("train_8b.build", "train_8b", "train_eagle3_8b"))   # the 8B part: 100 s


def write_chats(path: Path, n: int, words: int, seed: int = 0) -> None:
    """Synthetic chats (ASCII words) long enough to fill the packed rows: a JSONL the trainer reads."""
    rnd = random.Random(seed)
    vocab = ["alpha", "beta", "gamma", "delta", "hash", "map", "tree", "node", "cache", "token", "step", "head"]
    with open(path, "w") as f:
        for _ in range(n):
            text = lambda k: " ".join(rnd.choice(vocab) for _ in range(k))  # noqa: E731
            f.write(json.dumps({"messages": [{"role": "user", "content": text(words // 4)},
                                             {"role": "assistant", "content": text(words)}]}) + "\n")


@contextmanager
def handed_backbone(model):
    """The trainer's ``load_backbone`` replaced by one that hands it ``model`` (frozen, with the byte tokenizer the
    synthetic chats are written in), for trainers built inside the block."""
    from medusa_train import trainer as trainer_module
    from medusa_train.backbone import Backbone, byte_tokenizer

    tok = byte_tokenizer()
    model.config.eos_token_id, model.config.pad_token_id = tok.eos_token_id, tok.pad_token_id

    def load(cfg, device, seed=0, run_dir=None, write=True, before_write=None):
        if next(model.parameters()).device.type != torch.device(device).type:
            raise RuntimeError(f"handed backbone is on {next(model.parameters()).device}, the trainer runs on {device}")
        if before_write is not None:   # the trainer's data check and run record, as the real loader calls them
            before_write(tok)
        return Backbone(model.eval().requires_grad_(False), tok, "random:llama")

    saved = trainer_module.load_backbone
    trainer_module.load_backbone = load
    try:
        yield
    finally:
        trainer_module.load_backbone = saved


def train_throughput(shape: dict, device: str, precision: str, zero: int, micro: int, max_length: int,
                     steps: int, work: Path, heads: str = "medusa") -> dict:
    """One trainer of the ``heads`` family (medusa or eagle3) on ``shape``, then ``steps`` interleaved rounds (a
    first one warms up and is dropped) of the backbone's forward and one training micro-step on the same batch."""
    from medusa_train.launch import compose_recipe
    from medusa_train.trainer import MedusaTrainer

    data = work / "chats.jsonl"
    write_chats(data, n=max(16, 4 * micro * (steps + 2)), words=max_length // 2)
    ri = [f"++backbone.random_init.{k}={v}" for k, v in shape.items()]
    cfg = compose_recipe("debug_tiny", [
        f"output_dir={work / 'run'}", f"data.source={data}", "logger.wandb=disabled", "logger.plot=false",
        "trainer.progress_bar=false", "trainer.resume=never", f"trainer.device={device}",
        f"trainer.precision={precision}", f"trainer.zero_stage={zero}", f"trainer.micro_batch_size={micro}",
        f"trainer.global_batch_size={micro}", f"data.max_length={max_length}", "data.eval_conversations=2",
        "data.max_conversations=null", "data.vocab_scan_conversations=8",
        f"backbone.dtype={'bfloat16' if precision == 'bf16' else 'float32'}", *ri, f"heads={heads}",
        "heads.projection=truncated", f"heads.truncated_vocab_size={min(8192, shape['vocab_size'] // 2)}"])
    tr = MedusaTrainer(cfg)
    tr.setup()
    model = tr.backbone.model
    dev = tr.device
    it = iter(tr.batches)
    fwd, train, losses = [], [], []
    tr.engine.train()
    for i in range(steps + 1):  # the first round warms up and is dropped
        batch = next(it)
        tokens = int((batch["doc_ids"] > 0).sum())
        ids, pos = batch["input_ids"].to(dev), batch["position_ids"].to(dev)
        sync(dev)
        with torch.no_grad():
            t0 = time.perf_counter()
            model(input_ids=ids, position_ids=pos, use_cache=False)
            sync(dev)
            t1 = time.perf_counter()
        loss = tr.loss(batch)
        tr.engine.backward(loss)
        tr.engine.step()
        sync(dev)
        t2 = time.perf_counter()
        losses.append(loss.detach().float().item())
        if i:
            fwd.append(tokens / (t1 - t0))
            train.append(tokens / (t2 - t1))
    trainable = sum(p.numel() for p in tr.module.parameters() if p.requires_grad)
    out = {"heads": heads, "zero_stage": zero, "precision": precision, "micro_batch": micro, "max_length": max_length,
           "tokens_per_batch": tokens, "forward_tokens_per_s": round(median(fwd), 1),
           "train_tokens_per_s": round(median(train), 1),
           "ratio": round(median([t / f for t, f in zip(train, fwd)]), 3),
           "trainable_params_m": round(trainable / 1e6, 2), "losses": [round(x, 4) for x in losses],
           "finite": all(x == x and abs(x) < float("inf") for x in losses)}
    if dev.type == "cuda":
        out["peak_gpu_memory_gb"] = round(torch.cuda.max_memory_allocated(dev) / 2**30, 2)
    return out


def run(result: dict, section, device: torch.device, dry: bool, small: tuple[str, dict], sizes: dict,
        end: float, skip: tuple = ()) -> None:
    """Both families at the small shape into ``result["training"]`` / ``["training_eagle3"]``, then, when it can
    end before ``end`` (a perf_counter time; the dry run always runs it), at 8B into ``["training_8b"]`` /
    ``["training_eagle3_8b"]``; a part not run for time is listed in ``result["training_skipped"]``. ``section``
    runs a part (gpu_check's: errors recorded, ``--skip`` honoured); ``skip``: the 8B backbone is not built when
    both of its trainers are skipped."""
    result["training_skipped"] = []

    def free():
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    def train(shape: tuple[str, dict], heads: str, key: str):
        label, dims = shape
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        with tempfile.TemporaryDirectory(prefix="gpu-check-train-") as work:
            result[key] = {"shape": label, **train_throughput(dims, device.type, "bf16", 1, sizes["micro"],
                                                              sizes["max_length"], sizes["train_steps"], Path(work),
                                                              heads)}
        free()   # the trainer's engine and optimizer state, before the next trainer allocates its own

    section("train", lambda: train(small, "medusa", "training"), PART_S["train"])
    section("train_eagle3", lambda: train(small, "eagle3", "training_eagle3"), PART_S["train_eagle3"])
    if {"train_8b", "train_eagle3_8b"} <= set(skip):
        return
    big = ("Llama-3.1-8B (tiny stand-in)", TINY) if dry else ("Llama-3.1-8B", LLAMA31_8B)
    if not dry and time.perf_counter() + BIG_PART_S > end:
        result["training_skipped"] += ["train_8b", "train_eagle3_8b"]
        return
    state: dict = {}

    def build():
        t = time.perf_counter()
        state["model"] = device_llama(big[1], device, torch.bfloat16)
        result["training_8b_build_s"] = round(time.perf_counter() - t, 1)

    section("train_8b.build", build, PART_S["train_8b.build"])
    if "model" not in state:
        return
    with handed_backbone(state["model"]):
        section("train_8b", lambda: train(big, "medusa", "training_8b"), PART_S["train_8b"])
        section("train_eagle3_8b", lambda: train(big, "eagle3", "training_eagle3_8b"), PART_S["train_eagle3_8b"])
    del state["model"]
    free()


KEYS = ("training", "training_eagle3", "training_8b", "training_eagle3_8b")


def summary_lines(result: dict) -> list[str]:
    """summary.md's training table: one row a run, the shape named."""
    runs = [result[k] for k in KEYS if result.get(k)]
    lines = []
    if runs:
        lines += ["", "| training (real trainer, DeepSpeed) | tokens/batch | backbone forward tok/s | train step tok/s "
                      "| ratio | trainable | peak GPU memory |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {tr.get('shape', '')} {tr.get('heads', 'medusa')}, ZeRO {tr['zero_stage']}, {tr['precision']}, "
                  f"micro {tr['micro_batch']} x {tr['max_length']} | {tr['tokens_per_batch']} | "
                  f"{tr['forward_tokens_per_s']:.0f} | {tr['train_tokens_per_s']:.0f} | {tr['ratio']:.2f} | "
                  f"{tr['trainable_params_m']}M | {tr.get('peak_gpu_memory_gb', '-')} GB |" for tr in runs]
    if result.get("training_skipped"):
        lines += ["", f"Training parts skipped (time): {', '.join(result['training_skipped'])} (the 8B part needs "
                  f"~{BIG_PART_S} s: its own device call, see \"Time budget\")"]
    return lines
