"""The backbone, loaded once for both halves: one loader, one dtype table, one EOS rule.

The trainer (``medusa_train.backbone``) and the runtime (``inference.loading``, ``inference.runtime.model``) both load their
backbone here, so a model that trains also decodes, with the same dtype spelling, the same
end-of-sequence ids and the same errors. Anything the backbone name can be is resolved by
``assets.resolve_backbone_path``: ``embedded:smollm2``, a local folder (optionally a GGUF file
inside it), or a hub id.

Attention defaults to SDPA: tree verification passes custom 4D masks, which sdpa and eager
apply and flash-attention kernels ignore.

A hub id on a machine that cannot reach the hub (no network, no DNS: ``assets.hub_unreachable``, one connection tried
once a minute) is read from the local cache alone: the hub client would retry for two minutes, printing a line per
retry, before the same refusal.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import warnings
from pathlib import Path
from typing import Optional

import torch

from . import assets
from .errors import UserError, first_line

# Every spelling a user, a recipe or a config may use for the three float types.
DTYPES = {"float32": torch.float32, "fp32": torch.float32,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


def parse_dtype(dtype) -> torch.dtype:
    """A ``torch.dtype`` from any spelling in ``DTYPES`` (or a float dtype itself)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise UserError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
        return dtype
    if isinstance(dtype, str) and dtype.lower() in DTYPES:
        return DTYPES[dtype.lower()]
    raise UserError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")


def parse_device(device) -> torch.device:
    """``cpu``, ``cuda`` or ``cuda:N`` (``auto``: CUDA when available), checked against this machine."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise UserError(f"unknown device {device!r} (use cpu, cuda or cuda:N)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"device {device} requested but CUDA is not available")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UserError(f"device {device} requested but only {torch.cuda.device_count()} GPU(s) exist")
    elif dev.type != "cpu":
        raise UserError(f"unsupported device {device!r} (use cpu, cuda or cuda:N)")
    return dev


def _cache_only(path: str) -> dict:
    """``from_pretrained``'s keywords for ``path``: the local cache alone for a hub id the hub cannot serve here."""
    local = os.path.isdir(os.path.expanduser(path))
    return {"local_files_only": True} if not local and assets.hub_unreachable() else {}


AUTO_ATTENTION = "auto"
# transformers' refusal of a model class without the attention implementation asked for (before any weight is read)
LACKS_ATTENTION = re.compile(r"(\w+) does not support an attention implementation through ([\w.]+)")


def with_attention(build, attn_implementation: str = AUTO_ATTENTION):
    """``build(attn)``'s model under ``attn_implementation``; ``"auto"``: sdpa, or eager for a model class without
    sdpa (Gemma-2's soft caps, gpt-oss's sinks). Both apply the tree decoder's 4D masks, and decoding runs through
    the runtime's own attention function either way; training reads the same hidden states (eager is transformers'
    reference). transformers refuses the class from its config alone, before any weight is read: the retry costs
    little. Backbones the tree decoder cannot decode whatever their attention (ALiBi: Bloom, MPT) are refused
    before (``runtime.model.check_backbone_config``)."""
    if attn_implementation != AUTO_ATTENTION:
        return build(attn_implementation)
    try:
        return build("sdpa")
    except ValueError as e:
        if not LACKS_ATTENTION.match(str(e)):
            raise
        return build("eager")


