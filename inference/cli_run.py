"""What ``medusa-eval`` and ``medusa-generate`` run once their keys are read (``cli.py`` parses them).

Every check the keys, the heads' config.json and the prompts decide comes first (``cli_checks``), then the
backbone loads and the command decodes. This module imports the runtime, the evaluation and the loaders at
its top: ``cli.py`` imports it only once a command runs, so ``--help`` stays fast.
"""
from __future__ import annotations

import dataclasses
import json
import shlex
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from omegaconf import OmegaConf

from . import methods as decoding   # decoding.stream / generate / generate_batch, looked up when called
from .backbone import load_backbone
from .chat_template import check_template_args, set_template_args, template_args_for
from .cli_checks import (check_decoding_keys, check_eval_keys, check_eval_prompts_fit, check_fixed_choices,
                         check_keys_used, check_options_fit, check_prompts_fit, choice_modes, encode_prompts,
                         eval_methods, eval_out_dir, eval_prompts, generate_prompts, heads_spec, method_options,
                         read_choice_file)
from .cli_keys import GENERATE_DEFAULTS, GenerateKeys
from .errors import UserError
from .evaluation.batch_eval import check_batchable, evaluate_batched
from .evaluation.batch_reports import print_batched
from .evaluation.drift import greedy_drift
from .evaluation.evaluate import evaluate
from .evaluation.reports import print_per_method, publish_reports, write_compare, write_report
from .heads.native import make_temp_dir, release_temp_dir
from .loading import kernel_plans_path, load_medusa
from .methods.choice_file import is_choice_file, write_choice
from .methods.registry import PLAIN_METHOD, batched_names, check_greedy_only, get, methods_for_heads
from .prompts import Prompt, answered_turn, encode_turn, prompt_digest
from .runtime.batch_decode import check_batch_size
from .runtime.decode import answer_text, stream_text
from .runtime.draft_weights import check_draft_weights
from .runtime.model import MedusaModel, apply_kernels, check_kernels
from .runtime.race import auto_threads
from .runtime.static_steps import apply_graphs

__all__ = ["eval_choices", "eval_methods", "generate_options", "run_eval", "run_generate"]


def _device(cfg) -> str:
    torch.set_num_threads(cfg.threads or auto_threads())
    return cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")


def _load(cfg):
    if cfg.heads in ("???", ""):
        raise UserError("heads=<export directory> is required")
    return load_medusa(cfg.heads, backbone=cfg.backbone, device=_device(cfg), dtype=cfg.dtype,
                       trust_remote_code=cfg.trust_remote_code, apply_adapter=cfg.apply_adapter, kernels=cfg.kernels,
                       draft_weights=cfg.draft_weights, graphs=cfg.graphs, graph_buckets=list(cfg.graph_buckets),
                       chat_template_args=cfg.chat_template_args)


def _load_eval(cfg):
    """Backbone (+ heads when given) on the chosen device; without heads the backbone is ``backbone=``."""
    check_kernels(cfg.kernels)
    check_draft_weights(cfg.draft_weights)
    if cfg.heads:  # the heads name their backbone; they are loaded (and checked) even if medusa does not run
        return _load(cfg)
    model, tok, _ = load_backbone(cfg.backbone or "embedded:smollm2", device=_device(cfg), dtype=cfg.dtype,
                                  trust_remote_code=cfg.trust_remote_code)
    set_template_args(tok, cfg.chat_template_args, whose=f" of {cfg.backbone or 'embedded:smollm2'}")
    m = apply_kernels(MedusaModel(model=model, tokenizer=tok, heads=None), cfg.kernels, kernel_plans_path())
    return apply_graphs(m, cfg.graphs, list(cfg.graph_buckets))


def eval_choices(cfg, methods: list[str], spec, sizes) -> tuple[dict, dict, Any]:
    """(each method's options, each shaped method's choice mode, the ``SavedChoice`` of ``choice=<file>`` or None),
    every key checked against the heads' config before anything loads; the file's choice applied to its method
    (measured again, at fixed)."""
    options = {x: method_options(cfg, x, spec) for x in methods}
    check_options_fit(options, spec, cfg)   # the heads' config and the backbone's (not its weights)
    modes = choice_modes(cfg, options)
    saved = read_choice_file(cfg, spec, methods, evaluated=True)
    if saved is not None:
        options[saved.method] = get(saved.method).shape.apply(options[saved.method], saved.schedule, sizes is not None)
    check_fixed_choices(options, modes, spec)
    return options, modes, saved


