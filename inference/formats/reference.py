"""The reference Medusa layout and the engines that read it: TensorRT-LLM, TGI (v1 and v2), Medusa.

One directory, two files: ``config.json`` and ``medusa_lm_head.safetensors`` holding, for head h
of L blocks, ``{h}.{l}.linear.weight`` [hidden, hidden], ``{h}.{l}.linear.bias`` [hidden] and the
head's projection ``{h}.{L}.weight`` [vocab, hidden] (no bias): the state dict of the reference
``nn.Sequential(*blocks, nn.Linear(hidden, vocab, bias=False))``.

Read from the loaders themselves:
  TensorRT-LLM  tensorrt_llm/models/medusa/weight.py ``load_medusa_hf`` (NVIDIA/TensorRT-LLM
                commit 27712aa7720aa3e6a594ad3cc678625490cb479d) and examples/medusa/convert_checkpoint.py
                (commit 063e02f73410f2f9172a581ca5e3f41d0d3dab8e): reads ``medusa_lm_head.pt`` if present,
                else ``medusa_lm_head.safetensors``; config ``medusa_num_layers`` (and
                ``medusa_num_heads`` only when ``--num_medusa_heads`` is not given: its default is 4,
                so pass it); a projection per head is required (``{h}.{L}.weight``).
  TGI           server/text_generation_server/layers/medusa.py and layers/speculative.py
                (huggingface/text-generation-inference commits 91560ed931b217ddb1ee152891d20440fef331d4,
                c09f5bc93071e2701e201bb374d488e4673fac3d), models/__init__.py ``get_model``: a model dir whose
                config.json has ``medusa_num_heads`` is a Medusa dir, the backbone is its
                ``base_model_name_or_path``; the config must have NO ``architectures`` key (with one,
                TGI looks for an MLP speculator and otherwise silently runs without speculation).
                v1 = per-head projections as above; when ``{h}.{L}.weight`` is missing TGI falls back
                to v2: only ``{h}.0.linear.*`` and the base lm_head, ``medusa_num_layers`` must be 1.
  Medusa        FasterDecoding/Medusa medusa/model/medusa_model.py (commit 60eeab92e98adb0e787987493b11fa38535a8260):
                ``MedusaConfig`` {medusa_num_heads, medusa_num_layers, base_model_name_or_path};
                ``from_pretrained`` reads ``medusa_lm_head.pt`` only and builds ``[ResBlock] * L``
                (one block repeated), so it cannot hold L > 1 distinct layers.
"""

from __future__ import annotations

import json
import pickle
import re
import warnings
from pathlib import Path

import torch

from ..errors import UserError
from ..heads.medusa import MedusaHeads
from ..heads.native import load_state_checked
from ..heads.spec import HeadsSpec
from .export import (ExportOptions, ExportPlan, FormatWarning, full_projection, materialise_note,
                     megabytes, refuse_unless_kind, register_exporter)
from .importers import register_importer

WEIGHTS_SAFETENSORS = "medusa_lm_head.safetensors"
WEIGHTS_PICKLE = "medusa_lm_head.pt"
BLOCK = re.compile(r"^(\d+)\.(\d+)\.linear\.(weight|bias)$")
PROJECTION = re.compile(r"^(\d+)\.(\d+)\.weight$")
# Prefixes some trainers leave on the keys (a wrapper's attribute name, DDP's ``module.``).
_KEY_PREFIXES = ("module.", "medusa_head.", "medusa_heads.")

_SERVE = {
    "tensorrt_llm": "python examples/medusa/convert_checkpoint.py --model_dir <base model dir> "
                    "--medusa_model_dir <this dir> --num_medusa_heads {K} --output_dir tllm_ckpt --dtype float16; "
                    "trtllm-build --checkpoint_dir tllm_ckpt --output_dir engine --speculative_decoding_mode medusa",
    "tgi": "text-generation-launcher --model-id <this dir>",
    "medusa_v1": "the reference loader reads medusa_lm_head.pt only: convert where you need it "
                 "(torch.save(safetensors.torch.load_file(...), 'medusa_lm_head.pt'))",
}


# -- export -----------------------------------------------------------------------------------
def _projection_bytes(heads) -> int:
    if heads.projections is None:
        return 0
    n = sum(p.weight.numel() * p.weight.element_size() for p in heads.projections)
    return n + (heads.token_map.numel() * 8 if heads.token_map is not None else 0)


