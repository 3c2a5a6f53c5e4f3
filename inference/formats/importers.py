"""Recognise a foreign heads directory and load it as ``MedusaHeads``: the runtime's entry point.

``inference.heads.read_heads_spec`` / ``load_heads`` call ``detect_layout`` first and hand a
foreign directory to ``read_foreign_spec`` / ``import_heads``; anything else stays with the
native loader and its own errors. Layouts:

  reference  ``medusa_lm_head.safetensors`` or ``medusa_lm_head.pt`` (+ config.json): reference
             Medusa, TensorRT-LLM and TGI v1 (per-head projections) or TGI v2 (shared lm_head)
  vllm       config.json with ``model_type: medusa`` + safetensors (vLLM's Medusa drafter)
  vllm_mlp_speculator  config.json with ``model_type: mlp_speculator`` (vLLM / IBM fms-extras)

The backbone of imported heads is their config's ``base_model_name_or_path`` when present;
otherwise ``load_medusa`` asks for ``backbone=`` (its "do not record their backbone" error).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from ..errors import UserError
from ..heads import HeadsSpec, MedusaHeads, check_compatible
from . import mlp_speculator, reference, vllm


def detect_layout(heads_dir) -> Optional[str]:
    """"reference", "vllm", or None (not a foreign layout: the native loader decides)."""
    d = Path(heads_dir)
    if not d.is_dir():
        return None
    if reference.is_reference_dir(d):
        return "reference"
    if vllm.is_vllm_dir(d):
        return "vllm"
    if mlp_speculator.is_mlp_speculator_dir(d):
        return "vllm_mlp_speculator"
    return None


def _module(d: Path):
    layout = detect_layout(d)
    if layout is None:
        raise UserError(f"{d} is neither a heads export nor a reference-Medusa / TGI / vLLM Medusa directory")
    return {"reference": reference, "vllm": vllm, "vllm_mlp_speculator": mlp_speculator}[layout]


def read_foreign_spec(heads_dir) -> HeadsSpec:
    d = Path(heads_dir)
    return _module(d).read_spec(d)


def import_heads(heads_dir, backbone_config=None, lm_head_weight: Optional[torch.Tensor] = None,
                 device="cpu", dtype: Optional[torch.dtype] = None) -> MedusaHeads:
    """Load a foreign directory as ``MedusaHeads``, with the checks ``load_heads`` makes for ours."""
    d = Path(heads_dir)
    module = _module(d)
    spec = module.read_spec(d)
    if not spec.vocab_size:  # TGI v2 without vocab_size in its config: the backbone's vocabulary
        known = backbone_config.vocab_size if backbone_config is not None else \
            lm_head_weight.shape[0] if lm_head_weight is not None else 0
        spec.vocab_size = int(known)
    if backbone_config is not None:
        check_compatible(spec, backbone_config, where=f"heads in {d}")
    heads, own_lm_head = module.load(d, spec)
    if spec.projection == "shared":
        # A vLLM dir carries its own lm_head copy: run what the engine would run.
        weight = own_lm_head if own_lm_head is not None else lm_head_weight
        if weight is None:
            raise UserError(f"heads in {d} share the backbone lm_head: pass the backbone to load them")
        heads.attach_lm_head(weight)
    if dtype is not None:
        heads.to(dtype=dtype)
    return heads.to(device).eval()