def run_eval(cfg) -> dict:
    sampling, sizes = check_eval_keys(cfg)   # everything the config alone decides, before anything loads
    cfg.chat_template_args = template_args_for(cfg.heads, cfg.chat_template_args)   # given, else the training's
    methods = eval_methods(cfg)
    check_keys_used(cfg, methods)
    check_greedy_only(methods, sampling)
    spec = heads_spec(cfg, strict=True)   # heads given: readable
    options, modes, saved = eval_choices(cfg, methods, spec, sizes)
    if sizes is not None:  # before the backbone loads: methods that cannot decode batches
        check_batchable(methods, sizes)
    prompts, calibration, chose = eval_prompts(cfg, options, modes, sizes, saved)
    out = eval_out_dir(cfg)
    check_eval_prompts_fit(cfg, prompts, calibration, spec)   # the tokenizer alone: prompts beyond the positions
    m = _load_eval(cfg)
    settings = OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else dict(vars(cfg))
    settings["backbone"] = settings.get("backbone") or ("embedded:smollm2" if not cfg.heads else None)
    settings["methods"] = methods
    chosen: dict = {}
    common = dict(methods=methods, choice=modes, max_new_tokens=cfg.max_new_tokens, sampling=sampling,
                  calibration_prompts=cfg.calibration_prompts, calibration_tokens=cfg.calibration_tokens, seed=cfg.seed,
                  progress=cfg.progress_bar, settings=settings, options=options, calibration=calibration, chosen=chosen)
    if sizes is not None:
        report = evaluate_batched(m, prompts, batch_sizes=sizes, rounds=cfg.batch_rounds, **common)
    else:
        report = evaluate(m, prompts, turns=cfg.turns, budgets=list(cfg.tree_budgets), **common)
    if saved is not None:   # the given file's own calibration prompts, held out (eval_prompts)
        report["choice_calibration_prompt_ids"] = [p.id for p in chose]
    backbone_drift(cfg, m, prompts, report)
    write_eval(cfg, m, out, report, chosen, sizes is not None, [prompt_digest(p) for p in calibration or ()])
    return report


def backbone_drift(cfg, m, prompts, report: dict) -> None:
    """Medusa-2 heads decode on the adapted backbone: say how far it is from the original (report.json)."""
    spec = getattr(m.heads, "spec", None)
    if not (getattr(spec, "backbone_adapter", None) and m.adapter_applied):
        return
    original, _, _ = load_backbone(cfg.backbone or spec.base_model, device=m.device, dtype=cfg.dtype,
                                   trust_remote_code=cfg.trust_remote_code)
    ids = [encode_turn(m, p) for p in prompts[:8]]   # as the evaluation encodes them: a record's system message too
    report["backbone_drift"] = greedy_drift(m, MedusaModel(model=original, tokenizer=None, heads=None), ids,
                                            cfg.max_new_tokens)
    print(f"backbone drift vs the original ({len(ids)} prompts): greedy token agreement "
          f"{report['backbone_drift']['greedy_token_agreement']:.1%}, identical answers "
          f"{report['backbone_drift']['identical_answers']:.1%}")


def write_eval(cfg, m, out, report: dict, chosen: dict, batched: bool, chosen_on: Sequence[str] = ()) -> None:
    """report.json / .md / plots, the trade-off matrix with compare=true, and a choice file per measured
    choice (``methods.choice_file``; ``chosen_on``: the calibration prompts' digests); what was written and how
    to decode with each choice, printed."""
    real = out.resolve()   # the folder itself (a link to it): replaced whole; messages name it as given
    real.parent.mkdir(parents=True, exist_ok=True)
    stage = make_temp_dir(real)   # every file written there, then swapped in whole: a kill leaves one evaluation
    try:
        paths = write_report(stage, report)
        if cfg.compare:
            paths += write_compare(stage, report)
        fingerprint = getattr(getattr(m.heads, "spec", None), "base_model_fingerprint", "") or ""   # the loaded heads'
        files = {x: write_choice(stage, x, c, c.options, fingerprint, chosen_on) for x, c in chosen.items()
                 if c.measured}
        paths += list(files.values())
        given = [Path(cfg.choice)] if cfg.choice not in ("auto", "fixed") else []   # the choice= file read: kept
        stale = publish_reports(stage, real, given)
    finally:
        release_temp_dir(stage)
    paths = [out / p.name for p in paths]
    files = {x: out / p.name for x, p in files.items()}
    print()
    if batched:
        print_batched(report["batched"])
    print_per_method(report)
    print("report: " + ", ".join(str(p) for p in paths))
    if stale:
        print(f"removed what an earlier evaluation left in {out}: {', '.join(stale)}")
    # medusa-generate decodes with heads, and with the methods that use them only (a draft model's or prompt
    # lookup's choice was printed with a command it refused)
    spec = getattr(m.heads, "spec", None)
    usable = methods_for_heads(spec) if cfg.heads and spec is not None else ()
    for method, path in ((x, p) for x, p in files.items() if x in usable):
        sizes = report["batched"]["batch_sizes"] if batched else None
        print(f"decode with {method}'s choice: {generate_command(cfg, path, sizes)}")


