"""Methods eagle3 and eagle3_lookup's speculation shape: the (nodes, depth, top-k[, floor]) of EAGLE-3's dynamic
tree, chosen on this machine (``choice=auto``) by the rule Medusa's tree is (``medusa_choice``).

Its dynamic trees have no fixed node values to add up, so each candidate of a small grid gets its tau
measured by greedy decoding of the calibration prompts (``measure_eagle3_tau``), its step time in
``runtime.race``'s interleaved rounds against plain decoding (a setting whose steps differ by themselves: its
mean step over a whole calibration reply); the best expected tokens/s wins, plain
decoding when nothing beats it by more than the timings' spread. ``eagle3_lookup`` races the same shapes
with its looked-up branch on, and its parts (the lookup alone, the drafter alone, switching) beside them.

Batched (``Eagle3Shape.size``): the grid's narrower settings, their tau by batch-1 decoding, timed per
batch size with one shared drafter pointed at each setting in turn (its cache must see every step); with
a looked-up branch each setting is costed by its mean step at that batch size, since only some steps
graft a chain (at batch B, any of B rows').
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from ..errors import UserError
from ..runtime.model import MedusaModel
from ..runtime.race import PLAIN, clear_winner, progress_bar, race
from ..runtime.sizing import DEFAULT_BATCH_SIZES, BatchSizing, SharedSetting, size_speculation
from ..runtime.speculation import SpeculationSchedule
from . import registry
from .registry import generate
from .shape import ChoiceContext, Chosen, SpeculationShape, keyed_fields, plain_step_times

# (nodes N, depth D, top-k k): one, two or four depth-1 guesses (no expansion call: the catch-up call
# that every step makes already drafts them; they pay for drafters trained one step deep, whose deeper
# drafts are rarely right), chains, then trees of growing width. On a CPU with the prepacked kernels
# (runtime/linear_kernels.py) a 3-8-node verification costs ~1.2-1.4x a 1-token step (16 nodes ~1.75x),
# so wide shallow trees are cheap; EAGLE-2's own default is about (59, 6, 10), sized for a GPU. A fourth
# element is a probability floor (eagle_min_prob): of the N nodes, only those the drafter rates at least
# that likely are verified, so a step verifies 2 rows where the drafter is sure and up to N + 1 where it
# hesitates (on a CPU each row costs ~7% of a step; on a GPU the race will prefer the shapes without it).
EAGLE3_GRID = ((1, 1, 1), (2, 1, 2), (4, 1, 4), (4, 1, 4, 0.1), (2, 2, 1), (3, 2, 2), (8, 2, 4), (8, 2, 4, 0.1),
               (4, 4, 1), (4, 3, 2), (8, 4, 4), (16, 5, 4), (32, 6, 8))


@dataclass
class Eagle3Choice:
    """(nodes, depth, topk[, min_prob]) for method eagle3, or None: plain decoding is faster on this machine."""

    shape: Optional[tuple]
    reason: str
    candidates: list = field(default_factory=list)  # {name, nodes, depth, topk, measured_tau, step_ms (+ spread), rate}
    autoregressive_step_ms: Optional[float] = None   # None: not measured (a given choice)
    timing: dict = field(default_factory=dict)

    def options(self) -> dict:
        """The eagle3 option fields this choice sets (nodes=0: plain decoding)."""
        return eagle3_fields(self.shape or (0, 1, 1))

    def to_dict(self) -> dict:
        out = {"name": eagle3_name(self.shape) if self.shape else "none (plain decoding)",
               **eagle3_fields(self.shape or (0, 0, 0)), "reason": self.reason, "candidates": self.candidates,
               "autoregressive_step_ms": self.autoregressive_step_ms}
        if self.timing:
            out["timing"] = self.timing
        return out


# A shape's elements past (nodes, depth, topk), each None or absent = the options' own value: the probability
# floor, then for methods with a looked-up branch its tokens (0: the drafter alone) and its switch
_OPTIONAL_FIELDS = ("min_prob", "num_tokens", "switch")


def eagle3_fields(shape: tuple) -> dict:
    """The option fields a grid shape sets: (nodes, depth, topk), then those of min_prob, num_tokens and
    switch it gives (a shape without them keeps the options' own)."""
    out = {"nodes": shape[0], "depth": shape[1], "topk": shape[2]}
    out.update({k: v for k, v in zip(_OPTIONAL_FIELDS, shape[3:]) if v is not None})
    return out


def eagle3_name(shape: tuple) -> str:
    """A shape's name, as ``Eagle3Options.label`` names the same setting: n4-d1-k4, n4-d1-k4-p0.1; with a
    looked-up branch's fields: n4-d1-k4-t0 (the drafter alone), n4-d1-k4-s3 (switching), lookup-only."""
    f = eagle3_fields(shape)
    if not f["nodes"]:
        return "none (plain decoding)" if f.get("num_tokens") == 0 else "lookup-only"
    name = "n{}-d{}-k{}".format(*shape[:3]) + (f"-p{f['min_prob']:g}" if f.get("min_prob") else "")
    return name + "".join(f"-{tag}{f[k]}" for tag, k in (("t", "num_tokens"), ("s", "switch")) if k in f)


def eagle3_step_times(m: MedusaModel, prompt_ids: Sequence[int], shape: Optional[tuple], *,
                      steps: int = 8, warmup: int = 2, method: str = "eagle3", options=None,
                      reply_tokens: Optional[int] = None) -> list[float]:
    """``step_times`` for ``method`` (eagle3, or eagle3_lookup with ``options``' lookup settings) with
    (nodes, depth, topk[, min_prob]) = ``shape`` (None: plain decoding). ``reply_tokens``: every step of a
    whole reply that long instead of ``steps`` steps (a setting whose steps differ by themselves: its first
    steps are not its mix)."""
    if shape is None:
        return plain_step_times(m, prompt_ids, steps=steps, warmup=warmup)
    extra = getattr(options, "num_tokens", 0)          # a looked-up chain deepens a step's tree
    whole = reply_tokens is not None
    out = generate(m, list(prompt_ids), method, options=options, **eagle3_fields(shape), eos_token_ids=(),
                   max_new_tokens=reply_tokens if whole else (warmup + steps + 1) * (shape[1] + extra + 1),
                   max_steps=None if whole else warmup + steps, seed=0)
    times = list(out.step_s)
    return times[warmup:] if len(times) > warmup else times


def measure_eagle3_tau(m: MedusaModel, prompts: Sequence[Sequence[int]], shape: tuple, *,
                       max_new_tokens: int = 48, method: str = "eagle3", options=None) -> float:
    """Tokens per step of greedy ``method`` decoding with ``shape`` over ``prompts``: a dynamic tree has
    no fixed node values to add up, so its expected tau is measured by decoding. 0.0 when no step was verified
    (as ``GenerationOutput.tau``): nothing measured, so such a candidate never wins (1.0 once let it tie plain)."""
    tokens = steps = 0
    for p in prompts:
        out = generate(m, list(p), method, options=options, **eagle3_fields(shape),
                       max_new_tokens=max_new_tokens)
        tokens, steps = tokens + sum(out.accepted), steps + out.steps   # before the budget's cut, as a long reply runs
    return tokens / steps if steps else 0.0


def choose_eagle3(m: MedusaModel, calibration: Sequence[Sequence[int]], latency_prompt: Sequence[int], *,
                  grid: Sequence[tuple] = EAGLE3_GRID, calibration_tokens: int = 48,
                  latency_steps: int = 6, min_rounds: int = 3, max_rounds: int = 8,
                  log: Callable[[str], None] = print, progress: bool = False, method: str = "eagle3",
                  options=None) -> Eagle3Choice:
    """``choose_tree``'s rule for method eagle3: each (nodes, depth, topk[, min_prob]) of ``grid``'s tau is measured
    by greedy decoding of the calibration prompts, its step time in ``race``'s interleaved rounds
    against plain decoding; the best expected tokens/s wins, plain decoding when nothing beats it by more
    than the timings' spread (``clear_winner``). ``method="eagle3_lookup"`` (with ``options``, whose
    lookup settings are kept) races the same shapes with the looked-up branch on: its choice None sets
    eagle_nodes=0, which that method decodes as prompt lookup alone."""
    if not calibration:
        raise UserError("choosing eagle3's tree needs at least one calibration prompt")
    # a combined method races its parts too (eagle3_lookup: the lookup alone, the drafter alone, switching)
    parts = getattr(options, "part_shapes", None)
    grid = tuple(grid) + (tuple(parts()) if parts is not None else ())
    shapes = {eagle3_name(s): tuple(s) for s in dict.fromkeys(tuple(s) for s in grid)}
    bar = progress_bar(progress, len(shapes), f"calibrating {method}")
    taus, varies = {}, set()
    try:
        for i, (name, shape) in enumerate(shapes.items()):
            if bar is not None:
                bar.set_description_str(f"calibrating {method}: {name} ({i + 1}/{len(shapes)})")
            taus[name] = measure_eagle3_tau(m, calibration, shape, max_new_tokens=calibration_tokens,
                                            method=method, options=options)
            # a looked-up branch or a probability floor: the setting's steps differ in the rows they verify
            if registry.make_options(method, options, **eagle3_fields(shape)).steps_vary:
                varies.add(name)
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    prompt = list(latency_prompt)
    # A setting whose steps differ (a branch grafted or a switch made where the text repeats itself) is
    # timed over a whole calibration reply and costed by its mean step: its first few steps are not its
    # mix (a switching setting copied the prompt's own code for its first steps and was costed 73 ms where
    # its replies averaged 95, BENCHMARKS.md "EAGLE-3 with prompt lookup").
    step, spreads, timing = race(
        taus, lambda name: eagle3_step_times(m, prompt, shapes.get(name), steps=latency_steps, method=method,
                                             options=options,
                                             reply_tokens=calibration_tokens if name in varies else None),
        latency_steps=latency_steps, min_rounds=min_rounds, max_rounds=max_rounds, log=log, progress=progress,
        what=f"{method} trees", by_mean=varies)
    ar_step = step[PLAIN]
    cands, rates = [], {}
    for name, shape in shapes.items():
        rates[name] = taus[name] / step[name]
        cands.append({"name": name, **eagle3_fields(shape), "measured_tau": round(taus[name], 4) or None,
                      **spreads[name],
                      "timed_on": f"a {calibration_tokens}-token reply" if name in varies else f"{latency_steps} steps",
                      "expected_tokens_per_s": round(rates[name], 2)})
        log(f"  {method} {name:>11}: tau {taus[name]:.3f} (measured), step {step[name] * 1e3:.1f} ms -> "
            f"{rates[name]:.1f} tok/s expected")
    log(f"  plain decoding: step {ar_step * 1e3:.1f} ms -> {1 / ar_step:.1f} tok/s")
    name, why = clear_winner(1.0 / ar_step, spreads[PLAIN], {n: (rates[n], spreads[n]) for n in shapes})
    reason = f"best measured tau / step time ({why})" if name is not None else why
    # plain decoding, as these options write it (eagle3: nodes=0; a method with a branch: that off too)
    plain = getattr(options, "plain_shape", None)
    chosen = shapes[name] if name is not None else (plain if plain is not None else None)
    return Eagle3Choice(chosen, reason, cands, round(ar_step * 1e3, 2), timing)


# eagle3 (nodes, depth, topk) candidates at batch sizes: the batch-1 grid's narrower trees (not its
# widest, which a batch of rows multiplies into hundreds of verified rows per step)
EAGLE3_BATCH_GRID = ((1, 1, 1), (2, 1, 2), (4, 1, 4), (2, 2, 1), (3, 2, 2), (4, 4, 1), (4, 3, 2), (8, 4, 4))


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
                        "calibration_prompts >= 1 (or choice=fixed)")
    base = options if options is not None else registry.make_options(method)
    shapes = list(dict.fromkeys(tuple(s) for s in grid))
    settings = {eagle3_name(s): dataclasses.replace(base, **eagle3_fields(s), schedule=None)
                for s in shapes}
    taus = {name: measure_eagle3_tau(m, calibration, shape, max_new_tokens=calibration_tokens, method=method,
                                     options=base) for name, shape in zip(settings, shapes)}
    cands = {name: (o, taus[name]) for name, o in settings.items()}
    # sized for the largest setting; batch-size keys here only collect the settings
    shared = base.batch_drafter(m, SpeculationSchedule(dict(enumerate(settings.values(), 1))))
    # a looked-up branch grafts on some steps only, and at batch b on any of b rows' (narrower rows padded):
    # the race costs each setting by its mean step at that batch size (``race``'s varying)
    sizing = size_speculation(m, cands, lambda o: SharedSetting(shared, o), latency_prompts, batch_sizes,
                              what=f"{method} trees", varying=base.steps_vary, **timing)
    return sizing, {"measured_tau": {name: round(t, 4) or None for name, t in taus.items()}}




