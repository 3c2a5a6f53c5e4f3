"""The EAGLE-3 drafter directory vLLM, SGLang and TensorRT-LLM serve: export our ``Eagle3Drafter``, import one.

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
    Id 0 (the embeddings) is refused: SGLang captures ``hidden_states + residual`` and residual is None
    before layer 0 (vLLM did too; 0.34.0 takes ``hidden_states`` alone there).
  * weights: ``fc.weight`` [H, 3H], ``midlayer.*`` (vLLM renames it ``layers.0.``, both stack q/k/v and
    gate/up), ``norm.weight``, ``lm_head.weight`` [draft_vocab, H]; with a draft vocabulary ``d2t``
    int64 (target id = i + d2t[i]; rows sorted by target id, as SpecForge writes them) and ``t2d``
    bool [vocab] (both engines skip it). No ``embed_tokens``: both then use the target's, as we do.
  * a ``medusa_train`` key (engines keep unknown keys as config attributes and never read it) records
    the TTT depth, the target's layer count and fingerprint, so an export re-imports as the same spec.

TensorRT-LLM's PyTorch backend (NVIDIA/TensorRT-LLM ``_torch/models/modeling_speculative.py`` at ``TRTLLM_COMMIT``,
the other files it reads in ``tests/engine_specs.py``) loads the same directory through ``EagleDecodingConfig``
(one-model ``Eagle3ForCausalLM``): ``midlayer.*`` kept, ``model.`` prefixed, the checkpoint's lm_head and d2t (an
int32 parameter, needed when draft_vocab_size != vocab_size) loaded, t2d ignored, the target's embeddings shared.
It differs in three ways the export answers: it never reads the aux ids from config.json but captures
``eagle3_layers_to_capture`` (decoder-layer *outputs*, = ``eagle_config``'s ids; default {1, N//2-1, N-4}), so the
printed commands name them; it reads ``norm_before_fc`` from ``eagle_config`` only, so a set one is written there
too (vLLM reads it there first); and it computes no ``norm_before_residual``, no ``logit_scale`` and, with both
norms on fc's input, only ``fc_norm``: such drafters get a note to serve them with vLLM.

The importer reads that layout as SpecForge, the EAGLE repo and vLLM / SGLang users publish it
(``model.safetensors`` or ``pytorch_model.bin`` with ``torch.load(weights_only=True)``; the EAGLE
repository's trainer names the architecture ``LlamaForCausalLM``, which vLLM renames for method eagle3,
so a one-layer config holding ``fc.weight`` and ``midlayer.*`` is read as one), with its aux ids
ascending as both engines capture them (no permutation: fc runs as they run it), refusing in one
line what our drafter does not compute (more layers, biases, P-EAGLE's ``parallel_drafting`` (named, with the
tensor it adds), a RoPE scaling the engines would rotate otherwise than it (``heads/rope.py``), a draft width
other than the target's) and, with a backbone, a target it was not made for. The flags vLLM honours that the
drafter computes are read into its ``draft_layer`` (``heads/eagle3.py`` ``ENGINE_FLAGS``): ``norm_before_residual``,
``norm_output`` (EAGLE-3.1), ``logit_scale``, ``norm_before_fc`` (``input_norm.weight`` [3H]) and ``fc_norm``
(``fc_norm.{i}.weight`` [H]); an export writes them back (SGLang, read at the commit above, computes none of them:
the export says so). ``norm_output`` is read as vLLM reads it (``llama_eagle3.py`` LlamaModel.forward: the post-norm
state fed back, lm_head on the post-norm state either way; absent = false), also for SpecForge's dirs, although
SpecForge (sgl-project/SpecForge ``specforge/modeling/draft/llama3_eagle.py`` compute_logits, ``algorithms/eagle3/
model.py`` TTT loop, HEAD a6b6b0230009d15ec2a97a57384e6f53f0f96946) trains the key as "norm before lm_head" (default
true) and always feeds the pre-norm state back: its EAGLE-3.1 configs' ``"norm_output": true`` is served by vLLM
with post-norm feedback, so we draft that, not what SpecForge trained (the two agree at the first depth only).
vLLM's ``llama_eagle3.py`` (after vllm-project/vllm#38111, #42143 and #42764, read through the
stored index) reads ``norm_before_fc`` from ``eagle_config`` first, then the top level (NVIDIA's checkpoints put it
there), and ``fc_norm`` from the top level; speculators' converter reads either from either place. Here either
place sets them; the two saying different things is refused in one line. A set flag whose weights the checkpoint
lacks runs with ones, as vLLM (its RMSNorm starts at ones) and speculators (``input_norm.weight`` in
``_keys_to_ignore_on_load_missing``) run it, with a warning; such a tensor held while the config does not set its
flag is refused, naming the flag (vLLM would skip ``input_norm.weight`` and refuse ``fc_norm.*``).
``tie_word_embeddings: true`` with the checkpoint's own ``lm_head.weight`` loads that lm_head, as vLLM does
(a warning: SGLang would use the embedding table); without one it is refused. Sharded safetensors
(``model.safetensors.index.json``) load shard by shard. ``rope_scaling`` (llama3, linear, yarn,
longrope) is written and read as vLLM's and SGLang's ``get_rope`` read it (``heads/rope.py``).
"""