def load_backbone(name_or_path: str, *, device="cpu", dtype="float32", trust_remote_code: bool = False,
                  revision: Optional[str] = None, gguf_file: Optional[str] = None,
                  attn_implementation: str = AUTO_ATTENTION, attn_advice: str = ""):
    """(model, tokenizer, name): a causal LM and its tokenizer from an ``embedded:`` name, a local
    folder or a hub id; ``name`` is what heads record as their base model. ``dtype="auto"`` keeps
    the checkpoint's own. Any failure a user causes (no such model, no or damaged weights: ``check_weight_files``
    before transformers reads them, a config of no causal LM, a model class without ``attn_implementation``) is one
    ``UserError`` line (``attn_advice``: what the caller's user can set when the class lacks the implementation).
    ``attn_implementation="auto"``: sdpa, or eager for a class without it (``with_attention``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer   # lazy: 1.3 s; medusa-train's checks import this

    if name_or_path.startswith("random:"):
        raise UserError(f"backbone {name_or_path!r} is a random test model that cannot be rebuilt; "
                        "pass the backbone model itself")
    path, name = assets.resolve_backbone_path(name_or_path, gguf_file)
    _check_local(name_or_path, path)
    path = os.path.expanduser(path)   # as _check_local read it (transformers would take ~/model for a hub id)
    check_weight_files(name_or_path, path)   # before transformers reads anything: no weights, a file cut short
    kwargs = dict(trust_remote_code=trust_remote_code, revision=revision, **_cache_only(path))
    torch_dtype = "auto" if dtype == "auto" else parse_dtype(dtype)
    with loading_errors(name_or_path, path, attn_implementation=attn_implementation, attn_advice=attn_advice):
        tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
        model = with_attention(lambda attn: AutoModelForCausalLM.from_pretrained(
            path, dtype=torch_dtype, attn_implementation=attn, **kwargs), attn_implementation)
    return model.to(parse_device(device)), tokenizer, name


def _source(name_or_path: str, gguf_file: Optional[str] = None) -> tuple[str, dict]:
    """Where a backbone's config and tokenizer are read from without its weights, and the ``from_pretrained``
    keywords that go with it: a GGUF's conversion when one was made (read in no time, where the GGUF's metadata
    takes seconds), else the GGUF read in place (``gguf_file=``; never converted here), else the setting itself
    (a local path checked to exist)."""
    gguf = assets.gguf_source(name_or_path, gguf_file)
    converted = assets.cached_conversion(gguf) if gguf is not None else None
    if converted is not None:
        return str(converted), {}
    if gguf is not None:
        return str(gguf.parent), dict(gguf_file=gguf.name)
    _check_local(name_or_path, name_or_path)
    return name_or_path, {}


def load_tokenizer(name_or_path: str, *, trust_remote_code: bool = False):
    """``load_backbone``'s tokenizer alone (no weights, no GGUF conversion), with its errors."""
    from transformers import AutoTokenizer   # lazy: as load_backbone's

    path, kwargs = _source(name_or_path)
    with loading_errors(name_or_path, path, part="the tokenizer of "):
        return AutoTokenizer.from_pretrained(os.path.expanduser(path), trust_remote_code=trust_remote_code,
                                             **kwargs, **_cache_only(path))


def load_backbone_config(name_or_path: str, *, gguf_file: Optional[str] = None, trust_remote_code: bool = False,
                         revision: Optional[str] = None):
    """The backbone's transformers config, without its weights (and without converting a GGUF: the
    conversion's config.json when one was made, else its metadata read in place), with ``load_backbone``'s errors."""
    from transformers import AutoConfig   # lazy: as load_backbone's

    path, kwargs = _source(name_or_path, gguf_file)
    with loading_errors(name_or_path, path, config_only=True):
        return AutoConfig.from_pretrained(os.path.expanduser(path), trust_remote_code=trust_remote_code,
                                          revision=revision, **kwargs, **_cache_only(path))


def check_backbone_name(name_or_path: Optional[str]) -> None:
    """A backbone setting that names a local path refused in one line when it is none (before anything loads)."""
    if name_or_path and not name_or_path.startswith(("embedded:", "random:")):
        _check_local(name_or_path, name_or_path)


# The weights transformers reads from a model folder, in the order it looks for them (no variant, no
# ``transformers_weights`` naming another file: such a folder holds weights under another name, left to the load).
SAFETENSORS, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
PICKLES = ("pytorch_model.bin", "pytorch_model.bin.index.json")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack")


def check_weight_files(name_or_path: str, path: str) -> None:
    """The weights of a local model folder (``path``; a hub id is left to the hub) checked before transformers
    reads them, each failure one line: a config.json beside no weights at all (transformers' OSError, which read
    as an unreachable hub), an index naming a shard that is missing, a safetensors file whose header is cut short
    or overwritten (a traceback once the model had been built). Only the files transformers picks are opened
    (``model.safetensors`` or the shards its index names; headers only, no tensor read); a folder holding weights
    under other names (pickles, remote code's, an adapter's, a GGUF) is left to the load."""
    from .heads.native import check_safetensors, indexed_shards   # lazy: safetensors as transformers'

    folder = Path(os.path.expanduser(path))
    if not (folder / "config.json").is_file():
        return
    try:
        if (folder / SAFETENSORS).is_file():
            files = [folder / SAFETENSORS]
        elif (folder / SAFETENSORS_INDEX).is_file():
            files = indexed_shards(folder / SAFETENSORS_INDEX)
        elif any(f.name in PICKLES or f.name.endswith(WEIGHT_SUFFIXES) for f in folder.iterdir() if f.is_file()):
            return
        else:
            raise UserError(f"{folder} holds a config.json but no weights ({SAFETENSORS}, its shards or {PICKLES[0]})")
        for f in files:
            check_safetensors(f)
    except UserError as e:
        raise UserError(f"cannot load backbone {name_or_path!r}: {e}") from None


