"""The reference Medusa layout and the engines that read it: TensorRT-LLM, TGI (v1 and v2), Medusa.

One directory, two files: ``config.json`` and ``medusa_lm_head.safetensors`` holding, for head h
of L blocks, ``{h}.{l}.linear.weight`` [hidden, hidden], ``{h}.{l}.linear.bias`` [hidden] and the
head's projection ``{h}.{L}.weight`` [vocab, hidden] (no bias): the state dict of the reference
``nn.Sequential(*blocks, nn.Linear(hidden, vocab, bias=False))``.

Read from the loaders themselves:
  TensorRT-LLM  tensorrt_llm/models/medusa/weight.py ``load_medusa_hf`` (NVIDIA/TensorRT-LLM
                commit 27712aa7720aa3e6a594ad3cc678625490cb479d) and examples/medusa/convert_checkpoint.py
                (commit 063e02f73410f2f9172a581ca5e3f41d0d3dab8e; the same flag handling at
                b93e14ca093e446615f3009cae6ca5a33c4f2f56):
                reads ``medusa_lm_head.pt`` if present, else ``medusa_lm_head.safetensors``; a projection
                per head is required (``{h}.{L}.weight``). Its CLI flags win over the heads' config:
                ``--num_medusa_heads`` defaults to 4 (the config's ``medusa_num_heads`` is read only when
                the flag is None, which its default never is), and the engine config it writes takes
                ``num_medusa_layers`` from ``--num_medusa_layers`` (default 1) *before* it reads the
                heads' ``medusa_num_layers``: heads with L > 1 layers load all L into the checkpoint but
                the engine is built with one (trtllm-build only warns about the unused tensors). So the
                printed command passes ``--num_medusa_heads K --num_medusa_layers L``.
                The LLM API's ``MedusaConfig.from_hugging_face`` (tensorrt_llm/models/medusa/config.py,
                commit 084a8843ce92c0d349a90e0d4f8ed1232fe8ddbb) reads ``num_medusa_heads`` (not
                ``medusa_num_heads``) and ``medusa_num_layers`` from this dir's config.json: the export
                writes both spellings of the head count. ``examples/run.py --medusa_choices`` takes the
                tree as a list of paths (examples/medusa/README.md): the export writes one beside the
                heads (``medusa_choices.json``, see below).
  TGI           server/text_generation_server/layers/medusa.py and layers/speculative.py
                (huggingface/text-generation-inference commits 91560ed931b217ddb1ee152891d20440fef331d4,
                c09f5bc93071e2701e201bb374d488e4673fac3d), models/__init__.py ``get_model``: a model dir whose
                config.json has ``medusa_num_heads`` is a Medusa dir, the backbone is its
                ``base_model_name_or_path``; the config must have NO ``architectures`` key (with one,
                TGI looks for an MLP speculator and otherwise silently runs without speculation).
                v1 = per-head projections as above; when ``{h}.{L}.weight`` is missing TGI falls back
                to v2: only ``{h}.0.linear.*`` and the base lm_head, ``medusa_num_layers`` must be 1.
                The launcher (launcher/src/main.rs ``resolve_attention``, commit
                db931fcf42da018a3657580c64bf2720f167f9ab) reads the *model dir's* config.json, i.e. this
                one: without a head size (``head_dim``, or ``hidden_size / num_attention_heads``) it logs
                "Forcing attention to ... because head dim is not supported by flashinfer, also disabling
                prefix caching". With the backbone's ``head_dim`` and ``num_attention_heads`` here it takes
                the same path as for the backbone alone (flashinfer + prefix caching when the head size is
                64, 128 or 256). That is safe: ``get_model`` tests only ``medusa_num_heads`` and then reloads
                the config from ``base_model_name_or_path``; ``SpeculativeHead.load`` reads only
                ``architectures`` / ``medusa_num_layers`` here. What the export must NOT add:
                ``architectures`` (see above) and ``model_type`` -- the router's
                ``legacy_tokenizer_handle`` (router/src/server.rs) takes the tokenizer from
                ``base_model_name_or_path`` only when ``model_type`` is absent, and this dir has none.
                Without model_type the launcher's per-model rule (falcon, deepseek_v2: force the fallback
                attention) cannot fire, so for those backbones no head size is written and the note says
                to set ``ATTENTION`` / ``PREFIX_CACHING`` as for the backbone; multimodal and
                encoder-decoder backbones (prefix caching off in TGI) likewise get no head size.
                The launcher also hands this dir to the router as the tokenizer, and the router reads the
                chat template only from its ``tokenizer_config.json`` / ``chat_template.json``: the export
                copies the backbone's tokenizer files here (``tgi_tokenizer_files``).
  Medusa        FasterDecoding/Medusa medusa/model/medusa_model.py (commit 60eeab92e98adb0e787987493b11fa38535a8260):
                ``MedusaConfig`` {medusa_num_heads, medusa_num_layers, base_model_name_or_path};
                ``from_pretrained`` reads ``medusa_lm_head.pt`` only and builds ``[ResBlock] * L``
                (one block repeated), so it cannot hold L > 1 distinct layers. Its fallback path sets
                ``medusa_num_heads = 5`` whatever the config says and loads with ``strict=False``: with
                K < 5 heads the rest keep their random init, and its default trees (``mc_sim_7b_63`` and
                the ``*_stage2`` trees from ``get_medusa_choice``, depth 4) consult them. Candidates are
                the top ``TOPK = 10`` of each head (medusa/model/utils.py), so a tree rank must be < 10.

Trees (``medusa_choices.json``, tensorrt_llm and medusa_v1): a bare JSON list of paths, the format
both ``medusa_generate(medusa_choices=...)`` and TensorRT-LLM's ``run.py --medusa_choices`` take,
grown like the ``treeN`` defaults of ``inference.runtime.tree`` (63 nodes from the Medusa paper's
per-head accuracies) with depth <= K (<= 5 for the reference loader) and ranks < 10.
"""

