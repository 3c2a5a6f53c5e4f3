"""Evaluation: what a decoding method is worth on this machine, measured honestly.

One place defines the metrics (per method, in ``per_method``):
  tau                mean tokens emitted per verification step, bonus counted (plain decoding = 1.0);
                     pooled over all steps of all prompts; a step cut at EOS / max_new_tokens counts what it output;
                     null when no step was verified (nothing measured; ``GenerationOutput.tau`` says 0.0).
  acceptance_rate    accepted draft tokens / proposed draft tokens, as verification accepted them (before
                     that cut: a deep tree's last step is no rejection; the histogram and n_alpha too); null,
                     with ``ran_as_plain_decoding``, when the method proposed nothing (it fell back to plain).
                     What a step proposes is the method's own definition (``Method.proposed``): the tree's
                     depth for Medusa (the most it could accept, as vLLM counts its K speculative tokens); K for
                     the draft model, the candidate trie's depth for lookahead, the looked-up
                     length for prompt lookup, the merged trie's depth for medusa_lookup.
  n_alpha            P(the draft token at depth n is accepted | depths < n were accepted), for a
                     method with a fixed proposal depth (Medusa's tree).
  head accuracy      per head, top-1..top-5 against the backbone's own greedy tokens.
  tokens_per_s       new tokens / wall time including prefill, per method, summed over prompts.
  speedup_vs_<baseline>  tokens/s over each baseline run beside it (``Method.baseline``): the runtime's own
                     autoregressive loop (same cache, same token choice), transformers' ``generate``
                     (greedy) and, on CUDA, its static-cache form (``hf_generate_static``); pooled (all tokens
                     / all seconds), with ``per_prompt_speedup_vs_<baseline>`` [min, median, max] of each
                     prompt's own ratio beside it.
  greedy_identical_fraction  prompts whose output equals the autoregressive baseline's; greedy mode
                     only (in sample / typical mode outputs differ by design: the key is omitted);
                     ``greedy_mismatches`` names the prompts that differ (and a stderr warning does).
  samples            per prompt and method: tokens, prefill / decode seconds, tau, accepted / proposed draft
                     tokens, identical_to_greedy; ``evaluated_prompt_ids`` / ``calibration_prompt_ids``: which
                     prompts were scored and which calibrated the choice (never the same ones).

The methods come from the registry (``inference.methods``); the baselines (autoregressive,
hf_generate, on CUDA hf_generate_static) run beside them. They run interleaved prompt by prompt (their
order rotates), in one process, so the machine's background load hits them alike, each after one untimed
warm-up call (``warm_up``: every method alike, transformers' ``generate`` included). Before they run,
each method with a speculation shape gets its choice (``choosing``; ``choice=auto`` measures it on
held-out calibration prompts and this machine): the methods decoding a Medusa tree share one tree
(report.json's ``tree``, with the heads' measured ``head_accuracy``), EAGLE-3's methods each get their
setting (``<method>_tree``); where nothing beats plain decoding, a method runs without speculation and
says so.

The trade-off matrix (``reports.write_compare``) adds what each method costs (``Method.costs``):
extra parameters loaded (counted from the real modules, tensors shared with the backbone
excluded), extra KV cache (the cache slots a method allocates beyond plain decoding's prompt +
max_new_tokens, in bytes at the run's longest prompt) and the training it needs.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import statistics
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch
import transformers

from ..errors import UserError
from ..runtime.decode import answer_text
from ..runtime.linear_kernels import routing_summary
from ..runtime.model import MedusaModel, is_count
from ..runtime.race import progress_bar
from ..runtime.tree import MAX_TREE_NODES
from ..runtime.verify import SamplingConfig
from ..methods import registry
from ..methods.shape import DEFAULT_BUDGETS, ChoiceContext
from .choosing import calibrating, choice_modes, choose_all, method_options, report_entries
from ..prompts import (Prompt, encode_checked, encode_turn, prompt_record, second_turn_bound,
                       split_calibration)

DEFAULT_METHODS = ("medusa", "autoregressive", "hf_generate")


@dataclass
class Sample:
    prompt_id: str
    turn: int
    outputs: dict = field(default_factory=dict)  # method -> GenerationOutput
    tokens: dict = field(default_factory=dict)  # method -> token ids


def _spread(xs: list) -> Optional[list]:
    """[min, median, max] of ``xs`` (None when empty)."""
    return [round(min(xs), 4), round(statistics.median(xs), 4), round(max(xs), 4)] if xs else None


def method_summary(samples: list[Sample], method: str, methods: Sequence[str], rates: dict,
                   proposed: Optional[int] = None, greedy: bool = True) -> dict:
    """tau, acceptance rate, tokens/s, speedups and greedy identity of one method (module docstring).

    ``proposed``: the draft tokens each step counts as proposed when the method fixes it (a tree's
    depth; n_alpha is then reported too); None: what each step recorded. ``greedy``: the run's mode is
    greedy (greedy identity is reported only then). tau is None when no step was verified, the acceptance
    rate None (and ``ran_as_plain_decoding`` true) when no draft token was proposed: nothing was measured."""
    outs = [s.outputs[method] for s in samples]
    lengths = [n for o in outs for n in o.accept_lengths]
    out: dict = {"tokens_per_s": round(rates[method], 3),
                 "tau": round(sum(lengths) / len(lengths), 4) if lengths else None}
    if not registry.get(method).baseline:   # what verification accepted, before EOS / the budget cut a step
        verified = [n for o in outs for n in o.verified]
        accepted = [n - 1 for n in verified]
        total = proposed * len(lengths) if proposed is not None else sum(sum(o.proposed) for o in outs)
        out["acceptance_rate"] = round(sum(accepted) / total, 4) if total else None
        if not total:
            out["ran_as_plain_decoding"] = True
        out["proposed_per_step"] = round(total / len(lengths), 3) if lengths else 0.0
        if proposed is not None:
            out["n_alpha"] = [round(sum(a >= n for a in accepted) / max(sum(a >= n - 1 for a in accepted), 1), 4)
                              for n in range(1, proposed + 1)]
        out["accept_length_histogram"] = {str(k): verified.count(k) for k in sorted(set(verified))}
    for base in methods:
        if registry.get(base).baseline and rates[base] > 0:
            out[f"speedup_vs_{base}"] = round(rates[method] / rates[base], 4)
            if base != method:   # the spread behind the pooled ratio: each prompt's own ratio
                ratios = [s.outputs[method].tokens_per_s / s.outputs[base].tokens_per_s for s in samples
                          if s.outputs[base].tokens_per_s > 0]
                out[f"per_prompt_speedup_vs_{base}"] = _spread(ratios)
    if greedy and "autoregressive" in methods and samples and method != "autoregressive":   # not itself: always 1
        same = [s.tokens[method] == s.tokens["autoregressive"] for s in samples]
        out["greedy_identical_fraction"] = round(sum(same) / len(same), 4)
    return out


def _label(s: Sample) -> str:
    return s.prompt_id if s.turn == 1 else f"{s.prompt_id} (turn {s.turn})"


def summarize(samples: list[Sample], methods: Sequence[str], proposed: Optional[Mapping[str, int]] = None,
              greedy: bool = True) -> dict:
    """The report's numbers from the per-sample outputs (definitions: module docstring).

    ``proposed``: method -> draft tokens a step proposes, for the methods that fix it. ``greedy``:
    whether the run decoded greedily (identity with plain greedy is meaningful, and reported, only then;
    ``greedy_mismatches``: method -> the prompts whose output differs from the autoregressive baseline's)."""
    proposed = proposed or {}
    rates = {}
    for meth in methods:
        tokens = sum(len(s.outputs[meth].tokens) for s in samples)
        secs = sum(s.outputs[meth].prefill_s + s.outputs[meth].decode_s for s in samples)
        rates[meth] = tokens / secs if secs > 0 else 0.0
    out: dict = {"tokens_per_s": {k: round(v, 3) for k, v in rates.items()},
                 "per_method": {meth: method_summary(samples, meth, methods, rates, proposed.get(meth), greedy)
                                for meth in methods}}
    if greedy and "autoregressive" in methods and samples:   # each transformers baseline against the runtime's loop
        for base in (x for x in methods if x != "autoregressive" and registry.get(x).baseline):
            same = [s.tokens[base] == s.tokens["autoregressive"] for s in samples]
            out[f"{base}_identical_fraction"] = round(sum(same) / len(same), 4)
        differ = {x: [_label(s) for s in samples if s.tokens[x] != s.tokens["autoregressive"]] for x in methods}
        out["greedy_mismatches"] = {x: ids for x, ids in differ.items() if ids}
    return out


def warn_mismatches(mismatches: Mapping[str, Sequence[str]]) -> None:
    """One loud stderr line naming, per method, the prompts whose greedy output differs from plain greedy."""
    if mismatches:
        print("WARNING: output differs from plain greedy decoding: " + "; ".join(
            f"{x} on prompt{'s' if len(ids) > 1 else ''} {', '.join(map(str, ids))}" for x, ids in mismatches.items()),
              file=sys.stderr)


def sample_records(samples: list[Sample], specs: Mapping[str, Any], proposed: Mapping[str, int],
                   greedy: bool) -> list[dict]:
    """report.json's ``samples``: per prompt (and turn) and method, what a speedup is recomputed from (its tokens,
    prefill and decode seconds), tau, accepted / proposed draft tokens and, in greedy mode, whether its
    output equals plain greedy's (tau None: no step verified)."""
    rows = []
    for s in samples:
        row: dict = {"prompt_id": s.prompt_id, "turn": s.turn}
        for k, g in s.outputs.items():
            row.update({f"{k}_tokens": len(g.tokens), f"{k}_prefill_s": round(g.prefill_s, 6),
                        f"{k}_decode_s": round(g.decode_s, 6)})
            if not specs[k].baseline:
                row[f"{k}_tau"] = round(g.tau, 3) if g.steps else None
                row[f"{k}_accepted"] = sum(n - 1 for n in g.verified)
                row[f"{k}_proposed"] = proposed[k] * g.steps if k in proposed else sum(g.proposed)
            if greedy and "autoregressive" in s.tokens and k != "autoregressive":
                row[f"{k}_identical_to_greedy"] = s.tokens[k] == s.tokens["autoregressive"]
        rows.append(row)
    return rows


def machine() -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()}
    info["transformers"] = transformers.__version__
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


