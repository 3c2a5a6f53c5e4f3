"""What ``medusa-eval`` and ``medusa-generate`` refuse before the backbone loads.

A backbone takes seconds to minutes to load, behind its progress bars; a mistake that the keys, the heads'
config.json or the prompts file already show is refused first, in one line. Each rule lives with its concept
(sampling: ``runtime.verify.SamplingConfig``; a method's keys: its options class, which also checks them
against the heads' config, ``check_spec``; evaluation settings: ``evaluation.evaluate.check_settings``; batch
sizes: ``evaluation.batch_eval``; the report folder: ``evaluation.reports``); this module gathers what each
command needs from its config. Its imports are made where they are used, so ``--help`` stays fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from .errors import UserError


def sampling_config(cfg):
    """The decoding mode's settings (``SamplingConfig`` refuses a bad mode, temperature, top_p ...)."""
    from .runtime.verify import SamplingConfig

    return SamplingConfig(mode=cfg.mode, temperature=cfg.temperature if cfg.mode != "greedy" else 1.0,
                          top_k=cfg.top_k, top_p=cfg.top_p, typical_epsilon=cfg.typical_epsilon,
                          typical_delta=cfg.typical_delta)


def check_decoding_keys(cfg):
    """The keys both commands decode with: threads, max_new_tokens, the sampling settings (returned)."""
    for key, low, what in (("threads", 0, " (0: one per idle core)"), ("max_new_tokens", 1, "")):
        value = getattr(cfg, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise UserError(f"{key} must be an integer >= {low}{what}, got {value!r}")
    return sampling_config(cfg)


def heads_spec(cfg, strict: bool = False):
    """The spec of the heads in ``cfg.heads`` (config only), or None when there are none or (not ``strict``)
    it cannot be read here; ``strict``: an unreadable directory refused in one line."""
    from .loading import read_heads_spec_for

    if not cfg.heads or cfg.heads == "???":
        return None
    try:
        return read_heads_spec_for(cfg.heads, cfg.backbone, trust_remote_code=cfg.trust_remote_code)
    except UserError:
        if strict:
            raise
        return None


def check_options_fit(options: dict, spec, cfg) -> None:
    """What each method's options can tell from the heads' config alone (EAGLE-3: top-k within the drafter's
    outputs) and from the backbone's (``backbone_config``: a self:N draft within its layers), and
    max_new_tokens within its positions; ``check_model`` / the decoders say it again once loaded."""
    from .runtime.decode import check_positions

    for opts in options.values():
        check = getattr(opts, "check_spec", None)
        if check is not None and spec is not None:
            check(spec)
    config = backbone_config(cfg, spec)
    if config is None:
        return
    check_positions(config, cfg.max_new_tokens)
    for opts in options.values():
        check = getattr(opts, "check_backbone", None)
        if check is not None:
            check(config)


def backbone_config(cfg, spec):
    """The config (not the weights) of the backbone the command loads: ``backbone=``, else the one the heads
    record, else (no heads) embedded:smollm2; None when it cannot be read here (the load says why)."""
    from .backbone import load_backbone_config

    name = cfg.backbone or getattr(spec, "base_model", None) or (None if cfg.heads else "embedded:smollm2")
    if not name or str(name).startswith("random:"):
        return None
    try:
        return load_backbone_config(str(name), trust_remote_code=cfg.trust_remote_code)
    except (UserError, OSError, ValueError):
        return None


def encode_prompts(m, texts: list[str], cfg) -> list[list[int]]:
    """medusa-generate's prompts encoded, every one checked to fit the backbone's positions with max_new_tokens
    before any is decoded."""
    from .runtime.decode import check_budget

    ids = [m.encode_chat(t, system=cfg.system) for t in texts]
    for i, row in enumerate(ids, start=1):
        check_budget(m, len(row), cfg.max_new_tokens, what=f"prompt {i} of {len(ids)}" if len(ids) > 1 else "prompt")
    return ids


def check_tree(cfg) -> None:
    """Refuse a tree the heads cannot draft (deeper than the heads, more ranks than their outputs, an empty
    tree file) from the heads' config.json alone. ``auto`` / ``calibrated:N`` are grown from the heads
    themselves and always fit."""
    from .evaluation.tree_schedule_file import is_tree_schedule, read_tree_schedule
    from .loading import read_heads_spec_for
    from .runtime.tree import resolve_tree

    if not cfg.heads or cfg.tree == "auto" or str(cfg.tree).startswith("calibrated:"):
        return
    spec = read_heads_spec_for(cfg.heads, cfg.backbone, trust_remote_code=cfg.trust_remote_code)
    if is_tree_schedule(cfg.tree):   # a batched evaluation's tree per batch size: every tree checked
        read_tree_schedule(cfg.tree, spec)
        return
    tree = resolve_tree(cfg.tree, spec.num_heads)
    outputs = getattr(spec, "output_size", 0) or spec.vocab_size or 0
    tree.check_fits(spec.num_heads, outputs or 1 << 30)


def check_eval_keys(cfg):
    """(sampling settings, batch sizes or None: one prompt at a time) of an evaluation, every key the
    config alone decides checked: decoding, batching, calibration, tree budgets, turns."""
    from .evaluation.batch_eval import CHAIN_SIZING, parse_batch_sizes
    from .evaluation.evaluate import check_settings

    sampling = check_decoding_keys(cfg)
    check_settings(max_new_tokens=cfg.max_new_tokens, turns=cfg.turns, calibration_prompts=cfg.calibration_prompts,
                   calibration_tokens=cfg.calibration_tokens, budgets=list(cfg.tree_budgets), tree=cfg.tree)
    sizes = parse_batch_sizes(cfg.batch_size)
    if isinstance(cfg.batch_rounds, bool) or not isinstance(cfg.batch_rounds, int) or cfg.batch_rounds < 1:
        raise UserError(f"batch_rounds must be an integer >= 1, got {cfg.batch_rounds!r}")
    if cfg.batch_chains not in CHAIN_SIZING:
        raise UserError(f"batch_chains must be one of {', '.join(CHAIN_SIZING)}, got {cfg.batch_chains!r}")
    if sizes is not None and cfg.compare:
        raise UserError("compare=true measures one prompt at a time: with batch_size give methods=[...]")
    if sizes is not None and cfg.turns != "first":
        raise UserError("batch_size decodes first turns only: drop turns= or batch_size=")
    return sampling, sizes


def eval_prompts(cfg, methods: list[str], options: dict, sizes: Optional[list[int]]):
    """(the prompts evaluated, the calibration prompts or None when nothing calibrates); batch sizes above
    the prompts evaluated refused (they would be reported as measured, but never were)."""
    from .evaluation.batch_eval import check_sizes_measured
    from .evaluation.evaluate import EAGLE3_TREE_METHODS
    from .evaluation.prompts import load_prompts, select_prompts
    from .methods import get

    prompts = load_prompts(cfg.prompts)
    wanted = cfg.num_prompts
    if wanted is not None and (isinstance(wanted, bool) or not isinstance(wanted, int) or wanted < 1):
        raise UserError(f"num_prompts must be >= 1, got {wanted}")
    calibrating = ((cfg.tree == "auto" or str(cfg.tree).startswith("calibrated:"))
                   and any(get(x).needs_tree for x in methods)) or (
        any(x in methods and options[x].tree == "auto" for x in EAGLE3_TREE_METHODS)) or (
        sizes is not None and cfg.batch_chains == "auto" and any(get(x).chain is not None for x in methods))
    evaluated, calibration = select_prompts(prompts, wanted, cfg.calibration_prompts) if calibrating else \
        (prompts[:wanted] if wanted is not None else prompts, None)
    if sizes is not None:
        check_sizes_measured(sizes, len(evaluated))
    return evaluated, calibration


def eval_out_dir(cfg) -> Path:
    """The folder an evaluation writes its report to (default: beside the heads), checked writable."""
    from .evaluation.reports import check_report_dir

    name = "compare" if cfg.compare else "eval"
    out = Path(cfg.out) if cfg.out else Path(cfg.heads).resolve().parent / name if cfg.heads else Path("runs") / name
    check_report_dir(out)
    return out


def generate_prompts(cfg) -> tuple[list[str], bool]:
    """(the prompts, whether several were asked for: prompt=[...], prompts_file= or batch_size=)."""
    given = cfg.prompt
    if cfg.prompts_file is not None:
        if given is not None:
            raise UserError("give one of prompt= or prompts_file=")
        from .evaluation.prompts import load_prompts

        return [p.turns[0] for p in load_prompts(cfg.prompts_file)], True
    if isinstance(given, (int, float)) and not isinstance(given, bool):
        given = str(given)
    if isinstance(given, str) or given is None:
        if not (given or "").strip():
            raise UserError('prompt="..." is required and must not be empty')
        return [given], cfg.batch_size is not None
    if not hasattr(given, "__iter__") or hasattr(given, "keys"):
        raise UserError('prompt must be text or a list of texts (quote a prompt holding ": ", e.g. '
                        'prompt="\"Write: a poem\"")')
    texts = list(given)
    if not texts:
        raise UserError('prompt="..." is required and must not be empty')
    for i, t in enumerate(texts, start=1):
        if not isinstance(t, str) or not t.strip():
            raise UserError(f"prompt {i} of {len(texts)} is {'empty' if isinstance(t, str) else 'not text'}")
    return texts, True
