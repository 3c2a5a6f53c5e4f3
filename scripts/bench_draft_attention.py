"""The EAGLE-3 drafter's attention over its own KV cache: keys / values repeated per query head
(``repeat_interleave``, what ``Eagle3Drafter.forward_step`` did) against grouped-query attention inside
``scaled_dot_product_attention`` (``enable_gqa``, what it does now), interleaved, median per call.

    .venv/bin/python scripts/bench_draft_attention.py [CACHE_ENTRIES ...]     # default 300 600 1200

Shapes: SmolLM2-135M's (9 query heads, 3 key/value heads, head_dim 64), one or two new rows (a catch-up
call), fp32, the machine's default threads. Both arms return the same tensor (checked)."""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.nn.functional as F

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def main(sizes: list[int]) -> None:
    torch.manual_seed(0)
    rep = HEADS // KV_HEADS
    print(f"threads {torch.get_num_threads()}; median ms per call over 5 x 200 interleaved calls")
    print("| cache entries | new rows | repeat_interleave | enable_gqa | ratio |")
    print("|---|---|---|---|---|")
    for s in sizes:
        for rows in (1, 2):
            q = torch.randn(1, HEADS, rows, HEAD_DIM)
            k, v = torch.randn(1, KV_HEADS, s, HEAD_DIM), torch.randn(1, KV_HEADS, s, HEAD_DIM)
            mask = None
            if rows > 1:   # causal among the new rows, all of the past visible (forward_step's default)
                mask = torch.zeros(rows, s)
                mask[:, s - rows:] = torch.triu(torch.full((rows, rows), torch.finfo(torch.float32).min), 1)
                mask = mask[None, None]

            def repeated():
                return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                                      attn_mask=mask)

            def grouped():
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

            assert torch.allclose(repeated(), grouped(), atol=1e-6)
            times = {"rep": [], "gqa": []}
            for _ in range(5):
                for name, fn in (("rep", repeated), ("gqa", grouped)):
                    for _ in range(200):
                        t = time.perf_counter()
                        fn()
                        times[name].append(time.perf_counter() - t)
            a, b = statistics.median(times["rep"]) * 1e3, statistics.median(times["gqa"]) * 1e3
            print(f"| {s} | {rows} | {a:.3f} | {b:.3f} | {b / a:.2f} |")


if __name__ == "__main__":
    main([int(x) for x in sys.argv[1:]] or [300, 600, 1200])
