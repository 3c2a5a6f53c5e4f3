"""The one heads loader: native exports and every registered foreign layout, and ``load_medusa``.

It sits above both ``inference.heads`` (the native format, which knows no engine layout) and
``inference.formats`` (the importers, which register themselves): ``read_heads_spec`` /
``load_heads`` ask the registered importers whether a directory is a foreign layout (reference
Medusa, TGI, vLLM, EAGLE-3) and otherwise use the native reader, so ``load_medusa``, ``medusa-eval`` and
``medusa-export`` accept any of them as they are, with the same checks.

``load_medusa`` resolves the backbone the heads were trained on (``spec.base_model``: an
``embedded:`` name, a local path or hub id) unless one is given, loads it with SDPA attention
(custom 4D tree masks need an attention implementation that applies them: sdpa or eager;
flash-attention kernels ignore them), and loads the heads strictly, refusing heads made for
another backbone (hidden size, vocabulary, config fingerprint) and missing or corrupt files, as
``UserError``s.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Optional, Sequence

import torch

from .assets import cache_dir
from .backbone import load_backbone, load_backbone_config, parse_device, parse_dtype
from .chat_template import set_template_args, template_args_for
from .errors import NeedsBackboneConfig, UserError
from .formats.export import FormatWarning
from .formats.importers import detect_layout, importer_for
from .heads.native import check_config_object, check_safetensors, place, read_native, read_native_spec
from .heads.registry import family
from .heads.spec import HeadsSpec, check_compatible
from .runtime.adapter import merge_lora, read_adapter
from .runtime.kernel_plan_cache import FILE_NAME
from .runtime.model import MedusaModel, apply_kernels, check_backbone_config, check_kernels
from .runtime.draft_weights import check_draft_weights, half_draft_weights
from .runtime.static_steps import DEFAULT_BUCKETS, apply_graphs, check_graphs, graphs_mode


def read_heads_spec(heads_dir: str | os.PathLike, backbone_config=None) -> HeadsSpec:
    """The spec of any loadable heads directory, without loading weights. A layout whose config leaves
    facts to the target (``NeedsBackboneConfig``) is read with ``backbone_config``."""
    d = Path(heads_dir)
    check_config_object(d)   # every layout's detection looks keys up in it
    layout = detect_layout(d)
    if layout is not None:
        return importer_for(layout).spec(d, backbone_config)
    return _canonical_spec(read_native_spec(d), f"heads in {d}")


def _spec_before_load(heads_dir, backbone_config=None) -> HeadsSpec:
    """``read_heads_spec`` for a directory that is loaded next: without the layout's notes, which the load
    gives once, after checking the heads fit the backbone (so a refusal is one line on its own)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FormatWarning)
        return read_heads_spec(heads_dir, backbone_config)


def _canonical_spec(spec: HeadsSpec, where: str) -> HeadsSpec:
    """The spec as its family runs it once loaded (EAGLE-3: aux ids in the engines' ascending order, ids
    named twice refused): ``canonical_spec`` on the family's module, if it has one."""
    canonical = getattr(family(spec.kind).module, "canonical_spec", None)
    return canonical(spec, where) if canonical is not None else spec


def _canonicalize(heads, where: str):
    """Loaded heads in the form their family serves (``canonicalize`` on the module, if it has one)."""
    canonicalize = getattr(heads, "canonicalize", None)
    return canonicalize(where) if canonicalize is not None else heads


def spec_with_target(heads_dir: str | os.PathLike, backbone=None, trust_remote_code: bool = False):
    """(spec, target config) of a directory about to be loaded onto ``backbone`` (a name or path; None:
    the one the directory records). The target config is None when the directory's own config says
    everything; else it is the backbone's config (not its weights): an EAGLE-3 drafter that names no aux
    layers, as the EAGLE repository and SpecForge publish them, reads its target's default layers, so its
    spec depends on the target's depth."""
    try:
        return _spec_before_load(heads_dir), None
    except NeedsBackboneConfig as e:
        name = str(backbone) if backbone is not None else e.base_model
        if not name:
            raise
        target = load_backbone_config(name, trust_remote_code=trust_remote_code)
        return _spec_before_load(heads_dir, target), target


def export_target(heads_dir: str | os.PathLike, backbone=None, trust_remote_code: bool = False):
    """(spec, target config) of a directory about to be exported: ``spec_with_target``, plus the target's
    config (never its weights) whenever a target is named, so that ``load_heads`` refuses heads made for
    another one before anything is written (hidden size, vocabulary, config fingerprint, EAGLE-3 aux ids
    beyond its depth), whatever the family. ``backbone`` must be readable (one line otherwise); without
    it the base model the heads record is read when it can be (a ``random:`` test model or a hub id
    offline cannot: then there is nothing to check against, as before)."""
    spec, target = spec_with_target(heads_dir, backbone, trust_remote_code)
    if target is not None:  # the spec itself needed it (an EAGLE-3 dir naming no aux ids)
        return spec, target
    if backbone is not None:
        target = load_backbone_config(str(backbone), trust_remote_code=trust_remote_code)
    elif spec.base_model and not spec.base_model.startswith("random:"):
        try:
            target = load_backbone_config(spec.base_model, trust_remote_code=trust_remote_code)
        except UserError:
            pass
    return spec, target if _checkable(target) else None


