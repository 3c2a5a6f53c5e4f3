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
  tokens_per_s_runs   [min, median, max] of the single batched runs' tokens/s (the last batch may hold fewer
                      rows than B)
  speedup_vs_autoregressive, speedup_vs_hf_generate   over the plain batched loop / HF's batched generate
                      at the same B: pooled (all tokens / all seconds of each)
  speedup_vs_autoregressive_runs, speedup_vs_hf_generate_runs   [min, median, max] of the ratio batch by batch
                      (each run over the baseline's run of the same batch and round): the spread behind it
  tau, tau_per_row    tokens per row-step (bonus included; plain = 1.0): pooled over all rows, and per
                      row in prompt order (null where no step was verified)
  nodes_per_step      nodes per row a step verified (root included), averaged over row-steps
  identical_to_plain_batched, identical_to_batch1   greedy mode only, per row in prompt order: its
                      tokens equal the plain batched loop's row / batch-1 autoregressive ``generate``
``greedy_mismatches``: per method, the prompts whose row differed at any B (a stderr warning names them).
``speculation_stops_paying``: per method, the smallest B whose tokens/s is not above the plain batched
loop's (null: it pays at every B measured).

Each method with a speculation shape gets its choice per batch size (``choosing``, ``choice=auto``): a
Medusa tree, an EAGLE-3 setting (with eagle3_lookup's looked-up branch on), a chain method's length (up to its
set draft_k / prompt_lookup_tokens), each measured on the calibration prompts (held out as ``evaluate`` holds
them out) and timed per batch size on them too, never on the evaluated ones (``runtime.sizing``), or none where
nothing pays; ``choice=fixed`` keeps the options as given at every B (``tree=calibrated:N`` grows one N-node tree).
``report["batched"]["speculation"][method]`` records each sized method's schedule and how it was
measured; ``per_batch_size[B]["speculation"][method]`` the choice in force at B.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any, Callable, Mapping, Optional, Sequence, Union

from ..errors import UserError
from ..methods import registry
from ..methods.hf_generate import hf_generate_batch
from ..runtime.batch_decode import BatchOutput, check_batch_size
from ..methods.shape import ChoiceContext
from ..runtime.linear_kernels import routing_summary
from ..runtime.model import MedusaModel
from ..runtime.race import progress_bar
from ..runtime.speculation import tree_label
from ..runtime.verify import SamplingConfig
from .choosing import calibrating, choice_modes, choose_all, method_options, report_entries
from .evaluate import check_settings, machine, warm_tokens, warn_mismatches
from ..prompts import Prompt, encode_checked, prompt_record, split_calibration

PLAIN, HF = "autoregressive", "hf_generate"
# the baselines a batched evaluation measures; hf_generate_static is not among them: it decodes one prompt per
# generate call, so beside batches it would time something else than a batched baseline
BATCH_BASELINES = (PLAIN, HF)


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
    single = [o.tokens_per_s for o in runs[method]]
    out: dict = {"tokens_per_s": round(rates[method], 3),
                 "tokens_per_s_runs": [round(f(single), 3) for f in (min, statistics.median, max)],
                 "new_tokens": sum(o.new_tokens for o in runs[method]),
                 "seconds": round(sum(o.prefill_s + o.decode_s for o in runs[method]), 4),
                 "prefill_s": round(sum(o.prefill_s for o in runs[method]), 4),
                 "tau": round(sum(sum(r.accept_lengths) for r in rows) / steps, 4) if steps else None,
                 "tau_per_row": [round(r.tau, 3) if r.steps else None for r in rows]}
    if not registry.get(method).baseline:
        weights = [(a, s) for o in runs[method] for a, s in zip(o.active, o.speculation)]
        out["nodes_per_step"] = round(sum(a * s for a, s in weights) / max(1, sum(a for a, _ in weights)), 3)
    for base, key in ((PLAIN, "speedup_vs_autoregressive"), (HF, "speedup_vs_hf_generate")):
        if base != method and base in rates and rates[base] > 0:
            out[key] = round(rates[method] / rates[base], 4)
            paired = [o.tokens_per_s / b.tokens_per_s for o, b in zip(runs[method], runs[base]) if b.tokens_per_s > 0]
            if paired:
                out[f"{key}_runs"] = [round(f(paired), 4) for f in (min, statistics.median, max)]
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


def mismatched_rows(batched: dict, prompt_ids: list[str]) -> dict[str, list[str]]:
    """method -> the prompts whose row differs from greedy (the plain batched loop's row or batch-1 greedy) at any
    batch size, in prompt order; methods without any left out."""
    out = {}
    for x in batched["methods"]:
        rows = [entry["per_method"][x] for entry in batched["per_batch_size"].values()]
        bad = {i for row in rows for key in ("identical_to_plain_batched", "identical_to_batch1")
               for i, same in enumerate(row.get(key, [])) if not same}
        if bad:
            out[x] = [prompt_ids[i] for i in sorted(bad)]
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


def warm_batches(m: MedusaModel, ids: list[list[int]], measured: list[str], sizes: Sequence[int],
                 opts: Mapping[str, Any], max_new_tokens: int, sampling: SamplingConfig, seed: int) -> None:
    """Untimed batches of every measured method before the timed runs, for all alike (the calibration ran the
    runtime's methods, never transformers' batched ``generate``). With captured steps one per graph bucket up to
    each batch size and at the last batch's size, at ``max_new_tokens``, so the captures (rows leave, the batch
    shrinks to smaller buckets) happen here; else one batch of the smallest size, ``WARMUP_TOKENS`` long."""
    captured, tokens = warm_tokens(m, max_new_tokens)
    widths = {w for b in sizes for w in (*[x for x in m.static.buckets if x < b], b, len(ids) % b or b)} \
        if captured else {sizes[0]}
    for w in sorted(widths, reverse=True):   # the widest first: the buffer grows (dropping captures) only there
        for x in measured:
            run_method(m, x, ids[:w], opts.get(x), tokens, sampling, seed)


def run_batches(m: MedusaModel, ids: list[list[int]], measured: list[str], sizes: Sequence[int],
                opts: Mapping[str, Any], *, rounds: int, max_new_tokens: int, sampling: SamplingConfig, seed: int,
                progress: bool) -> dict[int, dict[str, list[BatchOutput]]]:
    """batch size -> method -> its runs: every batch of ``ids`` decoded ``rounds`` times by every method, the
    methods' order rotated from run to run (module docstring)."""
    runs = {b: {x: [] for x in measured} for b in sizes}
    bar = progress_bar(progress, rounds * sum(-(-len(ids) // b) for b in sizes), "batched eval", unit="batch",
                       leave=True, dynamic_ncols=False)
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
    return runs


def batched_section(runs: dict, ids: list, measured: list[str], sizes: Sequence[int], schedules: dict,
                    speculation: dict, reference: Optional[list], greedy: bool, rounds: int) -> dict:
    """The report's ``batched`` section from the runs (module docstring)."""
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
    batched: dict = {"batch_sizes": list(sizes), "num_prompts": len(ids), "methods": measured,
                     "greedy_reference": "autoregressive generate, one prompt at a time" if greedy else None,
                     "speculation": speculation, "per_batch_size": per_size,
                     "speculation_stops_paying": {x: stops_paying(rates, x) for x in speculative}}
    if greedy:
        batched["greedy_identical"] = {x: all(per_size[str(b)]["per_method"][x]["greedy_identical"] for b in sizes)
                                       for x in measured}
    return batched


def evaluate_batched(m: MedusaModel, prompts: list[Prompt], *, methods: Sequence[str], batch_sizes: Sequence[int],
                     choice: Union[str, Mapping[str, str]] = "auto", max_new_tokens: int = 128,
                     sampling: Optional[SamplingConfig] = None, calibration_prompts: int = 8,
                     calibration_tokens: int = 48, seed: int = 0, progress: bool = True,
                     log: Callable[[str], None] = print, settings: Optional[dict] = None,
                     options: Optional[Mapping[str, Any]] = None, rounds: int = 1,
                     calibration: Optional[list[Prompt]] = None, chosen: Optional[dict] = None, **fields) -> dict:
    """Run ``methods`` (+ the plain batched loop, + HF's batched generate in greedy mode) on batches of
    ``prompts`` at every batch size, interleaved; the report's ``batched`` section (module docstring).
    ``choice``, ``fields``, ``chosen``: as ``evaluate``'s, each choice made per batch size; ``calibration``:
    as ``evaluate``'s (None: the last ``calibration_prompts`` of ``prompts`` held out)."""
    sampling = sampling or SamplingConfig()
    greedy = sampling.is_greedy
    check_settings(max_new_tokens=max_new_tokens, calibration_prompts=calibration_prompts,
                   calibration_tokens=calibration_tokens)
    sizes = parse_batch_sizes([batch_sizes] if isinstance(batch_sizes, int) else list(batch_sizes))
    methods = registry.check_methods(list(methods), m)
    measured = list(methods) + [b for b in (PLAIN, HF) if b not in methods and (b == PLAIN or greedy)]
    registry.check_greedy_only(measured, sampling)
    opts = method_options(m, [x for x in measured if x != HF], options, fields)
    modes = choice_modes(list(opts), choice, fields)
    check_batchable(methods, sizes)
    for x, o in opts.items():
        if registry.get(x).prepare is not None:   # loaded once for every batch (a draft model)
            opts[x] = registry.get(x).prepare(m, o)
    calib_src: list[Prompt] = []
    if calibrating(opts, modes, batched=True):
        calib_src, prompts = (list(calibration), list(prompts)) if calibration else \
            split_calibration(list(prompts), calibration_prompts)
    if not prompts:
        raise UserError("no prompts to evaluate")
    held = prompt_record(prompts, calib_src, (settings or {}).get("num_prompts"))
    check_sizes_measured(sizes, len(prompts))
    ids = encode_checked(m, prompts, max_new_tokens)   # every prompt fits before anything is decoded
    calib = encode_checked(m, calib_src, calibration_tokens, key="calibration_tokens")
    # each batch size's steps are timed on the calibration prompts (rows cycled up to the size), not the evaluated
    ctx = ChoiceContext(m, calib, calib or ids, calibration_tokens, log=log, progress=progress)
    made = choose_all(ctx, opts, modes, sizes)
    opts.update({x: c.options for x, c in made.items()})
    if chosen is not None:
        chosen.update(made)
    reported = {x: registry.options_report(o) for x, o in opts.items() if dataclasses.fields(o)}
    reference = None
    if greedy:  # each row's batch-1 greedy output: what every batched row must reproduce
        reference = [registry.generate(m, p, PLAIN, max_new_tokens=max_new_tokens, seed=seed).tokens for p in ids]
    warm_batches(m, ids, measured, sizes, opts, max_new_tokens, sampling, seed)
    runs = run_batches(m, ids, measured, sizes, opts, rounds=rounds, max_new_tokens=max_new_tokens,
                       sampling=sampling, seed=seed, progress=progress)
    batched = batched_section(runs, ids, measured, sizes, {x: c.schedule for x, c in made.items()},
                              {x: c.record for x, c in made.items()}, reference, greedy, rounds)
    if greedy:   # the prompts any batch size decoded differently from greedy, per method (its per-row lists)
        batched["greedy_mismatches"] = mismatched_rows(batched, held["evaluated_prompt_ids"])
        warn_mismatches(batched["greedy_mismatches"])
    return {"settings": settings or {}, "machine": machine(), "num_samples": len(ids), "methods": measured, **held,
            "method_options": reported, "batched": batched,
            "linear_kernels": routing_summary(m.kernel_plans) if m.kernel_plans else "stock",
            "graphs": m.static.summary() if m.static is not None else "off", **report_entries(made)}
