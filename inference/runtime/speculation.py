"""How much a batched method speculates at each number of active rows: a ``SpeculationSchedule``.

At batch 1 a verification forward is bound by reading the weights, so extra draft nodes are almost
free; at batch 32 every node is 32 more rows of compute. The schedule holds the tree measured best
at each batch size (``evaluation.batch_sizing`` measures it) and answers, every step, which tree to
verify with for the rows still active.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .tree import MedusaTree


@dataclass
class SpeculationSchedule:
    """Which tree (None = plain decoding) to verify with at each number of active rows.

    ``choices[b]`` holds the winner measured at batch size b and ``rates[b][name]`` the expected
    tokens/s of every candidate there. For a count between measured sizes the next larger measured
    size decides (its step times bound the smaller batch's). Hysteresis: the current tree is kept
    unless the new count's winner is expected to be ``switch_gain`` faster than it, so timing noise
    between two near-equal candidates cannot flip the choice from step to step."""

    choices: dict[int, Optional[MedusaTree]]
    rates: dict[int, dict[str, float]] = field(default_factory=dict)
    switch_gain: float = 0.05

    def bucket(self, active: int) -> int:
        sizes = sorted(self.choices)
        return next((b for b in sizes if b >= active), sizes[-1])

    def choose(self, active: int, current: Optional[MedusaTree], started: bool) -> Optional[MedusaTree]:
        b = self.bucket(active)
        best = self.choices[b]
        if not started or current is best:
            return best
        rates = self.rates.get(b, {})
        now, new = rates.get(tree_label(current)), rates.get(tree_label(best))
        if now is not None and new is not None and new < now * (1 + self.switch_gain):
            return current
        return best

    def to_dict(self) -> dict:
        return {str(b): tree_label(t) for b, t in sorted(self.choices.items())}


def tree_label(tree: Optional[MedusaTree]) -> str:
    return "plain" if tree is None else (tree.name or f"{tree.num_nodes} nodes")
