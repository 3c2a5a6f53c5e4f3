"""Timing helpers shared by ``bench.py machine`` (CPU), the GPU check and ``bench.py profile-gpu``.

Both measure the same two things the same way: one verification forward of the runtime
(``MedusaModel.hidden`` + ``logits`` over n tree nodes after a prompt, cache truncated back after
each call) and the runtime's plain loop against transformers' greedy ``generate``, interleaved
prompt by prompt. On CUDA the device is synchronized before a host clock is read.
"""

from __future__ import annotations

import statistics
from contextlib import contextmanager
import time
from typing import Callable, Optional, Sequence

import torch

from inference.evaluation.evaluate import WARMUP_TOKENS   # the untimed warm-up call's length, as evaluations
from inference.methods import generate
from inference.runtime.model import MedusaModel
from inference.runtime.tree import MedusaTree


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def chain_mask(past: int, n: int, dtype: torch.dtype, device) -> torch.Tensor:
    """[1, 1, n, past+n] additive causal mask: the prompt visible, n new tokens in a chain."""
    mask = torch.zeros(1, 1, n, past + n, dtype=dtype, device=device)
    mask[..., past:] = torch.triu(torch.full((n, n), torch.finfo(dtype).min, dtype=dtype, device=device), 1)
    return mask


def verification_step(m: MedusaModel, prompt: Sequence[int], max_nodes: int) -> Callable[..., float]:
    """Prefill ``prompt`` once; return ``step(n, tree=None) -> seconds`` for one verification
    forward over n nodes (a chain, or ``tree``'s mask and depths when given), after which the
    cache is truncated back to the prompt, so every call sees the same past; ``step.device_ms(n, reps)``: the
    same forward's device ms, ``reps`` of them back to back."""
    past = len(prompt)
    dev = m.device
    cache = m.new_cache(past + max_nodes)
    with torch.inference_mode():
        m.hidden(torch.tensor([list(prompt)], device=dev), torch.arange(past, device=dev)[None], cache)
    masks: dict = {}

    def inputs(n: int, tree: Optional[MedusaTree]):
        key = (n, None if tree is None else tuple(map(tuple, tree.choices)))
        if key not in masks:
            if tree is None:
                mask, pos = chain_mask(past, n, m.dtype, dev), torch.arange(n, device=dev) + past
            else:
                assert tree.num_nodes == n, (tree.num_nodes, n)
                buf = tree.buffers(dev)
                mask, pos = buf.additive_mask(past, m.dtype), buf.position_offsets + past
            ids = torch.randint(0, m.vocab_size, (1, n), generator=torch.Generator().manual_seed(n)).to(dev)
            masks[key] = (ids, pos[None], mask)
        return masks[key]

    def step(n: int, tree: Optional[MedusaTree] = None) -> float:
        ids, pos, mask = inputs(n, tree)
        sync(dev)
        t = time.perf_counter()
        with torch.inference_mode():
            m.logits(m.hidden(ids, pos, cache, mask)[0])
        sync(dev)
        dt = time.perf_counter() - t
        cache.truncate(past)
        return dt

    def device_ms(n: int, reps: int = 50, tree: Optional[MedusaTree] = None) -> float:
        """Device ms of ``step(n, tree)``'s work with the host out of the way: where the step is captured (CUDA), its
        backbone graph replayed ``reps`` times back to back, plus the logits of one output (one lm_head matmul)
        ``reps`` times back to back, each between two CUDA events: one launch per repetition, so the device sets
        the pace. The step body itself back to back would measure the host's pace when the host is the limit,
        the very case a wall-vs-device verdict is for. Uncaptured (the dry run, CPU): the step body back to
        back on the host's clock, so the dry run runs this code too."""
        ids, pos, mask = inputs(n, tree)
        replay = m.static.captured_replay(1, n) if getattr(m, "static", None) is not None else None
        sync(dev)
        with torch.inference_mode():
            if replay is None or dev.type != "cuda":
                t = time.perf_counter()
                for _ in range(reps):
                    m.logits(m.hidden(ids, pos, cache, mask)[0])
                    cache.truncate(past)
                sync(dev)
                return (time.perf_counter() - t) * 1e3 / reps
            out = m.hidden(ids, pos, cache, mask)[0]
            cache.truncate(past)
            total = 0.0
            for work in (replay, lambda: m.logits(out)):
                work()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(reps):
                    work()
                end.record()
                end.synchronize()
                total += start.elapsed_time(end) / reps
            return total

    step.device_ms = device_ms   # an attribute: every caller of ``step(n)`` stays as it is
    return step


def plain_loop_vs_generate(m: MedusaModel, prompts: Sequence[Sequence[int]], tokens: int,
                           with_tokens: bool = False) -> dict:
    """The runtime's plain loop vs transformers' greedy generate (stock kernels), interleaved prompt
    by prompt (order alternating); tokens/s over all prompts, prefill included, and how many
    outputs were token-identical (``with_tokens``: and the runtime's tokens per prompt). Both are warmed
    alike first: one short untimed call each on the first prompt (``WARMUP_TOKENS``), so neither's first-call
    setup (transformers' ``generate`` building its config and processors, the runtime's first buffers) is timed,
    whatever the caller ran on the model before."""
    for name in ("autoregressive", "hf_generate") if prompts else ():
        generate(m, list(prompts[0]), name, max_new_tokens=min(WARMUP_TOKENS, tokens))
    rows = []
    for i, ids in enumerate(prompts):
        runs = {}
        order = ("autoregressive", "hf_generate") if i % 2 == 0 else ("hf_generate", "autoregressive")
        for name in order:
            runs[name] = generate(m, list(ids), name, max_new_tokens=tokens)
        rows.append(runs)
    rate = {k: sum(len(r[k].tokens) for r in rows) / sum(r[k].prefill_s + r[k].decode_s for r in rows)
            for k in ("autoregressive", "hf_generate")}
    return {"runtime_tokens_per_s": round(rate["autoregressive"], 2),
            "hf_generate_tokens_per_s": round(rate["hf_generate"], 2),
            "ratio": round(rate["autoregressive"] / rate["hf_generate"], 3),
            "identical": sum(r["autoregressive"].tokens == r["hf_generate"].tokens for r in rows), "prompts": len(rows),
            "new_tokens": [len(r["autoregressive"].tokens) for r in rows],
            **({"runtime_tokens": [r["autoregressive"].tokens for r in rows]} if with_tokens else {})}


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


@contextmanager
def off_if(m: MedusaModel, mode: str):
    """Graphs off for ``m`` inside the block when ``mode`` is "off" (dynamic cache); its static steps after."""
    saved = m.static
    m.static = None if mode == "off" else saved
    try:
        yield m
    finally:
        m.static = saved


def spread(xs, nd: int = 2) -> dict:
    return {"median": round(median(xs), nd), "min": round(min(xs), nd), "max": round(max(xs), nd), "n": len(xs)}


def rate(out) -> float:
    return len(out.tokens) / (out.prefill_s + out.decode_s)