def _check_local(name_or_path: str, path: str) -> None:
    """A setting that looks like a local path must exist (else the hub would be asked for it)."""
    looks_local = path.startswith((".", "/", "~")) or (os.path.sep in path and path.count("/") > 1)
    if looks_local and os.path.isfile(os.path.expanduser(path)):
        raise UserError(f"cannot load backbone {name_or_path!r}: it is a file, give the model's folder")
    if looks_local and not os.path.isdir(os.path.expanduser(path)):
        raise UserError(f"cannot load backbone {name_or_path!r}: path not found ({path})")
    # transformers reads a folder before the hub: one without config.json was a ValueError traceback (its tokenizer
    # "Couldn't instantiate the backend tokenizer", or "Unrecognized model") once the heads had loaded
    if os.path.isdir(os.path.expanduser(path)) and not os.path.isfile(os.path.join(os.path.expanduser(path),
                                                                                  "config.json")):
        raise UserError(f"cannot load backbone {name_or_path!r}: the folder holds no config.json (not a model folder)")


@contextlib.contextmanager
def loading_errors(name_or_path: str, path: Optional[str] = None, config_only: bool = False,
                    attn_implementation: str = AUTO_ATTENTION, part: str = "", attn_advice: str = ""):
    """transformers' loading errors that a user causes as one ``UserError`` line saying what to do (``path``: where
    it is read from; a local folder, and the hub is not to blame; ``part``: what of the backbone is loaded, "" for
    all of it); any other error keeps its traceback (a bug)."""
    from safetensors import SafetensorError   # lazy: as transformers'

    try:
        yield
    except OSError as e:
        local = path is not None and os.path.isdir(os.path.expanduser(str(path)))
        if not local and assets.hub_unreachable():
            raise UserError(f"cannot load backbone {name_or_path!r}: it is not a local model folder, "
                            f"{assets.hub_unreachable()} cannot be reached from this machine, and the hub's cache "
                            "here does not hold it whole (give a local model folder, or download the model where the "
                            "hub is reachable)") from None
        where = "" if local else " (not a local model folder, and the hub has no such model or cannot be reached)"
        raise UserError(f"cannot load backbone {name_or_path!r}{where}: {first_line(e)}") from None
    except SafetensorError as e:   # a file the checks before could not open (a hub download cut short)
        raise UserError(f"cannot load backbone {name_or_path!r}: a weights file is corrupt or unreadable "
                        f"({first_line(e)})") from None
    except ValueError as e:
        if "trust_remote_code" in str(e):
            raise UserError(f"backbone {name_or_path!r} needs custom code: set trust_remote_code=true "
                            "only if you trust its source") from None
        if config_only:
            raise UserError(f"cannot read the config of backbone {name_or_path!r}: {first_line(e)}") from None
        known = _model_class_refusal(str(e), attn_implementation, attn_advice)
        if known is None and path is not None and os.path.isdir(os.path.expanduser(str(path))):
            # a local folder's files are the user's to mend (a config.json without model_type, tokenizer files
            # transformers cannot build from), never this code's: a traceback there read as a bug. transformers'
            # words span lines (the tokenizer's cause is on its last): all of them, on one
            known = " ".join(str(e).split()) or type(e).__name__
        if known is None:
            raise
        raise UserError(f"cannot load {part}backbone {name_or_path!r}: {known}") from None


def _model_class_refusal(text: str, attn_implementation: str, attn_advice: str = "") -> Optional[str]:
    """transformers' refusal to build a causal LM from a config, both raised before any weight is read, in a
    line: a config of no causal LM (a vision or encoder model's), or a model class without the attention
    implementation it is loaded with; None for any other error."""
    unknown = re.match(r"Unrecognized configuration class <class '[\w.]*?(\w+)'> for this kind of AutoModel", text)
    if unknown:
        return f"its config ({unknown[1]}) is no causal language model's: transformers' AutoModelForCausalLM " \
               "has no class for it"
    unsupported = LACKS_ATTENTION.match(text)
    if unsupported:
        return f"transformers' {unsupported[1]} does not support attn_implementation={attn_implementation!r} " \
               f"({unsupported[2]}), which it is loaded with" + (f": {attn_advice}" if attn_advice else "")
    return None


def eos_token_ids(model, tokenizer=None) -> list[int]:
    """Every id that ends a reply: the generation config's, the model config's and the tokenizer's
    (chat models often end turns with a token that only one of them names)."""
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        e = getattr(src, "eos_token_id", None) if src is not None else None
        if e is not None:
            ids.update(e if isinstance(e, (list, tuple)) else [e])
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(int(i) for i in ids)


def lm_head_weight(model) -> torch.Tensor:
    head = model.get_output_embeddings()
    if head is None:
        raise UserError(f"{type(model).__name__} has no output embedding (lm_head); draft heads need one")
    return head.weight


