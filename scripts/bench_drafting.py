"""What drafting costs per step, per head family: the heads' share of a Medusa step.

    python scripts/bench_drafting.py runs/bench_heads/medusa1_smollm2/heads runs/bench_heads/hydra_smollm2/heads ...

For each heads directory and each tree (chain3, tree4, tree8): the median time of the
proposal alone (Medusa: every head once on h_t; dependent heads: one head call per depth, on
the nodes of the level above) and of a whole step (proposal + tree forward + verify +
compaction), on one prompt, methods interleaved over rounds. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from inference.evaluation.tree_choice import measure_step_latency
from inference.loading import load_medusa
from inference.runtime.tree import resolve_tree
from inference.runtime.verify import SamplingConfig

TREES = ("chain3", "tree4", "tree8")


def proposal_ms(m, tree, repeats: int = 50) -> float:
    buf = tree.buffers(m.device)
    h = torch.randn(m.config.hidden_size, dtype=m.dtype)
    cfg = SamplingConfig()
    times = []
    with torch.inference_mode():
        for _ in range(repeats):
            t = time.perf_counter()
            m.heads.draft_tree(buf, h, 1, cfg, None, m.vocab_size)
            times.append(time.perf_counter() - t)
    return statistics.median(times[5:]) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("heads", nargs="+")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    models = {d: load_medusa(d) for d in args.heads}
    prompt = next(iter(models.values())).encode_chat("Explain how a hash map works, with an example.")
    rows = {}
    for _ in range(args.rounds):
        for d, m in models.items():
            for name in TREES:
                tree = resolve_tree(name, m.num_heads)
                draft = proposal_ms(m, tree)
                step = measure_step_latency(m, prompt, [tree], steps=6)[tree.name] * 1e3
                key = (d, name)
                old = rows.get(key, (float("inf"), float("inf")))
                rows[key] = (min(old[0], draft), min(old[1], step))
    print("| heads | kind | tree | proposal (ms) | whole step (ms) | proposal share |")
    print("|---|---|---|---|---|---|")
    for (d, name), (draft, step) in rows.items():
        kind = models[d].heads.spec.kind
        print(f"| {d} | {kind} | {name} | {draft:.2f} | {step:.1f} | {draft / step:.0%} |")


if __name__ == "__main__":
    main()