from __future__ import annotations

import json
import pickle
import re
import warnings
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ..backbone import text_config
from ..errors import UserError
from ..heads.medusa import MedusaHeads
from ..heads.native import check_safetensors, load_state_checked
from ..heads.spec import HeadsSpec
from .export import (ExportOptions, ExportPlan, FormatWarning, full_projection, materialise_note,
                     megabytes, refuse_unless_kind, register_exporter, stored_projection_bytes)
from .importers import register_importer
from ..runtime.tree import grow_tree, reference_accuracies

WEIGHTS_SAFETENSORS = "medusa_lm_head.safetensors"
WEIGHTS_PICKLE = "medusa_lm_head.pt"
BLOCK = re.compile(r"^(\d+)\.(\d+)\.linear\.(weight|bias)$")
PROJECTION = re.compile(r"^(\d+)\.(\d+)\.weight$")
# Prefixes some trainers leave on the keys (a wrapper's attribute name, DDP's ``module.``).
_KEY_PREFIXES = ("module.", "medusa_head.", "medusa_heads.")

TREE_FILE = "medusa_choices.json"
_TREE_RANKS = 10     # FasterDecoding's TOPK: each head offers its top 10 (medusa/model/utils.py)
_TREE_BUDGET = 63    # nodes besides the root, as Medusa's and TensorRT-LLM's default trees
_REFERENCE_HEADS = 5  # FasterDecoding's from_pretrained builds 5 heads whatever the config says

