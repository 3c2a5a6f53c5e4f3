"""Load the backbone (frozen) and its tokenizer: embedded SmolLM2, any HF id/path, or tiny random.

Pretrained backbones go through the runtime's own loader (``inference.backbone``), so what
trains also decodes. The backbone never trains in Medusa-1: it is put in eval mode with ``requires_grad=False``
on every parameter, and the trainer runs it under ``torch.no_grad``. Only its body is run
during training (the heads need the last hidden state, not the backbone's own logits), which
skips the 49k-vocabulary lm_head product on every token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from inference import backbone as runtime_backbone
from inference.backbone import parse_dtype
from inference.errors import UserError

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
        model.to(parse_dtype(cfg.dtype))
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    if backbone.tokenizer.pad_token is None:
        backbone.tokenizer.pad_token = backbone.tokenizer.eos_token
    if not backbone.tokenizer.chat_template:
        raise UserError(f"tokenizer of {backbone.name} has no chat template; use a chat (instruct) model")
    return backbone


def _load_pretrained(cfg) -> Backbone:
    model, tokenizer, name = runtime_backbone.load_backbone(
        cfg.name_or_path, dtype=cfg.dtype, trust_remote_code=cfg.trust_remote_code, revision=cfg.revision,
        gguf_file=cfg.gguf_file, attn_implementation=cfg.attn_implementation)
    return Backbone(model, tokenizer, name)
