"""End to end: an EAGLE-3 setting decoded with the decoding attention and with transformers' sdpa, beside the loop.

    .venv/bin/python scripts/ab_tree_attention.py runs/eagle3_smollm2/heads [num_prompts=20] [max_new_tokens=96] \
        [SETTING=n4-d1-k4-p0.1+t6-m2] [float|float16]

SETTING as in ``scan_eagle3_lookup.py``. One backbone, loaded and routed once; per MT-Bench first turn, in turn:
the plain loop, the setting with ``runtime/attention.py``'s function, the setting with transformers' own sdpa
(the model's attention implementation switched between the two), so drift of the host's speed falls on all
three alike. Printed: tokens/s of each (prefill included), both settings against the loop, their mean steps,
and whether every output equals the loop's (greedy). Run it alone: it measures time (BENCHMARKS.md,
"Grouped-query attention in the verification forward").
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inference.evaluation.prompts import load_prompts  # noqa: E402
from inference.loading import load_medusa  # noqa: E402
from inference.methods import generate  # noqa: E402
from inference.runtime.attention import NAME  # noqa: E402
from scan_eagle3_lookup import parse, setting_run  # noqa: E402

ARMS = ("plain loop", "decoding attention", "transformers sdpa")


def main(heads_dir: str, num_prompts: int, max_new_tokens: int, setting: str, draft_weights: str) -> None:
    opts = parse(setting)
    m = load_medusa(heads_dir, draft_weights=draft_weights)
    prompts = [m.encode_chat(p.turns[0]) for p in load_prompts("embedded:mtbench", num_prompts)]
    secs = dict.fromkeys(ARMS, 0.0)
    tokens = dict.fromkeys(ARMS, 0)
    steps = {k: [] for k in ARMS}
    same = dict.fromkeys(ARMS[1:], 0)
    for ids in prompts:
        plain = generate(m, ids, "autoregressive", max_new_tokens=max_new_tokens)
        outs = {ARMS[0]: plain}
        for arm, impl in zip(ARMS[1:], (NAME, "sdpa")):
            m.model.config._attn_implementation = impl
            outs[arm] = setting_run(m, ids, opts, max_new_tokens)[0]
            same[arm] += outs[arm].tokens == plain.tokens
        m.model.config._attn_implementation = NAME
        for arm, out in outs.items():
            secs[arm] += out.prefill_s + out.decode_s
            tokens[arm] += len(out.tokens)
            steps[arm] += out.step_s
    rate = {k: tokens[k] / secs[k] for k in ARMS}
    mean = {k: statistics.mean(steps[k]) for k in ARMS}
    print(f"{heads_dir}: {setting}, draft_weights={draft_weights}, MT-Bench first turns 1-{num_prompts}, "
          f"{max_new_tokens} tokens, greedy, interleaved prompt by prompt")
    print("| arm | tokens/s | vs the loop | mean step (ms) | / the loop's mean step | = greedy |")
    print("|---|---|---|---|---|---|")
    for arm in ARMS:
        print(f"| {arm} | {rate[arm]:.2f} | {rate[arm] / rate[ARMS[0]]:.3f}x | {mean[arm] * 1e3:.2f} | "
              f"{mean[arm] / mean[ARMS[0]]:.3f} | {same.get(arm, len(prompts))}/{len(prompts)} |")


if __name__ == "__main__":
    args = sys.argv[1:]
    if not args:
        raise SystemExit(__doc__)
    main(args[0], int(args[1]) if len(args) > 1 else 20, int(args[2]) if len(args) > 2 else 96,
         args[3] if len(args) > 3 else "n4-d1-k4-p0.1+t6-m2", args[4] if len(args) > 4 else "float16")
