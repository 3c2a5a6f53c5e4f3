"""``medusa-export``: write trained heads in the layout a serving engine loads.

    medusa-export heads=runs/a/heads format=vllm out=runs/a/vllm
    medusa-export heads=runs/a/heads format=tgi out=runs/a/tgi base_model=HuggingFaceTB/SmolLM2-135M-Instruct
    medusa-export heads=runs/a/heads format=tensorrt_llm out=runs/a/trtllm materialize=true dtype=float16
    medusa-export heads=downloaded/medusa-vicuna-7b-v1.3 format=vllm out=vicuna-medusa-vllm overwrite=true
    medusa-export heads=runs/e/heads format=eagle3 out=runs/e/eagle3 base_model=meta-llama/Llama-3.1-8B-Instruct

User mistakes print one line and exit 2, like the other commands (no argument at all too: --help lists the
keys); the keys alone are checked here, before torch loads (the export itself: export_run.py). Each key is declared
once below (``cli_keys.declared_key``: its default and its help), and --help lists them from there.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from typing import Optional

from .cli_keys import command_keys_help, declared_key as _key
from .cli_support import run_cli
from .errors import UserError
from .formats import FORMATS, MATERIALIZE_UNREAD, MATERIALIZING_FORMATS

DTYPES = ("keep", "float32", "float16", "bfloat16")


@dataclass
class ExportConfig:
    """The command's keys, each declared once with its default and its --help line (``export_help``)."""

    heads: str = _key("???", "a heads export, or a reference-Medusa / TGI / vLLM Medusa / mlp_speculator / EAGLE-3 "
                      "dir (re-export)")
    format: str = _key("???", "vllm | tensorrt_llm | tgi | medusa_v1 | eagle3 (EAGLE-3 drafters, for vLLM, SGLang "
                       "and TensorRT-LLM); MLP speculators: vllm (its V0 engine) or tgi")
    out: str = _key("???", "the folder written, atomically; never the heads= folder, a folder holding it or one "
                    "inside it")
    overwrite: bool = _key(False, "replace a non-empty out=, and only if it is a previous export (an engine "
                           "layout's config.json and only the files exports write, no subfolders)")
    materialize: bool = _key(False, "expand shared / truncated projections into full per-head ones (needed by "
                             "tensorrt_llm, medusa_v1, tgi with >1 layer, MLP speculators; vllm and tgi then write "
                             "them too); prints the size cost; eagle3 refuses it")
    backbone: Optional[str] = _key(None, "the target the heads are checked against before anything is written "
                                   "(its config: hidden size, vocabulary, fingerprint, EAGLE-3 aux layers), where "
                                   "the lm_head of shared heads is read, and for tgi the attention head size its "
                                   "launcher needs (unset: the heads' base model, checked when its config can be "
                                   "read)")
    base_model: Optional[str] = _key(None, "the base model written into the engine config, a hub id or path the "
                                     "engine can load (unset: the heads' own; for heads trained with a LoRA adapter "
                                     "on the backbone, <run>/merged, else required)")
    dtype: str = _key("keep", "keep | float16 | bfloat16 | float32")
    trust_remote_code: bool = _key(False, "run the backbone's own modelling code (reading its config, tokenizer "
                                   "or lm_head)")


def export_help() -> str:
    """``medusa-export --help``: the module docstring and every key with its default (``command_keys_help``,
    read from ``ExportConfig``), each wrapped to 120 columns."""
    lines = [textwrap.fill(line, 120, subsequent_indent=" " * 6) for line in
             command_keys_help(ExportConfig).splitlines()]
    return __doc__.strip() + "\n\nmedusa-export keys:\n" + "\n".join(lines) + "\n"


def check_keys(cfg) -> None:
    """What the keys alone decide, refused before anything loads: a typo should cost nothing."""
    for key in ("heads", "format", "out"):
        if getattr(cfg, key) in ("???", "", None):
            raise UserError(f"{key}= is required (see medusa-export --help)")
    if cfg.format not in FORMATS:
        raise UserError(f"unknown format {cfg.format!r}: choose one of {', '.join(FORMATS)}")
    if cfg.materialize and cfg.format not in MATERIALIZING_FORMATS:
        raise UserError(MATERIALIZE_UNREAD.format(format=cfg.format))
    if cfg.dtype not in DTYPES:
        raise UserError(f"dtype must be one of {', '.join(DTYPES)}, got {cfg.dtype!r}")


def _export(cfg) -> None:
    check_keys(cfg)
    from .export_run import run_export   # lazy: torch, the heads and the formats load only once the keys are accepted

    run_export(cfg)


def export_main(argv: Optional[list[str]] = None) -> None:
    # no argument is a mistake like any missing key (one line, exit 2), as in medusa-eval / medusa-generate
    run_cli("medusa-export", export_help, ExportConfig, _export, argv)