from __future__ import annotations

import json
import math
import pickle
import warnings
from pathlib import Path
from typing import Optional

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from ..errors import IncompatibleHeadsError, NeedsBackboneConfig, UserError
from ..heads.eagle3 import (ENGINE_FLAGS, NUM_AUX, ascending_fc_inputs, engine_default_aux_layers,
                            refuse_repeated_aux_layers, repeated_aux_layers)
from ..heads.native import check_safetensors, check_shapes, indexed_shards, load_state_checked
from ..heads.rope import engine_rope_scaling, export_rope_scaling
from ..heads.registry import build_heads
from ..heads.spec import HeadsSpec
from . import MATERIALIZE_UNREAD
from .eagle3_targets import engines_refusing, vllm_releases_gating
from .export import ExportOptions, ExportPlan, FormatWarning, refuse_unless_kind, register_exporter
from .importers import register_importer
from .reference import load_pickle_weights

ARCHITECTURE = "LlamaForCausalLMEagle3"
ARCHITECTURES = (ARCHITECTURE, "Eagle3LlamaForCausalLM")  # vLLM's registry maps both to its EAGLE-3 Llama
# What the EAGLE repository's trainer (eagle/traineagle3) writes: vLLM prefixes "Eagle3" for method eagle3.
EAGLE_REPO_ARCHITECTURE = "LlamaForCausalLM"
WEIGHTS, PICKLE, INDEX = "model.safetensors", "pytorch_model.bin", "model.safetensors.index.json"
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
# Config flags (top level or in eagle_config) that add math this drafter does not compute: flag -> what it adds.
UNSUPPORTED_FLAGS = {
    "parallel_drafting": "P-EAGLE's parallel drafting: mask_hidden",
}
# The flags on fc's input the drafter computes (``ENGINE_FLAGS``) -> what they add.
FC_INPUT_FLAGS = {
    "norm_before_fc": "an RMSNorm over the concatenated aux states before fc: input_norm.weight",
    "fc_norm": "EAGLE-3.1's RMSNorm on each aux state before fc: fc_norm.{i}.weight",
}
# Tensors those flags (or a Qwen3-style draft layer) add, to name the flag when the config does not set it.
FLAG_TENSORS = {"input_norm.weight": "norm_before_fc", "fc_norm.": "fc_norm", "mask_hidden": "parallel_drafting",
                "q_norm.weight": "a Qwen3-style draft layer (q_norm / k_norm)",
                "k_norm.weight": "a Qwen3-style draft layer (q_norm / k_norm)"}


def sub_dict(raw: dict, key: str) -> dict:
    """``raw[key]`` when it is an object, else {} (absent, null or another type)."""
    value = raw.get(key)
    return value if isinstance(value, dict) else {}


def fc_input_weights(layer: dict, hidden: int) -> dict[str, int]:
    """The tensors the flags on fc's input that ``layer`` sets add: name -> its length."""
    out = {"input_norm.weight": NUM_AUX * hidden} if layer.get("norm_before_fc") else {}
    if layer.get("fc_norm"):
        out.update({f"fc_norm.{i}.weight": hidden for i in range(NUM_AUX)})
    return out