# What a measured choice depends on beyond the heads: the model decoded (backbone, adapter, dtype, device, its own
# code) and how (a choice measured sampling is pasted as sampling; with backbone= printed, apply_adapter's unset
# default would flip to off; the answers' length: the prompts were checked to fit the backbone with it)
_MEASURED_AS = ("backbone", "apply_adapter", "dtype", "device", "trust_remote_code", "mode", "temperature", "top_p",
                "top_k", "typical_epsilon", "typical_delta", "max_new_tokens", "chat_template_args")


EXAMPLE_PROMPT = "Write a haiku about the sea."


def generate_command(cfg, path: Path, batch_sizes: Optional[Sequence[int]]) -> str:
    """The medusa-generate command line that decodes as the evaluation measured ``path``'s choice: the heads, and
    the keys of ``_MEASURED_AS`` the evaluation was given (pasted without them, heads naming an unreachable base
    model failed, and a bfloat16 evaluation's choice decoded in float32). It runs as printed: an example prompt,
    or (``batch_sizes``: a batched evaluation's) the evaluation's prompts file at its largest batch size."""
    defaults = {f.name: f.default for f in dataclasses.fields(GenerateKeys)}
    given = [f"{key}={_word(value)}" for key in _MEASURED_AS if key != "chat_template_args"
             and (value := getattr(cfg, key)) is not None and value != defaults[key]]
    # the prompts as measured: rendered with the same template variables, one key each
    given += [f"chat_template_args.{k}={_word(v)}" for k, v in check_template_args(cfg.chat_template_args).items()]
    asked = [f"prompts_file={_word(cfg.prompts)}", f"batch_size={max(batch_sizes)}"] if batch_sizes else \
        [f"prompt={EXAMPLE_PROMPT}"]
    words = [shlex.quote(w) for w in (f"heads={cfg.heads}", *given, *asked, f"choice={path}")]
    return "medusa-generate " + " ".join(words)


