"""``medusa-eval`` and ``medusa-generate``: measure decoding methods, or decode with Medusa heads.

    medusa-eval heads=runs/medusa1_smollm2/heads                       # MT-Bench first turns, tree=auto
    medusa-eval heads=runs/a/heads num_prompts=10 max_new_tokens=96 out=runs/a/eval
    medusa-eval heads=runs/a/heads tree=tree8 turns=both prompts=my_prompts.jsonl
    medusa-eval heads=runs/a/heads mode=sample temperature=0.7 methods=[medusa]
    medusa-eval methods=[lookahead] prompts=code                         # no heads: training-free methods
    medusa-eval methods=[draft,prompt_lookup] draft=self:8 draft_k=3     # + the autoregressive / HF baselines
    medusa-eval heads=runs/a/heads methods=[medusa_lookup] prompts=code  # Medusa tree + prompt lookup branch
    medusa-eval compare=true prompts=code out=runs/compare_code          # every method: compare.md + .png
    medusa-eval heads=runs/e3/heads methods=[eagle3] eagle_tree=auto    # EAGLE-3 drafter, dynamic trees
    medusa-eval heads=runs/e3/heads methods=[eagle3_lookup] eagle_lookup_tokens=6   # + a prompt-lookup branch
    medusa-eval heads=runs/a/heads batch_size=[1,2,4,8,16,32]          # batched: throughput per batch size
    medusa-generate heads=runs/a/heads prompt="Write a haiku about the sea." tree=runs/a/eval/tree.json
    medusa-generate heads=runs/a/heads 'prompt=["Say hi.", "Name a colour."]'   # decoded as one batch
    medusa-generate heads=runs/e3/heads prompt="Hi." eagle_tree=runs/e3/eval/eagle3_lookup_tree.json  # eval's pick

Key=value overrides as in ``medusa-train`` (Hydra). The runtime library never imports Hydra;
only these entry points do. User mistakes print one line and exit 2, before anything loads where the keys,
the heads' config.json and the prompts decide (cli_checks.py). Boolean keys take true/false, yes/no, on/off,
1/0. Bounds: eagle_depth at most 32; eagle_topk, eagle_lookup_tokens, prompt_lookup_tokens, draft_k, lookahead_window,
lookahead_guesses at most 64; *_ngram at most 16; eagle_nodes, trees (treeN, chainN, calibrated:N) at most 256 nodes.

medusa-eval picks its methods with ``methods=[...]`` (default: the first method that decodes with the
heads: medusa, or eagle3_lookup for EAGLE-3 heads); ``compare=true`` is short for every available method
(those needing heads only with heads=, and only those that decode with them) and also writes the
trade-off matrix; medusa-generate decodes with that same default method. The baselines are always
added: autoregressive, and hf_generate in greedy mode. Without heads= the backbone is ``backbone=``
(default embedded:smollm2). Prompt sets: embedded:mtbench (default), code (bundled code /
structured-output prompts) or a JSONL file.

batch_size=B (or a list, batch_size=[1,2,4,8]) evaluates batched decoding instead: the prompts in
consecutive batches of B, each batch decoded by every requested method that batches (generate_batch),
the plain batched loop and transformers' batched generate; report.json's ``batched`` section and
throughput_vs_batch.png. Speculation is sized per batch size on this machine: Medusa's tree with
tree=auto, the draft model's k and prompt lookup's chain length with batch_chains=auto (default), EAGLE-3's
setting with eagle_tree=auto; the trees and EAGLE-3 settings are saved (tree_schedule.json,
eagle3_lookup_tree.json) for medusa-generate. medusa-generate takes several prompts as prompt=[...] or
prompts_file= (a JSONL as medusa-eval's prompts=) and decodes them together (batch_size=N: N at a time),
with such a file (tree=<file> / eagle_tree=<file>) speculating as the evaluation measured per batch size.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, List, Optional

from .cli_checks import (check_decoding_keys, check_eval_keys, check_options_fit, check_tree, encode_prompts,
                         eval_out_dir, eval_prompts, generate_prompts, heads_spec)
from .cli_support import enum_value, run_cli



@dataclass
class RuntimeConfig:
    heads: str = "???"  # a heads export directory (required)
    backbone: Optional[str] = None  # default: the base model recorded in the heads' config.json
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "float32"  # float32 | bfloat16 | float16
    # auto (measured: accuracy and latency) | calibrated:N (the best N-node tree for these heads,
    # kept whatever its speed: compare heads at one budget) | a default name (tree8, chain3) | a JSON path
    tree: str = "auto"
    mode: str = "greedy"  # greedy (lossless) | typical (lossy) | sample (exact)
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0
    typical_epsilon: float = 0.09
    typical_delta: float = 0.3
    max_new_tokens: int = 128
    seed: int = 0
    threads: int = 0  # torch CPU threads (0 = auto: one per core not kept busy by other processes)
    # auto: skinny CPU products take the faster formulation (linear_kernels), chosen by timing them once per
    # machine (kept in ~/.cache/medusa-train/kernel_plans.json) | measure: time them afresh | stock: transformers'
    kernels: str = "auto"
    # float: heads as trained | float16: fp32 heads' own linears in float16 (runtime/draft_weights.py; drafting
    # reads half the bytes; the backbone verifies, so greedy outputs and sampling's distribution are unchanged)
    draft_weights: str = "float"
    trust_remote_code: bool = False
    # Medusa-2 heads (trained with a LoRA adapter): merge it into the backbone. Default: when the
    # backbone is the one the heads record (no backbone= given); set false for a merged model.
    apply_adapter: Optional[bool] = None
    # eagle3 (EAGLE-3 heads): draft tokens verified per step (root excluded; 0: plain decoding) and the
    # dynamic tree's depth (depth - 1 drafter calls per step). Unset: fitted to the drafter (methods/eagle3.py
    # fitted_tree: no deeper than it was trained to draft, at most 4; as many nodes as that holds, at most 8)
    eagle_nodes: Optional[int] = None
    eagle_depth: Optional[int] = None
    eagle_topk: int = 4  # eagle3: children per expanded node, nodes expanded per depth
    # eagle3: verify only the drafted nodes whose draft probability (product along the path) is >= this;
    # 0: all eagle_nodes (EAGLE-2). On a CPU every verified row costs (BENCHMARKS.md "A probability floor on the tree")
    eagle_min_prob: float = 0.0
    # eagle3_lookup: the looked-up branch grafted onto eagle3's tree (measured: BENCHMARKS.md "EAGLE-3 plus
    # prompt lookup"); its own keys, since a branch verified beside a tree pays only for longer matches
    eagle_lookup_tokens: int = 6  # most tokens looked up per step
    eagle_lookup_max_ngram: int = 3  # longest suffix looked up
    eagle_lookup_min_ngram: int = 2  # shortest suffix looked up
    eagle_lookup_switch: int = 0  # a suffix match this long verifies the looked-up chain alone (0: never)


@dataclass
class EvalConfig(RuntimeConfig):
    heads: Optional[str] = None  # a heads export directory; needed only by the methods that use heads
    prompts: str = "embedded:mtbench"  # embedded:mtbench | code | a JSONL of prompts
    num_prompts: Optional[int] = None  # first N prompts (calibration prompts are taken after them)
    turns: str = "first"  # first | both
    method: Any = None  # removed: refused with a pointer to methods=
    methods: Optional[List[str]] = None  # the methods to measure (default: medusa); the baselines are added
    compare: bool = False  # run every available method, write compare.md + compare.png
    draft: str = "self:4"  # draft model: self:N (backbone's first N layers) | a path or hub id
    draft_k: int = 4  # draft tokens per step
    draft_adaptive: bool = False  # move K within 1..2*draft_k from the acceptance of the last step
    lookahead_window: int = 5  # W: Jacobi window columns
    lookahead_ngram: int = 4  # N: n-gram size (N-1 window levels)
    lookahead_guesses: int = 5  # G: pool candidates verified per step
    prompt_lookup_tokens: int = 10  # most tokens proposed per step
    prompt_lookup_max_ngram: int = 3  # longest suffix looked up
    prompt_lookup_min_ngram: int = 1  # shortest suffix looked up
    # eagle3: auto (as tree=auto: (nodes, depth, topk) measured on the calibration prompts and this machine,
    # or plain decoding when nothing beats it) | fixed (eagle_nodes / eagle_depth / eagle_topk as given)
    eagle_tree: str = "auto"
    calibration_prompts: int = 8
    calibration_tokens: int = 48
    tree_budgets: List[int] = field(default_factory=lambda: [1, 2, 3, 4, 6, 8, 12, 16, 24, 32])
    out: Optional[str] = None  # default: <heads>/../eval
    progress_bar: bool = True
    # 1: one prompt at a time (the evaluation above) | B | [1,2,4,...]: batched evaluation (batch_eval)
    batch_size: Any = 1
    batch_rounds: int = 1  # batched evaluation: each batch decoded this many times per method, interleaved
    # batched evaluation: auto = the draft model's k and prompt lookup's chain length chosen per batch size
    # (up to draft_k / prompt_lookup_tokens; none where no length pays) | fixed = as set, at every batch size
    batch_chains: str = "auto"


@dataclass
class GenerateConfig(RuntimeConfig):
    prompt: Any = None  # a prompt, or a list of prompts decoded together: prompt=["...", "..."]
    prompts_file: Optional[str] = None  # several prompts: a JSONL (forms as medusa-eval prompts=) | code
    batch_size: Any = None  # several prompts: how many decode together (default: all of them)
    tree: str = "tree4"
    # EAGLE-3 heads: a medusa-eval's eagle3_tree.json / eagle3_lookup_tree.json (eagle_tree=auto's choice on
    # this machine): decode with that method and its settings (a batched evaluation's file: its setting per
    # batch size, which batches decode with); unset: the heads' default method with eagle_* keys (or fitted)
    eagle_tree: Optional[str] = None
    system: Optional[str] = None


def _load(cfg):
    import torch

    from .evaluation.tree_choice import auto_threads
    from .loading import load_medusa

    torch.set_num_threads(cfg.threads or auto_threads())
    if cfg.heads in ("???", ""):
        from .errors import UserError

        raise UserError("heads=<export directory> is required")
    device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    return load_medusa(cfg.heads, backbone=cfg.backbone, device=device, dtype=cfg.dtype,
                       trust_remote_code=cfg.trust_remote_code, apply_adapter=cfg.apply_adapter, kernels=cfg.kernels,
                       draft_weights=cfg.draft_weights)


def eval_methods(cfg) -> list[str]:
    """The methods an evaluation runs, from ``methods`` / ``compare``, the mode and whether heads exist."""
    from .errors import UserError
    from .methods import get, names
    from .methods.registry import check_methods, methods_for_heads

    if cfg.method is not None:
        raise UserError("method= is gone: give methods=[name, ...] (the baselines are added)")
    if cfg.methods is not None and cfg.compare:
        raise UserError("give one of methods= or compare=true")
    greedy = enum_value(cfg.mode) == "greedy"
    baselines = [x for x in names() if get(x).baseline and (greedy or not get(x).greedy_only)]
    spec = heads_spec(cfg)  # unreadable: every heads method, medusa by default (loading says what is wrong)
    usable = [] if not cfg.heads else methods_for_heads(spec) if spec is not None else \
        [x for x in names() if get(x).needs_heads]
    if cfg.compare:
        chosen = [x for x in names() if not get(x).baseline and (x in usable or not get(x).needs_heads)]
    elif cfg.methods is not None:
        chosen = [str(x) for x in (cfg.methods if not isinstance(cfg.methods, str) else cfg.methods.split(","))]
    elif cfg.heads:
        chosen = usable[:1]
    else:
        free = "|".join(x for x in names() if not get(x).needs_heads and not get(x).baseline)
        raise UserError(f"give heads=<export directory> to evaluate Medusa heads, or methods=[{free}] "
                        "(or compare=true) for the training-free methods")
    methods = check_methods(chosen + [b for b in baselines if b not in chosen])
    needing = [x for x in methods if get(x).needs_heads]
    if needing and not cfg.heads:
        raise UserError(f"method {needing[0]} needs heads=<export directory>")
    refused = [x for x in needing if x not in usable]
    if refused:  # e.g. methods=[medusa] with EAGLE-3 heads: one line before the backbone loads
        raise UserError(get(refused[0]).refuses(spec))
    return methods


def _load_eval(cfg, methods):
    """Backbone (+ heads when given) on the chosen device; without heads the backbone is ``backbone=``."""
    import torch

    from .backbone import load_backbone
    from .evaluation.tree_choice import auto_threads
    from .loading import kernel_plans_path
    from .runtime.draft_weights import check_draft_weights
    from .runtime.model import MedusaModel, apply_kernels, check_kernels

    check_kernels(cfg.kernels)
    check_draft_weights(cfg.draft_weights)
    if cfg.heads:  # the heads name their backbone; they are loaded (and checked) even if medusa does not run
        return _load(cfg)
    torch.set_num_threads(cfg.threads or auto_threads())
    device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    model, tok, _ = load_backbone(cfg.backbone or "embedded:smollm2", device=device, dtype=cfg.dtype,
                                  trust_remote_code=cfg.trust_remote_code)
    return apply_kernels(MedusaModel(model=model, tokenizer=tok, heads=None), cfg.kernels, kernel_plans_path())


def fit_eagle_keys(cfg, spec) -> None:
    """Set eagle_nodes / eagle_depth left unset to the drafter's fitted tree (``eagle3.fitted_tree``)."""
    from .methods.eagle3 import fitted_tree

    cfg.eagle_nodes, cfg.eagle_depth = fitted_tree(spec, cfg.eagle_nodes, cfg.eagle_depth, cfg.eagle_topk)