# -- export -----------------------------------------------------------------------------------
@register_exporter("eagle3", "eagle3", files=(WEIGHTS,))
def export_eagle3(heads, options: ExportOptions) -> ExportPlan:
    refuse_unless_kind(heads, "eagle3")
    if options.materialize:   # the drafter's lm_head is written as it is: a silent no-op would look honoured
        raise UserError(MATERIALIZE_UNREAD.format(format="eagle3"))
    spec, read = heads.spec, heads.spec.settings.aux_layers
    if 0 in read:
        raise UserError(f"aux layer 0 (the embeddings) cannot be served by SGLang: it captures hidden_states + "
                        f"residual before each layer and residual is None before layer 0 (aux {read}; vLLM 0.34 "
                        "takes the embeddings there, older releases fail as SGLang does)")
    refuse_repeated_aux_layers(read, "this drafter")
    state = heads.state_dict()
    names = (*LAYER_WEIGHTS, *fc_input_weights(spec.settings.draft_layer, spec.hidden_size))
    # fc and the norms on its input in the order the engines capture the layers (ascending)
    tensors = ascending_fc_inputs({name: state[name].detach() for name in names}, read)
    lm_head = state["lm_head.weight"].detach().cpu()
    if spec.projection == "truncated":
        # Sorted by target id, as SpecForge writes d2t (offsets >= 0); the rows move with their ids.
        ids, order = heads.token_map.detach().cpu().long().sort()
        tensors["lm_head.weight"] = lm_head[order]
        # a draft vocabulary as large as the target's maps every id to itself: no maps, as for a projection of its
        # own (TensorRT-LLM declares d2t only for a smaller draft vocabulary; an all-zero one is no information)
        if ids.numel() < spec.vocab_size:
            tensors["d2t"] = ids - torch.arange(ids.numel())
            t2d = torch.zeros(spec.vocab_size, dtype=torch.bool)
            t2d[ids] = True
            tensors["t2d"] = t2d
    else:
        tensors["lm_head.weight"] = lm_head
    base = options.base_model or spec.base_model
    config = _export_config(spec, sorted(read), tensors["fc.weight"].dtype, base)
    k, target = spec.num_heads, base or "<base model>"
    architecture, model_type = _target_names(options)
    refusing = engines_refusing(architecture)
    serve = {"vLLM": f"serve: vllm serve {target} --speculative-config "
                     f"'{{\"method\": \"eagle3\", \"model\": \"<this dir>\", \"num_speculative_tokens\": {k}}}'",
             "SGLang": f"serve: python -m sglang.launch_server --model-path {target} --speculative-algorithm EAGLE3 "
                       f"--speculative-draft-model-path <this dir> --speculative-num-steps {k} "
                       f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}"}
    notes = [f"note: {refusing[engine]}: it would refuse this drafter's target" if engine in refusing else command
             for engine, command in serve.items()]
    gated = vllm_releases_gating(model_type) if "vLLM" not in refusing else None
    if gated:
        notes.append(f"note: vLLM {gated} refuse EAGLE-3 for a target of model_type {model_type!r} (\"eagle3 is only "
                     "supported for [...] models\"): serve it with vLLM 0.22.0 or later")
    notes += _trtllm_notes(base, k, sorted(read))
    flags = _set_flags(spec.settings.draft_layer)
    if flags:
        notes.append(f"note: this drafter computes {', '.join(f'{f}={v}' for f, v in flags.items())}, which vLLM "
                     "honours and SGLang does not: serve it with vLLM")
    trtllm_off = trtllm_unhonoured(spec.settings.draft_layer)
    if trtllm_off:
        notes.append(f"note: TensorRT-LLM ({TRTLLM_COMMIT[:10]}) would compute other drafts: {'; '.join(trtllm_off)}; "
                     "serve this drafter with vLLM")
    return ExportPlan(config=config, weights_file=WEIGHTS, tensors=tensors, notes=notes)


def _target_names(options: ExportOptions) -> tuple[Optional[str], Optional[str]]:
    """The target's transformers architecture (``LlamaForCausalLM``) and its text config's model_type (what older
    vLLM releases gate on: ``gemma3_text`` for Gemma 3's multimodal class), when its config can be read."""
    config = options.backbone_config() if options.backbone_config is not None else None
    names = getattr(config, "architectures", None) or []
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return (names[0] if names else None), getattr(text, "model_type", None) or getattr(config, "model_type", None)


# TensorRT-LLM's PyTorch backend (module docstring) at the commit its EAGLE-3 drafter was read.
TRTLLM_COMMIT = "00679c66c3e38f6d2651ad0a5bef0f94d862e36c"


