"""Apply a LoRA adapter (peft's file format) to a loaded backbone, without depending on peft.

Medusa-2 exports (``medusa_train/lora.py``) put the adapter the heads were trained with in
``<heads>/adapter/`` and name it in the heads config (``backbone_adapter``): heads trained
jointly with an adapter only accept well on the adapted backbone. The runtime merges it in
place: for every adapted linear layer ``W += scale * B @ A`` with ``scale = lora_alpha / r``
(``lora_alpha / sqrt(r)`` with ``use_rslora``), which is what ``merge_and_unload`` computes.
The merged weights are used for decoding and for the speedup baselines alike, so the
comparison stays between two runs of the same (fine-tuned) model.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from ..errors import UserError

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"


def read_adapter(adapter_dir) -> tuple[dict, dict[str, torch.Tensor]]:
    d = Path(adapter_dir)
    if not (d / CONFIG).is_file() or not (d / WEIGHTS).is_file():
        raise UserError(f"{d} is not a LoRA adapter directory (needs {CONFIG} and {WEIGHTS})")
    try:
        cfg = json.loads((d / CONFIG).read_text())
        tensors = load_file(str(d / WEIGHTS))
    except (json.JSONDecodeError, SafetensorError, OSError, ValueError) as e:
        raise UserError(f"adapter in {d} is corrupt or unreadable ({e})") from None
    if cfg.get("peft_type", "LORA") != "LORA":
        raise UserError(f"adapter in {d} is a {cfg.get('peft_type')} adapter; only LoRA can be applied")
    return cfg, tensors


@torch.no_grad()
def merge_lora(model, adapter_dir, adapter: Optional[tuple[dict, dict[str, torch.Tensor]]] = None) -> int:
    """Merge the adapter into ``model``'s linear weights in place; returns the number of layers. ``adapter``:
    ``read_adapter(adapter_dir)``'s result when the caller already read it (else it is read here)."""
    cfg, tensors = adapter if adapter is not None else read_adapter(adapter_dir)
    r = int(cfg["r"])
    alpha = float(cfg.get("lora_alpha", r))
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    fan_in_fan_out = bool(cfg.get("fan_in_fan_out"))
    modules = dict(model.named_modules())
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    merged = 0
    for key, a in tensors.items():
        if not key.endswith(".lora_A.weight"):
            continue
        path = key.removesuffix(".lora_A.weight").removeprefix("base_model.model.")
        b = tensors.get(key.replace(".lora_A.", ".lora_B."))
        layer = modules.get(path)
        if b is None or layer is None or not hasattr(layer, "weight"):
            raise UserError(f"adapter in {adapter_dir} adapts {path!r}, which this backbone does not have")
        if emb is not None and layer.weight is emb.weight:   # the change would move the input embedding too
            raise UserError(f"adapter in {adapter_dir} adapts {path!r}, whose weight this backbone ties to its input "
                            "embedding: it cannot be merged as trained")
        delta = (b.float() @ a.float()) * scale
        if fan_in_fan_out:
            delta = delta.T
        if tuple(delta.shape) != tuple(layer.weight.shape):
            raise UserError(f"adapter layer {path!r} has shape {tuple(delta.shape)}, the backbone's is "
                            f"{tuple(layer.weight.shape)}")
        layer.weight.add_(delta.to(layer.weight.dtype))
        merged += 1
    if merged == 0:
        raise UserError(f"adapter in {adapter_dir} holds no LoRA layers")
    return merged
