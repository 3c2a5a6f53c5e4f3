"""How much a batched method speculates at each batch size, measured on this machine.

At batch 1 a verification forward is bound by reading the weights, so a few extra draft nodes
are almost free (``tree_choice``). At batch B every node is B more rows of compute: the same
speculation that pays at batch 1 can cost more than it accepts at batch 16. So the choice is made
per batch size: for each B, plain decoding and a handful of candidates are timed at B rows,
interleaved in rounds (``tree_choice.race``, the same rule and spread record as the batch-1
choice), and the one with the best expected tau / step time wins if it beats plain decoding by more
than the timings' spread (``tree_choice.clear_winner``), or none. Expected tau per row is
the same at every B (it is the drafter's accuracy); only step times change. ``size_speculation`` is
that rule for any candidates and drafters; per family:

- Medusa heads (``choose_schedule``): small trees grown from the heads' measured accuracy, and
  top-1 chains, which stop paying later than trees because every node sits on the one path most
  likely accepted;
- EAGLE-3 (``choose_eagle3_schedule``): (nodes, depth, top-k) settings whose tau is measured by
  batch-1 decoding of the calibration prompts (a dynamic tree has no fixed node values to add up),
  timed with one shared drafter pointed at each setting in turn (its cache must see every step);
  with a looked-up branch (``eagle3_lookup``) each setting is costed by its mean step at that batch
  size, since only some steps graft a chain (at batch B, any of B rows');
- chain methods, the draft model and prompt lookup (``choose_chain_schedule``): chains of 1..most
  draft tokens. One batch-1 calibration run per prompt with the longest chain records how many
  tokens each step accepted (A); a chain of k tokens accepts min(A, k) of the same proposal (the
  first k drafts do not depend on k), so tau(k) = 1 + mean(min(A, k)) without decoding once per
  length. The step times are those of the method's own drafter (the draft model's k forwards, the
  lookups and their ragged proposals on real prompts), not of a bare chain.

The result is a ``SpeculationSchedule`` (a choice per batch size, with hysteresis) that the batched
decoder consults every step with its number of active rows: as rows finish, the batch shrinks and
speculation that did not pay at 16 rows may pay at 4.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from ..errors import UserError
from ..methods import registry
from ..methods.eagle3 import Eagle3Options
from ..methods.medusa import HeadsDrafter
from ..runtime.batch_decode import BatchTreeDecoder, Drafter, PlainDrafter, check_batch_size
from ..runtime.speculation import (ScheduleCursor, SpeculationSchedule, choice_depth, draft_tokens, fixed,
                                   tree_label)
from ..runtime.decode import _sync
from ..runtime.model import MedusaModel
from ..runtime.tree import MedusaTree, chain_tree, expected_tau, grow_tree
from .tree_choice import PLAIN, clear_winner, eagle3_fields, eagle3_name, measure_eagle3_tau, race

BATCH_BUDGETS = (1, 2, 3, 4, 8)   # draft nodes of the grown candidate trees (root not counted)
BATCH_CHAINS = (2, 3)             # chain lengths (root included)
DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32)
CHAIN_LENGTHS = (1, 2, 3, 4, 6, 8)   # draft tokens of the candidate chains (and the method's most)
# eagle3 (nodes, depth, topk) candidates at batch sizes: the batch-1 grid's narrower trees (not its
# widest, which a batch of rows multiplies into hundreds of verified rows per step)
EAGLE3_BATCH_GRID = ((1, 1, 1), (2, 1, 2), (4, 1, 4), (2, 2, 1), (3, 2, 2), (4, 4, 1), (4, 3, 2), (8, 4, 4))


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
        tree, tau = grow_tree(per_rank, b)
        tree.name = f"auto{len(tree.paths)}"   # the nodes it has (root excluded): growth stops at value 0
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
    """One prefilled batch of ``b`` rows whose steps are timed with each candidate's drafter in turn (EOS
    ignored, no row leaves): the prompts are prefilled once per batch size, not once per timing."""

    def __init__(self, m: MedusaModel, prompts: Sequence[Sequence[int]], b: int, drafters: dict[str, Drafter],
                 room: int):
        self.m, self.drafters = m, drafters
        rows = [list(prompts[i % len(prompts)]) for i in range(b)]
        # prefilled with the first (plain) candidate's drafter: one that taps features sees the prompts
        self.dec = BatchTreeDecoder(m, next(iter(drafters.values())))
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


def size_speculation(m: MedusaModel, candidates: dict[str, tuple[Any, float]], drafter_for: Callable[[Any], Drafter],
                     latency_prompts: Sequence[Sequence[int]], batch_sizes: Sequence[int], *, what: str,
                     latency_steps: int = 4, warmup: int = 2, min_rounds: int = 2, max_rounds: int = 4,
                     switch_gain: float = 0.05, log: Callable[[str], None] = print, progress: bool = False,
                     varying: bool = False) -> "BatchSizing":
    """Time plain decoding and each candidate (name -> (choice, expected tau)) at every batch size with
    ``drafter_for(choice)`` (``drafter_for(None)``: plain decoding's); keep the best expected tokens/s
    per batch size (module docstring)."""
    sizes = sorted({check_batch_size(b) for b in batch_sizes})
    if not latency_prompts:
        raise UserError(f"sizing {what} per batch needs at least one latency prompt: give num_prompts >= 1")
    taus = {name: tau for name, (_, tau) in candidates.items()}
    choices: dict[str, Any] = {PLAIN: None, **{name: c for name, (c, _) in candidates.items()}}
    # race's rounds: C candidate runs (up to depth + 1 tokens a step) and C + 1 plain runs (1 token a step)
    n_cand = len(choices) - 1
    deepest = max((choice_depth(c) for c in choices.values()), default=0)
    room = max_rounds * (warmup + latency_steps) * (n_cand + 1 + n_cand * (deepest + 1)) + 1
    plain = tree_label(None)
    picked, rates, table = {}, {}, {}
    for b in sizes:
        drafters = {name: drafter_for(c) for name, c in choices.items()}
        timer = _BatchTimer(m, latency_prompts, b, drafters, room)
        step, spreads, timing = race(taus, lambda name: timer(name, latency_steps, warmup), latency_steps=latency_steps,
                                     min_rounds=min_rounds, max_rounds=max_rounds, log=log, progress=progress,
                                     what=f"{what} at batch {b}", label=str, varying=varying)
        rate = {plain: b / step[PLAIN]}
        rows = []
        for name, (c, tau) in candidates.items():
            rate[name] = b * tau / step[name]
            rows.append({"name": name, "nodes": draft_tokens(c) + 1, "expected_tau": round(tau, 4),
                         **spreads[name], "expected_tokens_per_s": round(rate[name], 2)})
        name, why = clear_winner(rate[plain], spreads[PLAIN], {n: (rate[n], spreads[n]) for n in candidates},
                                 varying=varying)
        best = name or plain
        picked[b] = choices[name] if name else None
        # keyed as the schedule's hysteresis looks them up (``tree_label`` of a choice): a candidate's name here
        # can differ from its label (eagle3_lookup's setting "n4-d1-k4" is labelled "n4-d1-k4+t6-m2")
        rates[b] = {plain: rate[plain], **{tree_label(c): rate[n] for n, (c, _) in candidates.items()}}
        table[b] = {"winner": best, "plain_step_ms": round(step[PLAIN] * 1e3, 3),
                    "plain_tokens_per_s": round(rate[plain], 2), "candidates": rows, "timing": timing}
        log(f"  batch {b:>3}: plain {step[PLAIN] * 1e3:.1f} ms/step; best {best} "
            f"({rate[best]:.1f} tok/s expected vs plain {rate[plain]:.1f}{'' if name else '; ' + why})")
    return BatchSizing(SpeculationSchedule(picked, rates, switch_gain), table)


def choose_schedule(m: MedusaModel, per_rank, latency_prompts: Sequence[Sequence[int]],
                    batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES, *, budgets: Sequence[int] = BATCH_BUDGETS,
                    chains: Sequence[int] = BATCH_CHAINS, **timing) -> BatchSizing:
    """Medusa heads: the tree per batch size, from the heads' measured per-rank accuracy (module docstring)."""
    if m.heads is None:
        raise UserError("sizing speculation per batch needs Medusa heads (heads=<export directory>)")
    cands = {t.name: (t, tau) for t, tau in candidate_trees(per_rank, m.num_heads, budgets, chains)}
    return size_speculation(m, cands, lambda tree: HeadsDrafter(m, tree), latency_prompts, batch_sizes,
                            what="speculation", **timing)


# -- EAGLE-3 ----------------------------------------------------------------------------------------
class _Setting:
    """One candidate setting of a drafter shared by every candidate (EAGLE-3's drafter cache must see
    every step, so candidates cannot each keep their own): drafting through it first points the
    shared drafter at this setting (None: a plain step, the drafter still catching up)."""

    def __init__(self, shared, choice):
        self.shared, self.choice = shared, choice

    def __getattr__(self, name):   # tap_layers, prefilled, accepted, rows_kept, max_nodes, ...
        return getattr(self.shared, name)

    def draft(self, dec):
        self.shared.cursor = ScheduleCursor(fixed(self.choice))
        return self.shared.draft(dec)


def choose_eagle3_schedule(m: MedusaModel, calibration: Sequence[Sequence[int]],
                           latency_prompts: Sequence[Sequence[int]], batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
                           *, grid: Sequence[tuple[int, int, int]] = EAGLE3_BATCH_GRID, calibration_tokens: int = 48,
                           method: str = "eagle3", options=None, **timing) -> tuple[BatchSizing, dict]:
    """EAGLE-3's (nodes, depth, topk) per batch size (module docstring): (the sizing, each setting's
    measured tau). ``method="eagle3_lookup"`` (with ``options``, whose looked-up branch is kept) sizes
    the same shapes with the branch on: tau by batch-1 decoding with it, step times by its batched
    drafter on the latency prompts (grafts where those prompts repeat themselves)."""
    if not calibration:
        raise UserError(f"sizing {method} per batch needs at least one calibration prompt: give "
                        "calibration_prompts >= 1 (or eagle_tree=fixed)")
    base = options if options is not None else Eagle3Options()
    shapes = list(dict.fromkeys(tuple(s) for s in grid))
    settings = {eagle3_name(s): dataclasses.replace(base, **eagle3_fields(s), tree="fixed", schedule=None)
                for s in shapes}
    taus = {name: measure_eagle3_tau(m, calibration, shape, max_new_tokens=calibration_tokens, method=method,
                                     options=base) for name, shape in zip(settings, shapes)}
    cands = {name: (o, taus[name]) for name, o in settings.items()}
    # sized for the largest setting; batch-size keys here only collect the settings
    shared = base.batch_drafter(m, SpeculationSchedule(dict(enumerate(settings.values(), 1))))
    # a looked-up branch grafts on some steps only, and at batch b on any of b rows' (narrower rows padded):
    # the race costs each setting by its mean step at that batch size (``race``'s varying)
    sizing = size_speculation(m, cands, lambda o: _Setting(shared, o), latency_prompts, batch_sizes,
                              what=f"{method} trees", varying=base.steps_vary, **timing)
    return sizing, {"measured_tau": {name: round(t, 4) for name, t in taus.items()}}


# -- chain methods (draft model, prompt lookup) ----------------------------------------------------
def measure_chain_acceptance(m: MedusaModel, method: str, options, prompts: Sequence[Sequence[int]],
                             max_new_tokens: int) -> list[int]:
    """Draft tokens accepted by each step of greedy batch-1 decoding of ``prompts`` with the method's
    longest chain (``ChainSizing.calibration``)."""
    spec = registry.get(method)
    opts = spec.chain.calibration(options)
    accepted = []
    for p in prompts:
        out = registry.generate(m, list(p), method, options=opts, max_new_tokens=max_new_tokens, eos_token_ids=())
        accepted += [n - 1 for n in out.accept_lengths]
    return accepted


def chain_candidates(accepted: Sequence[int], most: int,
                     lengths: Sequence[int] = CHAIN_LENGTHS) -> dict[str, tuple[Any, float]]:
    """Chains of each of ``lengths`` (up to ``most``) and of ``most`` draft tokens, with expected tau
    1 + mean(min(A, k)) over the calibration steps' accepted counts A (module docstring)."""
    if not accepted:
        raise UserError("sizing a chain needs at least one calibration step: give calibration_prompts >= 1 "
                        "and calibration_tokens >= 1")
    out = {}
    for k in sorted({x for x in lengths if x <= most} | {most}):
        tau = 1 + sum(min(a, k) for a in accepted) / len(accepted)
        tree = chain_tree(k + 1)
        out[tree.name] = (tree, tau)
    return out


def choose_chain_schedule(m: MedusaModel, method: str, options, calibration: Sequence[Sequence[int]],
                          latency_prompts: Sequence[Sequence[int]], batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
                          *, calibration_tokens: int = 48, lengths: Sequence[int] = CHAIN_LENGTHS,
                          **timing) -> tuple[BatchSizing, dict]:
    """A chain method's length per batch size (module docstring): (the sizing, the calibration record)."""
    spec = registry.get(method)
    if spec.chain is None or spec.batch_decoder is None:
        raise UserError(f"method {method} has no chain length to size per batch size; chain methods: "
                        + ", ".join(x for x in registry.batched_names() if registry.get(x).chain is not None))
    if not calibration:
        raise UserError(f"sizing {method}'s chain needs at least one calibration prompt: give calibration_prompts "
                        ">= 1 (or batch_chains=fixed)")
    accepted = measure_chain_acceptance(m, method, options, calibration, calibration_tokens)
    most = spec.chain.most(options)
    cands = chain_candidates(accepted, most, lengths)

    def drafter_for(chain):
        if chain is None:
            return PlainDrafter()
        return spec.batch_decoder(m, dataclasses.replace(options, schedule=fixed(chain)), None, None,
                                  "compact").drafter

    sizing = size_speculation(m, cands, drafter_for, latency_prompts, batch_sizes, what=f"{method} chains",
                              varying=spec.chain.varying, **timing)
    record = {"calibration_steps": len(accepted), "mean_accepted_at_most": round(sum(accepted) / len(accepted), 4),
              "most": most, "expected_tau": {name: round(tau, 4) for name, (_, tau) in cands.items()}}
    return sizing, record