def _method_options(cfg, methods: list[str], spec) -> dict:
    """Each method's typed options from its keys (bad K / W / N -> one line before any model loads);
    ``spec``: the heads' (``heads_spec``), which unset eagle_* keys are fitted to and options are checked against."""
    from .methods.registry import options_from_keys

    fit_eagle_keys(cfg, spec)
    options = {meth: options_from_keys(meth, cfg) for meth in methods}
    check_options_fit(options, spec, cfg)   # the heads' config and the backbone's (not its weights)
    return options


def run_eval(cfg) -> dict:
    from omegaconf import OmegaConf

    from .evaluation.batch_eval import check_batchable, evaluate_batched
    from .evaluation.batch_reports import print_batched
    from .evaluation.evaluate import evaluate
    from .evaluation.reports import print_per_method, write_compare, write_report
    from .methods import get

    sampling, sizes = check_eval_keys(cfg)   # everything the config alone decides, before anything loads
    methods = eval_methods(cfg)
    options = _method_options(cfg, methods, heads_spec(cfg, strict=True))   # heads given: readable
    if sizes is not None:  # before the backbone loads: methods that cannot decode batches
        check_batchable(methods, sizes)
    prompts, calibration = eval_prompts(cfg, methods, options, sizes)
    tree = cfg.tree
    if any(get(x).needs_tree for x in methods):
        check_tree(cfg)  # before the backbone loads
        tree = _eval_tree_schedule(cfg, sizes) or tree
    out = eval_out_dir(cfg)
    m = _load_eval(cfg, methods)
    settings = OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else dict(vars(cfg))
    settings["backbone"] = settings.get("backbone") or ("embedded:smollm2" if not cfg.heads else None)
    settings["methods"] = methods
    if sizes is not None:
        report = evaluate_batched(m, prompts, methods=methods, batch_sizes=sizes, tree=tree,
                                  max_new_tokens=cfg.max_new_tokens, sampling=sampling,
                                  calibration_prompts=cfg.calibration_prompts, calibration_tokens=cfg.calibration_tokens,
                                  seed=cfg.seed, progress=cfg.progress_bar, settings=settings, options=options,
                                  rounds=cfg.batch_rounds, chains=cfg.batch_chains, calibration=calibration)
    else:
        report = evaluate(m, prompts, methods=methods, tree=cfg.tree, max_new_tokens=cfg.max_new_tokens,
                          sampling=sampling, turns=cfg.turns, calibration_prompts=cfg.calibration_prompts,
                          calibration_tokens=cfg.calibration_tokens, budgets=list(cfg.tree_budgets), seed=cfg.seed,
                          progress=cfg.progress_bar, settings=settings, options=options, calibration=calibration)
    spec = getattr(m.heads, "spec", None)
    if getattr(spec, "backbone_adapter", None) and m.adapter_applied:
        # Medusa-2 heads decode on the adapted backbone: say how far it is from the original.
        from .evaluation.drift import greedy_drift
        from .backbone import load_backbone
        from .runtime.model import MedusaModel

        original, _, _ = load_backbone(cfg.backbone or spec.base_model, device=m.device, dtype=cfg.dtype,
                                       trust_remote_code=cfg.trust_remote_code)
        ids = [m.encode_chat(p.turns[0]) for p in prompts[:8]]
        report["backbone_drift"] = greedy_drift(m, MedusaModel(model=original, tokenizer=None, heads=None), ids,
                                                cfg.max_new_tokens)
        print(f"backbone drift vs the original ({len(ids)} prompts): greedy token agreement "
              f"{report['backbone_drift']['greedy_token_agreement']:.1%}, identical answers "
              f"{report['backbone_drift']['identical_answers']:.1%}")
    paths = write_report(out, report)
    if cfg.compare:
        paths += write_compare(out, report)
    if (report.get("tree") or {}).get("choices"):
        from .runtime.tree import MedusaTree

        MedusaTree(report["tree"]["choices"], name=report["tree"]["name"]).save(out / "tree.json")
        paths.append(out / "tree.json")
    from .evaluation.eagle3_choice_file import write_choices
    from .evaluation.tree_schedule_file import write_tree_schedule

    # eagle_tree=auto's choices (batched: per batch size), for medusa-generate eagle_tree=<file>; a batched
    # evaluation's Medusa trees per batch size, for medusa-generate tree=<file>
    fingerprint = getattr(spec, "base_model_fingerprint", "") or ""   # the loaded heads'
    choices = write_choices(out, report, fingerprint)
    trees = write_tree_schedule(out, report, fingerprint) if sizes is not None else None
    paths += list(choices.values()) + ([trees] if trees else [])
    print()
    if sizes is not None:
        print_batched(report["batched"])
    print_per_method(report)
    print("report: " + ", ".join(str(p) for p in paths))
    batches = " prompts_file=<prompts.jsonl> batch_size=<B>" if sizes is not None else ""
    for method, path in choices.items():
        print(f"decode with {method}'s choice: medusa-generate heads={cfg.heads}{batches} eagle_tree={path}")
    if trees:
        print(f"decode with these trees: medusa-generate heads={cfg.heads}{batches} tree={trees}")
    return report


