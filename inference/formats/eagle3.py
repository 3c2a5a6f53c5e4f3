"""The EAGLE-3 drafter directory vLLM and SGLang both serve: export our ``Eagle3Drafter``, import one.

Read from the engines' own loaders:
  vLLM    vllm-project/vllm
            vllm/model_executor/models/llama_eagle3.py        commit 00bd1493b3e82d6c13c68ee8a0e1c5a96707e190
            vllm/model_executor/models/llama.py (aux capture)  commit e06c9ba2a6ea923a84add30f5dafaea126429b81
            model_executor/models/registry.py (architectures) and v1/worker/gpu_model_runner.py
            (``_get_eagle3_aux_layers_from_config``), read through the stored index
  SGLang  sgl-project/sglang
            python/sglang/srt/models/llama_eagle3.py          commit 03d5a7771f6082e7737a5f19cae7d1e863087013
            python/sglang/srt/models/llama.py (``set_eagle3_layers_to_capture``)
                                                              commit 00239548f1cd1a06ca145a5447a86738090a48f1

What they read, and so what this module writes (``tests/engine_specs.py`` restates both loaders and
runs their forward on an export):
  * ``config.json``: ``architectures: ["LlamaForCausalLMEagle3"]`` (SGLang's only entry class; vLLM maps
    it and ``Eagle3LlamaForCausalLM`` to the same model), ``model_type: llama`` (both build a
    ``LlamaConfig``), ``num_hidden_layers: 1``, the Llama sizes, ``vocab_size`` = the target's,
    ``draft_vocab_size`` always (SGLang takes a missing one to mean "use the target's lm_head"),
    ``tie_word_embeddings: false`` (SGLang would make lm_head the embedding), ``norm_before_residual:
    false`` (our drafter keeps the un-normed state as residual, vLLM's default; SGLang has only that).
  * aux layers: vLLM reads top-level ``eagle_aux_hidden_state_layer_ids`` first and captures the
    *input* of decoder layer i (= transformers' hidden_states[i], our ids); SGLang reads only
    ``eagle_config`` and adds one (its ids name layer *outputs*). So the top level holds our ids and
    ``eagle_config`` holds ids - 1: both engines then capture the layers the drafter was trained on.
    Id 0 (the embeddings) is refused: both capture ``hidden_states + residual`` and residual is None
    before layer 0.
  * weights: ``fc.weight`` [H, 3H], ``midlayer.*`` (vLLM renames it ``layers.0.``, both stack q/k/v and
    gate/up), ``norm.weight``, ``lm_head.weight`` [draft_vocab, H]; with a draft vocabulary ``d2t``
    int64 (target id = i + d2t[i]; rows sorted by target id, as SpecForge writes them) and ``t2d``
    bool [vocab] (both engines skip it). No ``embed_tokens``: both then use the target's, as we do.
  * a ``medusa_train`` key (engines keep unknown keys as config attributes and never read it) records
    the TTT depth, the target's layer count and fingerprint, so an export re-imports as the same spec.

The importer reads that layout as SpecForge, the EAGLE repo and vLLM / SGLang users publish it
(``model.safetensors`` or ``pytorch_model.bin`` with ``torch.load(weights_only=True)``; the EAGLE
repository's trainer names the architecture ``LlamaForCausalLM``, which vLLM renames for method eagle3,
so a one-layer config holding ``fc.weight`` and ``midlayer.*`` is read as one), with its aux ids
ascending as both engines capture them (no permutation: fc runs as they run it), refusing in one
line what our drafter does not compute (``norm_before_residual: true``, more layers, biases, a RoPE
scaling the engines would rotate otherwise than it (``heads/rope.py``), a draft width other than the
target's) and, with a backbone, a target it was not made for. ``rope_scaling`` (llama3, linear, yarn,
longrope) is written and read as vLLM's and SGLang's ``get_rope`` read it (``heads/rope.py``).
"""

from __future__ import annotations

import json
import pickle
import warnings
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from ..errors import IncompatibleHeadsError, NeedsBackboneConfig, UserError
from ..heads.eagle3 import (NUM_AUX, ascending_fc, engine_default_aux_layers, refuse_repeated_aux_layers,
                            repeated_aux_layers)
from ..heads.native import load_state_checked
from ..heads.rope import engine_rope_scaling, export_rope_scaling
from ..heads.registry import build_heads
from ..heads.spec import HeadsSpec
from .export import ExportOptions, ExportPlan, FormatWarning, refuse_unless_kind, register_exporter
from .importers import register_importer
from .reference import load_pickle_weights

