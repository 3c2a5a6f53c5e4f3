"""Load the frozen backbone and its tokenizer (embedded SmolLM2, any HF id/path, or tiny random), read its
config without weights, and name it (``backbone_identity``).

Pretrained backbones go through the runtime's own loader (``inference.backbone``), so what
trains also decodes. The backbone never trains in Medusa-1: it is put in eval mode with ``requires_grad=False``
on every parameter, and the trainer runs it under ``torch.no_grad`` (``backbone_inputs``). What the heads read
from it per batch is ``backbone_inputs``; what is checked before it loads, ``preflight``. transformers (0.8 s)
is imported inside the functions that build a tokenizer, a config or a model: preflight imports this module,
and its refusals that need none of them come first.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from omegaconf import OmegaConf

from inference import backbone as runtime_backbone
from inference.backbone import parse_dtype
from inference.chat_template import check_template_args, set_template_args
from inference.errors import UserError
from inference.heads.native import make_temp_dir, open_permissions, release_temp_dir
from inference.heads.spec import backbone_fingerprint

CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass
class Backbone:
    model: Any  # a transformers *ForCausalLM
    tokenizer: Any
    name: str  # what the export records as base model
    identity: str | None = None  # what caches and distilled data key on, when not ``name`` (a kept random backbone;
    # a local folder recorded by its absolute path, keyed as written)
    released: int = 0  # bytes of the body ``release_body`` freed (0: the whole backbone is loaded)
    _loaded_parameters: int = field(default=0, repr=False)

    def parameter_count(self) -> int:
        """The backbone's parameters as loaded (a released body counted too; ZeRO-3 partitions whole)."""
        if self.released:
            return self._loaded_parameters
        return sum(getattr(p, "ds_numel", p.numel()) for p in self.model.parameters())

    def release_body(self) -> int:
        """Free every weight but the input embeddings and the lm_head (heads trained from cached features read
        only those: their init, the teacher term, a drafter's token embeddings) and return the bytes freed: ~13
        GiB of Llama-3.1-8B in bf16 on each GPU, by arithmetic, for the rest of the run (weights mapped from a
        file on the CPU were page cache, not the process's own memory). The model cannot run afterwards; its
        config, dtype and device stay readable."""
        model = self.model
        kept = {id(runtime_backbone.lm_head_weight(model)), id(model.get_input_embeddings().weight)}
        self._loaded_parameters = self.parameter_count()
        for p in model.parameters():   # each shared tensor once (tied embeddings)
            if id(p) not in kept and p.numel():
                self.released += p.numel() * p.element_size()
                # the tensor's storage goes (DeepSpeed's ZeRO-3 frees partitioned weights the same way): the
                # Parameter objects, the modules and the model's structure stay
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        return self.released


