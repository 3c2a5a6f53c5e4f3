"""Batched evaluation (``medusa-eval batch_size=B`` or ``batch_size=[1,2,4,...]``): what speculation is
worth when many prompts decode together.

For each batch size B the evaluated prompts (first turns) are split into consecutive batches of B
(the last one may be smaller). Every batch is decoded (``rounds`` times, for large B where there are
few batches to average over) by each requested batched method
(``generate_batch``), by the plain batched loop (``autoregressive``: the same ragged cache, one
token per row per step) and, in greedy mode, by transformers' batched ``generate`` (left padding,
attention mask; ``hf_generate_batch``), interleaved: the order rotates from batch to batch, so the
machine's background load hits them alike.

Per batch size (``report["batched"]["per_batch_size"][B]["per_method"][method]``):
  tokens_per_s        new tokens of all rows / wall time of all the method's batched runs, prefill included
  tokens_per_s_runs   [min, median, max] of the single runs' tokens/s (the spread behind the ratio)
  speedup_vs_autoregressive, speedup_vs_hf_generate   over the plain batched loop / HF's batched generate
                      at the same B
  tau, tau_per_row    tokens per row-step (bonus included; plain = 1.0): pooled over all rows, and per
                      row in prompt order
  nodes_per_step      nodes per row a step verified (root included), averaged over row-steps
  identical_to_plain_batched, identical_to_batch1   greedy mode only, per row in prompt order: its
                      tokens equal the plain batched loop's row / batch-1 autoregressive ``generate``
``speculation_stops_paying``: per method, the smallest B whose tokens/s is not above the plain batched
loop's (null: it pays at every B measured).

The methods taking a tree (Medusa) get one per batch size: ``tree=auto`` measures the heads on the
calibration prompts (held out as ``evaluate`` holds them out) and lets
``batch_sizing.choose_schedule`` pick the tree for each B (a ``SpeculationSchedule``, recorded with
its sizing); ``calibrated:N`` grows one N-node tree, and a given tree is used at every B.
The chain methods (draft model, prompt lookup) get a chain length per batch size with
``chains="auto"`` (``batch_sizing.choose_chain_schedule``: up to their set draft_k /
prompt_lookup_tokens, none where no length pays), or their set length at every B with ``"fixed"``.
EAGLE-3 with ``eagle_tree=auto`` gets its (nodes, depth, top-k) per batch size the same way
(``batch_sizing.choose_eagle3_schedule``), and ``eagle3_lookup`` too, each setting measured with its
looked-up branch on; with ``fixed``, the set setting at every B.
``report["batched"]["speculation"][method]`` records each sized method's schedule and how it was
measured; ``per_batch_size[B]["speculation"][method]`` the choice in force at B.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from ..errors import UserError
from ..methods import registry
from ..methods.hf_generate import hf_generate_batch
from ..runtime.batch_decode import BatchOutput, check_batch_size
from ..runtime.speculation import SpeculationSchedule, tree_label
from ..runtime.linear_kernels import routing_summary
from ..runtime.model import MedusaModel
from ..runtime.tree import chain_tree, resolve_tree
from ..runtime.verify import SamplingConfig
from .evaluate import EAGLE3_TREE_METHODS, check_settings, machine
from .prompts import Prompt, encode_checked, split_calibration
from .batch_sizing import choose_chain_schedule, choose_eagle3_schedule, choose_schedule
from .eagle3_choice_file import schedule_settings
from .tree_schedule_file import schedule_trees
from .tree_choice import calibrated_choice, choose_tree, measure_head_accuracy

PLAIN, HF = "autoregressive", "hf_generate"
CHAIN_SIZING = ("auto", "fixed")


# -- what the command line gives ---------------------------------------------------------------
def parse_batch_sizes(value) -> Optional[list[int]]:
    """``batch_size`` as given: None for the plain 1 (one prompt at a time: ``evaluate``), else the
    distinct sizes, ascending (a single size, or a list); one ``UserError`` line for a bad one."""
    if isinstance(value, int) and not isinstance(value, bool) and value == 1:
        return None
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        return [check_batch_size(value)]
    items = list(value)
    if not items:
        raise UserError("batch_size must be an integer >= 1 or a list of them, got []")
    for x in items:
        if isinstance(x, bool) or not isinstance(x, int) or x < 1:
            raise UserError(f"batch_size must be an integer >= 1 or a list of them: {x!r} in {items}")
    return sorted(set(items))


def check_batchable(methods: Sequence[str], sizes: Sequence[int]) -> None:
    """Refuse, in one line, a method that decodes one prompt at a time (``hf_generate`` batches here)."""
    given = str(sizes[0]) if len(sizes) == 1 else str(list(sizes))
    for x in methods:
        if x != HF and registry.get(x).batch_decoder is None:
            raise UserError(f"method {x} decodes one prompt at a time, so batch_size={given} cannot run it; "
                            f"methods that decode batches: {', '.join(registry.batched_names())}")


def check_sizes_measured(sizes: Sequence[int], evaluated: int) -> None:
    """Refuse, in one line, batch sizes above the number of prompts evaluated: such a batch is only as large as
    the prompts, so a report under its size (e.g. "speculation stops paying at batch size 10^8") would claim a
    measurement never made."""
    over = [b for b in sizes if b > evaluated]
    if over:
        prompts = f"{evaluated} prompt{'s' if evaluated != 1 else ''}"
        raise UserError(f"batch_size {', '.join(map(str, over))} {'exceeds' if len(over) == 1 else 'exceed'} the "
                        f"{prompts} evaluated: give more prompts (num_prompts=, prompts=) or smaller batch sizes")


# -- the tree per batch size ------------------------------------------------------------------
def needs_calibration(tree) -> bool:
    return tree == "auto" or calibrated_choice(tree) is not None


def choose_speculation(m: MedusaModel, tree, sizes: Sequence[int], calib: list[list[int]], latency: list[list[int]],
                       *, calibration_tokens: int, progress: bool, log: Callable[[str], None]):
    """(the schedule, its report record, the heads' measured per-rank accuracy or None)."""
    fixed = calibrated_choice(tree) if isinstance(tree, str) else None
    if isinstance(tree, SpeculationSchedule) or not needs_calibration(tree):
        schedule = tree if isinstance(tree, SpeculationSchedule) else \
            SpeculationSchedule({b: resolve_tree(tree, m.num_heads) if tree is not None else None for b in sizes})
        return schedule, {"tree": "given", "schedule": schedule.to_dict(), "sizing": None}, None
    if fixed is not None:
        choice = choose_tree(m, calib, calib[0], calibration_tokens=calibration_tokens, log=log, fixed_nodes=fixed,
                             progress=progress)
        schedule = SpeculationSchedule({b: choice.tree for b in sizes})
        return schedule, {"tree": tree, "schedule": schedule.to_dict(), "sizing": None}, choice.accuracies
    log(f"choosing the speculation per batch size: head accuracy on {len(calib)} calibration prompts, "
        "batch step latency on this device")
    per_rank = measure_head_accuracy(m, calib, max_new_tokens=calibration_tokens).per_rank.tolist()
    # batch 1 is always sized too: the last rows of a batch decode alone once the others have finished
    sizing = choose_schedule(m, per_rank, latency, sorted({1, *sizes}), log=log, progress=progress)
    log("speculation per batch size: " + ", ".join(f"{b}: {t}" for b, t in sizing.schedule.to_dict().items()))
    # the trees themselves, for medusa-generate tree=<out>/tree_schedule.json (tree_schedule_file)
    return sizing.schedule, {"tree": "auto", "schedule": sizing.schedule.to_dict(), "sizing": sizing.to_dict(),
                             "trees": schedule_trees(sizing.schedule)}, per_rank


# -- the numbers ------------------------------------------------------------------------------
def rate(runs: Sequence[BatchOutput]) -> float:
    secs = sum(o.prefill_s + o.decode_s for o in runs)
    return sum(o.new_tokens for o in runs) / secs if secs > 0 else 0.0


def method_summary(method: str, runs: dict[str, list[BatchOutput]], rates: dict[str, float],
                   reference: Optional[list[list[int]]], greedy: bool, rounds: int = 1) -> dict:
    """One method's numbers at one batch size (module docstring). ``runs[x]`` holds each batch's
    ``rounds`` runs in a row; per-row figures come from each batch's first run (prompt order)."""
    rows = [r for o in runs[method][::rounds] for r in o.rows]
    steps = sum(r.steps for r in rows)
    single = sorted(o.tokens_per_s for o in runs[method])
    out: dict = {"tokens_per_s": round(rates[method], 3),
                 "tokens_per_s_runs": [round(single[0], 3), round(single[len(single) // 2], 3), round(single[-1], 3)],
                 "new_tokens": sum(o.new_tokens for o in runs[method]),
                 "seconds": round(sum(o.prefill_s + o.decode_s for o in runs[method]), 4),
                 "prefill_s": round(sum(o.prefill_s for o in runs[method]), 4),
                 "tau": round(sum(sum(r.accept_lengths) for r in rows) / steps, 4) if steps else 1.0,
                 "tau_per_row": [round(r.tau, 3) for r in rows]}
    if not registry.get(method).baseline:
        weights = [(a, s) for o in runs[method] for a, s in zip(o.active, o.speculation)]
        out["nodes_per_step"] = round(sum(a * s for a, s in weights) / max(1, sum(a for a, _ in weights)), 3)
    for base, key in ((PLAIN, "speedup_vs_autoregressive"), (HF, "speedup_vs_hf_generate")):
        if base != method and base in rates and rates[base] > 0:
            out[key] = round(rates[method] / rates[base], 4)
    if greedy:
        checks = []
        if method != PLAIN:
            plain = [r.tokens for o in runs[PLAIN][::rounds] for r in o.rows]
            out["identical_to_plain_batched"] = [r.tokens == p for r, p in zip(rows, plain)]
            checks += out["identical_to_plain_batched"]
        if reference is not None:
            out["identical_to_batch1"] = [r.tokens == t for r, t in zip(rows, reference)]
            checks += out["identical_to_batch1"]
        out["greedy_identical"] = all(checks)
    return out


def stops_paying(per_size: Mapping[int, Mapping[str, float]], method: str) -> Optional[int]:
    """The smallest batch size whose tokens/s for ``method`` is not above the plain batched loop's."""
    return next((b for b in sorted(per_size) if per_size[b][method] <= per_size[b][PLAIN]), None)


# -- the whole batched evaluation ---------------------------------------------------------------
def run_method(m: MedusaModel, method: str, rows: list[list[int]], options, max_new_tokens: int,
               sampling: SamplingConfig, seed: int) -> BatchOutput:
    if method == HF:
        return hf_generate_batch(m, rows, max_new_tokens)
    return registry.generate_batch(m, rows, method, options=options, max_new_tokens=max_new_tokens,
                                   sampling=sampling, seed=seed)


def evaluate_batched(m: MedusaModel, prompts: list[Prompt], *, methods: Sequence[str], batch_sizes: Sequence[int],
                     tree: Any = "auto", max_new_tokens: int = 128, sampling: Optional[SamplingConfig] = None,
                     calibration_prompts: int = 8, calibration_tokens: int = 48, seed: int = 0,
                     progress: bool = True, log: Callable[[str], None] = print, settings: Optional[dict] = None,
                     options: Optional[Mapping[str, Any]] = None, rounds: int = 1, chains: str = "auto",
                     calibration: Optional[list[Prompt]] = None) -> dict:
    """Run ``methods`` (+ the plain batched loop, + HF's batched generate in greedy mode) on batches of
    ``prompts`` at every batch size, interleaved; the report's ``batched`` section (module docstring).
    ``calibration``: as ``evaluate``'s (None: the last ``calibration_prompts`` of ``prompts`` held out)."""
    if chains not in CHAIN_SIZING:
        raise UserError(f"batch_chains must be one of {', '.join(CHAIN_SIZING)}, got {chains!r}")
    sampling = sampling or SamplingConfig()
    greedy = sampling.is_greedy
    check_settings(max_new_tokens=max_new_tokens, calibration_prompts=calibration_prompts,
                   calibration_tokens=calibration_tokens)
    sizes = parse_batch_sizes([batch_sizes] if isinstance(batch_sizes, int) else list(batch_sizes))
    methods = registry.check_methods(list(methods), m)
    measured = list(methods) + [b for b in (PLAIN, HF) if b not in methods and (b == PLAIN or greedy)]
    refused = [x for x in measured if registry.get(x).greedy_only and not greedy]
    if refused:
        raise UserError(f"{refused[0]} is measured in greedy mode only")
    opts = {x: registry.fitted_options(m, x, registry.make_options(x, (options or {}).get(x)))
            for x in measured if x != HF}
    check_batchable(methods, sizes)
    for x, o in opts.items():
        if registry.get(x).prepare is not None:   # loaded once for every batch (a draft model)
            opts[x] = registry.get(x).prepare(m, o)
    reported = {x: registry.options_report(o) for x, o in opts.items() if dataclasses.fields(o)}
    tree_methods = [x for x in opts if registry.get(x).needs_tree]
    chain_methods = [x for x in opts if registry.get(x).chain is not None and chains == "auto"
                     and getattr(opts[x], "schedule", None) is None]
    eagle_auto = [x for x in EAGLE3_TREE_METHODS if x in opts and opts[x].tree == "auto" and opts[x].schedule is None]
    calib_src: list[Prompt] = []
    if (tree_methods and not isinstance(tree, SpeculationSchedule) and needs_calibration(tree)) or chain_methods \
            or eagle_auto:
        calib_src, prompts = (list(calibration), list(prompts)) if calibration else \
            split_calibration(list(prompts), calibration_prompts)
    if not prompts:
        raise UserError("no prompts to evaluate")
    check_sizes_measured(sizes, len(prompts))
    ids = encode_checked(m, prompts, max_new_tokens)   # every prompt fits before anything is decoded
    calib = encode_checked(m, calib_src, calibration_tokens)
    schedules: dict[str, SpeculationSchedule] = {}
    speculation: dict[str, dict] = {}
    per_rank = None
    if tree_methods:
        schedule, record, per_rank = choose_speculation(m, tree, sizes, calib, ids,
                                                        calibration_tokens=calibration_tokens, progress=progress,
                                                        log=log)
        for x in tree_methods:
            opts[x] = dataclasses.replace(opts[x], tree=schedule)
            reported.setdefault(x, {})["tree"] = schedule.to_dict()
            schedules[x], speculation[x] = schedule, record
    sized = [(x, "chain", "chain length", "acceptance", choose_chain_schedule) for x in chain_methods] + \
        [(x, "tree", "tree", "tau of each setting", choose_eagle3_schedule) for x in eagle_auto]
    for x, what, noun, basis, choose in sized:   # eagle3_lookup sized with its looked-up branch on
        log(f"choosing {x}'s {noun} per batch size: {basis} on {len(calib)} calibration prompts, "
            "batch step latency on this device")
        sizing, record = choose(m, method=x, options=opts[x], calibration=calib, latency_prompts=ids,
                                batch_sizes=sorted({1, *sizes}), calibration_tokens=calibration_tokens, log=log,
                                progress=progress)
        opts[x] = dataclasses.replace(opts[x], schedule=sizing.schedule)
        reported.setdefault(x, {})["schedule"] = sizing.schedule.to_dict()
        schedules[x] = sizing.schedule
        speculation[x] = {what: "auto", "schedule": sizing.schedule.to_dict(), "calibration": record,
                          "sizing": sizing.to_dict()}
        if x in eagle_auto:   # each batch size's keys, for medusa-generate eagle_tree=<file> (eagle3_choice_file)
            speculation[x]["settings"] = schedule_settings(sizing.schedule)
        log(f"{x} {what} per batch size: " + ", ".join(f"{b}: {t}" for b, t in sizing.schedule.to_dict().items()))
    for x in opts:
        if registry.get(x).chain is not None and x not in schedules:   # fixed: the set length at every B
            given = getattr(opts[x], "schedule", None)
            schedules[x] = given or SpeculationSchedule({b: chain_tree(registry.get(x).chain.most(opts[x]) + 1)
                                                         for b in sizes})
            speculation[x] = {"chain": "given" if given else "fixed", "schedule": schedules[x].to_dict(),
                              "sizing": None}
    for x in EAGLE3_TREE_METHODS:
        if x in opts and x not in schedules:   # eagle_tree=fixed (or a given schedule)
            o = opts[x]
            schedules[x] = o.schedule or SpeculationSchedule({b: o.fixed_choice() for b in sizes})
            speculation[x] = {"tree": "given" if o.schedule else "fixed", "schedule": schedules[x].to_dict(),
                              "sizing": None}
    reference = None
    if greedy:  # each row's batch-1 greedy output: what every batched row must reproduce
        reference = [registry.generate(m, p, PLAIN, max_new_tokens=max_new_tokens, seed=seed).tokens for p in ids]

    runs = {b: {x: [] for x in measured} for b in sizes}
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=rounds * sum(-(-len(ids) // b) for b in sizes), desc="batched eval", unit="batch")
    k = 0
    for b in sizes:
        for start in range(0, len(ids), b):
            rows = ids[start:start + b]
            for _ in range(rounds):
                order = measured[k % len(measured):] + measured[:k % len(measured)]
                for x in order:
                    runs[b][x].append(run_method(m, x, rows, opts.get(x), max_new_tokens, sampling, seed + k))
                k += 1
                if bar is not None:
                    bar.update(1)
    if bar is not None:
        bar.close()

    rates = {b: {x: rate(runs[b][x]) for x in measured} for b in sizes}
    per_size = {}
    for b in sizes:
        entry: dict = {"batches": -(-len(ids) // b), "rounds": rounds, "rows": len(ids),
                       "tokens_per_s": {x: round(v, 3) for x, v in rates[b].items()},
                       "per_method": {x: method_summary(x, runs[b], rates[b], reference, greedy, rounds)
                                      for x in measured}}
        if schedules:
            entry["speculation"] = {x: tree_label(sched.choices[sched.bucket(b)]) for x, sched in schedules.items()}
        per_size[str(b)] = entry
    speculative = [x for x in measured if not registry.get(x).baseline]
    batched: dict = {"batch_sizes": sizes, "num_prompts": len(ids), "methods": measured,
                     "greedy_reference": "autoregressive generate, one prompt at a time" if greedy else None,
                     "speculation": speculation, "per_batch_size": per_size,
                     "speculation_stops_paying": {x: stops_paying(rates, x) for x in speculative}}
    if greedy:
        batched["greedy_identical"] = {x: all(per_size[str(b)]["per_method"][x]["greedy_identical"] for b in sizes)
                                       for x in measured}
    report = {"settings": settings or {}, "machine": machine(), "num_samples": len(ids), "methods": measured,
              "method_options": reported, "batched": batched,
              "linear_kernels": routing_summary(m.kernel_plans) if m.kernel_plans else "stock"}
    if per_rank is not None:
        report["head_accuracy"] = {"per_rank": per_rank, "topk": torch.tensor(per_rank).cumsum(1).tolist(),
                                   "measured_on": f"{len(calib_src)} calibration prompts (backbone greedy tokens)"}
    return report