def _checkable(config) -> bool:
    """A config ``check_compatible`` can compare heads with (a multimodal one nests its sizes: not here)."""
    return config is not None and getattr(config, "hidden_size", None) is not None


def read_heads_spec_for(heads_dir: str | os.PathLike, backbone=None, trust_remote_code: bool = False) -> HeadsSpec:
    """``read_heads_spec`` for a directory about to be loaded onto ``backbone`` (``spec_with_target``), its weight
    files checked too (``check_weight_files``): a corrupt one is refused before the backbone's weights load."""
    spec = spec_with_target(heads_dir, backbone, trust_remote_code)[0]
    check_weight_files(heads_dir, spec)
    return spec


def check_weight_files(heads_dir: str | os.PathLike, spec: HeadsSpec) -> None:
    """Every safetensors file of a heads directory of any layout, and of the backbone adapter its spec records,
    checked from its header alone: safetensors' own validation (the header's length, its JSON, the tensors'
    offsets against the file's size: a half-written or cut file), reading no tensor. The load (``load_heads``,
    ``merge_lora``) reads them only after the backbone's weights; this refuses a corrupt one first, in the
    loaders' words."""
    d = Path(heads_dir)
    folders = [d] + ([d / spec.backbone_adapter] if spec.backbone_adapter else [])
    for f in sorted(f for folder in folders for f in folder.glob("*.safetensors") if f.is_file()):
        check_safetensors(f)


def load_heads(heads_dir: str | os.PathLike, backbone_config=None,
               lm_head_weight: Optional[torch.Tensor] = None,
               device: str | torch.device = "cpu", dtype: Optional[torch.dtype] = None,
               input_embeddings: Optional[torch.Tensor] = None):
    """Load heads strictly; with ``backbone_config``, refuse heads made for another model."""
    heads, own_lm_head = read_heads(heads_dir, backbone_config, lm_head_weight)
    return attach_and_place(heads, heads_dir, own_lm_head if own_lm_head is not None else lm_head_weight,
                           input_embeddings, device, dtype)


def read_heads(heads_dir: str | os.PathLike, backbone_config=None, lm_head_weight: Optional[torch.Tensor] = None):
    """(heads, the directory's own copy of a shared lm_head or None) of any layout, strictly checked (every tensor
    the config implies present and so shaped, and in a native export no other; with ``backbone_config``, made for
    that model) and in the form their
    family serves, but not yet given the backbone tensors they borrow (``attach_and_place``): it reads no backbone
    weights, so ``load_medusa`` reads the heads before them and refuses mismatched ones first."""
    d = Path(heads_dir)
    if detect_layout(d) is not None:
        heads, own_lm_head = _read_imported(d, backbone_config, lm_head_weight)
    else:
        _canonical_spec(read_native_spec(d), f"heads in {d}")  # refused before any weight is read
        heads, own_lm_head = read_native(d, backbone_config), None
    return _canonicalize(heads, f"heads in {d}"), own_lm_head


def attach_and_place(heads, heads_dir, lm_head_weight: Optional[torch.Tensor],
                     input_embeddings: Optional[torch.Tensor], device: str | torch.device = "cpu",
                     dtype: Optional[torch.dtype] = None):
    """Heads ``read_heads`` returned, given the backbone tensors they borrow (a shared lm_head, the input
    embeddings; one line where one is needed and missing), then cast and placed, in eval mode."""
    if heads.needs_lm_head and lm_head_weight is None:
        raise UserError(f"heads in {heads_dir} share the backbone lm_head: pass the backbone to load them")
    if heads.needs_input_embeddings and input_embeddings is None:
        raise UserError(f"{heads.spec.kind} heads in {heads_dir} read the backbone's input embeddings: "
                        "pass the backbone to load them")
    heads.attach_backbone(lm_head_weight, input_embeddings)
    return place(heads, device, dtype)


def import_heads(heads_dir, backbone_config=None, lm_head_weight: Optional[torch.Tensor] = None,
                 device="cpu", dtype: Optional[torch.dtype] = None, input_embeddings: Optional[torch.Tensor] = None):
    """Load a foreign directory, with the checks ``load_heads`` makes for ours."""
    d = Path(heads_dir)
    if detect_layout(d) is None:
        raise UserError(f"{d} is neither a heads export nor a reference-Medusa / TGI / vLLM Medusa / EAGLE-3 directory")
    return load_heads(d, backbone_config, lm_head_weight, device, dtype, input_embeddings)


