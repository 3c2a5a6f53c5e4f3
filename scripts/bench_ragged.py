"""Which batch KV layout is cheaper: per-row compaction or masked gaps (BENCHMARKS.md "Batched decoding").

    python scripts/bench_ragged.py runs/hydra_smollm2_greedy/heads --batch 4 16 --tree chain2 tree4

For each batch size and tree, the same MT-Bench first turns are decoded with ``ragged=compact`` and
``ragged=gaps`` (and the plain batched loop as the reference), the two layouts interleaved over
rounds with their order rotated; the script prints per layout the median tokens/s, the attended
width at the end (the cache slots the last step's attention read), and whether every row is
token-identical to the plain batched loop. Run it alone: every figure is a latency.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from inference.evaluation.prompts import load_prompts
from inference.loading import load_medusa
from inference.methods import generate_batch
from inference.runtime import batch_cache


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("heads")
    ap.add_argument("--batch", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--tree", nargs="+", default=["chain2", "tree4"])
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    m = load_medusa(a.heads)
    prompts = [m.encode_chat(p.turns[0]) for p in load_prompts("embedded:mtbench", max(a.batch))]

    widths: dict[str, int] = {}
    original = batch_cache.RaggedKVCache.step_mask

    def recording(self, tree_mask, depth, dtype):   # the widest key span a step attends over, per layout
        mask, pos = original(self, tree_mask, depth, dtype)
        widths[self.mode] = max(widths.get(self.mode, 0), mask.shape[-1])
        return mask, pos

    batch_cache.RaggedKVCache.step_mask = recording
    print("| batch | tree | plain tok/s | compact tok/s | gaps tok/s | gaps / compact | width compact | "
          "width gaps | identical |")
    print("|---|---|---|---|---|---|---|---|---|")
    for b in a.batch:
        rows = prompts[:b]
        ref = generate_batch(m, rows, "autoregressive", max_new_tokens=a.max_new_tokens)
        plain = ref.tokens_per_s
        for tree in a.tree:
            rates = {"compact": [], "gaps": []}
            same = True
            widths.clear()
            for r in range(a.rounds):
                order = ["compact", "gaps"] if r % 2 == 0 else ["gaps", "compact"]
                for mode in order:
                    t = time.perf_counter()
                    out = generate_batch(m, rows, "medusa", tree=tree, max_new_tokens=a.max_new_tokens, ragged=mode)
                    rates[mode].append(out.new_tokens / (time.perf_counter() - t))
                    same &= [x.tokens for x in out.rows] == [x.tokens for x in ref.rows]
            c, g = statistics.median(rates["compact"]), statistics.median(rates["gaps"])
            print(f"| {b} | {tree} | {plain:.1f} | {c:.1f} | {g:.1f} | {g / c:.3f} | {widths.get('compact')} | "
                  f"{widths.get('gaps')} | {same} |", flush=True)


if __name__ == "__main__":
    main()
