"""Acceptance of an EAGLE-3 drafter by context position: was a drafter trained on short rows worse further out?
(BENCHMARKS.md "More, shorter conversations").

    .venv/bin/python scripts/eagle3_acceptance_by_position.py HEADS PROMPTS MAX_NEW_TOKENS

MT-Bench first turns 21..20+PROMPTS, greedy, n1-d1-k1 (no branch): tokens per step of the steps whose
context (prompt + emitted) is < 256, 256-511, 512-767 and >= 768 tokens long. Deterministic; run per drafter.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from scan_eagle3_lookup import setting_run  # noqa: E402

from inference.evaluation.prompts import load_prompts  # noqa: E402
from inference.loading import load_medusa  # noqa: E402

BUCKETS = ((256, "<256"), (512, "256-511"), (768, "512-767"), (float("inf"), ">=768"))

if len(sys.argv) != 4:
    raise SystemExit(__doc__)
heads, n_prompts, new = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
m = load_medusa(heads)
prompts = [m.encode_chat(p.turns[0]) for p in load_prompts("embedded:mtbench", 40)[20:20 + n_prompts]]
buckets: dict[str, list[int]] = {name: [] for _, name in BUCKETS}   # context bucket -> tokens of each step there
for ids in prompts:
    out, _, _ = setting_run(m, ids, dict(nodes=1, depth=1, topk=1), new)
    context = len(ids)                  # a step starts at the prompt plus every token the steps before emitted
    for tokens in out.accept_lengths:
        buckets[next(name for limit, name in BUCKETS if context < limit)].append(tokens)
        context += tokens
for name, xs in buckets.items():
    if xs:
        print(f"{heads} context {name}: {len(xs)} steps, tokens per step {sum(xs) / len(xs):.3f}")