ARCHITECTURE = "LlamaForCausalLMEagle3"
ARCHITECTURES = (ARCHITECTURE, "Eagle3LlamaForCausalLM")  # vLLM's registry maps both to its EAGLE-3 Llama
# What the EAGLE repository's trainer (eagle/traineagle3) writes: vLLM prefixes "Eagle3" for method eagle3.
EAGLE_REPO_ARCHITECTURE = "LlamaForCausalLM"
WEIGHTS, PICKLE = "model.safetensors", "pytorch_model.bin"
META = "medusa_train"
# Foreign checkpoints do not say how many steps they were unrolled in training; SpecForge's default.
FOREIGN_DEPTH = 7
LAYER_WEIGHTS = (
    "fc.weight",
    *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
    *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
    *(f"midlayer.{n}.weight" for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")),
    "norm.weight",
)


# -- export -----------------------------------------------------------------------------------
@register_exporter("eagle3", "eagle3", files=(WEIGHTS,))
def export_eagle3(heads, options: ExportOptions) -> ExportPlan:
    refuse_unless_kind(heads, "eagle3")
    spec, layer, read = heads.spec, heads.spec.settings.draft_layer, heads.spec.settings.aux_layers
    if 0 in read:
        raise UserError(f"aux layer 0 (the embeddings) cannot be served: vLLM and SGLang capture hidden_states + "
                        f"residual before each layer and residual is None before layer 0 (aux {read})")
    refuse_repeated_aux_layers(read, "this drafter")
    aux = sorted(read)  # the engines capture ascending: fc's blocks follow (ascending_fc)
    state = heads.state_dict()
    tensors = {name: state[name].detach() for name in LAYER_WEIGHTS}
    tensors["fc.weight"] = ascending_fc(tensors["fc.weight"], read)
    lm_head = state["lm_head.weight"].detach().cpu()
    if spec.projection == "truncated":
        # Sorted by target id, as SpecForge writes d2t (offsets >= 0); the rows move with their ids.
        ids, order = heads.token_map.detach().cpu().long().sort()
        tensors["lm_head.weight"] = lm_head[order]
        tensors["d2t"] = ids - torch.arange(ids.numel())
        t2d = torch.zeros(spec.vocab_size, dtype=torch.bool)
        t2d[ids] = True
        tensors["t2d"] = t2d
    else:
        tensors["lm_head.weight"] = lm_head
    dtype = tensors["fc.weight"].dtype
    base = options.base_model or spec.base_model
    config = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": spec.hidden_size,
        "intermediate_size": layer["intermediate_size"],
        "num_attention_heads": layer["num_attention_heads"],
        "num_key_value_heads": layer["num_key_value_heads"],
        "head_dim": layer["head_dim"],
        "hidden_act": layer["hidden_act"],
        "rms_norm_eps": layer["rms_norm_eps"],
        "rope_theta": layer["rope_theta"],
        **export_rope_scaling(layer),  # rope_scaling as vLLM's and SGLang's get_rope read it (heads/rope.py)
        "max_position_embeddings": layer["max_position_embeddings"],
        "attention_bias": False,
        "mlp_bias": False,
        "vocab_size": spec.vocab_size,
        "draft_vocab_size": spec.output_size,
        "tie_word_embeddings": False,
        "norm_before_residual": False,
        "eagle_aux_hidden_state_layer_ids": aux,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in aux],
                         "use_aux_hidden_state": True},
        "torch_dtype": str(dtype).removeprefix("torch."),
        "base_model_name_or_path": base,
        META: {"num_heads": spec.num_heads, "target_layers": layer["target_layers"],
               "base_model_fingerprint": spec.base_model_fingerprint},
    }
    k, target = spec.num_heads, base or "<base model>"
    notes = [
        f"serve: vllm serve {target} --speculative-config "
        f"'{{\"method\": \"eagle3\", \"model\": \"<this dir>\", \"num_speculative_tokens\": {k}}}'",
        f"serve: python -m sglang.launch_server --model-path {target} --speculative-algorithm EAGLE3 "
        f"--speculative-draft-model-path <this dir> --speculative-num-steps {k} --speculative-eagle-topk 1 "
        f"--speculative-num-draft-tokens {k + 1}",
    ]
    return ExportPlan(config=config, weights_file=WEIGHTS, tensors=tensors, notes=notes)