_SERVE = {
    "tensorrt_llm": "python examples/medusa/convert_checkpoint.py --model_dir <base model dir> "
                    "--medusa_model_dir <this dir> --num_medusa_heads {K} --num_medusa_layers {L} "
                    "--output_dir tllm_ckpt --dtype float16; "
                    "trtllm-build --checkpoint_dir tllm_ckpt --output_dir engine --speculative_decoding_mode medusa; "
                    "python examples/run.py --engine_dir engine --tokenizer_dir <base model dir> --use_py_session "
                    "--temperature 0.0 --medusa_choices \"$(cat <this dir>/" + TREE_FILE + ")\" "
                    "(without --num_medusa_layers, convert_checkpoint.py builds 1 layer per head)",
    "tgi": "text-generation-launcher --model-id <this dir>",
    "medusa_v1": "the reference loader reads medusa_lm_head.pt only: convert where you need it "
                 "(torch.save(safetensors.torch.load_file(...), 'medusa_lm_head.pt')); it builds 5 heads "
                 "(strict=False), so pass a tree no deeper than {depth}: "
                 "model.medusa_generate(..., medusa_choices=json.load(open('<this dir>/" + TREE_FILE + "')))",
}

# Backbone model types whose attention TGI's launcher picks by model_type, which this dir cannot carry.
_TGI_MODEL_TYPE_ATTENTION = ("falcon", "deepseek_v2")


def reference_tree(num_heads: int, max_depth: int):
    """The tree written beside reference-layout heads: depth <= min(num_heads, max_depth), ranks < 10."""
    depth = min(num_heads, max_depth)
    tree, _ = grow_tree(reference_accuracies(depth, _TREE_RANKS), _TREE_BUDGET, name=f"tree64-depth{depth}")
    return tree