def _eval_tree_schedule(cfg, sizes):
    """A batched evaluation's tree_schedule.json given as ``tree=``: the schedule to measure again (batched), or
    one clear line (one prompt at a time needs one tree); None for any other tree."""
    from .errors import UserError
    from .evaluation.tree_schedule_file import is_tree_schedule, read_tree_schedule

    if not is_tree_schedule(cfg.tree):
        return None
    if sizes is None:
        raise UserError(f"tree={cfg.tree} holds a tree per batch size: evaluate it batched (batch_size=[...]) or "
                        "give one tree (tree.json, a name or choices)")
    spec = heads_spec(cfg)
    if spec is None:
        raise UserError(f"tree={cfg.tree} is for the Medusa-family heads it was measured with: give heads=")
    return read_tree_schedule(cfg.tree, spec)


def eagle_tree_choice(cfg, spec, method: str):
    """(the method to decode with, the ``Choice`` read or None) for medusa-generate's ``eagle_tree``: a file
    medusa-eval wrote sets the method and its eagle_* keys on ``cfg``; ``auto`` is refused (an evaluation's to
    make); before the backbone loads."""
    from .errors import UserError
    from .methods.registry import methods_for_heads

    if cfg.eagle_tree == "auto":
        raise UserError("eagle_tree=auto is chosen by an evaluation (medusa-eval ... eagle_tree=auto); decode "
                        "with its choice: eagle_tree=<eval dir>/eagle3_lookup_tree.json (or eagle3_tree.json)")
    if cfg.eagle_tree in (None, "fixed"):
        return method, None
    from .evaluation.eagle3_choice_file import read_choice

    if spec is None or spec.kind != "eagle3":
        raise UserError("eagle_tree=<file> is for EAGLE-3 heads (medusa-eval's eagle3_tree.json); "
                        "Medusa-family heads take the evaluation's tree.json as tree=<file>")
    choice = read_choice(cfg.eagle_tree, spec, methods_for_heads(spec))
    for key, value in choice.settings.items():
        setattr(cfg, key, value)
    return choice.method, choice


