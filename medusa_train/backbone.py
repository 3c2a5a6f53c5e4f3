"""Load the backbone (frozen) and its tokenizer: embedded SmolLM2, any HF id/path, or tiny random.

The backbone never trains in Medusa-1: it is put in eval mode with ``requires_grad=False``
on every parameter, and the trainer runs it under ``torch.no_grad``. Only its body is run
during training (the heads need the last hidden state, not the backbone's own logits), which
skips the 49k-vocabulary lm_head product on every token.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from inference.errors import UserError
from inference import assets

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass
class Backbone:
    model: Any  # a transformers *ForCausalLM
    tokenizer: Any
    name: str  # what the export records as base model


def byte_tokenizer():
    """A 259-token byte-level tokenizer with a ChatML template: no files, no network (tests)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

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


def random_backbone(config: dict, seed: int = 0) -> Backbone:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(config)
    model_type = cfg.pop("model_type", "llama")
    tokenizer = byte_tokenizer()
    cfg.setdefault("vocab_size", len(tokenizer))
    if cfg["vocab_size"] < len(tokenizer):
        raise UserError(f"backbone.random_init.vocab_size must be >= {len(tokenizer)} (the byte tokenizer)")
    hf_config = AutoConfig.for_model(model_type, **cfg)
    hf_config.eos_token_id = tokenizer.eos_token_id
    hf_config.pad_token_id = tokenizer.pad_token_id
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa")
    return Backbone(model, tokenizer, f"random:{model_type}")


def load_backbone(cfg, device: torch.device | str = "cpu", seed: int = 0) -> Backbone:
    """Build the frozen backbone described by a ``BackboneConfig``."""
    if cfg.random_init:
        backbone = random_backbone(dict(cfg.random_init), seed=seed)
    else:
        backbone = _load_pretrained(cfg)
    model = backbone.model
    if cfg.dtype != "auto":
        model.to(_DTYPES[cfg.dtype])
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    if backbone.tokenizer.pad_token is None:
        backbone.tokenizer.pad_token = backbone.tokenizer.eos_token
    if not backbone.tokenizer.chat_template:
        raise UserError(f"tokenizer of {backbone.name} has no chat template; use a chat (instruct) model")
    return backbone


def _load_pretrained(cfg) -> Backbone:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, name = assets.resolve_backbone_path(cfg.name_or_path, cfg.gguf_file)
    looks_local = path.startswith((".", "/", "~")) or os.path.sep in path and path.count("/") > 1
    if looks_local and not os.path.isdir(os.path.expanduser(path)):
        raise UserError(f"backbone path not found: {path}")
    kwargs = dict(trust_remote_code=cfg.trust_remote_code, revision=cfg.revision)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=_DTYPES.get(cfg.dtype, "auto"), attn_implementation=cfg.attn_implementation, **kwargs)
    except OSError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"cannot load backbone {cfg.name_or_path!r} (not a local model folder, and the hub has no "
                        f"such model or cannot be reached): {first}") from None
    except ValueError as e:
        if "trust_remote_code" in str(e):
            raise UserError(f"backbone {cfg.name_or_path!r} needs custom code: set backbone.trust_remote_code=true "
                            "only if you trust its source") from None
        raise
    return Backbone(model, tokenizer, name)


def lm_head_weight(model) -> torch.Tensor:
    head = model.get_output_embeddings()
    if head is None:
        raise UserError(f"{type(model).__name__} has no output embedding (lm_head); Medusa heads need one")
    return head.weight


def body(model):
    """The decoder stack without lm_head (``model.model`` for Llama/Qwen/Mistral/Gemma)."""
    base = getattr(model, model.base_model_prefix, None)
    if base is None:
        raise UserError(f"cannot find the decoder body of {type(model).__name__}")
    return base
