"""The random models the GPU check times (benchmarks/gpu_check.py, benchmarks/gpu_graphs.py): real shapes, random
weights, no download."""

from __future__ import annotations

from contextlib import nullcontext

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from inference.heads.eagle3 import default_aux_layers, draft_layer_config
from inference.heads.registry import init_heads
from inference.heads.spec import HeadsSpec
from inference.loading import attach_heads
from inference.runtime.model import MedusaModel

try:  # transformers' own weight init is skipped (every weight is drawn in device_llama anyway)
    from transformers.initialization import no_init_weights
except ImportError:  # pragma: no cover - another layout: transformers then initialises on the device first
    no_init_weights = nullcontext

# SmolLM2-135M(-Instruct)'s config.json, as transformers' LlamaConfig takes it.
SMOLLM2_135M = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0,
                    max_position_embeddings=8192, rms_norm_eps=1e-5, hidden_act="silu")
TINY = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=320, tie_word_embeddings=True, rope_theta=100000.0,
            max_position_embeddings=512, rms_norm_eps=1e-5, hidden_act="silu")
# Llama-3.1-8B's config.json as LlamaConfig takes it (its llama3 rope scaling left out: same cost per step).
LLAMA31_8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                  intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0,
                  max_position_embeddings=131072, rms_norm_eps=1e-5, hidden_act="silu")

# eagle3_smollm2's drafter (benchmarks/history.md "EAGLE-3 plus prompt lookup" / "eagle3_smollm2 retrained"): greedy tau on
# MT-Bench first turns 1-20, 96 tokens, eagle3 without the lookup branch; deterministic, so the GPU times steps only.
EAGLE3_TAU = {(1, 1, 1): 1.320, (4, 1, 4): 1.534}
EAGLE3_DRAFT_VOCAB = 8192

def backbone(shape: dict, device: torch.device, dtype: torch.dtype, seed: int = 0):
    cfg = LlamaConfig(**shape, initializer_range=0.02, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    return model.to(device, dtype).eval()


def device_llama(shape: dict, device: torch.device, dtype: torch.dtype, seed: int = 0, eos_token_id=None,
                 pad_token_id=None):
    """A random Llama of ``shape`` made on ``device`` in ``dtype`` directly: under ``torch.device`` every weight
    is allocated there (8B never exists on the host: 16 GB bf16, not 32 GB fp32), transformers' per-module init
    is skipped (``no_init_weights``), then every matrix is drawn N(0, 0.02) and every norm set to 1 on the device
    (what transformers' init gives a Llama with initializer_range 0.02), one pass over the weights."""
    cfg = LlamaConfig(**shape, initializer_range=0.02, eos_token_id=eos_token_id, bos_token_id=None,
                      pad_token_id=pad_token_id)
    with torch.device(device), no_init_weights():
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=dtype)
    if cfg.tie_word_embeddings:  # no_init_weights also skips the tying init_weights does
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=g) if p.dim() > 1 else p.fill_(1.0)
    return model.eval()


def eagle3_model(m: MedusaModel, seed: int = 0, tokenizer=None) -> MedusaModel:
    """``m``'s backbone with a random EAGLE-3 drafter of the recipe's shape (draft vocabulary: the first
    ``EAGLE3_DRAFT_VOCAB`` ids; random weights draft the same amount of work as trained ones); ``tokenizer``: the
    result's, for benchmarks that encode chats."""
    model, cfg = m.model, m.model.config
    vocab = min(EAGLE3_DRAFT_VOCAB, cfg.vocab_size)
    spec = HeadsSpec(num_heads=1, num_layers=1, hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size,
                     projection="truncated", truncated_vocab_size=vocab, kind="eagle3",
                     aux_layers=default_aux_layers(cfg.num_hidden_layers), draft_layer=draft_layer_config(cfg),
                     base_model="random:llama")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        heads = init_heads(spec, model.get_output_embeddings().weight.float().cpu(),
                           model.get_input_embeddings().weight.float().cpu(), torch.arange(vocab))
    return attach_heads(model, heads, tokenizer)