def layer_output_ids(aux) -> list[int]:
    """Our aux ids (hidden_states[i]: i = 0 the embeddings) as the decoder-layer outputs they are, one lower: the
    ids SGLang reads from ``eagle_config`` and TensorRT-LLM's ``eagle3_layers_to_capture`` (which it never reads
    from the draft's config.json, so they go in its serve command)."""
    return [int(i) - 1 for i in sorted(aux)]


def _trtllm_notes(base: str, k: int, aux: list[int]) -> list[str]:
    """The TensorRT-LLM serve commands: the layers to capture are always named (its default {1, N//2-1, N-4} is
    ours only for drafters trained on EAGLE-3's default ids)."""
    target, ids = base or "<base model>", layer_output_ids(aux)
    return [
        f"serve: TensorRT-LLM LLM API: LLM(\"{target}\", speculative_config=EagleDecodingConfig(max_draft_len={k}, "
        f"speculative_model_dir=\"<this dir>\", eagle3_one_model=True, "
        f"eagle3_layers_to_capture={{{', '.join(map(str, ids))}}}))",
        f"serve: trtllm-serve {target} --extra_llm_api_options eagle3.yaml, eagle3.yaml holding: speculative_config: "
        f"{{decoding_type: Eagle3, max_draft_len: {k}, speculative_model_dir: <this dir>, eagle3_one_model: true, "
        f"eagle3_layers_to_capture: {ids}}}",
    ]


def trtllm_unhonoured(layer: dict) -> list[str]:
    """What of ``layer``'s engine flags TensorRT-LLM's Eagle3 drafter computes otherwise than we (and vLLM) do."""
    out = []
    if layer.get("norm_before_residual", False):
        out.append("norm_before_residual=true (its decoder layer keeps the un-normed state as residual)")
    if layer.get("logit_scale", 1.0) != 1.0:
        out.append(f"logit_scale={layer['logit_scale']} (it does not scale the draft logits)")
    if layer.get("norm_before_fc", False) and layer.get("fc_norm", False):
        out.append("norm_before_fc with fc_norm (it applies fc_norm only, not input_norm before it)")
    rope = layer.get("rope_scaling") or {}
    if rope.get("rope_type") == "longrope":
        # RopeParams.from_config reads no short_mscale / long_mscale / attention_factor / factor: its cos/sin scale is
        # always derived from max_position_embeddings / original_max_position_embeddings
        ratio, omax = layer["max_position_embeddings"] / rope["original_max_position_embeddings"], \
            rope["original_max_position_embeddings"]
        derived = 1.0 if ratio <= 1.0 else math.sqrt(1 + math.log(ratio) / math.log(omax))
        if abs(derived - rope["attention_factor"]) > 1e-6 * max(1.0, derived):
            out.append(f"LongRoPE's cos/sin scaled by {derived:.6g} (derived from its positions; it ignores "
                       "short_mscale / long_mscale / attention_factor), not the drafter's "
                       f"{rope['attention_factor']:.6g}")
    return out


def _set_flags(layer: dict) -> dict:
    """The engine flags (``ENGINE_FLAGS``) ``layer`` sets to other than their defaults."""
    return {f: layer[f] for f, default in ENGINE_FLAGS.items() if f in layer and layer[f] != default}


def _export_config(spec: HeadsSpec, aux: list[int], dtype: torch.dtype, base: str) -> dict:
    layer = spec.settings.draft_layer
    return {
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
        "norm_before_residual": bool(layer.get("norm_before_residual", False)),  # written always (SGLang: false)
        **{f: v for f, v in _set_flags(layer).items() if f != "norm_before_residual"},
        "eagle_aux_hidden_state_layer_ids": aux,
        # TensorRT-LLM reads norm_before_fc from eagle_config only, vLLM from there first: say it there too
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": layer_output_ids(aux),
                         "use_aux_hidden_state": True,
                         **({"norm_before_fc": True} if layer.get("norm_before_fc") else {})},
        "torch_dtype": str(dtype).removeprefix("torch."),
        "base_model_name_or_path": base,
        META: {"num_heads": spec.num_heads, "target_layers": layer["target_layers"],
               "base_model_fingerprint": spec.base_model_fingerprint},
    }


