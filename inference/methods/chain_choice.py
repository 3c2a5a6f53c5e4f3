"""The chain methods' speculation shape (the draft model's k, prompt lookup's proposal length): how many
draft tokens a batched step proposes, chosen per batch size on this machine (``choice=auto``).

Chains of 1..most draft tokens (most: the method's set length). One batch-1 calibration run per prompt
with the longest chain records how many tokens each step accepted (A); a chain of k tokens accepts
min(A, k) of the same proposal (the first k drafts do not depend on k), so tau(k) = 1 + mean(min(A, k))
without decoding once per length. The step times are those of the method's own batched drafter (the
draft model's k forwards, the lookups and their ragged proposals on real prompts), not of a bare chain,
timed per batch size by ``runtime.sizing``. One prompt at a time a chain method decodes its set length.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from ..errors import UserError
from ..runtime.batch_decode import PlainDrafter
from ..runtime.model import MedusaModel
from ..runtime.sizing import DEFAULT_BATCH_SIZES, BatchSizing, size_speculation
from ..runtime.speculation import SpeculationSchedule, draft_tokens, fixed
from ..runtime.tree import MAX_TREE_NODES, chain_tree
from . import registry
from .shape import ChoiceContext, Chosen, SpeculationShape, keyed_fields

CHAIN_LENGTHS = (1, 2, 3, 4, 6, 8)   # draft tokens of the candidate chains (and the method's most)


def measure_chain_acceptance(m: MedusaModel, method: str, options, prompts: Sequence[Sequence[int]],
                             max_new_tokens: int) -> list[int]:
    """Draft tokens accepted by each step of greedy batch-1 decoding of ``prompts`` with the method's
    longest chain (``ChainShape.calibration``)."""
    opts = registry.get(method).shape.calibration(options)
    accepted = []
    for p in prompts:
        out = registry.generate(m, list(p), method, options=opts, max_new_tokens=max_new_tokens, eos_token_ids=())
        accepted += [n - 1 for n in out.accepted]   # before the budget's cut: a deep chain's last step is no rejection
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
    if not isinstance(spec.shape, ChainShape) or spec.batch_decoder is None:
        raise UserError(f"method {method} has no chain length to size per batch size; chain methods: "
                        + ", ".join(x for x in registry.batched_names() if isinstance(registry.get(x).shape, ChainShape)))
    if not calibration:
        raise UserError(f"sizing {method}'s chain needs at least one calibration prompt: give calibration_prompts "
                        ">= 1 (or choice=fixed)")
    accepted = measure_chain_acceptance(m, method, options, calibration, calibration_tokens)
    most = spec.shape.most(options)
    cands = chain_candidates(accepted, most, lengths)

    def drafter_for(chain):
        if chain is None:
            return PlainDrafter()
        return spec.batch_decoder(m, dataclasses.replace(options, schedule=fixed(chain)), None, None,
                                  "compact").drafter

    sizing = size_speculation(m, cands, drafter_for, latency_prompts, batch_sizes, what=f"{method} chains",
                              varying=spec.shape.varying, **timing)
    record = {"calibration_steps": len(accepted), "mean_accepted_at_most": round(sum(accepted) / len(accepted), 4),
              "most": most, "expected_tau": {name: round(tau, 4) for name, (_, tau) in cands.items()}}
    return sizing, record


class ChainShape(SpeculationShape):
    """A chain method's length (module docstring): the options field ``field`` holds the most draft tokens;
    ``calibration(options)``: the options of the batch-1 run that measures how many tokens each step would
    accept (every step proposing the most: no adaptive length); ``varying``: its proposals' lengths follow
    the text (lookups), so its step times vary by themselves. The options have a ``schedule`` field (a
    ``SpeculationSchedule`` of chains) that the sizing fills."""

    noun = "chain length"
    measured_on = "acceptance"
    record_key = "chain"

    def __init__(self, field: str, calibration: Callable[[Any], Any] = lambda options: options, varying: bool = False):
        self.field, self.calibration, self.varying = field, calibration, varying

    def most(self, options) -> int:
        return getattr(options, self.field)

    def calibrates(self, options, mode: str, batched: bool) -> bool:
        return batched and mode == "auto" and options.schedule is None

    def choose(self, ctx: ChoiceContext, method: str, options, mode: str) -> Chosen:
        return self.given(options)   # one prompt at a time: its set length (its decoders adapt by themselves)

    def size_schedule(self, ctx: ChoiceContext, method: str, options, batch_sizes: Sequence[int]) -> tuple:
        return choose_chain_schedule(ctx.m, method=method, options=options, calibration=ctx.calibration,
                                     latency_prompts=ctx.latency, batch_sizes=batch_sizes,
                                     calibration_tokens=ctx.calibration_tokens, log=ctx.log, progress=ctx.progress)

    def fixed_choice(self, options, heads=None):
        return chain_tree(self.most(options) + 1)

    def apply(self, options, schedule: SpeculationSchedule, batched: bool):
        if batched:   # the set length bounds the schedule's chains (the caches are sized for it): at least theirs
            longest = max([draft_tokens(c) for c in schedule.choices.values()] + [self.most(options)])
            return dataclasses.replace(options, **{self.field: longest}, schedule=schedule)
        choice = schedule.choices[min(schedule.choices)]   # None (plain decoding) is the caller's to decode plainly
        return dataclasses.replace(options, **{self.field: draft_tokens(choice)}, schedule=None) if choice else options

    def encode(self, choice, options) -> dict:
        return {keyed_fields(options)[self.field]: draft_tokens(choice)}

    def decode(self, keys: dict, method: str, options):
        (key, tokens), = keys.items()
        if key != keyed_fields(options)[self.field] or isinstance(tokens, bool) or not isinstance(tokens, int) \
                or not 1 <= tokens < MAX_TREE_NODES:
            raise ValueError(f"not a chain length of method {method}: {keys}")
        return chain_tree(tokens + 1)
