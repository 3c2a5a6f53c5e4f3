"""Speculation near a backbone's position limits (runtime/model.py ``body_hidden``'s cap, runtime/rope_switch.py):
draft nodes past the request's budget or across LongRoPE's switch must not change a single output token."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, Phi3Config

from inference.methods import generate, generate_batch
from inference.runtime.rope_switch import PerPositionLongRope

from runtime_support import OracleHeads, one_thread, wrap  # noqa: F401 (one_thread: autouse fixture)

V, LIMIT = 96, 32
SPECULATING = [("draft", dict(draft="self:2", k=6)), ("prompt_lookup", {})]   # self:2 = the whole model: all accepted


def recomputed_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding with a full forward per token, no cache: what the backbone itself says."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


def cached_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding one token a forward over transformers' KV cache: the keys of earlier positions keep the
    rotation they were computed with. (transformers' Phi-3 ``generate`` instead drops its cache when the sequence
    passes the LongRoPE switch and recomputes it all with the long factors; an engine such as vLLM keeps it.)"""
    from transformers import DynamicCache

    cache, out = DynamicCache(), []
    with torch.no_grad():
        logits = model(torch.tensor([prompt]), past_key_values=cache, use_cache=True).logits
        for i in range(n):
            out.append(int(logits[0, -1].argmax()))
            logits = model(torch.tensor([out[-1:]]), past_key_values=cache, use_cache=True,
                           position_ids=torch.tensor([[len(prompt) + i]])).logits
    return out


def backbone(config, seed: int):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def llama(rope: dict, seed: int):
    return backbone(LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=LIMIT,
                                initializer_range=0.3, tie_word_embeddings=False, eos_token_id=None,
                                bos_token_id=None, pad_token_id=None, rope_scaling=rope), seed)


def phi3_longrope(seed: int, switch: int = 24):
    half = 8   # head_dim 16
    return backbone(Phi3Config(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                               original_max_position_embeddings=switch, initializer_range=0.3,
                               tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None,
                               rope_scaling={"type": "longrope", "short_factor": [1.0] * half,
                                             "long_factor": [8.0] * half}), seed)


@pytest.mark.parametrize("seed", range(4))
def test_dynamic_rope_output_is_unchanged_up_to_the_last_position(seed):
    """Guards against: draft nodes past the last position making dynamic-NTK RoPE rescale its frequencies for the
    whole forward (transformers picks them from the forward's largest position), accepted tokens included: with
    prompt + max_new_tokens = max_position_embeddings, 20 of 36 speculative runs differed from plain greedy, and
    a short batch row differed from its batch-1 output because another row's nodes crossed the limit."""
    model = llama({"rope_type": "dynamic", "factor": 8.0}, seed)
    rng = random.Random(seed)
    prompt = [rng.randrange(V) for _ in range(rng.randrange(14, 24))]
    n = LIMIT - len(prompt)
    want = recomputed_greedy(model, prompt, n)
    m = wrap(model, None)
    oracle = wrap(model, OracleHeads(m, prompt + want + [0] * 8, 4))
    assert generate(oracle, prompt, "medusa", tree="tree8", max_new_tokens=n, eos_token_ids=()).tokens == want
    for method, options in SPECULATING:
        assert generate(m, prompt, method, max_new_tokens=n, eos_token_ids=(), **options).tokens == want, method
    short = [rng.randrange(V) for _ in range(6)]
    rows = generate_batch(m, [prompt, short], "prompt_lookup", max_new_tokens=n, eos_token_ids=()).rows
    assert rows[0].tokens == want
    assert rows[1].tokens == generate(m, short, "prompt_lookup", max_new_tokens=n, eos_token_ids=()).tokens


def test_learned_positions_never_index_past_their_table():
    """Guards against: a verification step near the limit feeding draft nodes at positions >= n_positions to a
    learned position table (GPT-2's wpe): IndexError, where plain decoding of the same request runs."""
    model = backbone(GPT2Config(vocab_size=V, n_embd=64, n_layer=2, n_head=4, n_positions=LIMIT, eos_token_id=None,
                                bos_token_id=None, initializer_range=0.3), 0)
    prompt = [5, 17, 3, 88, 41, 9, 60, 61, 7, 30, 12, 95, 44, 2, 8, 19, 77, 23, 54, 1]
    n = LIMIT - len(prompt)
    want = recomputed_greedy(model, prompt, n)
    oracle = wrap(model, OracleHeads(wrap(model, None), prompt + want, 3))   # all 32 positions: perfect guesses
    assert generate(oracle, prompt, "medusa", tree="chain3", max_new_tokens=n, eos_token_ids=()).tokens == want


@pytest.mark.parametrize("seed", range(4))
def test_longrope_speculation_across_the_switch_equals_plain_decoding(seed):
    """Guards against: a speculative step straddling LongRoPE's switch (original_max_position_embeddings) rotating
    its whole forward, accepted tokens below the switch included, with the long factors, where one-token decoding
    rotates them short: 14 of 16 speculative runs differed from the plain loop. Plain decoding must still equal
    one-token decoding over transformers' cache (the prompt keeps transformers' rule), and batch rows on either
    side of the switch their batch-1 runs."""
    model = phi3_longrope(seed)
    rng = random.Random(seed)
    prompt = [rng.randrange(V) for _ in range(rng.randrange(8, 20))]
    n = 20                                             # crosses position 24
    m = wrap(model, None)
    want = cached_greedy(model, prompt, n)
    plain = generate(m, prompt, "autoregressive", max_new_tokens=n, eos_token_ids=()).tokens
    assert plain == want
    for method, options in SPECULATING:
        assert generate(m, prompt, method, max_new_tokens=n, eos_token_ids=(), **options).tokens == want, method
    long_prompt = [rng.randrange(V) for _ in range(30)]   # already past the switch: long factors throughout
    rows = generate_batch(m, [prompt, long_prompt], "prompt_lookup", max_new_tokens=n, eos_token_ids=()).rows
    assert rows[0].tokens == want
    long_want = cached_greedy(model, long_prompt, n)   # transformers' own rotation of a prompt past the switch
    assert generate(m, long_prompt, "autoregressive", max_new_tokens=n, eos_token_ids=()).tokens == long_want
    assert rows[1].tokens == long_want


def test_the_longrope_wrapper_is_installed_once_and_only_for_longrope():
    """Guards against: wrapping the rotary module again for each MedusaModel over the same backbone (each layer
    of wrappers doubling the rotary's cost), or wrapping backbones without LongRoPE."""
    model = phi3_longrope(0)
    first, second = wrap(model, None), wrap(model, None)
    assert isinstance(model.model.rotary_emb.forward, PerPositionLongRope)
    assert first._rope_switch is second._rope_switch
    assert not isinstance(model.model.rotary_emb.forward.forward, PerPositionLongRope)
    assert wrap(llama({"rope_type": "dynamic", "factor": 8.0}, 0), None)._rope_switch is None