def run_generate(cfg) -> None:
    from .errors import UserError
    from .evaluation.tree_schedule_file import is_tree_schedule, read_tree_schedule
    from .methods import get
    from .methods import stream as decode_stream
    from .methods.registry import batched_names, methods_for_heads, options_from_keys
    from .runtime.batch_decode import check_batch_size

    texts, several = generate_prompts(cfg)
    sampling = check_decoding_keys(cfg)   # before anything loads, as every check below
    size = check_batch_size(cfg.batch_size) if cfg.batch_size is not None else None
    if cfg.heads in ("???", ""):
        raise UserError("heads=<export directory> is required")
    spec = heads_spec(cfg)
    method = methods_for_heads(spec)[0] if spec is not None else "medusa"  # eagle3_lookup for EAGLE-3 heads
    method, choice = eagle_tree_choice(cfg, spec, method)
    cfg.eagle_tree = "fixed"   # the options' own key: a file has been read into eagle_* keys above
    fit_eagle_keys(cfg, spec)
    batching = get(method).batch_decoder is not None
    if size is not None and size > 1 and not batching:
        raise UserError(f"method {method} (these heads) decodes one prompt at a time: drop batch_size "
                        f"(methods that decode batches: {', '.join(batched_names())})")
    tree = {"tree": cfg.tree} if get(method).needs_tree else {}
    options = options_from_keys(method, cfg)  # bad eagle_* keys: one line before the backbone loads
    check_options_fit({method: options}, spec, cfg)
    together = several and batching   # prompts decoded in batches: a batched evaluation's schedule applies
    if choice is not None and choice.schedule is not None:   # a batched evaluation's choice per batch size
        from dataclasses import replace

        from .evaluation.eagle3_choice_file import eagle3_schedule

        options = replace(options, schedule=eagle3_schedule(method, choice.schedule, cfg))
        if choice.plain_alone and not together:   # the evaluation found plain decoding best at batch 1
            method, options = "autoregressive", None
    if tree and is_tree_schedule(cfg.tree):   # a batched evaluation's Medusa tree per batch size
        schedule = read_tree_schedule(cfg.tree, spec)   # every tree checked against the heads
        tree = {"tree": schedule if together else schedule.choices[min(schedule.choices)]}
        if tree["tree"] is None:   # plain decoding won at batch 1
            method, tree, options = "autoregressive", {}, None
    elif tree:
        check_tree(cfg)  # before the backbone loads
    sized = (choice is not None and choice.schedule is not None) or (tree and is_tree_schedule(cfg.tree))
    if together and method != "autoregressive" and not sized:
        print(f"note: every batch speculates as one prompt would; on a CPU that stops paying from 2-4 rows "
              f"(BENCHMARKS.md): medusa-eval heads={cfg.heads} batch_size=[1,2,4,...] measures it per batch size "
              f"and writes the file to decode batches with", file=sys.stderr)
    m = _load(cfg)
    ids = encode_prompts(m, texts, cfg)   # every prompt fits the backbone's positions before any is decoded
    if several:
        generate_several(m, texts, ids, method, size or len(ids), batching, options, sampling, cfg, tree)
        return
    stream = decode_stream(m, ids[0], method, options=options, max_new_tokens=cfg.max_new_tokens,
                           sampling=sampling, seed=cfg.seed, **tree)
    shown, tokens = "", []
    for chunk in stream:  # decode the whole answer each time: multi-byte characters span tokens
        tokens += chunk
        text = m.tokenizer.decode(tokens, skip_special_tokens=True)
        sys.stdout.write(text[len(shown):])
        sys.stdout.flush()
        shown = text
    out = stream.result
    print(f"\n\n[{len(out.tokens)} tokens, tau {out.tau:.2f}, {out.tokens_per_s:.1f} tokens/s, "
          f"finish: {out.finish_reason}]", file=sys.stderr)


