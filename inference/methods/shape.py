"""A method's speculation shape: what it speculates with, and how that is chosen on this machine.

A method that can speculate more or less (a Medusa tree, EAGLE-3's (nodes, depth, top-k), a chain's length)
declares a ``SpeculationShape`` in its ``Method`` (``registry.Method.shape``). The shape answers, for that
method's options:

- ``choose`` (one prompt at a time) / ``size`` (per batch size): the candidates, each timed against plain
  decoding in ``runtime.race``'s interleaved rounds, and the winner (or plain decoding) as a ``Chosen``:
  the options with the choice applied, the ``SpeculationSchedule`` of choices per batch size, and what the
  report records. ``mode`` is the command line's ``choice`` key: ``auto`` measures, ``fixed`` takes the
  options as given (at every batch size);
- ``calibrates`` / ``reads_budgets``: whether the choice measures on the held-out calibration prompts, and
  whether it grows candidates for the node budgets ``tree_budgets`` gives (a key no choice reads is refused);
- ``apply``: a schedule (batched) or its batch-1 choice onto the options;
- ``encode`` / ``decode``: one choice as the method's own option keys, what the one choice file
  (``choice_file``) stores per batch size;
- ``step_shape``: the static shape a choice verifies per row and step, (nodes root included, depth): what a
  captured step buckets on; ``static_shapes`` lists them per batch size of a schedule.

The evaluation and the command lines call these and never ask which method they hold. Methods that share
one choice (``group``: Medusa's tree for ``medusa`` and ``medusa_lookup``) are measured once.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ..errors import UserError
from ..runtime.model import MedusaModel
from ..runtime.speculation import SpeculationSchedule, choice_depth, draft_tokens
from .registry import generate

CHOICE_MODES = ("auto", "fixed")
DEFAULT_BUDGETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)   # node budgets of the batch-1 Medusa candidates


@dataclass
class ChoiceContext:
    """What a choice is measured on: the model, the encoded calibration prompts (accuracy / tau), the prompts
    whose steps are timed (batch 1 times the first), the tokens decoded per calibration prompt, the node
    budgets a grown tree may take (``tree_budgets``), where progress goes."""

    m: MedusaModel
    calibration: list
    latency: list
    calibration_tokens: int = 48
    budgets: Sequence[int] = DEFAULT_BUDGETS
    log: Callable[[str], None] = print
    progress: bool = False


@dataclass
class Chosen:
    """A shape's choice: ``options`` with it applied, ``schedule`` (the choice per batch size; None: plain
    decoding), ``record`` (how it was chosen: report.json), ``report`` (entries the report keeps at its top
    level, e.g. the heads' measured accuracy), ``name`` / ``reason`` (one line each, for the choice file)."""

    options: Any
    schedule: SpeculationSchedule
    record: dict = field(default_factory=dict)
    report: dict = field(default_factory=dict)
    name: str = ""
    reason: str = ""
    measured: bool = False     # made by a measurement on this machine (a file worth writing), not given


class SpeculationShape(ABC):
    """The base of the three built-in shapes (``medusa_choice.MedusaTreeShape``, ``eagle3_choice.Eagle3Shape``,
    ``chain_choice.ChainShape``) and of any plug-in's: the module docstring lists what each answers."""

    noun = "speculation"   # what the logs call one choice ("tree", "chain length")
    record_key = "tree"    # the key of a batched record's mode (auto / fixed / given; chains: "chain")
    fixed_by: tuple = ()   # option fields that, given, name the shape itself: choice=auto leaves it as given

    def group(self, method: str) -> str:
        """Methods with the same group share one choice (measured with the first of them)."""
        return method

    def calibrates(self, options, mode: str, batched: bool) -> bool:
        """Whether the choice needs the calibration prompts (held out from the evaluated ones)."""
        return mode == "auto"

    def reads_budgets(self, options, mode: str, batched: bool) -> bool:
        """Whether the choice grows candidates for the node budgets ``tree_budgets`` gives (``ChoiceContext``)."""
        return False

    @abstractmethod
    def choose(self, ctx: ChoiceContext, method: str, options, mode: str) -> Chosen:
        """The choice for one prompt at a time (``mode``: auto measures, fixed takes the options as given)."""

    measured_on = "tau"   # what a batched choice measures on the calibration prompts (its log line says)

    def size(self, ctx: ChoiceContext, method: str, options, mode: str, sizes: Sequence[int]) -> Chosen:
        """The choice per batch size of ``sizes`` (batch 1 always measured too: a batch's last rows decode
        alone): the options as given (``given``) unless it ``calibrates``, else ``size_schedule``'s sizing."""
        if not self.calibrates(options, mode, True):
            return self.given(options, sizes, "given" if getattr(options, "schedule", None) is not None else "fixed")
        ctx.log(f"choosing {method}'s {self.noun} per batch size: {self.measured_on} on {len(ctx.calibration)} "
                "calibration prompts, batch step latency on this device")
        sizing, record = self.size_schedule(ctx, method, options, sorted({1, *sizes}))
        return self.sized(ctx, method, options, sizing, record)

    def size_schedule(self, ctx: ChoiceContext, method: str, options, batch_sizes: Sequence[int]) -> tuple:
        """(``runtime.sizing.BatchSizing``, what its calibration measured) for ``batch_sizes``: a shape that
        sizes per batch size through ``size`` says how."""
        raise NotImplementedError(f"{type(self).__name__} does not size per batch size")

    @abstractmethod
    def fixed_choice(self, options, heads=None) -> Any:
        """What the options as given speculate with (None: plain decoding); ``heads``: the loaded model or the
        heads' spec, where the choice depends on them (a named Medusa tree is built for their depth)."""

    @abstractmethod
    def apply(self, options, schedule: SpeculationSchedule, batched: bool):
        """The options speculating with ``schedule`` (batched) or with its batch-1 choice."""

    @abstractmethod
    def encode(self, choice, options) -> dict:
        """One (non-None) choice of ``options``' method as that method's option keys."""

    @abstractmethod
    def decode(self, keys: dict, method: str, options) -> Any:
        """The choice ``encode`` wrote, over ``options`` (the command line's); ValueError / TypeError /
        KeyError for keys it cannot take (the file reader names the file)."""

    def check_spec(self, choice, spec) -> None:
        """Refuse, in one line, a choice (read from a file) the heads of ``spec`` cannot decode with."""

    def sized(self, ctx: ChoiceContext, method: str, options, sizing, record: dict) -> Chosen:
        """The ``Chosen`` of a per-batch-size sizing (``runtime.sizing``): its schedule applied, logged, recorded."""
        shown = sizing.schedule.to_dict()
        listed = ", ".join(f"{b}: {t}" for b, t in shown.items())
        ctx.log(f"{method} {self.noun} per batch size: {listed}")
        return Chosen(dataclasses.replace(options, schedule=sizing.schedule), sizing.schedule,
                      {self.record_key: "auto", "schedule": shown, "calibration": record, "sizing": sizing.to_dict()},
                      name=f"per batch size: {listed}",
                      reason="sized per batch size by a batched evaluation on this machine", measured=True)

    def step_shape(self, choice) -> tuple[int, int]:
        """(rows verified per sequence and step, root included; draft depth) of one choice: the most it
        verifies, so a captured step of that size holds every step it makes."""
        return draft_tokens(choice) + 1, choice_depth(choice)

    def static_shapes(self, schedule: SpeculationSchedule, grafted: int = 0) -> dict[int, tuple[int, int]]:
        """Batch size -> ``step_shape`` of the choice in force there: the buckets a captured step needs (with
        ``grafted`` rows, as many levels deeper, that a method adds to every speculating step)."""
        return {b: tuple(x + grafted for x in self.step_shape(c)) if c is not None else (1, 0)
                for b, c in sorted(schedule.choices.items())}

    def given(self, options, sizes: Sequence[int] = (1,), how: str = "fixed") -> Chosen:
        """``mode=fixed``: the options as given at every batch size (``how="fixed"``), or the schedule they
        already hold (``"given"``: a choice file's)."""
        schedule = getattr(options, "schedule", None) or \
            SpeculationSchedule({b: self.fixed_choice(options) for b in sizes})
        return Chosen(options, schedule, {self.record_key: how, "schedule": schedule.to_dict(), "sizing": None})


def keyed_fields(options) -> dict[str, str]:
    """field name -> command-line key of the options' keyed fields."""
    return {f.name: f.metadata["key"] for f in dataclasses.fields(options) if f.metadata.get("key")}


def method_mode(shape: SpeculationShape, choice: str, given: Sequence[str]) -> str:
    """The choice mode of a method whose option fields ``given`` were set by the caller: ``fixed`` where one
    of them names the shape itself (``fixed_by``: Medusa's tree=tree8), else ``choice``."""
    if choice not in CHOICE_MODES:
        raise UserError(f"choice must be auto, fixed or a choice file medusa-eval wrote, got {choice!r}")
    return "fixed" if set(getattr(shape, "fixed_by", ())) & set(given) else choice


def plain_step_times(m: MedusaModel, prompt_ids: Sequence[int], *, steps: int = 8, warmup: int = 2) -> list[float]:
    """Wall time (s) of each of ``steps`` plain decoding steps after ``warmup`` ones, EOS ignored: the
    reference every candidate is raced against."""
    out = generate(m, list(prompt_ids), "autoregressive", max_new_tokens=warmup + steps + 1, eos_token_ids=())
    times = list(out.step_s)
    return times[warmup:] if len(times) > warmup else times
