"""``medusa-export``: write trained heads in the layout a serving engine loads.

    medusa-export heads=runs/a/heads format=vllm out=runs/a/vllm
    medusa-export heads=runs/a/heads format=tgi out=runs/a/tgi base_model=HuggingFaceTB/SmolLM2-135M-Instruct
    medusa-export heads=runs/a/heads format=tensorrt_llm out=runs/a/trtllm materialize=true dtype=float16
    medusa-export heads=downloaded/medusa-vicuna-7b-v1.3 format=vllm out=vicuna-medusa-vllm overwrite=true
    medusa-export heads=runs/e/heads format=eagle3 out=runs/e/eagle3 base_model=meta-llama/Llama-3.1-8B-Instruct

Keys:
  heads=DIR         a heads export, or a reference-Medusa / TGI / vLLM Medusa / EAGLE-3 dir (re-export)
  format=NAME       vllm | tensorrt_llm | tgi | medusa_v1 | eagle3 (EAGLE-3 drafters, for vLLM and SGLang)
  out=DIR           written atomically; a non-empty DIR is refused unless overwrite=true, and even then
                    unless it is a previous export (a config.json and files, no subfolders); never
                    the heads= folder, a folder holding it or one inside it
  materialize=BOOL  expand shared / truncated projections into full per-head ones for formats
                    that need them (tensorrt_llm, medusa_v1, tgi with >1 layer); prints the size cost
  backbone=NAME     the target the heads are checked against before anything is written (its config:
                    hidden size, vocabulary, fingerprint, EAGLE-3 aux layers), where the lm_head of
                    shared heads is read, and for tgi the attention head size its launcher needs
                    (default: the heads' base model, checked when its config can be read)
  base_model=NAME   the base model written into the engine config (default: the heads' own);
                    use a hub id or path the engine can load
  dtype=NAME        keep (default) | float16 | bfloat16 | float32

User mistakes print one line and exit 2, like the other commands.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Optional

from .cli_support import run_cli


@dataclass
class ExportConfig:
    heads: str = "???"
    format: str = "???"
    out: str = "???"
    overwrite: bool = False
    materialize: bool = False
    backbone: Optional[str] = None
    base_model: Optional[str] = None
    dtype: str = "keep"
    trust_remote_code: bool = False


def run_export(cfg) -> None:
    import warnings
    from pathlib import Path

    import torch

    from .errors import UserError
    from .loading import export_target, load_heads
    from .formats import FORMATS
    from .formats.export import ExportOptions, FormatWarning, check_out_dir, export_heads, exporter_for, megabytes

    for key in ("heads", "format", "out"):
        if getattr(cfg, key) in ("???", "", None):
            raise UserError(f"{key}= is required (see medusa-export --help)")
    if cfg.format not in FORMATS:  # before any loading: a typo should cost nothing
        raise UserError(f"unknown format {cfg.format!r}: choose one of {', '.join(FORMATS)}")
    dtypes = {"keep": None, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    if cfg.dtype not in dtypes:
        raise UserError(f"dtype must be one of {', '.join(dtypes)}, got {cfg.dtype!r}")
    src, out = Path(cfg.heads), Path(cfg.out)
    check_out_dir(out, cfg.overwrite, source=src)   # never the heads' own folder, one above or inside it

    with warnings.catch_warnings(record=True) as caught:  # one line each, not Python's two-line warnings
        warnings.simplefilter("always", FormatWarning)
        # The native loader's errors for a dir that is no heads at all, then the registry's for a
        # kind this format has no exporter for, before anything is loaded; the target's config (from
        # backbone= or the heads' own base model) so heads made for another target are refused.
        first, target = export_target(src, cfg.backbone, trust_remote_code=cfg.trust_remote_code)
        exporter_for(cfg.format, first.kind)
        # Shared heads get an empty placeholder here: the backbone's lm_head is read below only if
        # the chosen format needs it (vLLM copies it, materialisation expands it; TGI v2 does not).
        # Likewise an empty input-embedding table for drafters that borrow the backbone's (EAGLE-3):
        # no format stores it, so an export never reads it.
        heads = load_heads(src, backbone_config=target, lm_head_weight=torch.empty(0),
                           input_embeddings=torch.empty(0))
    for message in dict.fromkeys(str(w.message) for w in caught):  # spec + load both see the same dir
        print(f"medusa-export: warning: {message}", file=sys.stderr)
    spec = heads.spec

    loaded = {} if target is None else {"config": target}

    def backbone_lm_head():
        if "w" not in loaded:
            from .heads.spec import check_compatible
            from .backbone import load_backbone

            name = cfg.backbone or spec.base_model
            if not name:
                raise UserError(f"heads in {src} do not record their backbone; pass backbone=")
            print(f"reading the lm_head of {name} ...", file=sys.stderr)
            # dtype "auto": the checkpoint's own dtype (a 7B model in bf16 needs half the memory of
            # fp32); the matrix is then cast to the heads' dtype, losslessly for bf16/fp16 -> fp32.
            model, _, _ = load_backbone(name, dtype="auto", trust_remote_code=cfg.trust_remote_code)
            if not spec.vocab_size:  # TGI-v2 dir without vocab_size: the backbone's vocabulary
                spec.vocab_size = model.config.vocab_size
            check_compatible(spec, model.config, where=f"heads in {src}")
            loaded.setdefault("config", model.config)
            heads_dtype = next((p.dtype for p in heads.parameters()), torch.float32)
            loaded["w"] = model.get_output_embeddings().weight.detach().to(heads_dtype).clone()
        return loaded["w"]

    def backbone_config():
        """The backbone's config without its weights (None when it cannot be read: a note says so)."""
        if "config" not in loaded:
            loaded["config"] = _read_backbone_config(cfg.backbone or spec.base_model, cfg.trust_remote_code)
        return loaded["config"]

    options = ExportOptions(materialize=cfg.materialize, lm_head=backbone_lm_head,
                            base_model=cfg.base_model or "", dtype=dtypes[cfg.dtype],
                            backbone_config=backbone_config)
    result = export_heads(heads, cfg.format, out, overwrite=cfg.overwrite, options=options)
    for note in result.notes:
        print(note)
    base = cfg.base_model or spec.base_model
    if not base or ":" in base.split("/")[0]:
        print(f"note: the config records base model {base!r}, which engines cannot load: "
              "pass base_model=<hub id or path>")
    print(f"wrote {result.path} ({', '.join(result.files)}; weights {megabytes(result.weight_bytes)})")


def _read_backbone_config(name: Optional[str], trust_remote_code: bool):
    """A transformers config for ``name`` (local dir, hub id or ``embedded:``), or None."""
    from .errors import UserError

    if not name or name.startswith("random:"):
        return None
    try:
        from transformers import AutoConfig

        from .assets import resolve_backbone_path

        path, _ = resolve_backbone_path(name)
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, UserError):
        return None


def export_main(argv: Optional[list[str]] = None) -> None:
    run_cli("medusa-export", __doc__, ExportConfig, run_export, argv, help_when_empty=True)
