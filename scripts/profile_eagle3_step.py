"""Where an eagle3 decoding step's time goes, phase by phase, beside a plain step.

    python scripts/profile_eagle3_step.py runs/eagle3_smollm2/heads --shapes 1,1,1 4,1,4 --rounds 5

For each tree shape (nodes, depth, topk) and plain decoding, interleaved over rounds on one MT-Bench
prompt (greedy, EOS ignored): the median per step of each phase of ``Eagle3Decoder.step`` — drafting
(``_draft``), tree buffers, the verification forward (backbone + aux tap), the lm_head over the tree,
``verify``, the KV compaction, the drafter's catch-up call — and of the rest (glue: the tree
reranking, tensor bookkeeping, Python), against the whole step and the plain step; and the fastest
step of each arm against the fastest plain step (on a host whose speed drifts, noise only adds time,
so the minimum is the steadier estimate of what a step costs). Warm-up steps are left out. The phases are timed by wrapping the functions the step calls, so the method's code is the
one measured. ``--draft-weights float float16`` adds an arm per setting of ``draft_weights`` on the same
backbone (``one_backbone``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from contextlib import contextmanager

import torch

import inference.methods.eagle3 as eagle3_method
from inference.loading import load_heads, load_medusa
from inference.runtime.cache import TreeKVCache
from inference.runtime.draft_weights import half_draft_weights
from inference.runtime.model import MedusaModel
from inference.evaluation.prompts import load_prompts
from inference.evaluation.tree_choice import eagle3_step_times, step_times

PHASES = ("draft", "tree buffers", "verify forward", "lm_head", "verify", "compaction", "catch-up")


class Recorder:
    """Phase times (s) of the current step; steps after ``warmup`` are kept."""

    def __init__(self, warmup: int):
        self.warmup, self.index, self.inside = warmup, 0, False
        self.current: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []

    def timed(self, phase: str, fn):
        def wrapper(*args, **kwargs):
            if not self.inside:
                return fn(*args, **kwargs)
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.current[phase] += time.perf_counter() - t
        return wrapper

    def step(self, fn):
        def wrapper(*args, **kwargs):
            self.inside, self.current = True, defaultdict(float)
            t = time.perf_counter()
            try:
                out = fn(*args, **kwargs)
                self.current["tokens"] = len(out[0])
                return out
            finally:
                self.inside = False
                self.current["whole step"] = time.perf_counter() - t
                if self.index >= self.warmup:
                    self.steps.append(dict(self.current))
                self.index += 1
        return wrapper


@contextmanager
def recording(warmup: int):
    rec = Recorder(warmup)
    patches = [
        (eagle3_method.Eagle3Decoder, "step", rec.step),
        (eagle3_method.Eagle3Decoder, "_draft", lambda f: rec.timed("draft", f)),
        (eagle3_method.Eagle3Decoder, "_catch_up", lambda f: rec.timed("catch-up", f)),
        (eagle3_method, "tree_buffers", lambda f: rec.timed("tree buffers", f)),
        (eagle3_method, "verify", lambda f: rec.timed("verify", f)),
        (MedusaModel, "hidden_aux", lambda f: rec.timed("verify forward", f)),
        (MedusaModel, "logits", lambda f: rec.timed("lm_head", f)),
        (TreeKVCache, "keep", lambda f: rec.timed("compaction", f)),
    ]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    try:
        for owner, name, wrap in patches:
            setattr(owner, name, wrap(getattr(owner, name)))
        yield rec
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def profile_shape(m, prompt, shape, steps: int, warmup: int) -> list[dict[str, float]]:
    with recording(warmup) as rec:
        # the race's own timed run; catch-up inside a step is timed, the prefill's call is not (rec.inside
        # is False there)
        eagle3_step_times(m, prompt, shape, steps=steps, warmup=warmup)
    return rec.steps


def one_backbone(heads_dir: str, settings: list[str]) -> dict[str, MedusaModel]:
    """One model per draft-weights setting, all on ONE backbone (loaded and kernel-routed once), so the
    arms differ in their heads only: ``draft_weights=float16`` converts a second copy of the heads as
    ``load_medusa`` would (before routing, which then leaves the float16 linears alone)."""
    m = load_medusa(heads_dir)
    models = {}
    for w in dict.fromkeys(settings):
        if w == "float":
            models[w] = m
            continue
        heads = load_heads(heads_dir, backbone_config=m.model.config, lm_head_weight=m.lm_head.weight,
                           device=m.device, dtype=m.dtype, input_embeddings=m.model.get_input_embeddings().weight)
        half_draft_weights(heads, m.model)
        models[w] = MedusaModel(model=m.model, tokenizer=m.tokenizer, heads=heads)
    return models


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("heads")
    ap.add_argument("--shapes", nargs="+", default=["1,1,1", "4,1,4"], help="nodes,depth,topk")
    ap.add_argument("--draft-weights", nargs="+", default=["float"], choices=["float", "float16"],
                    help="one arm per setting (runtime/draft_weights.py), interleaved with the shapes")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=0, help="MT-Bench first turn index")
    args = ap.parse_args()
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes]
    models = one_backbone(args.heads, args.draft_weights)
    plain_model = next(iter(models.values()))
    prompt = plain_model.encode_chat(load_prompts("embedded:mtbench", 1 + args.prompt)[args.prompt].turns[0])
    arms = [(w, s) for s in shapes for w in models]
    results: dict[tuple, list[dict[str, float]]] = defaultdict(list)
    plain: list[float] = []
    for r in range(args.rounds):
        plain += step_times(plain_model, prompt, None, steps=args.steps, warmup=args.warmup)
        for w, shape in arms[r % len(arms):] + arms[:r % len(arms)]:
            results[w, shape] += profile_shape(models[w], prompt, shape, args.steps, args.warmup)
        plain += step_times(plain_model, prompt, None, steps=args.steps, warmup=args.warmup)
    base = statistics.median(plain) * 1e3
    print(f"threads {torch.get_num_threads()}, {args.rounds} rounds x {args.steps} steps, prompt {len(prompt)} tokens")
    print(f"plain step: median {base:.2f} ms, min {min(plain) * 1e3:.2f} ms ({len(plain)} steps)\n")
    print("| phase (median ms per step) | " + " | ".join("n{}-d{}-k{} ".format(*s) + w for w, s in arms) + " |")
    print("|---|" + "---|" * len(arms))
    def steps(rows):
        return [row["whole step"] for row in rows]

    def ms(value: float) -> str:
        return f"{value * 1e3:.2f}"

    derived = {  # table row -> cell from one arm's step records
        "glue": lambda rows: ms(statistics.median(r["whole step"] - sum(r.get(p, 0.0) for p in PHASES) for r in rows)),
        "whole step": lambda rows: ms(statistics.median(steps(rows))),
        "whole step / plain": lambda rows: f"{statistics.median(steps(rows)) * 1e3 / base:.3f}",
        "fastest step": lambda rows: ms(min(steps(rows))),
        "fastest step / plain": lambda rows: f"{min(steps(rows)) / min(plain):.3f}",
        "tokens per step": lambda rows: f"{statistics.mean(r['tokens'] for r in rows):.3f}",
    }
    for phase in PHASES + tuple(derived):
        cell = derived.get(phase) or (lambda rows, p=phase: ms(statistics.median(r.get(p, 0.0) for r in rows)))
        print(f"| {phase} | " + " | ".join(cell(results[arm]) for arm in arms) + " |")

if __name__ == "__main__":
    main()
