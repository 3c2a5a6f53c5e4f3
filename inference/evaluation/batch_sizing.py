"""How much Medusa speculates at each batch size, measured on this machine (``tree=auto`` with batches).

At batch 1 a verification forward is bound by reading the weights, so a few extra tree nodes
are almost free (``tree_choice``). At batch B every node is B more rows of compute: the same
tree that pays at batch 1 can cost more than it accepts at batch 16. So the choice is made per
batch size: for each B, plain decoding and a handful of candidates (small trees grown from the
heads' measured accuracy, and top-1 chains, which stop paying later than trees because every
node sits on the one path most likely accepted) are timed at B rows, interleaved in rounds
(``tree_choice.race``, the same rule and spread record as the batch-1 choice), and the one with
the best expected tau / step time wins, or none. Expected tau per row is the same at every B
(it is the heads' accuracy); only step times change.

The result is a ``SpeculationSchedule`` (a tree per batch size, with hysteresis) that the batched
Medusa decoder consults every step with its number of active rows: as rows finish, the batch
shrinks and a tree that did not pay at 16 rows may pay at 4.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from ..errors import UserError
from ..methods.medusa import HeadsDrafter
from ..runtime.batch_decode import BatchTreeDecoder, PlainDrafter, check_batch_size
from ..runtime.speculation import SpeculationSchedule, tree_label
from ..runtime.decode import _sync
from ..runtime.model import MedusaModel
from ..runtime.tree import MedusaTree, chain_tree, expected_tau, grow_tree
from .tree_choice import PLAIN, race

BATCH_BUDGETS = (1, 2, 3, 4, 8)   # draft nodes of the grown candidate trees (root not counted)
BATCH_CHAINS = (2, 3)             # chain lengths (root included)
DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32)


@dataclass
class BatchSizing:
    """The schedule, and per batch size what was measured: candidates, step times, the winner."""

    schedule: SpeculationSchedule
    table: dict = field(default_factory=dict)   # batch size -> {winner, plain_step_ms, candidates, timing}

    def to_dict(self) -> dict:
        return {"schedule": self.schedule.to_dict(), "switch_gain": self.schedule.switch_gain,
                "per_batch_size": {str(b): v for b, v in sorted(self.table.items())}}


def candidate_trees(per_rank, num_heads: int, budgets: Sequence[int] = BATCH_BUDGETS,
                    chains: Sequence[int] = BATCH_CHAINS) -> list[tuple[MedusaTree, float]]:
    """Distinct trees grown for ``budgets`` and top-1 chains of ``chains`` tokens, with expected tau."""
    out, seen = [], set()
    for b in sorted(set(budgets)):
        tree, tau = grow_tree(per_rank, b, name=f"auto{b}")
        out.append((tree, tau))
    for n in chains:
        if n - 1 <= num_heads:
            tree = chain_tree(n)
            out.append((tree, expected_tau(tree, per_rank)))
    unique = []
    for tree, tau in out:
        key = tuple(map(tuple, tree.choices))
        if tree.num_nodes > 1 and key not in seen:
            seen.add(key)
            unique.append((tree, tau))
    return unique


class _BatchTimer:
    """One prefilled batch of ``b`` rows whose steps are timed with each candidate in turn (EOS
    ignored, no row leaves): the prompts are prefilled once per batch size, not once per timing."""

    def __init__(self, m: MedusaModel, prompts: Sequence[Sequence[int]], b: int, trees: dict, room: int):
        self.m, self.trees = m, trees
        rows = [list(prompts[i % len(prompts)]) for i in range(b)]
        self.dec = BatchTreeDecoder(m, PlainDrafter())
        self.drafters = {name: (HeadsDrafter(m, t) if t is not None else PlainDrafter()) for name, t in trees.items()}
        with torch.inference_mode():
            self.dec.prefill(rows, room)

    def __call__(self, name: str, steps: int, warmup: int) -> list[float]:
        self.dec.drafter = self.drafters[name]
        times = []
        for i in range(warmup + steps):
            t = time.perf_counter()
            self.dec.step()
            _sync(self.m.device)
            if i >= warmup:
                times.append(time.perf_counter() - t)
        return times


def choose_schedule(m: MedusaModel, per_rank, latency_prompts: Sequence[Sequence[int]],
                    batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES, *, budgets: Sequence[int] = BATCH_BUDGETS,
                    chains: Sequence[int] = BATCH_CHAINS, latency_steps: int = 4, warmup: int = 2, min_rounds: int = 2,
                    max_rounds: int = 4, switch_gain: float = 0.05, log: Callable[[str], None] = print,
                    progress: bool = False) -> BatchSizing:
    """Time plain decoding and each candidate tree at every batch size; keep the best expected
    tokens/s per batch size (module docstring)."""
    if m.heads is None:
        raise UserError("sizing speculation per batch needs Medusa heads (heads=<export directory>)")
    sizes = sorted({check_batch_size(b) for b in batch_sizes})
    if not latency_prompts:
        raise UserError("sizing speculation per batch needs at least one latency prompt")
    cands = candidate_trees(per_rank, m.num_heads, budgets, chains)
    taus = {t.name: tau for t, tau in cands}
    trees: dict[str, Optional[MedusaTree]] = {PLAIN: None, **{t.name: t for t, _ in cands}}
    rounds_room = max_rounds * len(trees) * (warmup + latency_steps)
    room = rounds_room * (max((t.max_depth for t, _ in cands), default=0) + 1) + 1
    choices, rates, table = {}, {}, {}
    for b in sizes:
        timer = _BatchTimer(m, latency_prompts, b, trees, room)
        step, spreads, timing = race(taus, lambda name: timer(name, latency_steps, warmup), latency_steps=latency_steps,
                                     min_rounds=min_rounds, max_rounds=max_rounds, log=log, progress=progress,
                                     what=f"speculation at batch {b}", label=lambda name: f"tree {name}")
        rate = {tree_label(None): b / step[PLAIN]}
        rows = []
        for tree, tau in cands:
            rate[tree.name] = b * tau / step[tree.name]
            rows.append({"name": tree.name, "nodes": tree.num_nodes, "expected_tau": round(tau, 4),
                         **spreads[tree.name], "expected_tokens_per_s": round(rate[tree.name], 2)})
        best = max(rate, key=rate.get)
        choices[b] = trees.get(best) if best != tree_label(None) else None
        rates[b] = rate
        table[b] = {"winner": best, "plain_step_ms": round(step[PLAIN] * 1e3, 3),
                    "plain_tokens_per_s": round(rate[tree_label(None)], 2), "candidates": rows, "timing": timing}
        log(f"  batch {b:>3}: plain {step[PLAIN] * 1e3:.1f} ms/step; best {best} "
            f"({rate[best]:.1f} tok/s expected vs plain {rate[tree_label(None)]:.1f})")
    return BatchSizing(SpeculationSchedule(choices, rates, switch_gain), table)
