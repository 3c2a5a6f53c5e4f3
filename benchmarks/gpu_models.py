"""The random models the GPU check times (benchmarks/gpu_check.py, benchmarks/gpu_graphs.py): real shapes, random
weights, no download."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from inference.heads.eagle3 import default_aux_layers, draft_layer_config
from inference.heads.registry import init_heads
from inference.heads.spec import HeadsSpec
from inference.loading import attach_heads
from inference.runtime.model import MedusaModel

# SmolLM2-135M(-Instruct)'s config.json, as transformers' LlamaConfig takes it.
SMOLLM2_135M = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0,
                    max_position_embeddings=8192, rms_norm_eps=1e-5, hidden_act="silu")
TINY = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=320, tie_word_embeddings=True, rope_theta=100000.0,
            max_position_embeddings=512, rms_norm_eps=1e-5, hidden_act="silu")

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


def eagle3_model(m: MedusaModel, seed: int = 0) -> MedusaModel:
    """``m``'s backbone with a random EAGLE-3 drafter of the recipe's shape (draft vocabulary: the first
    ``EAGLE3_DRAFT_VOCAB`` ids; random weights draft the same amount of work as trained ones)."""
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
    return attach_heads(model, heads)