def _read_imported(d: Path, backbone_config=None, lm_head_weight: Optional[torch.Tensor] = None):
    """``read_heads`` of a foreign layout: (heads, its own lm_head copy or None)."""
    importer = importer_for(detect_layout(d))
    # The layout's notes only once the heads fit this backbone: a refusal is then one line on its own.
    with warnings.catch_warnings(record=True) as notes:
        warnings.simplefilter("always", FormatWarning)
        spec = importer.spec(d, backbone_config)
        if not spec.vocab_size:  # TGI v2 without vocab_size in its config: the backbone's vocabulary
            known = backbone_config.vocab_size if backbone_config is not None else \
                lm_head_weight.shape[0] if lm_head_weight is not None else 0
            spec.vocab_size = int(known)
        if backbone_config is not None:
            check_compatible(spec, backbone_config, where=f"heads in {d}")
    for note in notes:
        warnings.warn_explicit(note.message, note.category, note.filename, note.lineno)
    return importer.load(d, spec)


def load_medusa(heads_dir, backbone=None, device=None, dtype=None, trust_remote_code: bool = False,
                tokenizer=None, apply_adapter: Optional[bool] = None, kernels: Optional[str] = None,
                draft_weights: str = "float", graphs: str = "auto",
                graph_buckets: Sequence[int] = DEFAULT_BUCKETS,
                chat_template_args: Optional[dict] = None) -> MedusaModel:
    """Backbone + tokenizer + heads, checked to belong together.

    backbone: None (use the heads' recorded ``base_model``), a name/path, or a loaded ``*ForCausalLM`` (then
    ``tokenizer`` may be given too), used in place: put on ``device`` / ``dtype``, in eval mode, its attention
    switched to the runtime's (tree masks). Heads trained with a LoRA adapter (Medusa-2, ``spec.backbone_adapter``)
    get it merged into the backbone their config records (``backbone=None``); a backbone given explicitly is used as
    is (e.g. ``<run>/merged``) unless ``apply_adapter=True``. device/dtype default to cpu/float32 when loading, and
    to the given model's own when a model object is passed. kernels: ``auto`` routes skinny CPU products through the
    fastest formulation (``linear_kernels``: the linears change class in place and may keep prepacked weights;
    choices an earlier launch on this machine measured are reused from ``kernel_plans_path()``), ``measure``
    measures them afresh, ``stock`` leaves transformers'; default ``auto`` for a backbone loaded here, ``stock`` for
    a model object. draft_weights: ``float16`` stores fp32 heads' own linears in float16 (``runtime.draft_weights``:
    drafts may move slightly, greedy outputs and sampling's distribution do not), ``float`` keeps them as trained.
    graphs: ``auto`` steps the backbone as CUDA graphs over static shapes on CUDA (``runtime.static_steps``), padded
    to ``graph_buckets`` rows. chat_template_args: the template's variables, joining those the heads recorded."""
    check_load_arguments(heads_dir, tokenizer, draft_weights, graphs, graph_buckets, device)
    template = template_args_for(heads_dir, chat_template_args)   # given, else the training run's
    if kernels is None:
        kernels = "stock" if backbone is not None and not isinstance(backbone, (str, Path)) else "auto"
    check_kernels(kernels)  # before any loading
    # missing / unreadable export -> UserError before any model load
    if backbone is None or isinstance(backbone, (str, Path)):
        spec = read_heads_spec_for(heads_dir, backbone, trust_remote_code=trust_remote_code)
    else:
        spec = _spec_before_load(heads_dir, getattr(backbone, "config", None))
    adapter_applied = False
    if backbone is None or isinstance(backbone, (str, Path)):
        name = str(backbone) if backbone is not None else spec.base_model
        if not name:
            raise UserError(f"heads in {heads_dir} do not record their backbone; pass backbone=")
        target = _refuse_another_target(heads_dir, spec, name, trust_remote_code)
        # The heads read whole before the backbone's weights: tensors their config does not imply, refused first.
        read = read_heads(heads_dir, target) if _checkable(target) else None
        dev = parse_device("cpu" if device is None else device)
        dt = parse_dtype(dtype or torch.float32)
        apply = apply_adapter if apply_adapter is not None else backbone is None
        adapter = None
        if spec.backbone_adapter and apply:   # a missing or unreadable adapter refused before the backbone loads
            adapter = read_adapter(Path(heads_dir) / spec.backbone_adapter)
        model, tok, _ = load_backbone(name, device=dev, dtype=dt, trust_remote_code=trust_remote_code)
        tokenizer = tokenizer or tok
        if adapter is not None:  # Medusa-2 heads: decode on the backbone they were trained with
            merge_lora(model, Path(heads_dir) / spec.backbone_adapter, adapter)
            adapter_applied = True
    else:
        model, read = backbone, None
        if not hasattr(model, "get_output_embeddings"):
            raise UserError(f"backbone must be a name, a path or a transformers causal LM, got {type(model).__name__}")
        p = next(model.parameters())
        dev = parse_device(device) if device is not None else p.device
        dt = parse_dtype(dtype) if dtype is not None else p.dtype
        model = model.to(device=dev, dtype=dt)
    lm_w = model.get_output_embeddings().weight if model.get_output_embeddings() is not None else None
    emb = model.get_input_embeddings()
    if spec.backbone_adapter and apply_adapter and not adapter_applied:
        merge_lora(model, Path(heads_dir) / spec.backbone_adapter)
        adapter_applied = True
    if read is None:
        read = read_heads(heads_dir, model.config, lm_w)
    else:
        check_compatible(read[0].spec, model.config, where=f"heads in {heads_dir}")
    heads = attach_and_place(read[0], heads_dir, read[1] if read[1] is not None else lm_w,
                            emb.weight if emb is not None else None, dev, dt)
    if draft_weights == "float16":  # before routing: the half linears are not routed
        half_draft_weights(heads, model)
    if (template or chat_template_args is not None) and tokenizer is not None:
        set_template_args(tokenizer, template, whose=f" of {getattr(model.config, '_name_or_path', '') or 'it'}")
    m = apply_kernels(MedusaModel(model=model, tokenizer=tokenizer, heads=heads, adapter_applied=adapter_applied),
                      kernels, kernel_plans_path())
    return apply_graphs(m, graphs, graph_buckets)