def _export(heads: MedusaHeads, options: ExportOptions, fmt: str) -> ExportPlan:
    refuse_unless_kind(heads, "medusa")
    spec = heads.spec
    K, L = spec.num_heads, spec.num_layers
    elem = next((p.element_size() for p in heads.parameters()), 4)
    full_bytes = K * spec.vocab_size * spec.hidden_size * elem
    grow = f"+{megabytes(full_bytes - _projection_bytes(heads))}"
    layout = "v1"
    if fmt == "tgi" and spec.projection == "shared" and (L == 1 or not options.materialize):
        if L != 1:
            raise UserError(f"TGI's shared-lm_head layout (v2) takes exactly one layer per head (its loader asserts "
                            f"medusa_num_layers == 1), these heads have {L}: pass materialize=true to write "
                            f"per-head projections instead ({grow})")
        layout = "v2"
    if layout == "v1" and spec.projection != "own" and not options.materialize:
        raise UserError(f"{fmt} needs a full-vocabulary projection per head and these heads have a {spec.projection} "
                        f"projection: pass materialize=true to expand it ({grow})")
    notes = []
    tensors: dict[str, torch.Tensor] = {}
    for h, blocks in enumerate(heads.blocks):
        for l, block in enumerate(blocks):
            tensors[f"{h}.{l}.linear.weight"] = block.linear.weight.detach()
            tensors[f"{h}.{l}.linear.bias"] = block.linear.bias.detach()
        if layout == "v1":
            tensors[f"{h}.{L}.weight"] = full_projection(heads, h, options)[0]
    if layout == "v1" and spec.projection != "own":
        notes.append(materialise_note(heads, fmt, _projection_bytes(heads), full_bytes))
    if fmt == "medusa_v1" and L > 1:
        notes.append(f"the reference Medusa loader repeats one block L times ([ResBlock] * L): it cannot run these "
                     f"{L} distinct layers (TensorRT-LLM and TGI can)")
    dtype = next(t for t in tensors.values() if t.is_floating_point()).dtype
    # No "architectures" key: TGI would then look for an MLP speculator and drop the heads.
    config = {
        "medusa_num_heads": K,
        "medusa_num_layers": L,
        "base_model_name_or_path": options.base_model or spec.base_model,
        "hidden_size": spec.hidden_size,
        "vocab_size": spec.vocab_size,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "base_model_fingerprint": spec.base_model_fingerprint,
        "medusa_layout": layout,
    }
    notes.append("serve: " + _SERVE[fmt].format(K=K, L=L))
    return ExportPlan(config=config, weights_file=WEIGHTS_SAFETENSORS, tensors=tensors, notes=notes)


@register_exporter("tensorrt_llm", "medusa")
def export_tensorrt_llm(heads, options):
    return _export(heads, options, "tensorrt_llm")


@register_exporter("tgi", "medusa")
def export_tgi(heads, options):
    return _export(heads, options, "tgi")


@register_exporter("medusa_v1", "medusa")
def export_medusa_v1(heads, options):
    return _export(heads, options, "medusa_v1")


# -- import -----------------------------------------------------------------------------------
def is_reference_dir(d: Path) -> bool:
    return (d / WEIGHTS_SAFETENSORS).is_file() or (d / WEIGHTS_PICKLE).is_file()


def _config(d: Path) -> dict:
    f = d / "config.json"
    if not f.is_file():
        return {}  # weights alone are enough: counts come from them; the backbone must then be passed
    try:
        raw = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{f} is not valid JSON ({e})") from None
    return raw if isinstance(raw, dict) else {}


def load_pickle_weights(path: Path) -> dict[str, torch.Tensor]:
    """A ``.pt`` state dict, unpickled with ``weights_only=True``: tensors and containers only.

    A pickle that names any other global (a class, a function) would run code on load; it is
    refused, naming that global."""
    try:
        obj = torch.load(str(path), map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, AttributeError, TypeError, ValueError, EOFError) as e:
        text = str(e)
        m = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text) or re.search(r"global ([\w.]+)", text)
        if m or "Weights only load failed" in text:
            what = f" ({m[1]})" if m else ""
            raise UserError(f"{path} needs arbitrary code to unpickle{what}: refused, only plain tensors are loaded "
                            "(weights_only=True); re-save it as safetensors where you trust its source") from None
        first = text.strip().splitlines()[0] if text.strip() else type(e).__name__
        raise UserError(f"{path} is corrupt or unreadable ({first})") from None
    if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
        obj = obj["state_dict"]
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise UserError(f"{path} is not a state dict of tensors")
    return {str(k): v for k, v in obj.items()}


def _strip(name: str) -> str:
    for p in _KEY_PREFIXES:
        name = name.removeprefix(p)
    return name


