"""vLLM's Medusa drafter directory: export our heads to it, import one into ``MedusaHeads``.

Read from vLLM's own loader (vllm-project/vllm):
  vllm/model_executor/models/medusa.py        (commit 01dbb08195ca9c70ac9044786a906a353e07fcdf)
  vllm/transformers_utils/configs/medusa.py   (commit 0531c2226a6a25cd96ccc856f3bda3f0bb4efb5f)
  vllm/v1/spec_decode/medusa.py               (commit 055e47c28003156421365af985d676fc921cb075)

What that loader does, and what this module therefore writes:
  * config ``model_type: "medusa"`` (vLLM picks the Medusa drafter from it), ``hidden_size``,
    ``vocab_size``, ``num_heads``, ``num_hidden_layers`` (layers per head), ``truncated_vocab_size``
    (defaults to vocab_size), ``medusa_fc_bias`` (without it the block Linears have no bias and
    ours would be dropped), ``original_lm_head`` (one ``lm_head`` shared by all heads).
    ``MedusaConfig.from_pretrained`` renames any key containing "num" and "heads" to
    ``num_heads`` (and "num" + "layers" to ``num_hidden_layers``), so no other key may.
  * weights ``blocks.{h}.layers.{l}.weight`` / ``.bias`` ([hidden, hidden] / [hidden]),
    ``lm_heads.{h}.weight`` ([truncated_vocab_size or vocab_size, hidden]); with
    ``original_lm_head`` only ``lm_heads.0.weight`` (loaded into the shared ``lm_head``);
    ``token_map`` ([truncated_vocab_size] int64) used only when truncated_vocab_size < vocab_size.
    Names not among its parameters are silently ignored and a parameter nobody loads keeps its
    random init: that is the "0% acceptance" failure, so names must be exact.
  * the drafter takes each head's argmax (top-1 chains): ``num_speculative_tokens`` = num_heads.
Releases: 0.33.0 removed Medusa (its ``speculator_config.py`` lists no ``medusa`` method), so these heads
serve on vLLM <= 0.32.0; per-head truncated heads load only up to 0.11.0 (the export says both).
``materialize=true`` writes a full-vocabulary ``lm_heads.{h}`` per head instead (shared or truncated heads), which
every release with Medusa loads.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ..errors import UserError
from ..heads.medusa import MedusaHeads
from ..heads.native import check_safetensors, check_tensor_values, load_state_checked
from ..heads.spec import HeadsSpec
from .export import (ExportOptions, ExportPlan, FormatWarning, full_projection, materialise_note, megabytes,
                     refuse_unless_kind, register_exporter, stored_projection_bytes, written_bytes)
from .importers import register_importer

BLOCK = re.compile(r"^blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)$")
LM_HEAD = re.compile(r"^lm_heads\.(\d+)\.weight$")
WEIGHTS = "model.safetensors"   # what vLLM's Medusa loader reads
# Releases read (their wheels' medusa.py): 0.33.0 has no Medusa; 0.11.1-0.32.0 build per-head lm_heads of
# vocab_size rows (a truncated one fails ParallelLMHead's shape check); up to LAST_WITH_TRUNCATED they had
# truncated_vocab_size rows, the layout written here.
LAST_WITH_MEDUSA = "0.32.0"
LAST_WITH_TRUNCATED = "0.11.0"


# -- export -----------------------------------------------------------------------------------
@register_exporter("vllm", "medusa", files=(WEIGHTS,))
def export_vllm(heads: MedusaHeads, options: ExportOptions) -> ExportPlan:
    refuse_unless_kind(heads, "medusa")
    spec = heads.spec
    tensors: dict[str, torch.Tensor] = {}
    for h, blocks in enumerate(heads.blocks):
        for l, block in enumerate(blocks):
            tensors[f"blocks.{h}.layers.{l}.weight"] = block.linear.weight.detach()
            tensors[f"blocks.{h}.layers.{l}.bias"] = block.linear.bias.detach()
    notes = []
    truncated_vocab = spec.vocab_size
    original_lm_head = False
    if spec.projection != "own" and options.materialize:
        # one full-vocabulary lm_head per head: the layout every release with Medusa loads (0.11.1 and later refuse
        # truncated heads), asked for by name, so never replaced by the smaller layouts below
        # without it: one lm_head copy for shared heads (vLLM reads the drafter's own), else the stored projections
        before = (written_bytes(options.backbone_lm_head(heads), options) if spec.projection == "shared"
                  else stored_projection_bytes(heads, options))
        for h in range(spec.num_heads):
            tensors[f"lm_heads.{h}.weight"] = full_projection(heads, h, options)[0]
        after = sum(written_bytes(tensors[f"lm_heads.{h}.weight"], options) for h in range(spec.num_heads))
        notes.append(materialise_note(heads, "vllm", before, after))
    elif spec.projection == "shared":
        # vLLM reads the drafter's lm_head from the drafter checkpoint, never from the target.
        lm = options.backbone_lm_head(heads)
        tensors["lm_heads.0.weight"] = lm
        original_lm_head = True
        notes.append(f"vLLM needs its own copy of the backbone lm_head ({megabytes(written_bytes(lm, options))})")
    elif spec.projection == "truncated" and spec.truncated_vocab_size < spec.vocab_size:
        truncated_vocab = spec.truncated_vocab_size
        tensors["token_map"] = heads.token_map.detach().to(torch.int64)
        for h, proj in enumerate(heads.projections):
            tensors[f"lm_heads.{h}.weight"] = proj.weight.detach()
    elif spec.projection == "truncated":
        # truncated_vocab_size == vocab_size: vLLM ignores token_map then, so put each row at its
        # token id instead (exact when the map is a permutation, which a full-size map must be).
        order = heads.token_map.cpu()
        if not torch.equal(order.sort().values, torch.arange(spec.vocab_size)):
            raise UserError("a truncated projection as large as the vocabulary must map every token once")
        for h, proj in enumerate(heads.projections):
            full = torch.empty_like(proj.weight.detach().cpu())
            full[order] = proj.weight.detach().cpu()
            tensors[f"lm_heads.{h}.weight"] = full
    else:
        for h, proj in enumerate(heads.projections):
            tensors[f"lm_heads.{h}.weight"] = proj.weight.detach()
    dtype = next(t for t in tensors.values() if t.is_floating_point()).dtype
    config = {
        "model_type": "medusa",
        "architectures": ["MedusaModel"],
        "hidden_size": spec.hidden_size,
        "vocab_size": spec.vocab_size,
        "num_heads": spec.num_heads,
        "num_hidden_layers": spec.num_layers,
        "truncated_vocab_size": truncated_vocab,
        "medusa_fc_bias": True,
        "original_lm_head": original_lm_head,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "base_model_name_or_path": options.base_model or spec.base_model,
        "base_model_fingerprint": spec.base_model_fingerprint,
    }
    notes.append(f"serve: vllm serve {config['base_model_name_or_path'] or '<base model>'} --speculative-config "
                 f"'{{\"method\": \"medusa\", \"model\": \"<this dir>\", "
                 f"\"num_speculative_tokens\": {spec.num_heads}}}'")
    notes.append(f"note: vLLM {LAST_WITH_MEDUSA} is the last release with Medusa (0.33.0 removed it): "
                 f"pip install 'vllm<={LAST_WITH_MEDUSA}' to serve these heads")
    if truncated_vocab < spec.vocab_size:
        notes.append(f"note: vLLM loads per-head truncated heads up to {LAST_WITH_TRUNCATED} (0.11.1 sized each "
                     f"head's lm_head to the full vocabulary and refuses them): pip install "
                     f"'vllm<={LAST_WITH_TRUNCATED}', or pass materialize=true (full per-head projections) or train "
                     "heads.projection=own or shared for newer releases")
    return ExportPlan(config=config, weights_file=WEIGHTS, tensors=tensors, notes=notes)


# -- import -----------------------------------------------------------------------------------
def is_vllm_dir(d: Path) -> bool:
    cfg = d / "config.json"
    if not cfg.is_file():
        return False
    try:
        raw = json.loads(cfg.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, OSError):
        return False
    return isinstance(raw, dict) and raw.get("model_type") == "medusa"


def _weight_files(d: Path) -> list[Path]:
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise UserError(f"{d} is a vLLM Medusa dir without safetensors weights (only safetensors are read)")
    return files


def _counts(config: dict) -> tuple:
    """num_heads / num_hidden_layers as vLLM's MedusaConfig reads them (any "num..heads" key)."""
    heads = layers = None
    for k, v in config.items():
        if "num" in k and "heads" in k:
            heads = v
        elif "num" in k and "layers" in k:
            layers = v
    return heads, layers