# -- import -----------------------------------------------------------------------------------
def raw_config(d: Path) -> dict | None:
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
    raw = raw_config(d)
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
            names = _pickle_names(d / PICKLE)
    except (OSError, RuntimeError, ValueError, TypeError, AttributeError, EOFError, pickle.UnpicklingError,
            SafetensorError):
        # an unreadable file is not this layout's to claim; the loader that does claim it says why
        return False
    names = [n.removeprefix("model.") for n in names]
    return "fc.weight" in names and any(n.startswith("midlayer.") for n in names)


def _pickle_names(path: Path) -> list[str]:
    """The keys of a ``.bin`` state dict (``weights_only``): memory-mapped, or read whole when it is a legacy
    (pre-zip) ``torch.save`` file, which cannot be memory-mapped (RuntimeError "mmap can only be used with ...")."""
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as e:
        if "mmap" not in str(e):
            raise
        obj = torch.load(path, map_location="cpu", weights_only=True)
    return [str(k) for k in obj] if isinstance(obj, dict) else []


def _aux_ids(d: Path, raw: dict) -> list[int] | None:
    """Our (transformers hidden_states) ids as the engines capture them: vLLM's top-level key as is, else
    SGLang's eagle_config + 1; ascending, since both collect the listed layers while walking the target's
    layers and feed fc in that order whatever order the config lists them in."""
    where = d / "config.json"
    top = raw.get("eagle_aux_hidden_state_layer_ids") or None
    eagle = sub_dict(raw, "eagle_config")
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


def _refusals(where, raw: dict) -> None:
    """One line for each thing the checkpoint asks that our drafter does not compute."""
    if int(raw.get("num_hidden_layers", 1)) != 1:
        raise UserError(f"{where}: {raw['num_hidden_layers']} draft layers; this drafter has one decoder layer")
    eagle = sub_dict(raw, "eagle_config")
    if not eagle.get("use_aux_hidden_state", True):
        raise UserError(f"{where}: use_aux_hidden_state=false (EAGLE-1 style input) is not an EAGLE-3 drafter")
    for flag, what in UNSUPPORTED_FLAGS.items():
        if raw.get(flag) or eagle.get(flag):
            raise UserError(f"{where}: {flag}=true ({what}) is not supported by this drafter")
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


def _flag_value(where, raw: dict, flag: str):
    """``flag``'s value in ``raw``: the top level's; for the flags on fc's input the top level's or eagle_config's
    (module docstring), refused in one line when both are given and differ."""
    value = raw.get(flag)
    eagle = sub_dict(raw, "eagle_config")
    if flag not in FC_INPUT_FLAGS or eagle.get(flag) is None:
        return value
    if value is not None and value != eagle[flag]:
        raise UserError(f"{where}: {flag} is {value!r} at the top level and {eagle[flag]!r} in eagle_config; vLLM and "
                        "speculators' converter read it from different places: say it once")
    return eagle[flag]


def _engine_flags(where, raw: dict) -> dict:
    """The flags vLLM honours that the drafter computes (``ENGINE_FLAGS``), those set to other than their
    defaults: they go into ``draft_layer``."""
    flags = {}
    for flag, default in ENGINE_FLAGS.items():
        value = _flag_value(where, raw, flag)
        if value is None:
            continue
        if isinstance(default, bool) and not isinstance(value, bool):
            raise UserError(f"{where}: {flag} must be true or false, got {value!r}")
        if not isinstance(default, bool):
            try:
                value = float(value)
            except (TypeError, ValueError):
                raise UserError(f"{where}: {flag} must be a number, got {value!r}") from None
            if not math.isfinite(value) or value == 0:
                raise UserError(f"{where}: {flag} must be a finite non-zero number, got {value!r}")
        if value != default:
            flags[flag] = value
    return flags