def decoder_body(model):
    """The decoder stack without lm_head (``model.model`` for Llama/Qwen/Mistral/Gemma)."""
    base = getattr(model, model.base_model_prefix, None)
    if base is None:
        raise UserError(f"cannot find the decoder body of {type(model).__name__}")
    return base


def text_config(model_or_config):
    """The decoder's own config (multimodal models nest it)."""
    cfg = getattr(model_or_config, "config", model_or_config)
    return cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg


def scale_logits(logits: torch.Tensor, logit_scale: Optional[float], softcap: Optional[float]) -> torch.Tensor:
    """The backbone's own post-lm_head transforms (Cohere's ``logit_scale``, Gemma's final soft-cap):
    verification and training targets must take the argmax of the logits the model itself samples from."""
    if logit_scale is not None:
        logits = logits * logit_scale
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


# ``logits_scaling`` means opposite things in transformers' forwards: Granite's (and its MoE / SWA variants')
# divide the logits by it, MiniCPM3's divide the hidden state before the lm_head (the same), HyperCLOVA X's multiply.
_DIVIDES_BY_LOGITS_SCALING = ("granite", "minicpm3")   # model_type prefixes
_MULTIPLIES_BY_LOGITS_SCALING = ("hyperclovax",)


def logit_scaling(model) -> tuple:
    """(logit scale, final soft-cap) the backbone applies after its lm_head (``scale_logits``; (None, None) for
    most): whatever reads its distribution through the lm_head applies them. The scale is Cohere's
    ``logit_scale`` or a ``logits_scaling`` read as the model type's forward reads it; greedy tokens never depend
    on it, sampled ones and the trainer's teacher terms do."""
    cfg = text_config(model)
    scale = getattr(cfg, "logit_scale", None)
    by = getattr(cfg, "logits_scaling", None)
    if isinstance(by, (int, float)) and by not in (0, 1):
        kind = str(getattr(cfg, "model_type", ""))
        if kind.startswith(_DIVIDES_BY_LOGITS_SCALING):
            scale = (scale or 1.0) / by
        elif kind.startswith(_MULTIPLIES_BY_LOGITS_SCALING):
            scale = (scale or 1.0) * by
        else:
            warnings.warn(f"the backbone's config ({kind}) has logits_scaling={by}, which no known forward of this "
                          "model type reads: it is not applied (sampled tokens may differ from the model's)")
    return scale, getattr(cfg, "final_logit_softcapping", None)


def backbone_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """The backbone's next-token logits at ``hidden`` (lm_head, then its own scaling)."""
    return scale_logits(model.get_output_embeddings()(hidden), *logit_scaling(model))


class HiddenStateTap:
    """Reads hidden_states[i] (transformers' numbering: 0 = the embeddings, i = decoder layer i-1's
    output) of a few layers during the body's ordinary forward, through forward hooks, so the
    runtime's verification forward and the trainer's frozen forward also yield EAGLE-3's aux features
    without ``output_hidden_states`` keeping every layer. ``with tap: body(...)``, then ``tap.features()``
    is their concatenation [..., len(ids) * H] in ``ids`` order."""

    def __init__(self, model, ids):
        body = decoder_body(model)
        layers = getattr(body, "layers", None)
        if layers is None:
            raise UserError(f"{type(model).__name__} has no decoder layer list to read hidden states from")
        self.ids = [int(i) for i in ids]
        bad = [i for i in self.ids if not 0 <= i < len(layers)]
        if bad:
            raise UserError(f"aux layer ids {bad} are out of range: the backbone has hidden states 0..{len(layers) - 1}")
        self._modules = [body.get_input_embeddings() if i == 0 else layers[i - 1] for i in self.ids]
        # Per thread: the hooks sit on modules every thread's forward runs through, so a tap keeps only the states
        # of forwards run by the thread that opened it (another thread's decoding read its features otherwise).
        self._local = threading.local()

    def __enter__(self):
        me = threading.get_ident()
        self._local.out = {}
        self._local.handles = [mod.register_forward_hook(self._hook(slot, me, self._local.out))
                               for slot, mod in enumerate(self._modules)]
        return self

    def __exit__(self, *exc):
        for h in self._local.handles:
            h.remove()
        self._local.handles = []

    @staticmethod
    def _hook(slot: int, thread: int, out: dict):
        def grab(module, args, output):
            if threading.get_ident() == thread:
                out[slot] = output[0] if isinstance(output, (tuple, list)) else output
        return grab

    def features(self) -> torch.Tensor:
        return torch.cat([self._local.out[s] for s in range(len(self.ids))], dim=-1)