def _shapes(d: Path) -> dict[str, tuple]:
    shapes = {}
    for f in _weight_files(d):
        check_safetensors(f)
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                shapes[k.removeprefix("medusa_heads.")] = tuple(st.get_slice(k).get_shape())
    return shapes


def read_spec(d: Path) -> HeadsSpec:
    """The heads a vLLM Medusa dir holds: counts from the weights (a warning if config.json differs)."""
    config = json.loads((d / "config.json").read_text())
    shapes = _shapes(d)
    blocks, lm_heads, unknown = {}, set(), []
    for name, shape in shapes.items():
        if m := BLOCK.match(name):
            blocks.setdefault(int(m[1]), set()).add(int(m[2]))
        elif m := LM_HEAD.match(name):
            lm_heads.add(int(m[1]))
        elif name not in ("token_map", "lm_head.weight"):
            unknown.append(name)
    if unknown:
        raise UserError(f"{d}: tensors vLLM's Medusa loader would ignore: {sorted(unknown)[:4]}")
    cfg_heads, cfg_layers = _counts(config)
    original = bool(config.get("original_lm_head", False))
    head_ids = set(blocks) | (set() if original else lm_heads)
    num_heads = max(head_ids) + 1 if head_ids else cfg_heads
    if not num_heads or head_ids and head_ids != set(range(num_heads)):
        raise UserError(f"{d}: heads must be numbered 0..K-1 in the weights, found {sorted(head_ids)}")
    layer_sets = {frozenset(blocks.get(h, ())) for h in range(num_heads)}
    if len(layer_sets) != 1:
        raise UserError(f"{d}: heads have different numbers of layers")
    layers = sorted(next(iter(layer_sets)))
    if layers != list(range(len(layers))):
        raise UserError(f"{d}: layers must be numbered 0..L-1, found {layers}")
    num_layers = len(layers)
    for what, cfg_value, value in (("num_heads", cfg_heads, num_heads), ("num_hidden_layers", cfg_layers, num_layers)):
        if cfg_value is not None and cfg_value != value:
            warnings.warn(f"{d / 'config.json'} says {what}={cfg_value} but the weights hold {value}: using {value}",
                          FormatWarning, stacklevel=3)
    if num_layers and config.get("medusa_fc_bias", False):
        missing = [f"blocks.{h}.layers.{l}.bias" for h in range(num_heads) for l in layers
                   if f"blocks.{h}.layers.{l}.bias" not in shapes]
        if missing:
            raise UserError(f"{d}: medusa_fc_bias is set but {missing[0]} is missing")
    if "vocab_size" not in config:
        raise UserError(f"{d / 'config.json'} has no vocab_size")
    vocab = int(config["vocab_size"])
    truncated = int(config.get("truncated_vocab_size") or vocab)
    if truncated < vocab and "token_map" not in shapes:
        raise UserError(f"{d}: truncated_vocab_size {truncated} < vocab_size {vocab} but there is no token_map tensor")
    any_weight = next((shapes[k] for k in shapes if BLOCK.match(k) or LM_HEAD.match(k) or k == "lm_head.weight"), None)
    hidden = int(config.get("hidden_size") or (any_weight[-1] if any_weight else 0))
    if original:
        projection = "truncated" if truncated < vocab else "shared"
    else:
        projection = "truncated" if truncated < vocab else "own"
    return HeadsSpec(num_heads=num_heads, num_layers=num_layers, hidden_size=hidden, vocab_size=vocab,
                     projection=projection, truncated_vocab_size=truncated if projection == "truncated" else None,
                     base_model=config.get("base_model_name_or_path") or "",
                     base_model_fingerprint=config.get("base_model_fingerprint") or "")