# -- import -----------------------------------------------------------------------------------
def _raw_config(d: Path) -> dict | None:
    try:
        raw = json.loads((d / "config.json").read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return raw if isinstance(raw, dict) else None


def is_eagle3_dir(d: Path) -> bool:
    """By the config alone, so a dir without weights gets this layout's error, not the native one's; the
    EAGLE repository's own layout (``LlamaForCausalLM``, which vLLM renames to its EAGLE-3 class) by its
    one-layer config with a ``draft_vocab_size`` (which its trainer requires) or the drafter's weight names,
    so a one-layer Llama target is not taken for one."""
    raw = _raw_config(d)
    archs = raw.get("architectures") if raw else None
    if not isinstance(archs, list):
        return False
    if any(a in ARCHITECTURES for a in archs):
        return True
    return EAGLE_REPO_ARCHITECTURE in archs and raw.get("num_hidden_layers") == 1 and \
        ("draft_vocab_size" in raw or _holds_drafter_weights(d))  # no target config has draft_vocab_size


def _holds_drafter_weights(d: Path) -> bool:
    """Whether the dir's weights are an EAGLE-3 drafter's (``fc.weight`` and ``midlayer.*``): the names
    only (a safetensors header; a ``.bin`` memory-mapped, ``weights_only``)."""
    names: list[str] = []
    try:
        if (d / WEIGHTS).is_file():
            with safe_open(str(d / WEIGHTS), framework="pt") as f:
                names = list(f.keys())
        elif (d / PICKLE).is_file():
            obj = torch.load(d / PICKLE, map_location="cpu", weights_only=True, mmap=True)
            names = [str(k) for k in obj] if isinstance(obj, dict) else []
    except (OSError, RuntimeError, ValueError, TypeError, AttributeError, EOFError, pickle.UnpicklingError,
            SafetensorError):
        # an unreadable file is not this layout's to claim; the loader that does claim it says why
        return False
    names = [n.removeprefix("model.") for n in names]
    return "fc.weight" in names and any(n.startswith("midlayer.") for n in names)


def _aux_ids(d: Path, raw: dict) -> list[int] | None:
    """Our (transformers hidden_states) ids as the engines capture them: vLLM's top-level key as is, else
    SGLang's eagle_config + 1; ascending, since both collect the listed layers while walking the target's
    layers and feed fc in that order whatever order the config lists them in."""
    where = d / "config.json"
    top = raw.get("eagle_aux_hidden_state_layer_ids") or None
    eagle = raw.get("eagle_config") if isinstance(raw.get("eagle_config"), dict) else {}
    sglang = eagle.get("eagle_aux_hidden_state_layer_ids") or None
    try:
        top = [int(i) for i in top] if top is not None else None
        sglang = [int(i) + 1 for i in sglang] if sglang is not None else None
    except (TypeError, ValueError):
        raise UserError(f"{where}: eagle_aux_hidden_state_layer_ids must be a list of integers") from None
    if top is not None:
        if sglang is not None and sorted(sglang) != sorted(top):
            warnings.warn(f"{where}: vLLM captures hidden states {sorted(top)} (top-level ids), SGLang "
                          f"{sorted(sglang)} (eagle_config ids + 1): using vLLM's", FormatWarning, stacklevel=4)
        ids = top
    elif sglang is not None:
        warnings.warn(f"{where} names its aux layers only in eagle_config: read as SGLang does (hidden "
                      f"states {sorted(sglang)}); vLLM captures one layer earlier", FormatWarning, stacklevel=4)
        ids = sglang
    else:
        return None
    if len(ids) != NUM_AUX:
        raise UserError(f"{where} names {len(ids)} aux layers; EAGLE-3 drafters read {NUM_AUX}")
    refuse_repeated_aux_layers(ids, str(where))
    if ids != sorted(ids):
        warnings.warn(f"{where} lists aux layers {ids} out of order: vLLM and SGLang capture them ascending "
                      f"({sorted(ids)}) and feed fc in that order; read as they run it", FormatWarning, stacklevel=4)
    return sorted(ids)


def _target_default_aux(d: Path, layers: int) -> list[int]:
    """The layers the engines capture for a config that names none, refused in one line when they are
    not three distinct servable ids of this target (a shallow one: the engines would feed fc 2H)."""
    ids = engine_default_aux_layers(layers)
    if repeated_aux_layers(ids) or min(ids) < 1:
        raise IncompatibleHeadsError(f"{d / 'config.json'} names no aux layer ids, and on a {layers}-layer target "
                                     f"the engines' default (2, N//2, N-3) = {ids} is not three distinct layers "
                                     "1..N-1: it was trained for a deeper target")
    return sorted(ids)


def _refusals(d: Path, raw: dict) -> None:
    """One line for each thing the checkpoint asks that our drafter does not compute."""
    where = d / "config.json"
    if raw.get("norm_before_residual"):
        raise UserError(f"{where}: norm_before_residual=true (residual taken after hidden_norm) is not supported: "
                        "this drafter implements the default (residual = the un-normed hidden state)")
    if int(raw.get("num_hidden_layers", 1)) != 1:
        raise UserError(f"{where}: {raw['num_hidden_layers']} draft layers; this drafter has one decoder layer")
    if not (raw.get("eagle_config") or {}).get("use_aux_hidden_state", True):
        raise UserError(f"{where}: use_aux_hidden_state=false (EAGLE-1 style input) is not an EAGLE-3 drafter")
    if raw.get("tie_word_embeddings"):
        raise UserError(f"{where}: tie_word_embeddings=true (lm_head = embed_tokens) is not supported")
    for key in ("attention_bias", "mlp_bias", "bias"):
        if raw.get(key):
            raise UserError(f"{where}: {key}=true; this drafter's linear layers have no bias")
    if raw.get("hidden_act", "silu") not in ("silu", "swish"):
        raise UserError(f"{where}: hidden_act {raw['hidden_act']!r}; this drafter's MLP is SwiGLU (silu)")
    engine_rope_scaling(raw, where)  # a rope type or option the engines would rotate differently from the drafter
    target_hidden = raw.get("target_hidden_size")
    if target_hidden is not None and int(target_hidden) != int(raw.get("hidden_size", 0)):
        raise UserError(f"{where}: target_hidden_size {target_hidden} != hidden_size {raw.get('hidden_size')}; this "
                        "drafter reads target features of its own width")


def read_spec(d: Path, backbone_config=None) -> HeadsSpec:
    raw = _raw_config(d)
    if raw is None:
        raise UserError(f"{d / 'config.json'} is not a readable JSON object")
    _refusals(d, raw)
    try:
        hidden, vocab, n_heads = int(raw["hidden_size"]), int(raw["vocab_size"]), int(raw["num_attention_heads"])
        inner = int(raw["intermediate_size"])
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"{d / 'config.json'} is not an EAGLE-3 Llama config (missing or bad {e})") from None
    draft_vocab = int(raw.get("draft_vocab_size") or vocab)  # absent: the full vocabulary (vLLM)
    meta = raw.get(META) if isinstance(raw.get(META), dict) else {}
    layers = backbone_config.num_hidden_layers if backbone_config is not None else meta.get("target_layers")
    layers = None if layers is None else int(layers)
    if draft_vocab > vocab:
        raise UserError(f"{d / 'config.json'}: draft_vocab_size {draft_vocab} exceeds vocab_size {vocab}; a draft "
                        "vocabulary is a subset of the target's")
    aux = _aux_ids(d, raw)
    if aux is None:  # both engines then capture the target's default layers, known only with the target
        if layers is None:
            raise NeedsBackboneConfig(f"{d / 'config.json'} names no aux layer ids (the engines then use the "
                                      "target's layers (2, N//2, N-3)): load it with its backbone (backbone=)",
                                      base_model=str(raw.get("base_model_name_or_path") or ""))
        aux = _target_default_aux(d, layers)
    if backbone_config is not None and not all(0 <= i < layers for i in aux):
        raise IncompatibleHeadsError(f"EAGLE-3 drafter in {d} reads aux layers {aux}, the backbone has hidden states "
                                     f"0..{layers - 1} ({layers} layers): it was trained for another target")
    if layers is None:  # no backbone: the fewest layers these ids need (the backbone's count is checked on load)
        layers = max(aux) + 1
    draft_layer = {
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(raw.get("num_key_value_heads") or n_heads),
        "head_dim": int(raw.get("head_dim") or hidden // n_heads),
        "intermediate_size": inner,
        "rms_norm_eps": float(raw.get("rms_norm_eps") or 1e-6),  # LlamaConfig's defaults
        "rope_theta": float(raw.get("rope_theta") or (raw.get("rope_parameters") or {}).get("rope_theta") or 10000.0),
        "hidden_act": "silu",
        "max_position_embeddings": int(raw.get("max_position_embeddings") or 2048),
        "target_layers": layers,
    }
    rope = engine_rope_scaling(raw, d / "config.json")
    if rope:  # absent = plain RoPE, as draft_layer_config writes it
        draft_layer["rope_scaling"] = rope
    # A draft vocabulary as large as the target's is held as a full lm_head (``load`` puts the rows at
    # their ids), so only a smaller one needs the token map.
    truncated = draft_vocab < vocab
    return HeadsSpec(num_heads=int(meta.get("num_heads") or FOREIGN_DEPTH), num_layers=1, hidden_size=hidden,
                     vocab_size=vocab, projection="truncated" if truncated else "own",
                     truncated_vocab_size=draft_vocab if truncated else None,
                     base_model=str(raw.get("base_model_name_or_path") or ""),
                     base_model_fingerprint=str(meta.get("base_model_fingerprint") or ""), kind="eagle3",
                     aux_layers=aux, draft_layer=draft_layer)


def _weights(d: Path) -> tuple[dict[str, torch.Tensor], Path]:
    if (d / WEIGHTS).is_file():
        try:
            tensors = load_file(str(d / WEIGHTS))
        except (SafetensorError, OSError) as e:
            raise UserError(f"{d / WEIGHTS} is corrupt or unreadable ({e})") from None
        f = d / WEIGHTS
    elif (d / PICKLE).is_file():
        tensors, f = load_pickle_weights(d / PICKLE), d / PICKLE
    else:
        raise UserError(f"{d} is an EAGLE-3 dir without {WEIGHTS} or {PICKLE}")
    # SGLang accepts names with or without the "model." its own module adds; so do we.
    return {k.removeprefix("model."): v for k, v in tensors.items()}, f


def load(d: Path, spec: HeadsSpec):
    """(drafter, None), values exactly as the engines run them: the draft rows at their target ids."""
    tensors, f = _weights(d)
    known = {*LAYER_WEIGHTS, "lm_head.weight", "d2t", "t2d", "embed_tokens.weight"}
    missing = sorted({*LAYER_WEIGHTS, "lm_head.weight"} - set(tensors))
    unknown = sorted(set(tensors) - known)
    if missing or unknown:
        raise UserError(f"{f} is not an EAGLE-3 drafter this runtime computes: missing {missing[:4]}, "
                        f"unexpected {unknown[:4]}")
    if "embed_tokens.weight" in tensors:
        warnings.warn(f"{f}: embed_tokens.weight ignored: this runtime embeds with the target's table, as SGLang does "
                      "(vLLM may use the checkpoint's copy)", FormatWarning, stacklevel=3)
    lm_head = tensors["lm_head.weight"]
    rows = lm_head.shape[0]
    if rows != spec.output_size:
        raise UserError(f"{f}: lm_head.weight has {rows} rows, config draft_vocab_size is {spec.output_size}")
    d2t = tensors.get("d2t")
    if d2t is None:  # vLLM keeps draft_id_to_target_id at zeros, SGLang has no map: draft id = target id
        ids = torch.arange(rows)
    else:
        if d2t.shape != (rows,) or d2t.is_floating_point():
            raise UserError(f"{f}: d2t must be {rows} integers (target id = i + d2t[i]), got {d2t.dtype} "
                            f"{tuple(d2t.shape)}")
        ids = torch.arange(rows) + d2t.long()
    if ids.min() < 0 or ids.max() >= spec.vocab_size or ids.unique().numel() != rows:
        raise UserError(f"{f}: d2t maps draft tokens outside 0..{spec.vocab_size - 1} or two onto one target id")
    state = {name: tensors[name] for name in LAYER_WEIGHTS}
    if spec.projection == "truncated":
        state["lm_head.weight"], state["token_map"] = lm_head, ids
    else:
        full = torch.empty_like(lm_head)
        full[ids] = lm_head  # rows == vocab here, so the distinct ids cover every token once
        state["lm_head.weight"] = full
    heads = build_heads(spec)
    load_state_checked(heads, state, f)
    return heads, None


register_importer("eagle3", detect=is_eagle3_dir, read_spec=read_spec, load=load, read_spec_for=read_spec)