def _draft_layer(where, raw: dict, layers: int) -> dict:
    hidden, n_heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
    draft_layer = {
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(raw.get("num_key_value_heads") or n_heads),
        "head_dim": int(raw.get("head_dim") or hidden // n_heads),
        "intermediate_size": int(raw["intermediate_size"]),
        "rms_norm_eps": float(raw.get("rms_norm_eps") or 1e-6),  # LlamaConfig's defaults
        "rope_theta": float(raw.get("rope_theta") or (raw.get("rope_parameters") or {}).get("rope_theta") or 10000.0),
        "hidden_act": "silu",
        "max_position_embeddings": int(raw.get("max_position_embeddings") or 2048),
        "target_layers": layers,
        **_engine_flags(where, raw),
    }
    rope = engine_rope_scaling(raw, where)
    if rope:  # absent = plain RoPE, as draft_layer_config writes it
        draft_layer["rope_scaling"] = rope
    return draft_layer


def read_spec(d: Path, backbone_config=None) -> HeadsSpec:
    raw = raw_config(d)
    if raw is None:
        raise UserError(f"{d / 'config.json'} is not a readable JSON object")
    return spec_from_config(d, raw, backbone_config)


def spec_from_config(d: Path, raw: dict, backbone_config=None, depth: int | None = None,
                     layout: str | None = None) -> HeadsSpec:
    """The spec of the EAGLE-3 drafter in ``d`` whose (vLLM-shaped) config is ``raw``; ``depth``: its trained
    depth when the layout records one elsewhere than our ``medusa_train`` key (else ``FOREIGN_DEPTH``);
    ``layout``: the format named in refusals when it is not this one."""
    where = f"{d / 'config.json'} ({layout})" if layout else d / "config.json"
    _refusals(where, raw)
    try:
        hidden, vocab = int(raw["hidden_size"]), int(raw["vocab_size"])
        int(raw["num_attention_heads"]), int(raw["intermediate_size"])
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"{where} is not an EAGLE-3 Llama config (missing or bad {e})") from None
    draft_vocab = int(raw.get("draft_vocab_size") or vocab)  # absent: the full vocabulary (vLLM)
    meta = sub_dict(raw, META)
    layers = backbone_config.num_hidden_layers if backbone_config is not None else meta.get("target_layers")
    layers = None if layers is None else int(layers)
    if draft_vocab > vocab:
        raise UserError(f"{where}: draft_vocab_size {draft_vocab} exceeds vocab_size {vocab}; a draft "
                        "vocabulary is a subset of the target's")
    aux = _aux_ids(d, raw)
    if aux is None:  # both engines then capture the target's default layers, known only with the target
        if layers is None:
            raise NeedsBackboneConfig(f"{where} names no aux layer ids (the engines then use the "
                                      "target's layers (2, N//2, N-3)): load it with its backbone (backbone=)",
                                      base_model=str(raw.get("base_model_name_or_path") or ""))
        aux = _target_default_aux(d, layers)
    if backbone_config is not None and not all(0 <= i < layers for i in aux):
        raise IncompatibleHeadsError(f"EAGLE-3 drafter in {d} reads aux layers {aux}, the backbone has hidden states "
                                     f"0..{layers - 1} ({layers} layers): it was trained for another target")
    if layers is None:  # no backbone: the fewest layers these ids need (the backbone's count is checked on load)
        layers = max(aux) + 1
    # A draft vocabulary as large as the target's is held as a full lm_head (``load`` puts the rows at
    # their ids), so only a smaller one needs the token map.
    truncated = draft_vocab < vocab
    return HeadsSpec(num_heads=int(meta.get("num_heads") or depth or FOREIGN_DEPTH), num_layers=1,
                     hidden_size=hidden, vocab_size=vocab, projection="truncated" if truncated else "own",
                     truncated_vocab_size=draft_vocab if truncated else None,
                     base_model=str(raw.get("base_model_name_or_path") or ""),
                     base_model_fingerprint=str(meta.get("base_model_fingerprint") or ""), kind="eagle3",
                     aux_layers=aux, draft_layer=_draft_layer(where, raw, layers))


def read_weights(d: Path) -> tuple[dict[str, torch.Tensor], Path]:
    """The dir's tensors (``model.`` stripped) and the file they came from: ``model.safetensors``, its shards
    (``model.safetensors.index.json``), or ``pytorch_model.bin`` through ``torch.load(weights_only=True)``."""
    if (d / WEIGHTS).is_file():
        files, f = [d / WEIGHTS], d / WEIGHTS
    elif (d / INDEX).is_file():
        files, f = indexed_shards(d / INDEX), d / INDEX
    elif (d / PICKLE).is_file():
        files, f = [], d / PICKLE
    else:
        raise UserError(f"{d} is an EAGLE-3 dir without {WEIGHTS}, {INDEX} or {PICKLE}")
    tensors: dict[str, torch.Tensor] = {}
    for shard in files:
        check_safetensors(shard)
        tensors.update(load_file(str(shard)))
    if not files:
        tensors = load_pickle_weights(f)
    # SGLang accepts names with or without the "model." its own module adds; so do we.
    return {k.removeprefix("model."): v for k, v in tensors.items()}, f


