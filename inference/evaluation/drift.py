"""How far a fine-tuned backbone (Medusa-2's LoRA) drifted from the original, on the eval prompts.

Medusa-2 changes the backbone, so "lossless" now means lossless with respect to the *tuned*
model; a user also needs to know how different that model's answers are from the original's.
Measured here: both models decode every prompt greedily; reported are the share of token
positions where the two answers hold the same token (over the longer answer's length) and the
share of answers identical end to end. (Held-out perplexity with and without the adapter is measured by the
trainer at export, ``<run>/drift.json``.)
"""

from __future__ import annotations

from typing import Sequence

from ..methods import generate
from ..runtime.model import MedusaModel


def greedy_drift(tuned: MedusaModel, original: MedusaModel, prompts: Sequence[Sequence[int]],
                 max_new_tokens: int) -> dict:
    same_tokens = total = identical = 0
    for ids in prompts:
        a = generate(original, list(ids), "autoregressive", max_new_tokens=max_new_tokens).tokens
        b = generate(tuned, list(ids), "autoregressive", max_new_tokens=max_new_tokens).tokens
        same_tokens += sum(x == y for x, y in zip(a, b))
        total += max(len(a), len(b))
        identical += a == b
    n = max(len(prompts), 1)
    return {"prompts": len(prompts), "greedy_token_agreement": same_tokens / max(total, 1),
            "identical_answers": identical / n}
