"""What an ``eagle3_lookup`` step costs by the rows it verifies, beside the runtime's plain loop.

    .venv/bin/python scripts/eagle3_lookup_step_costs.py runs/eagle3_smollm2/heads [num_prompts] [max_new_tokens] \
        [SETTING] [float|float16]

SETTING as in ``scan_eagle3_lookup.py`` (default ``n1-d1-k1+t6-m2``: the method's defaults at the two-row
tree; a setting without a branch, ``n4-d1-k4-p0.1``, is decoded by ``eagle3``). Per prompt, plain
decoding and the setting run one after the other (interleaved prompt by prompt,
greedy, the method's own decoder driven by ``run_decoder``, which times every step the way medusa-eval
does). Printed: both methods' tokens/s (prefill included) and their ratio; the mean step of each; and
the median step per number of verified rows (root + drafted nodes + grafted nodes) against the plain
loop's median step, which is the cost model behind the lookup branch's length (BENCHMARKS.md). Run it
alone: it measures time.
"""

from __future__ import annotations

import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inference.evaluation.prompts import load_prompts  # noqa: E402
from inference.loading import load_medusa  # noqa: E402
from inference.methods import generate  # noqa: E402
from scan_eagle3_lookup import parse, setting_run  # noqa: E402


def main(heads_dir: str, num_prompts: int, max_new_tokens: int, setting: str, draft_weights: str) -> None:
    opts = parse(setting)
    m = load_medusa(heads_dir, draft_weights=draft_weights)
    prompts = [m.encode_chat(p.turns[0]) for p in load_prompts("embedded:mtbench", num_prompts)]
    plain_steps, steps_by_rows, lookup_steps = [], defaultdict(list), []
    secs = {"plain": 0.0, "lookup": 0.0}
    tokens = {"plain": 0, "lookup": 0}
    for ids in prompts:
        out = generate(m, ids, "autoregressive", max_new_tokens=max_new_tokens)
        plain_steps += out.step_s
        secs["plain"] += out.prefill_s + out.decode_s
        tokens["plain"] += len(out.tokens)
        out, rows, _ = setting_run(m, ids, opts, max_new_tokens)
        secs["lookup"] += out.prefill_s + out.decode_s
        tokens["lookup"] += len(out.tokens)
        lookup_steps += out.step_s
        for r, t in zip(rows, out.step_s):
            steps_by_rows[r].append(t)
    rate = {k: tokens[k] / secs[k] for k in secs}
    plain = statistics.median(plain_steps)
    print(f"{heads_dir}: {setting}, draft_weights={draft_weights}, MT-Bench first turns 1-{num_prompts}, "
          f"{max_new_tokens} tokens, greedy")
    print(f"plain loop {rate['plain']:.2f} tokens/s, eagle3_lookup {rate['lookup']:.2f} tokens/s: "
          f"{rate['lookup'] / rate['plain']:.3f}x; tau {tokens['lookup'] / (len(lookup_steps) + len(prompts)):.3f}")
    print(f"mean step: plain {statistics.mean(plain_steps) * 1e3:.2f} ms, eagle3_lookup "
          f"{statistics.mean(lookup_steps) * 1e3:.2f} ms ({statistics.mean(lookup_steps) / statistics.mean(plain_steps):.3f}x)")
    print("| rows verified | steps | median step (ms) | / plain median step |")
    print("|---|---|---|---|")
    print(f"| 1 (plain loop) | {len(plain_steps)} | {plain * 1e3:.2f} | 1.000 |")
    for r in sorted(steps_by_rows):
        med = statistics.median(steps_by_rows[r])
        print(f"| {r} | {len(steps_by_rows[r])} | {med * 1e3:.2f} | {med / plain:.3f} |")


if __name__ == "__main__":
    args = sys.argv[1:]
    if not args:
        raise SystemExit(__doc__)
    main(args[0], int(args[1]) if len(args) > 1 else 10, int(args[2]) if len(args) > 2 else 96,
         args[3] if len(args) > 3 else "n1-d1-k1+t6-m2", args[4] if len(args) > 4 else "float")