def byte_tokenizer():
    """A 259-token byte-level tokenizer with a ChatML template: no files, no network (tests)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers   # lazy: not for preflight's imports (docstring)
    from transformers import PreTrainedTokenizerFast   # lazy: not for preflight's imports (docstring)

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token="<|im_start|>")
    fast.chat_template = CHATML_TEMPLATE
    return fast


BYTE_TOKENIZER_SIZE = 259


# transformers' refusal of a model class without the run's attention implementation, completed with the key to set
ATTN_ADVICE = "set backbone.attn_implementation=eager"


def random_config(config: dict):
    """The transformers config of a ``backbone.random_init`` dict (no weights)."""
    from transformers import CONFIG_MAPPING, AutoConfig   # lazy: not for preflight's imports (docstring)

    # nested values (rope_scaling, layer_types) as plain dicts and lists: transformers validates their types
    cfg = OmegaConf.to_container(config, resolve=True) if OmegaConf.is_config(config) else dict(config)
    model_type = cfg.pop("model_type", "llama")
    if model_type not in CONFIG_MAPPING:   # transformers' own line lists every one of its hundreds of types
        near = difflib.get_close_matches(str(model_type), list(CONFIG_MAPPING.keys()), n=1, cutoff=0.8)
        raise UserError(f"backbone.random_init.model_type={model_type!r} is not a transformers model type"
                        f"{f' (did you mean {near[0]}?)' if near else ''}; e.g. llama, qwen2, mistral, gemma2")
    cfg.setdefault("vocab_size", BYTE_TOKENIZER_SIZE)
    if cfg["vocab_size"] < BYTE_TOKENIZER_SIZE:
        raise UserError(f"backbone.random_init.vocab_size must be >= {BYTE_TOKENIZER_SIZE} (the byte tokenizer)")
    try:
        hf_config = AutoConfig.for_model(model_type, **cfg)
    except Exception as e:  # ValueError/TypeError, or huggingface_hub's strict-dataclass validation wrapping one
        cause = e.__cause__ if e.__cause__ is not None and "validation error" in str(e).lower() else e
        raise UserError(f"backbone.random_init: {(str(cause).strip().splitlines() or [type(cause).__name__])[0]}"
                        ) from None
    # transformers leaves this to the first forward (a RuntimeError there, after the run's files are written).
    heads = getattr(hf_config, "num_attention_heads", None)
    kv = getattr(hf_config, "num_key_value_heads", None)
    if isinstance(heads, int) and isinstance(kv, int) and kv > 0 and heads % kv:
        raise UserError(f"backbone.random_init: num_attention_heads={heads} is not a multiple of "
                        f"num_key_value_heads={kv}")
    return hf_config


def random_backbone(config: dict, seed: int = 0, attn_implementation: str = "auto") -> Backbone:
    from transformers import AutoModelForCausalLM   # lazy: not for preflight's imports (docstring)

    tokenizer = byte_tokenizer()
    assert len(tokenizer) == BYTE_TOKENIZER_SIZE
    hf_config = random_config(config)
    model_type = hf_config.model_type
    hf_config.eos_token_id = tokenizer.eos_token_id
    hf_config.pad_token_id = tokenizer.pad_token_id
    with torch.random.fork_rng(), runtime_backbone.loading_errors(f"random:{model_type}", attn_advice=ATTN_ADVICE,
                                                                  attn_implementation=attn_implementation):
        torch.manual_seed(seed)
        model = runtime_backbone.with_attention(
            lambda attn: AutoModelForCausalLM.from_config(hf_config, attn_implementation=attn), attn_implementation)
    return Backbone(model, tokenizer, f"random:{model_type}")


def _stop_token(backbone: Backbone) -> str:
    """A token to pad batches with when the tokenizer names neither a pad nor an eos token: the first id the model's
    configs stop at (padding is masked: any token serves); one line when there is none."""
    ids = runtime_backbone.eos_token_ids(backbone.model, backbone.tokenizer)
    if not ids:
        raise UserError(f"the tokenizer of {backbone.name} names no pad or eos token and the model's configs no "
                        "eos_token_id: batches cannot be padded; set eos_token in its tokenizer_config.json")
    return backbone.tokenizer.convert_ids_to_tokens(ids[0])


RANDOM_BACKBONE_DIR = "backbone"  # <output_dir>/backbone: a random backbone saved with its run


def load_backbone(cfg, device: torch.device | str = "cpu", seed: int = 0, run_dir=None,
                  write: bool = True, before_write: Callable[[Any], None] | None = None) -> Backbone:
    """Build the frozen backbone described by a ``BackboneConfig``.

    With ``run_dir``, a random backbone (``random_init``) is kept with the run: saved (model +
    tokenizer, safetensors) into ``<run_dir>/backbone`` (by the process with ``write``) and named
    by that folder's absolute path, which the heads then record as their base model, so the
    runtime (``medusa-eval heads=<run_dir>/heads``) rebuilds exactly it. ``before_write`` is given the
    tokenizer before that save (whether or not there is one to make): the trainer checks its data with it,
    so data it refuses leaves the run's folder as it was."""
    backbone = (random_backbone(cfg.random_init, seed=seed, attn_implementation=cfg.attn_implementation)
                if cfg.random_init else _load_pretrained(cfg))
    if backbone.tokenizer.pad_token is None:
        backbone.tokenizer.pad_token = backbone.tokenizer.eos_token or _stop_token(backbone)
    if not backbone.tokenizer.chat_template:
        raise UserError(f"tokenizer of {backbone.name} has no chat template; use a chat (instruct) model")
    set_template_args(backbone.tokenizer, getattr(cfg, "chat_template_args", None), "backbone.chat_template_args",
                      whose=f" of {backbone.name}")
    if before_write is not None:
        before_write(backbone.tokenizer)
    if cfg.random_init and run_dir is not None:  # kept in fp32, before the cast below
        # cached features stay keyed on "random:<type>" + weights, wherever the run is
        backbone.identity = backbone.name
        backbone.name = keep_random_backbone(backbone, Path(run_dir) / RANDOM_BACKBONE_DIR, write)
    model = backbone.model
    if cfg.dtype != "auto":
        model.to(parse_dtype(cfg.dtype))
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    return backbone