def _shapes(d: Path) -> tuple[dict[str, tuple], dict[str, torch.Tensor] | None]:
    """Names -> shapes (and the tensors, when they had to be loaded to know them)."""
    from safetensors import SafetensorError, safe_open

    f = d / WEIGHTS_SAFETENSORS
    if f.is_file():  # preferred over the pickle when both exist: nothing to unpickle
        try:
            with safe_open(str(f), framework="pt") as st:
                return {_strip(k): tuple(st.get_slice(k).get_shape()) for k in st.keys()}, None
        except (SafetensorError, OSError) as e:
            raise UserError(f"{f} is corrupt or unreadable ({e})") from None
    tensors = {_strip(k): v for k, v in load_pickle_weights(d / WEIGHTS_PICKLE).items()}
    return {k: tuple(v.shape) for k, v in tensors.items()}, tensors


def _load_tensors(d: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    f = d / WEIGHTS_SAFETENSORS
    if f.is_file():
        return {_strip(k): v for k, v in load_file(str(f)).items()}
    return {_strip(k): v for k, v in load_pickle_weights(d / WEIGHTS_PICKLE).items()}


def read_spec(d: Path, shapes: dict[str, tuple] | None = None) -> HeadsSpec:
    """Heads and layers counted from the weights (reference configs are often wrong: a warning)."""
    config = _config(d)
    if shapes is None:
        shapes, _ = _shapes(d)
    weights_name = WEIGHTS_SAFETENSORS if (d / WEIGHTS_SAFETENSORS).is_file() else WEIGHTS_PICKLE
    layers: dict[int, set] = {}
    projections: dict[int, int] = {}
    unknown = []
    for name, shape in shapes.items():
        if m := BLOCK.match(name):
            layers.setdefault(int(m[1]), set()).add(int(m[2]))
        elif m := PROJECTION.match(name):
            projections[int(m[1])] = int(m[2])
        else:
            unknown.append(name)
    if unknown:
        raise UserError(f"{d / weights_name} has tensors that are not Medusa head weights: {sorted(unknown)[:4]}")
    head_ids = set(layers) | set(projections)
    if not head_ids:
        raise UserError(f"{d / weights_name} holds no Medusa head weights")
    K = max(head_ids) + 1
    if head_ids != set(range(K)):
        raise UserError(f"{d / weights_name}: heads must be numbered 0..K-1, found {sorted(head_ids)}")
    layer_sets = {frozenset(layers.get(h, ())) for h in range(K)}
    if len(layer_sets) != 1:
        raise UserError(f"{d / weights_name}: heads have different numbers of layers")
    L = len(next(iter(layer_sets)))
    if sorted(next(iter(layer_sets))) != list(range(L)):
        raise UserError(f"{d / weights_name}: layers must be numbered 0..L-1")
    for h in range(K):
        for l in range(L):
            if f"{h}.{l}.linear.bias" not in shapes or f"{h}.{l}.linear.weight" not in shapes:
                raise UserError(f"{d / weights_name}: {h}.{l}.linear.weight/bias is missing")
    if projections and set(projections) != set(range(K)):
        raise UserError(f"{d / weights_name}: only heads {sorted(projections)} have a projection")
    if projections and set(projections.values()) != {L}:
        raise UserError(f"{d / weights_name}: a head's projection must be {{h}}.{L}.weight after its {L} layers")
    for key, value in (("medusa_num_heads", K), ("medusa_num_layers", L)):
        if key in config and config[key] != value:
            warnings.warn(f"{d / 'config.json'} says {key}={config[key]} but {weights_name} holds {value}: "
                          f"using {value}", FormatWarning, stacklevel=3)
    first = shapes.get("0.0.linear.weight") or shapes.get(f"0.{L}.weight")
    hidden = int(first[-1])
    # Without projections (TGI v2) the vocabulary is the backbone's: 0 here means "not known yet".
    vocab = int(shapes[f"0.{L}.weight"][0]) if projections else int(config.get("vocab_size") or 0)
    return HeadsSpec(num_heads=K, num_layers=L, hidden_size=hidden, vocab_size=vocab,
                     projection="own" if projections else "shared",
                     base_model=config.get("base_model_name_or_path") or "",
                     base_model_fingerprint=config.get("base_model_fingerprint") or "")


def load(d: Path, spec: HeadsSpec) -> tuple[MedusaHeads, None]:
    tensors = _load_tensors(d)
    heads = MedusaHeads(spec)
    L = spec.num_layers
    state = {}
    for h in range(spec.num_heads):
        for l in range(L):
            state[f"blocks.{h}.{l}.linear.weight"] = tensors[f"{h}.{l}.linear.weight"]
            state[f"blocks.{h}.{l}.linear.bias"] = tensors[f"{h}.{l}.linear.bias"]
        if spec.projection == "own":
            state[f"projections.{h}.weight"] = tensors[f"{h}.{L}.weight"]
    load_state_checked(heads, state, d)
    return heads, None


register_importer("reference", detect=is_reference_dir, read_spec=read_spec, load=load)