class Eagle3Shape(SpeculationShape):
    """EAGLE-3's tree setting (module docstring): each method chooses its own, raced with its own branches."""

    noun = "tree"

    def choose(self, ctx: ChoiceContext, method: str, options, mode: str) -> Chosen:
        if mode != "auto":
            return self.given(options)
        ctx.log(f"choosing {method}'s tree: tau on {len(ctx.calibration)} calibration prompts, step latency on "
                "this device")
        c = choose_eagle3(ctx.m, ctx.calibration, ctx.calibration[0], calibration_tokens=ctx.calibration_tokens,
                          log=ctx.log, progress=ctx.progress, method=method, options=options)
        record = c.to_dict()
        ctx.log(f"{method} tree: {record['name']} ({c.reason})")
        chosen = dataclasses.replace(options, **c.options())
        return Chosen(chosen, SpeculationSchedule({1: chosen.fixed_choice()}), record, {f"{method}_tree": record},
                      record["name"], c.reason, measured=True)

    def calibrates(self, options, mode: str, batched: bool) -> bool:
        return mode == "auto" and not (batched and options.schedule is not None)   # batched: a choice file's schedule

    def size_schedule(self, ctx: ChoiceContext, method: str, options, batch_sizes: Sequence[int]) -> tuple:
        return choose_eagle3_schedule(ctx.m, method=method, options=options, calibration=ctx.calibration,
                                      latency_prompts=ctx.latency, batch_sizes=batch_sizes,
                                      calibration_tokens=ctx.calibration_tokens, log=ctx.log, progress=ctx.progress)

    def fixed_choice(self, options, heads=None):
        return options.fixed_choice()

    def apply(self, options, schedule: SpeculationSchedule, batched: bool):
        if batched:   # the branch's keys (every setting's own) from the setting of the smallest batch that drafts
            first = next((c for _, c in sorted(schedule.choices.items()) if c is not None), options)
            return dataclasses.replace(first, schedule=schedule)
        choice = schedule.choices[min(schedule.choices)]
        if choice is not None:
            return dataclasses.replace(choice, schedule=None)
        plain = getattr(options, "plain_shape", None) or (0, 1, 1)   # these options' plain decoding
        return dataclasses.replace(options, **eagle3_fields(plain), schedule=None)

    def encode(self, choice, options=None) -> dict:
        return {key: getattr(choice, name) for name, key in keyed_fields(choice).items()}

    def decode(self, keys: dict, method: str, options):
        names = {key: name for name, key in keyed_fields(options).items()}
        unknown = sorted(set(keys) - set(names))
        if unknown:
            raise ValueError(f"unknown keys {unknown} for method {method}")
        return dataclasses.replace(options, **{names[k]: v for k, v in keys.items()}, schedule=None)

    def step_shape(self, choice) -> tuple[int, int]:
        branch = choice.num_tokens if getattr(choice, "looks_up", False) else 0   # a grafted looked-up chain
        return choice.nodes + branch + 1, choice.depth + branch
