"""Acceptance of an EAGLE-3 drafter by context position: was a drafter trained on short rows worse further out?
(BENCHMARKS.md "More, shorter conversations").

    .venv/bin/python scripts/eagle3_acceptance_by_position.py HEADS PROMPTS MAX_NEW_TOKENS

MT-Bench first turns 21..20+PROMPTS, greedy, n1-d1-k1 (no branch): tokens per step of the steps whose
context (prompt + emitted) is < 256, 256-511, 512-767 and >= 768 tokens long. Deterministic; run per drafter.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from inference.evaluation.prompts import load_prompts  # noqa: E402
from inference.loading import load_medusa  # noqa: E402
from inference.methods.eagle3 import Eagle3Decoder, Eagle3Options  # noqa: E402
from inference.runtime.decode import TokenStream, run_decoder  # noqa: E402

if len(sys.argv) != 4:
    raise SystemExit(__doc__)
heads, n_prompts, new = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
m = load_medusa(heads)
prompts = [m.encode_chat(p.turns[0]) for p in load_prompts("embedded:mtbench", 40)[20:20 + n_prompts]]
buckets: dict[str, list[int]] = {}    # context-length bucket -> tokens of each step taken there
for ids in prompts:
    dec = Eagle3Decoder(m, Eagle3Options(nodes=1, depth=1, topk=1))
    orig = dec.step
    def step(dec=dec, orig=orig):
        pos = dec.past
        new_toks, d = orig()
        b = "<256" if pos < 256 else "256-511" if pos < 512 else "512-767" if pos < 768 else ">=768"
        buckets.setdefault(b, []).append(len(new_toks))
        return new_toks, d
    dec.step = step
    for _ in TokenStream(run_decoder(dec, m, ids, new, None, None)):
        pass
for b in ("<256", "256-511", "512-767", ">=768"):
    xs = buckets.get(b, [])
    if xs:
        print(f"{heads} context {b}: {len(xs)} steps, tokens per step {sum(xs) / len(xs):.3f}")