def _word(value) -> str:
    """A value as a command line reads it back (true / false; a list or mapping as JSON; a string the command line
    would read as another value, "true", "1", "a: b", quoted)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    if isinstance(value, str) and OmegaConf.from_dotlist([f"v={value}"]).get("v") != value:
        return json.dumps(value)
    return str(value)


def generate_options(cfg, spec, several: bool, size: Optional[int]):
    """(the method to decode with, its options, whether prompts decode in batches): the heads' default method
    and the command line's keys, or a choice file's method and choice (per batch size when batched)."""
    if cfg.choice == "auto":
        raise UserError("choice=auto is made by an evaluation (medusa-eval heads=... choice=auto); decode with the "
                        "file it writes: choice=<eval dir>/<method>_choice.json")
    spec = spec if spec is not None else heads_spec(cfg, strict=True)   # unreadable heads: one line, before loading
    usable = methods_for_heads(spec)
    saved = read_choice_file(cfg, spec, usable, GENERATE_DEFAULTS)
    method = saved.method if saved is not None else usable[0]
    batching = get(method).batch_decoder is not None
    if size is not None and size > 1 and not batching:
        raise UserError(f"method {method} (these heads) decodes one prompt at a time: drop batch_size "
                        f"(methods that decode batches: {', '.join(batched_names())})")
    options = method_options(cfg, method, spec)   # bad keys: one line before the backbone loads
    check_options_fit({method: options}, spec, cfg)
    together = several and batching   # prompts decoded in batches: a batched evaluation's schedule applies
    if saved is not None:
        grafts = get(method).grafted(options) if get(method).grafted is not None else 0
        # the evaluation found plain decoding best at batch 1; a method that grafts its own proposals under the
        # tree (a looked-up chain) ran them alone with no tree, and was measured and reported so
        if saved.plain_alone and not together and not grafts:
            return PLAIN_METHOD, None, together
        return method, get(method).shape.apply(options, saved.schedule, together), together
    shape = get(method).shape
    if shape is not None and shape.calibrates(options, "fixed", together):   # tree=calibrated:N: prompts to measure
        given = " ".join(f"{key}={getattr(options, key)}" for key in shape.fixed_by)
        raise UserError(f"{given} is grown from measurements on calibration prompts, which medusa-generate does not "
                        f"take: 'medusa-eval heads={cfg.heads} {given} out=<dir>' measures it and writes "
                        f"<dir>/{method}_choice.json; decode with choice=<dir>/{method}_choice.json")
    if shape is not None:
        check_fixed_choices({method: options}, {method: "fixed"}, spec)   # before the backbone loads
    return method, options, together


def batching_note(cfg, method: str, together: bool) -> None:
    """Say that batches speculate as one prompt would, where prompts decode in batches with a shaped method and no
    choice file sized it per batch size. Printed once every check has passed (``run_generate``): a refusal comes
    first and alone (the note once came before a prompt's "exceeds the backbone's positions")."""
    if together and get(method).shape is not None and not is_choice_file(cfg.choice):
        print(f"note: every batch speculates as one prompt would; on a CPU that stops paying from 2-4 rows "
              f"(BENCHMARKS.md): medusa-eval heads={cfg.heads} batch_size=[1,2,4,...] measures it per batch size "
              f"and writes the file to decode batches with (choice=<file>)", file=sys.stderr)


def run_generate(cfg) -> None:
    prompts, several = generate_prompts(cfg)   # each with its system message: the record's, else system=
    sampling = check_decoding_keys(cfg)   # before anything loads, as every check below
    size = check_batch_size(cfg.batch_size) if cfg.batch_size is not None else None
    if cfg.heads in ("???", ""):
        raise UserError("heads=<export directory> is required")
    cfg.chat_template_args = template_args_for(cfg.heads, cfg.chat_template_args)   # given, else the training's
    spec = heads_spec(cfg)   # None when unreadable here: the load below says why
    method, options, together = generate_options(cfg, spec, several, size)
    check_keys_used(cfg, [method], GENERATE_DEFAULTS, names_methods=False)
    check_prompts_fit(cfg, prompts, spec)   # the tokenizer alone: a prompt too long refused before weights
    batching_note(cfg, method, together)   # after the checks: a refusal is the one line printed
    m = _load(cfg)
    ids = encode_prompts(m, prompts, cfg)   # every prompt fits the backbone's positions before any is decoded
    if several:
        generate_several(m, prompts, ids, method, size or len(ids), together, options, sampling, cfg)
        return
    stream = decoding.stream(m, ids[0], method, options=options, max_new_tokens=cfg.max_new_tokens,
                             sampling=sampling, seed=cfg.seed)
    for piece in stream_text(m.tokenizer, stream):   # multi-byte characters span tokens: printed once whole
        sys.stdout.write(piece)
        sys.stdout.flush()
    out = stream.result
    graphs = ""
    if m.static is not None and (m.static.captures or m.static.calls.captures):
        graphs = (f", {len(m.static.captures)} steps + {len(m.static.calls.captures)} drafter calls captured as "
                  f"CUDA graphs in {m.static.capture_s + m.static.calls.capture_s:.2f} s (in that time)")
    print(f"\n\n[{len(out.tokens)} tokens, tau {out.tau:.2f}, {out.tokens_per_s:.1f} tokens/s{graphs}, "
          f"finish: {out.finish_reason}]", file=sys.stderr)


def generate_several(m, prompts: list[Prompt], ids: list[list[int]], method: str, size: int, batching: bool,
                     options, sampling, cfg) -> None:
    """Decode several prompts, ``size`` at a time with ``generate_batch`` when the method batches (one at
    a time otherwise); print each answer under its prompt's number, and each batch's numbers on stderr."""
    for start in range(0, len(ids), size if batching else 1):
        rows = ids[start:start + (size if batching else 1)]
        if batching:
            out = decoding.generate_batch(m, rows, method, options=options, max_new_tokens=cfg.max_new_tokens,
                                          sampling=sampling, seed=cfg.seed)
            outs, secs, tau = out.rows, out.prefill_s + out.decode_s, out.tau
        else:
            g = decoding.generate(m, rows[0], method, options=options, max_new_tokens=cfg.max_new_tokens,
                                  sampling=sampling, seed=cfg.seed)
            outs, secs, tau = [g], g.prefill_s + g.decode_s, g.tau
        for i, g in enumerate(outs, start=start + 1):
            p = prompts[i - 1]
            head = " ".join(p.turns[answered_turn(p)].split())   # the question answered: a chat's last one
            print(f"=== [{i}/{len(ids)}] {head[:70] + ('...' if len(head) > 70 else '')}")
            print(answer_text(m.tokenizer, g.tokens), flush=True)
            print(f"[{len(g.tokens)} tokens, tau {g.tau:.2f}, finish: {g.finish_reason}]", file=sys.stderr,
                  flush=True)
            print(flush=True)
        tokens = sum(len(g.tokens) for g in outs)
        print(f"[{'batch of ' + str(len(outs)) if batching else 'prompt ' + str(start + 1)}: {tokens} tokens in "
              f"{secs:.2f} s, {tokens / secs if secs > 0 else 0:.1f} tokens/s, tau {tau:.2f}]", file=sys.stderr,
              flush=True)
