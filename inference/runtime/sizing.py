"""How much a batched method speculates at each batch size, measured on this machine (``size_speculation``).

At batch 1 a verification forward is bound by reading the weights, so a few extra draft nodes are almost
free. At batch B every node is B more rows of compute: the same speculation that pays at batch 1 can cost
more than it accepts at batch 16. So the choice is made per batch size: for each B, plain decoding and a
handful of candidates are timed at B rows, interleaved in rounds (``race.race``, the same rule and spread
record as the batch-1 choice), and the one with the best expected tau / step time wins if it beats plain
decoding by more than the timings' spread (``race.clear_winner``), or none. Expected tau per row is the
same at every B (it is the drafter's accuracy); only step times change. What the candidates are and how
their tau is measured is each method's speculation shape (``methods.shape``); this module times them.

The result is a ``SpeculationSchedule`` (a choice per batch size, with hysteresis) that the batched
decoder consults every step with its number of active rows: as rows finish, the batch shrinks and
speculation that did not pay at 16 rows may pay at 4.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from ..errors import UserError
from .batch_decode import BatchTreeDecoder, Drafter, check_batch_size
from .decode import _sync
from .model import MedusaModel
from .race import PLAIN, clear_winner, race
from .speculation import ScheduleCursor, SpeculationSchedule, choice_depth, draft_tokens, fixed, tree_label

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32)

@dataclass
class BatchSizing:
    """The schedule, and per batch size what was measured: candidates, step times, the winner."""

    schedule: SpeculationSchedule
    table: dict = field(default_factory=dict)   # batch size -> {winner, plain_step_ms, candidates, timing}

    def to_dict(self) -> dict:
        return {"schedule": self.schedule.to_dict(), "switch_gain": self.schedule.switch_gain,
                "per_batch_size": {str(b): v for b, v in sorted(self.table.items())}}



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
            # as run_batch steps: a captured step freezes the LongRoPE switch's rule (rope_switch), and these timed
            # steps capture the buckets later generations replay; outside ``stepping`` they froze the prompts' rule
            with self.m.stepping():
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



class SharedSetting:
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


