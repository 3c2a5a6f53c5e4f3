"""Several ``eagle3`` / ``eagle3_lookup`` settings and the runtime's plain loop, timed interleaved, in rounds.

    .venv/bin/python scripts/race_eagle3_settings.py runs/eagle3_smollm2/heads NUM_PROMPTS MAX_NEW_TOKENS \
        ROUNDS float|float16 SETTING...

SETTING as in ``scan_eagle3_lookup.py`` (``n2-d1-k2+t6-m2``, ``n4-d1-k4-p0.1+t6-m2``, ...). medusa-eval runs
one setting per method and run; comparing two settings there means two runs, whose ratios move by a few
percent with the host's speed between them. Here every prompt is decoded by plain decoding and by every
setting one after the other (the order rotating from prompt to prompt), on one backbone loaded and routed
once, for ROUNDS rounds over MT-Bench first turns 1..NUM_PROMPTS. Printed per round: each setting's
tokens/s (prefill included, as medusa-eval counts them) over the plain loop's in that round; then the
median over rounds, tau (deterministic: greedy), and whether every output equals plain greedy decoding.
Run it alone: it measures time.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inference.evaluation.prompts import load_prompts  # noqa: E402
from inference.loading import load_medusa  # noqa: E402
from inference.methods import generate  # noqa: E402
from scan_eagle3_lookup import parse, setting_run  # noqa: E402

PLAIN = "plain"


def main(heads_dir: str, num_prompts: int, max_new_tokens: int, rounds: int, draft_weights: str,
         settings: list[str]) -> None:
    opts = {s: parse(s) for s in settings}
    m = load_medusa(heads_dir, draft_weights=draft_weights)
    prompts = [m.encode_chat(p.turns[0]) for p in load_prompts("embedded:mtbench", num_prompts)]
    names = [PLAIN] + settings
    ratios = {s: [] for s in settings}
    taus, same = {}, {s: 0 for s in settings}
    print(f"{heads_dir}: draft_weights={draft_weights}, MT-Bench first turns 1-{num_prompts}, {max_new_tokens} "
          f"tokens, greedy, {rounds} rounds")
    for r in range(rounds):
        secs = {n: 0.0 for n in names}
        tokens = {n: 0 for n in names}
        steps = {n: 0 for n in names}
        accepted = {n: 0 for n in names}
        for i, ids in enumerate(prompts):
            order = names[i % len(names):] + names[:i % len(names)]
            outs = {}
            for name in order:
                if name == PLAIN:
                    out = generate(m, ids, "autoregressive", max_new_tokens=max_new_tokens)
                else:
                    out, _, _ = setting_run(m, ids, opts[name], max_new_tokens)
                outs[name] = out
                secs[name] += out.prefill_s + out.decode_s
                tokens[name] += len(out.tokens)
                steps[name] += len(out.accept_lengths)
                accepted[name] += sum(out.accept_lengths)
            if r == 0:               # greedy: outputs and tau are the same every round
                for s in settings:
                    same[s] += outs[s].tokens == outs[PLAIN].tokens
        plain_rate = tokens[PLAIN] / secs[PLAIN]
        cells = []
        for s in settings:
            ratios[s].append(tokens[s] / secs[s] / plain_rate)
            taus.setdefault(s, accepted[s] / max(steps[s], 1))
            cells.append(f"{s} {ratios[s][-1]:.3f}x")
        print(f"round {r + 1}: plain {plain_rate:.2f} tokens/s; " + "; ".join(cells), flush=True)
    print("| setting | tau | vs the loop, median (rounds) | = greedy |")
    print("|---|---|---|---|")
    for s in settings:
        spread = " / ".join(f"{x:.3f}" for x in ratios[s])
        print(f"| {s} | {taus[s]:.3f} | **{statistics.median(ratios[s]):.3f}x** ({spread}) | "
              f"{same[s]}/{len(prompts)} |")


if __name__ == "__main__":
    args = sys.argv[1:]
    if len(args) < 6:
        raise SystemExit(__doc__)
    main(args[0], int(args[1]), int(args[2]), int(args[3]), args[4], args[5:])