def generate_several(m, texts: list[str], ids: list[list[int]], method: str, size: int, batching: bool, options,
                     sampling, cfg, tree: dict) -> None:
    """Decode several prompts, ``size`` at a time with ``generate_batch`` when the method batches (one at
    a time otherwise); print each answer under its prompt's number, and each batch's numbers on stderr."""
    from .methods import generate, generate_batch

    for start in range(0, len(ids), size if batching else 1):
        rows = ids[start:start + (size if batching else 1)]
        if batching:
            out = generate_batch(m, rows, method, options=options, max_new_tokens=cfg.max_new_tokens,
                                 sampling=sampling, seed=cfg.seed, **tree)
            outs, secs, tau = out.rows, out.prefill_s + out.decode_s, out.tau
        else:
            g = generate(m, rows[0], method, options=options, max_new_tokens=cfg.max_new_tokens, sampling=sampling,
                         seed=cfg.seed, **tree)
            outs, secs, tau = [g], g.prefill_s + g.decode_s, g.tau
        for i, g in enumerate(outs, start=start + 1):
            head = " ".join(texts[i - 1].split())
            print(f"=== [{i}/{len(ids)}] {head[:70] + ('...' if len(head) > 70 else '')}")
            print(m.tokenizer.decode(g.tokens, skip_special_tokens=True))
            print(f"[{len(g.tokens)} tokens, tau {g.tau:.2f}, finish: {g.finish_reason}]\n", flush=True)
        tokens = sum(len(g.tokens) for g in outs)
        print(f"[{'batch of ' + str(len(outs)) if batching else 'prompt ' + str(start + 1)}: {tokens} tokens in "
              f"{secs:.2f} s, {tokens / secs if secs > 0 else 0:.1f} tokens/s, tau {tau:.2f}]", file=sys.stderr,
              flush=True)


def eval_help() -> str:
    """``medusa-eval --help``: the module docstring and the registered methods (imports the runtime)."""
    from .methods.registry import describe

    return __doc__.strip() + "\n\nmedusa-eval methods ([their keys]):\n" + describe() + "\n"


def eval_main(argv: Optional[list[str]] = None) -> None:
    run_cli("medusa-eval", eval_help(), EvalConfig, run_eval, argv)


def generate_main(argv: Optional[list[str]] = None) -> None:
    run_cli("medusa-generate", __doc__, GenerateConfig, run_generate, argv)