# -- the whole evaluation ------------------------------------------------------------------
def check_settings(*, max_new_tokens: int, turns: str = "first", calibration_prompts: int = 8,
                   calibration_tokens: int = 48, budgets: Sequence[int] = DEFAULT_BUDGETS) -> None:
    """Refuse, in one line, evaluation settings that cannot be measured; from the settings alone, so
    medusa-eval calls it before the backbone loads. No calibration prompt, token or non-empty node budget
    would leave nothing timed, and a report saying "plain decoding is fastest" all the same."""
    if not is_count(max_new_tokens, 1):
        raise UserError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if turns not in ("first", "both"):
        raise UserError(f"turns must be first|both, got {turns!r}")
    for name, value in (("calibration_prompts", calibration_prompts), ("calibration_tokens", calibration_tokens)):
        if not is_count(value, 1):
            raise UserError(f"{name} must be an integer >= 1, got {value!r}")
    given = list(budgets) if isinstance(budgets, Sequence) and not isinstance(budgets, str) else None
    if not given or not all(is_count(b, 1) and b < MAX_TREE_NODES for b in given):
        raise UserError(f"tree_budgets must be a non-empty list of node counts >= 1 (root excluded), each at most "
                        f"{MAX_TREE_NODES - 1}, got {budgets!r}")


