"""The parts of an EAGLE-3 step timed alone, by row count: the backbone's forward, its lm_head, the drafter's call.

    .venv/bin/python scripts/eagle3_step_parts.py runs/eagle3_smollm2/heads [context_tokens] [rounds]

After a prefill of ``context_tokens`` (the first MT-Bench prompt, padded with ordinary token ids), each
part runs 15 times per round, interleaved over ``rounds`` rounds, and the median of the round medians is
printed: the plain loop's step (1-token forward without a mask + lm_head + argmax); the verification
forward (tapped, with a tree mask) over 1, 2, 5 and 8 rows, a 1-row forward without a mask; the lm_head
over 1, 2, 5 and 8 rows; the drafter's catch-up call (``forward_step`` + ``project`` of the last row) over 1-3
accepted rows. The cache is cut back after every call, so every call sees the same context. What a step
adds to a plain one, part by part (BENCHMARKS.md, "Where eagle3_lookup's time goes"). Run it alone.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inference.evaluation.prompts import load_prompts  # noqa: E402
from inference.heads.eagle3 import DraftKV  # noqa: E402
from inference.loading import load_medusa  # noqa: E402
from inference.runtime.tree import tree_buffers  # noqa: E402


def median_ms(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


@torch.inference_mode()
def main(heads_dir: str, context: int, rounds: int) -> None:
    m = load_medusa(heads_dir)
    d = m.heads
    if getattr(d.spec, "kind", "") != "eagle3":
        raise SystemExit(f"{heads_dir}: not EAGLE-3 heads")
    prompt = m.encode_chat(load_prompts("embedded:mtbench", 1)[0].turns[0])
    prompt = (prompt + list(range(100, 100 + context)))[:max(context, 1)]
    past = len(prompt)
    cache = m.new_cache(past + 64)
    tap = m.aux_tap(d.spec.aux_layers)
    _, aux = m.hidden_aux(torch.tensor([prompt]), torch.arange(past)[None], cache, tap)
    dkv = DraftKV(past + 64)
    _, _, (k, v) = d.forward_step(torch.tensor([prompt[1:] + [5]]), d.combine(aux[0])[None], torch.arange(past)[None])
    dkv.append(k, v)

    def plain():
        h = m.hidden(torch.tensor([[7]]), torch.tensor([[past]]), cache)
        m.logits(h[0, -1]).argmax()
        cache.truncate(past)

    def forward(rows: int, masked: bool = True):
        parents = torch.tensor([-1] + [0] * (rows - 1))       # the root and rows - 1 children
        depths = torch.tensor([0] + [1] * (rows - 1))
        mask = tree_buffers(parents, depths, int(depths.max())).additive_mask(past, m.dtype) if masked else None
        ids, pos = torch.tensor([[7] * rows]), (depths + past)[None]

        def run():
            if masked:
                m.hidden_aux(ids, pos, cache, tap, mask)
            else:
                m.hidden(ids, pos, cache)
            cache.truncate(past)
        return run

    def lm_head(rows: int):
        h = torch.randn(rows, m.model.config.hidden_size)
        return lambda: m.logits(h)

    def catch_up(rows: int):
        feats, nxt = aux[0, :rows], torch.tensor([[5] * rows])

        def run():
            normed, _, _ = d.forward_step(nxt, d.combine(feats)[None], torch.arange(past, past + rows)[None],
                                          dkv.view())
            d.project(normed[0, -1])
        return run

    parts = {"plain loop step": plain, "forward 1 row, no mask": forward(1, masked=False)}
    parts.update({f"forward {r} rows (tapped, tree mask)": forward(r) for r in (1, 2, 5, 8)})
    parts.update({f"lm_head {r} rows": lm_head(r) for r in (1, 2, 5, 8)})
    parts.update({f"drafter catch-up {r} rows": catch_up(r) for r in (1, 2, 3)})
    results = {name: [] for name in parts}
    for _ in range(rounds):
        for name, fn in parts.items():
            results[name].append(median_ms(fn, 15))
    print(f"{heads_dir}: context {past} tokens, {rounds} rounds x 15 calls, threads {torch.get_num_threads()}")
    print("| part | median ms | round medians |")
    print("|---|---|---|")
    for name, v in results.items():
        print(f"| {name} | {statistics.median(v):.2f} | {' '.join(f'{x:.1f}' for x in v)} |")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 250, int(sys.argv[3]) if len(sys.argv) > 3 else 5)