def tgi_launcher_keys(backbone_config, spec: HeadsSpec) -> tuple[dict, str]:
    """(keys TGI's launcher reads for its attention choice, a note for the user or "")."""
    how = ("TGI's launcher will force its fallback attention and disable prefix caching for this dir; "
           "set ATTENTION / PREFIX_CACHING as TGI picks them for the backbone")
    if backbone_config is None:
        return {}, f"note: the backbone's config could not be read (pass backbone=<model>): {how}"
    top = backbone_config.to_dict() if hasattr(backbone_config, "to_dict") else dict(backbone_config)
    cfg = text_config(backbone_config)
    get = (lambda k: getattr(cfg, k, None)) if not isinstance(cfg, dict) else cfg.get
    if get("hidden_size") != spec.hidden_size:
        raise UserError(f"the backbone config has hidden size {get('hidden_size')}, the heads need "
                        f"{spec.hidden_size}: wrong backbone")
    model_type = top.get("model_type")
    if model_type in _TGI_MODEL_TYPE_ATTENTION or top.get("vision_config") or top.get("is_encoder_decoder"):
        return {}, (f"note: TGI chooses attention for {model_type} backbones by model_type, which a Medusa dir "
                    f"cannot carry: {how}")
    heads = get("num_attention_heads")
    head_dim = get("head_dim") or (spec.hidden_size // heads if heads and spec.hidden_size % heads == 0 else None)
    if not heads or not head_dim:
        return {}, f"note: the backbone config names no attention head size: {how}"
    keys = {"num_attention_heads": int(heads), "head_dim": int(head_dim)}
    if get("max_position_embeddings"):   # TGI reads it from this dir: absent, 4,096 (more than a short backbone has)
        keys["max_position_embeddings"] = int(get("max_position_embeddings"))
    return keys, ""


def tgi_tokenizer_files(options: ExportOptions, notes: list) -> dict:
    """The backbone's tokenizer files for the TGI dir. TGI's launcher hands the model dir to its router as
    the tokenizer, and the router takes the chat template (and bos / eos) only from that dir's
    ``tokenizer_config.json`` / ``chat_template.json`` (router/src/server.rs): without them every
    ``/v1/chat/completions`` request fails with "template not found" (``base_model_name_or_path`` gives it
    the tokenizer only, through ``legacy_tokenizer_handle``)."""
    files = options.tokenizer_files() if options.tokenizer_files is not None else {}
    if not files:
        notes.append("note: the backbone's tokenizer could not be read (pass backbone=<model>): TGI's chat API "
                     "needs its tokenizer_config.json (with the chat template) in this dir, or "
                     "--tokenizer-config-path <backbone>/tokenizer_config.json")
    elif "chat_template.json" not in files:
        notes.append("note: the backbone's tokenizer has no chat template: TGI serves /generate, not its chat API")
    return files


# -- export -----------------------------------------------------------------------------------
def _export(heads: MedusaHeads, options: ExportOptions, fmt: str) -> ExportPlan:
    refuse_unless_kind(heads, "medusa")
    spec = heads.spec
    K, L = spec.num_heads, spec.num_layers
    written = options.dtype or next((p.dtype for p in heads.parameters()), torch.float32)   # dtype= casts them
    full_bytes = K * spec.vocab_size * spec.hidden_size * (torch.finfo(written).bits // 8)
    grow = f"+{megabytes(full_bytes - stored_projection_bytes(heads, options))}"
    layout = "v1"
    # materialize=true asks for per-head projections (v1) by name, even where the compact v2 could hold the heads
    if fmt == "tgi" and spec.projection == "shared" and not options.materialize:
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
        notes.append(materialise_note(heads, fmt, stored_projection_bytes(heads, options), full_bytes))
    if fmt == "medusa_v1" and K > _REFERENCE_HEADS:
        notes.append(f"the reference Medusa loader builds {_REFERENCE_HEADS} heads whatever the config says "
                     f"(strict=False): heads {_REFERENCE_HEADS}..{K - 1} are ignored there")
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
    extra_files = {}
    depth = K
    if fmt == "tensorrt_llm":
        config["num_medusa_heads"] = K  # what TensorRT-LLM's LLM-API MedusaConfig.from_hugging_face reads
    if fmt == "tgi":
        # The head size TGI's launcher needs to keep flashinfer + prefix caching (never model_type).
        reader = options.backbone_config
        keys, note = tgi_launcher_keys(reader() if reader is not None else None, spec)
        config.update(keys)
        if note:
            notes.append(note)
        extra_files.update(tgi_tokenizer_files(options, notes))
    if fmt in ("tensorrt_llm", "medusa_v1"):
        tree = reference_tree(K, _REFERENCE_HEADS if fmt == "medusa_v1" else K)
        depth = tree.max_depth
        extra_files[TREE_FILE] = json.dumps(tree.choices) + "\n"
        notes.append(f"tree: {TREE_FILE} ({tree.num_nodes - 1} nodes, depth {depth} <= {K} heads)")
    notes.append("serve: " + _SERVE[fmt].format(K=K, L=L, depth=depth))
    return ExportPlan(config=config, weights_file=WEIGHTS_SAFETENSORS, tensors=tensors, notes=notes,
                      extra_files=extra_files)


@register_exporter("tensorrt_llm", "medusa", files=(WEIGHTS_SAFETENSORS, TREE_FILE))
def export_tensorrt_llm(heads, options):
    return _export(heads, options, "tensorrt_llm")


@register_exporter("tgi", "medusa", files=(WEIGHTS_SAFETENSORS,))
def export_tgi(heads, options):
    return _export(heads, options, "tgi")


@register_exporter("medusa_v1", "medusa", files=(WEIGHTS_SAFETENSORS, TREE_FILE))
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
    f = d / WEIGHTS_SAFETENSORS
    if f.is_file():  # preferred over the pickle when both exist: nothing to unpickle
        check_safetensors(f)
        with safe_open(str(f), framework="pt") as st:
            return {_strip(k): tuple(st.get_slice(k).get_shape()) for k in st.keys()}, None
    tensors = {_strip(k): v for k, v in load_pickle_weights(d / WEIGHTS_PICKLE).items()}
    return {k: tuple(v.shape) for k, v in tensors.items()}, tensors


def _load_tensors(d: Path) -> dict[str, torch.Tensor]:
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