def decode_interleaved(m: MedusaModel, prompts: list[Prompt], methods: Sequence[str], opts: Mapping[str, Any], *,
                       max_new_tokens: int, sampling: SamplingConfig, turns: str, seed: int,
                       progress: bool) -> list[Sample]:
    """Every method on every prompt (and second turn with ``turns="both"``, continuing from the reply the prompt
    gives, else the plain answer: the same chat for every method), the methods' order rotated from prompt to prompt
    (module docstring)."""
    samples: list[Sample] = []
    bar = progress_bar(progress, len(prompts) * (2 if turns == "both" else 1), "eval", unit="prompt", leave=True,
                       dynamic_ncols=False)
    for i, p in enumerate(prompts):
        answers: list[str] = []
        for turn in range(min(len(p.turns), 2 if turns == "both" else 1)):
            ids = encode_turn(m, p, turn, answers)
            sample = Sample(p.id, turn + 1)
            order = list(methods[i % len(methods):]) + list(methods[: i % len(methods)])
            for meth in order:
                g = registry.generate(m, ids, meth, options=opts[meth], max_new_tokens=max_new_tokens,
                                      sampling=sampling, seed=seed + i)
                sample.outputs[meth] = g
                sample.tokens[meth] = list(g.tokens)
            samples.append(sample)
            # the plain answer (else methods[0]'s: the first of this prompt's rotated order once gave each prompt's
            # second turn another method's answer), even an empty one, for every method alike
            ref = sample.tokens["autoregressive" if "autoregressive" in sample.tokens else methods[0]]
            answers.append(answer_text(m.tokenizer, ref) if m.tokenizer is not None else "")
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    return samples