def keep_random_backbone(backbone: Backbone, folder: Path, write: bool = True) -> str:
    """Save a random backbone (fp32 safetensors + its tokenizer) into ``folder``; its absolute path is
    the name heads record. A rerun (resume) rebuilds the same weights and rewrites the same files.

    Written whole or not at all: into ``.<folder>.tmp-<pid>-*`` beside it (``make_temp_dir``), then each file
    renamed into ``folder``, so a Ctrl-C, SIGTERM or crash mid-save leaves no half-written file there (a new run's
    ``folder`` does not exist until every file is written); the temporary folder is removed on the way out, or,
    after a kill that skipped that, by the next save once its writer is gone."""
    folder = folder.resolve()
    if write:
        from transformers.utils import logging as hf_logging   # lazy: not for preflight's imports (docstring)

        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = make_temp_dir(folder)
        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # "Writing model shards" for a few hundred kB
        try:
            backbone.model.save_pretrained(tmp, safe_serialization=True)
            backbone.tokenizer.save_pretrained(tmp)
            open_permissions(tmp)
            folder.mkdir(exist_ok=True)
            for f in sorted(tmp.iterdir()):
                os.replace(f, folder / f.name)
        finally:
            release_temp_dir(tmp)
            if bars:
                hf_logging.enable_progress_bar()
    return str(folder)


def _load_pretrained(cfg) -> Backbone:
    model, tokenizer, name = runtime_backbone.load_backbone(
        cfg.name_or_path, dtype=cfg.dtype, trust_remote_code=cfg.trust_remote_code, revision=cfg.revision,
        gguf_file=cfg.gguf_file, attn_implementation=cfg.attn_implementation, attn_advice=ATTN_ADVICE)
    # The heads record the absolute path of a local folder (``name``); caches and distilled data keep keying on the
    # setting as written, as they did before names were made absolute, so a run continues its own cache and data.
    as_written = cfg.name_or_path if not cfg.gguf_file or cfg.name_or_path.startswith("embedded:") \
        else f"{cfg.name_or_path}/{cfg.gguf_file}"
    return Backbone(model, tokenizer, name, identity=as_written if as_written != name else None)


# -- identity --------------------------------------------------------------------------------------------------
def weights_fingerprint(model) -> str:
    """A hash of every weight tensor's name, shape, dtype and leading values: other weights, other hash.

    Reading all bytes of an 8B model would take a minute; the first 64 values of each tensor
    change under any fine-tune or merged adapter, and cost nothing.
    """
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        head = p.detach().reshape(-1)[:64].float().cpu().contiguous()
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
        h.update(head.numpy().tobytes())
    return h.hexdigest()[:16]


def backbone_identity(backbone: Backbone) -> dict:
    """What generated data or cached features depend on: architecture and weights."""
    model = backbone.model
    return {"name": backbone.identity or backbone.name, "config": backbone_fingerprint(model.config),
            "weights": weights_fingerprint(model)}


def template_identity(backbone_cfg) -> dict:
    """What a run's record of its data (a features cache's or distillation's identity, beside ``backbone_identity``)
    adds for the chat template's arguments of ``backbone_cfg``: nothing when unset, so records made before the
    setting existed still match."""
    args = check_template_args(getattr(backbone_cfg, "chat_template_args", None), "backbone.chat_template_args")
    return {"chat_template_args": args} if args else {}


def tokenizer_fingerprint(tokenizer) -> str:
    """What turns a conversation into ids, hashed: the tokenizer's definition (a fast tokenizer's whole JSON:
    vocabulary, merges, normalizer, added tokens, BOS handling; else its vocabulary) and its chat template. Data made
    under another one (a hub revision that changed only the template, an edited chat_template.jinja) holds other ids
    than this tokenizer gives, while the backbone's weights and config are the same."""
    digest = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        # canonical: not the call-time truncation / padding state a padded call leaves in it, not the serializer's
        # version or its spelling of merges (pairs since tokenizers 0.20, "a b" strings before)
        spec = {k: v for k, v in json.loads(backend.to_str()).items() if k not in ("truncation", "padding", "version")}
        model = spec.get("model") or {}
        if isinstance(model.get("merges"), list):
            model["merges"] = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
        digest.update(json.dumps(spec, sort_keys=True).encode())
    else:
        digest.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    digest.update(json.dumps(getattr(tokenizer, "chat_template", None), sort_keys=True).encode())
    return f"sha256 {digest.hexdigest()[:16]}"


def backbone_config(cfg):
    """The backbone's transformers config, read without its weights (``AutoConfig`` or ``random_init``)."""
    if cfg.random_init:
        return random_config(cfg.random_init)
    return runtime_backbone.load_backbone_config(cfg.name_or_path, gguf_file=cfg.gguf_file,
                                                 trust_remote_code=cfg.trust_remote_code, revision=cfg.revision)