def load(d: Path, spec: HeadsSpec):
    """(drafter, None), values exactly as the engines run them: the draft rows at their target ids."""
    tensors, f = read_weights(d)
    return load_tensors(spec, tensors, f, tied=bool((raw_config(d) or {}).get("tie_word_embeddings"))), None


def _refuse_unknown(f, tensors: dict, flagged: dict) -> None:
    """One line for a tensor the drafter would not load (naming the flag that adds it) or a layer weight missing;
    ``flagged``: the tensors the config's flags on fc's input add (``fc_input_weights``)."""
    known = {*LAYER_WEIGHTS, *flagged, "lm_head.weight", "d2t", "t2d", "embed_tokens.weight"}
    missing = sorted(set(LAYER_WEIGHTS) - set(tensors))
    unknown = sorted(set(tensors) - known)
    for name in unknown:
        flag = next((v for k, v in FLAG_TENSORS.items() if k in name), None)
        if flag in FC_INPUT_FLAGS:
            raise UserError(f"{f} holds {name}, but its config does not set {flag}=true ({FC_INPUT_FLAGS[flag]}): "
                            f"vLLM would not compute it; set {flag} in config.json if the drafter was trained with it")
        if flag:
            what = f"{flag}=true ({UNSUPPORTED_FLAGS[flag]})" if flag in UNSUPPORTED_FLAGS else flag
            raise UserError(f"{f} holds {name}: {what} is not supported by this drafter")
    if missing or unknown:
        raise UserError(f"{f} is not an EAGLE-3 drafter this runtime computes: missing {missing[:4]}, "
                        f"unexpected {unknown[:4]}")


def _fc_input_state(f, tensors: dict, flagged: dict) -> dict:
    """The weights of the norms on fc's input the config sets; one it lacks is ones, as vLLM and speculators run
    it (module docstring), with a warning."""
    missing = [name for name in flagged if name not in tensors]
    if missing:
        flags = sorted({f"{v}=true" for name in missing for k, v in FLAG_TENSORS.items() if k in name})
        warnings.warn(f"{f}: {', '.join(flags)} but no {', '.join(missing)}: run with ones, as vLLM (its RMSNorm "
                      "starts at ones) and speculators run it", FormatWarning, stacklevel=4)
    dtype = tensors["fc.weight"].dtype
    return {name: tensors[name] if name in tensors else torch.ones(size, dtype=dtype) for name, size in flagged.items()}


def load_tensors(spec: HeadsSpec, tensors: dict[str, torch.Tensor], path: Path, tied: bool = False,
                 layout: str | None = None):
    """The drafter of ``spec`` from vLLM-named tensors read from ``path``; ``tied``: the config's
    tie_word_embeddings (vLLM loads the checkpoint's own lm_head.weight regardless; without one refused);
    ``layout``: the format named in refusals when it is not this one."""
    f = f"{path} ({layout})" if layout else path
    flagged = fc_input_weights(spec.settings.draft_layer, spec.hidden_size)
    _refuse_unknown(f, tensors, flagged)
    if "lm_head.weight" not in tensors:
        why = "tie_word_embeddings=true (lm_head = embed_tokens) is not supported" if tied else \
            "an EAGLE-3 drafter needs its own draft lm_head"
        raise UserError(f"{f} has no lm_head.weight: {why}")
    if tied:
        warnings.warn(f"{f}: tie_word_embeddings=true, but the checkpoint has its own lm_head.weight: loaded, as vLLM "
                      "loads it (SGLang would use the embedding table instead)", FormatWarning, stacklevel=3)
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
    state.update(_fc_input_state(f, tensors, flagged))
    if spec.projection == "truncated":
        state["lm_head.weight"], state["token_map"] = lm_head, ids
    else:
        full = torch.empty_like(lm_head)
        full[ids] = lm_head  # rows == vocab here, so the distinct ids cover every token once
        state["lm_head.weight"] = full
    check_shapes(spec, {k: tuple(t.shape) for k, t in state.items()}, path)   # before building at the config's sizes
    heads = build_heads(spec)
    load_state_checked(heads, state, path)
    return heads


register_importer("eagle3", detect=is_eagle3_dir, read_spec=read_spec, load=load, read_spec_for=read_spec)