WARMUP_TOKENS = 8   # the untimed warm-up's length without captured steps


def warm_tokens(m: MedusaModel, max_new_tokens: int) -> tuple[bool, int]:
    """Whether ``m`` has captured steps (``graphs``), and the untimed warm-up's length: ``max_new_tokens`` with
    them (the captures happen there), else ``WARMUP_TOKENS`` at most."""
    captured = m.static is not None and m.static.capture is not None
    return captured, max_new_tokens if captured else min(WARMUP_TOKENS, max_new_tokens)


def warm_up(m: MedusaModel, ids: list[list[int]], methods: Sequence[str], opts: Mapping[str, Any],
            max_new_tokens: int, sampling: SamplingConfig, seed: int, longest: int = 0) -> None:
    """One untimed generation of every timed method before the timed runs, for all alike: the calibration ran
    the runtime's methods, never transformers' ``generate``, whose first-call setup was then timed on the first
    prompt alone. ``ids``: the prompts' encoded first turns. With captured steps (``graphs``) on the longest
    at ``max_new_tokens`` (the captures and the KV buffer's growth to the longest prompt happen here), else
    ``WARMUP_TOKENS`` on the first one. ``longest``: the longest prompt a timed run will have (second turns are
    longer than any first): the warm-up row is lengthened to it, or the buffer regrew, dropping every graph,
    and the captures were timed."""
    if not ids:
        return
    captured, tokens = warm_tokens(m, max_new_tokens)
    row = max(ids, key=len) if captured else ids[0]
    if captured and longest > len(row):
        row = (row * (longest // len(row) + 1))[:longest]
    for meth in methods:
        registry.generate(m, row, meth, options=opts[meth], max_new_tokens=tokens, sampling=sampling, seed=seed)


def evaluate(m: MedusaModel, prompts: list[Prompt], *, methods: Sequence[str] = DEFAULT_METHODS,
             choice: Union[str, Mapping[str, str]] = "auto", max_new_tokens: int = 128,
             sampling: Optional[SamplingConfig] = None, turns: str = "first", calibration_prompts: int = 8,
             calibration_tokens: int = 48, budgets: Sequence[int] = DEFAULT_BUDGETS, seed: int = 0,
             progress: bool = True, log: Callable[[str], None] = print, settings: Optional[dict] = None,
             options: Optional[Mapping[str, Any]] = None, calibration: Optional[list[Prompt]] = None,
             chosen: Optional[dict] = None, **fields) -> dict:
    """Run ``methods`` interleaved on ``prompts`` and summarise them (module docstring).

    ``options``: method name -> its options object (defaults for the others); ``fields``: option fields set on
    every method that has them (``tree="chain3"``); ``choice``: ``auto`` / ``fixed`` (``choosing``), each
    method's speculation shape choosing. ``m.heads`` may be None when no method needs heads.
    ``calibration``: the calibration prompts, all of ``prompts`` evaluated (``prompts.select_prompts``);
    None: the last ``calibration_prompts`` held out (``split_calibration``). Either way no prompt both
    calibrates and is evaluated. ``chosen``: a dict that gets each shaped method's ``Chosen`` (medusa-eval
    writes the choice files from it)."""
    sampling = sampling or SamplingConfig()
    check_settings(max_new_tokens=max_new_tokens, turns=turns, calibration_prompts=calibration_prompts,
                   calibration_tokens=calibration_tokens, budgets=budgets)
    methods = registry.check_methods(methods, m)
    specs = {meth: registry.get(meth) for meth in methods}
    registry.check_greedy_only(methods, sampling)
    opts = method_options(m, methods, options, fields)
    modes = choice_modes(methods, choice, fields)
    calib_src: list[Prompt] = []
    if calibrating(opts, modes, batched=False):
        calib_src, prompts = (calibration, prompts) if calibration else split_calibration(prompts, calibration_prompts)
    held = prompt_record(prompts, calib_src, (settings or {}).get("num_prompts"))
    calib = encode_checked(m, calib_src, calibration_tokens, key="calibration_tokens")
    ids = encode_checked(m, prompts, max_new_tokens, turns)   # every turn fits before anything is decoded
    made = choose_all(ChoiceContext(m, calib, calib[:1], calibration_tokens, budgets, log, progress), opts, modes)
    opts.update({meth: c.options for meth, c in made.items()})
    if chosen is not None:
        chosen.update(made)
    reported = {meth: registry.options_report(o) for meth, o in opts.items() if dataclasses.fields(o)}
    for meth, spec in specs.items():
        if spec.prepare is not None:  # loaded once and reused for every prompt (a draft model)
            opts[meth] = spec.prepare(m, opts[meth])
    seconds = [second_turn_bound(m, p, max_new_tokens) for p in prompts if turns == "both" and len(p.turns) > 1]
    warm_up(m, ids, methods, opts, max_new_tokens, sampling, seed, longest=max(seconds, default=0))
    samples = decode_interleaved(m, prompts, methods, opts, max_new_tokens=max_new_tokens, sampling=sampling,
                                 turns=turns, seed=seed, progress=progress)
    run_length = max((s.outputs[methods[0]].prompt_tokens for s in samples), default=0) + max_new_tokens
    proposed = {meth: spec.proposed(opts[meth]) for meth, spec in specs.items() if spec.proposed is not None}
    report = {"settings": settings or {}, "machine": machine(), "num_samples": len(samples), "methods": list(methods),
              **held, **summarize(samples, methods, proposed, greedy=sampling.is_greedy),
              "method_options": reported, "run_length": run_length,
              "costs": {x: dataclasses.asdict(spec.costs(m, opts[x], run_length)) for x, spec in specs.items()},
              "linear_kernels": routing_summary(m.kernel_plans) if m.kernel_plans else "stock",
              "graphs": m.static.summary() if m.static is not None else "off", **report_entries(made)}
    report["samples"] = sample_records(samples, specs, proposed, sampling.is_greedy)
    warn_mismatches(report.get("greedy_mismatches"))
    return report
