"""How much a batched method speculates at each number of active rows: a ``SpeculationSchedule``.

At batch 1 a verification forward is bound by reading the weights, so extra draft nodes are almost
free; at batch 32 every node is 32 more rows of compute. The schedule holds the speculation measured
best at each batch size (``runtime.sizing`` measures it, for each method's ``methods.shape``) and answers, every step, how much
to speculate for the rows still active. A choice is whatever its method drafts with: a Medusa tree,
a chain (``chain_tree(k + 1)``: k draft tokens for the draft model or prompt lookup), EAGLE-3's
(nodes, depth, top-k) options; None is plain decoding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from .tree import MedusaTree


@dataclass
class SpeculationSchedule:
    """Which tree, chain or setting (None = plain decoding) to speculate with at each number of active rows.

    ``choices[b]`` holds the winner measured at batch size b and ``rates[b][name]`` the expected
    tokens/s of every candidate there. For a count between measured sizes the next larger measured
    size decides (its step times bound the smaller batch's). Hysteresis: the current tree is kept
    unless the new count's winner is expected to be ``switch_gain`` faster than it, so timing noise
    between two near-equal candidates cannot flip the choice from step to step."""

    choices: dict[int, Any]
    rates: dict[int, dict[str, float]] = field(default_factory=dict)
    switch_gain: float = 0.05

    def bucket(self, active: int) -> int:
        sizes = sorted(self.choices)
        return next((b for b in sizes if b >= active), sizes[-1])

    def choose(self, active: int, current: Any, started: bool) -> Any:
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


class ScheduleCursor:
    """One decoder's place in a schedule: the choice in force, moved by ``next`` before every step
    (hysteresis needs the previous choice, so each decoder keeps its own)."""

    def __init__(self, schedule: SpeculationSchedule):
        self.schedule = schedule
        self.current: Any = None
        self.started = False

    def next(self, active: int) -> Any:
        self.current = self.schedule.choose(active, self.current, self.started)
        self.started = True
        return self.current


def schedule_record(schedule: SpeculationSchedule, encode: Callable[[Any], Any]) -> dict:
    """A schedule as JSON: each batch size's choice through ``encode`` (None stays None: plain decoding), the
    expected tokens/s per choice label that the hysteresis compares, the switch gain."""
    return {"choices": {str(b): encode(c) if c is not None else None for b, c in sorted(schedule.choices.items())},
            "rates": {str(b): dict(r) for b, r in sorted(schedule.rates.items())},
            "switch_gain": schedule.switch_gain}


def schedule_from_record(record: dict, decode: Callable[[Any], Any]) -> SpeculationSchedule:
    """The schedule ``schedule_record`` wrote, each choice through ``decode``; KeyError / TypeError /
    ValueError / AttributeError for a damaged record (the caller names the file)."""
    choices = {int(b): decode(c) if c is not None else None for b, c in record["choices"].items()}
    rates = {int(b): {str(k): float(v) for k, v in r.items()} for b, r in record.get("rates", {}).items()}
    return SpeculationSchedule(choices, rates, float(record.get("switch_gain", 0.05)))


def fixed(choice: Any) -> SpeculationSchedule:
    """The same choice at every batch size."""
    return SpeculationSchedule({1: choice})


def as_schedule(value: Any) -> SpeculationSchedule:
    return value if isinstance(value, SpeculationSchedule) else fixed(value)


def draft_tokens(choice: Any) -> int:
    """Draft tokens a choice verifies per row and step (root excluded)."""
    if choice is None:
        return 0
    return choice.num_nodes - 1 if isinstance(choice, MedusaTree) else int(getattr(choice, "nodes"))


def choice_depth(choice: Any) -> int:
    """How deep a choice drafts (a Medusa tree's or chain's depth; EAGLE-3's depth option)."""
    if choice is None:
        return 0
    return choice.max_depth if isinstance(choice, MedusaTree) else int(getattr(choice, "depth"))


def tree_label(tree: Any) -> str:
    if tree is None:
        return "plain"
    if isinstance(tree, MedusaTree):
        return tree.name or f"{tree.num_nodes} nodes"
    return str(getattr(tree, "label", tree))