def load(d: Path, spec: HeadsSpec) -> tuple[MedusaHeads, torch.Tensor | None]:
    """(heads, the dir's own shared lm_head or None), values exactly as vLLM would run them."""
    tensors = {}
    for f in _weight_files(d):
        tensors.update({k.removeprefix("medusa_heads."): v for k, v in load_file(str(f)).items()})
    config = json.loads((d / "config.json").read_text())
    heads = MedusaHeads(spec)
    state = {}
    for h in range(spec.num_heads):
        for l in range(spec.num_layers):
            w = tensors[f"blocks.{h}.layers.{l}.weight"]
            state[f"blocks.{h}.{l}.linear.weight"] = w
            # vLLM builds the Linear without bias unless medusa_fc_bias: a zero bias is the same map.
            bias = tensors.get(f"blocks.{h}.layers.{l}.bias") if config.get("medusa_fc_bias") else None
            state[f"blocks.{h}.{l}.linear.bias"] = bias if bias is not None else \
                torch.zeros(spec.hidden_size, dtype=w.dtype)
    shared = None
    if config.get("original_lm_head", False):
        shared = tensors.get("lm_head.weight", tensors.get("lm_heads.0.weight"))
        if shared is None:
            raise UserError(f"{d}: original_lm_head is set but there is no lm_heads.0.weight")
    token_map = tensors.get("token_map") if spec.projection == "truncated" else None
    if token_map is not None:
        if token_map.shape != (spec.output_size,):
            raise UserError(f"{d}: token_map has shape {tuple(token_map.shape)}, expected ({spec.output_size},)")
        # checked as stored, before it indexes a full-vocabulary head: a float map was cast silently
        check_tensor_values("token_map", token_map, False, spec.vocab_size, d)
        token_map = token_map.to(torch.long)
        state["token_map"] = token_map
    if spec.projection != "shared":
        for h in range(spec.num_heads):
            w = shared if shared is not None else tensors.get(f"lm_heads.{h}.weight")
            if w is None:
                raise UserError(f"{d}: lm_heads.{h}.weight is missing")
            if token_map is not None and w.shape[0] > token_map.shape[0]:
                w = w[token_map]  # vLLM slices a full-vocabulary head by the map the same way
            state[f"projections.{h}.weight"] = w
    load_state_checked(heads, state, d)
    return heads, shared


register_importer("vllm", detect=is_vllm_dir, read_spec=read_spec, load=load)
