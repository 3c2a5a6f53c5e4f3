"""Load the backbone (frozen) and its tokenizer: embedded SmolLM2, any HF id/path, or tiny random;
run it for what the heads learn from (``FrozenFeatures``), and name it (``backbone_identity``).

Pretrained backbones go through the runtime's own loader (``inference.backbone``), so what
trains also decodes. The backbone never trains in Medusa-1: it is put in eval mode with ``requires_grad=False``
on every parameter, and the trainer runs it under ``torch.no_grad``. Only its body is run
during training (the heads need the last hidden state, not the backbone's own logits), which
skips the 49k-vocabulary lm_head product on every token.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch

from inference import backbone as runtime_backbone
from inference.backbone import backbone_logits, decoder_body, parse_dtype
from inference.errors import UserError

from .data.masks import attention_mask
from .data.tokenize import IGNORE

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


# -- running the frozen backbone -----------------------------------------------------------------------------
GREEDY_CHUNK = 1024  # rows per backbone lm_head product for greedy targets: bounds the [rows, vocab] logits


class FrozenFeatures:
    """What the frozen backbone gives the heads: last hidden states and, for ``heads.targets=backbone``, its
    greedy tokens. Used by the online batch source on every micro-batch and by the feature-cache builder
    once per batch, so both store/feed exactly the same tensors (the online == cached(fp32) guarantee)."""

    def __init__(self, model, packed: bool, compute_dtype: torch.dtype, device: torch.device):
        self.model, self.packed = model, packed
        self.compute_dtype, self.device = compute_dtype, device
        self.body = decoder_body(model)

    @torch.no_grad()
    def backbone_hidden(self, batch: dict) -> torch.Tensor:
        """The backbone's last hidden states in its own dtype (before the cast to the heads' precision)."""
        dev = self.device
        ids, pos, doc = batch["input_ids"].to(dev), batch["position_ids"].to(dev), batch["doc_ids"].to(dev)
        mask = attention_mask(doc, self.packed, self.model.dtype)
        return self.body(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).last_hidden_state

    def hidden_states(self, batch: dict) -> torch.Tensor:
        """What the heads are fed: the last hidden states in the training precision."""
        return self.backbone_hidden(batch).to(self.compute_dtype)

    @torch.no_grad()
    def greedy_ids(self, hidden: torch.Tensor, labels: torch.Tensor, doc_ids: torch.Tensor) -> torch.Tensor:
        """[B, T] the backbone's argmax over its full vocabulary where ``losses.backbone_labels`` reads it,
        IGNORE elsewhere. ``hidden`` comes from ``backbone_hidden`` (backbone dtype, not the heads'
        rounding); the lm_head runs on ``GREEDY_CHUNK`` rows at a time so a 49k vocabulary stays small."""
        from .losses import greedy_positions

        need = greedy_positions(labels.to(hidden.device), doc_ids.to(hidden.device))
        out = torch.full(need.shape, IGNORE, dtype=torch.long, device=hidden.device)
        rows = hidden[need]
        if rows.shape[0]:
            out[need] = torch.cat([backbone_logits(self.model, rows[s:s + GREEDY_CHUNK]).argmax(-1)
                                   for s in range(0, rows.shape[0], GREEDY_CHUNK)])
        return out

    def features(self, batch: dict, greedy: bool = True) -> dict:
        """``hidden`` (training precision) and, with ``greedy``, ``greedy`` ids: one backbone forward for both."""
        raw = self.backbone_hidden(batch)
        out = {"hidden": raw.to(self.compute_dtype)}
        if greedy:
            out["greedy"] = self.greedy_ids(raw, batch["labels"], batch["doc_ids"])
        return out


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
    from inference.heads.spec import backbone_fingerprint

    model = backbone.model
    return {"name": backbone.name, "config": backbone_fingerprint(model.config),
            "weights": weights_fingerprint(model)}