def _refuse_another_target(heads_dir, spec: HeadsSpec, name: str, trust_remote_code: bool):
    """The target's config (not its weights; None where it cannot be read here: ``load_backbone`` says why in one
    line), heads made for another target refused from it before its weights load (the load checks again, on the
    model's own config); a spec without a vocabulary (TGI v2) takes the target's."""
    try:
        config = load_backbone_config(name, trust_remote_code=trust_remote_code)
    except UserError:
        return None
    check_backbone_config(config, name)   # a backbone the tree decoder cannot decode, before its weights
    if spec.vocab_size and _checkable(config):
        check_compatible(spec, config, where=f"heads in {heads_dir}")
    return config


def kernel_plans_path() -> Optional[Path]:
    """Where ``kernels=auto`` keeps the kernel choices measured on this machine (``runtime/kernel_plan_cache``):
    ``$MEDUSA_TRAIN_KERNEL_PLANS`` (a file; ``none``: keep none, measure at every launch), else
    ``kernel_plans.json`` in the cache (``$MEDUSA_TRAIN_CACHE``, default ``~/.cache/medusa-train``)."""
    given = os.environ.get("MEDUSA_TRAIN_KERNEL_PLANS", "").strip()
    if given.lower() == "none":
        return None
    return Path(given) if given else cache_dir() / FILE_NAME


def check_load_arguments(heads_dir, tokenizer, draft_weights, graphs, graph_buckets, device) -> None:
    """``load_medusa``'s arguments that are checked alone, each refused in one line before anything loads."""
    if not isinstance(heads_dir, (str, os.PathLike)):
        raise UserError(f"heads_dir must be the heads' folder (a path), got {type(heads_dir).__name__}")
    if tokenizer is not None and not (callable(getattr(tokenizer, "decode", None))
                                      and callable(getattr(tokenizer, "apply_chat_template", None))):
        raise UserError(f"tokenizer must be a transformers tokenizer (or None: the backbone's own), got "
                        f"{type(tokenizer).__name__}")   # a path given here failed later as "has no chat template"
    check_draft_weights(draft_weights)
    on = graphs_mode(graphs) == "on"
    buckets = list(graph_buckets) if isinstance(graph_buckets, (list, tuple)) else graph_buckets   # 4: refused there
    check_graphs(graphs, buckets, str(parse_device(device)) if on and device is not None else None)


def attach_heads(model, heads, tokenizer=None) -> MedusaModel:
    """Wrap in-memory heads (e.g. fresh ``MedusaHeads.from_lm_head``), checked against the backbone, without an
    export round trip."""
    p = model.get_output_embeddings().weight
    check_compatible(heads.spec, model.config)
    heads = heads.to(device=p.device, dtype=p.dtype).eval()
    emb = model.get_input_embeddings()
    heads.attach_backbone(p, emb.weight if emb is not None else None)
    return MedusaModel(model=model, tokenizer=tokenizer, heads=heads)
