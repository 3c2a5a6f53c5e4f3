"""Tiny models and stub heads shared by the decoding tests (tests/runtime/, tests/methods/ and the other rooms that decode)."""

from __future__ import annotations

import types

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from inference.heads.drafting import IndependentDrafting
from inference.heads.medusa import MedusaHeads
from inference.heads.spec import HeadsSpec
from inference.loading import attach_heads
from inference.runtime.model import MedusaModel


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Run tiny models on one thread: with the two shared cores busy, OpenMP barriers between
    two threads make millisecond-sized ops ~50x slower. Import this into a test module."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny_llama(vocab: int = 96, hidden: int = 64, layers: int = 2, seed: int = 0, init: float = 0.02,
               max_positions: int = 512) -> LlamaForCausalLM:
    """A random Llama with GQA (4 query heads, 2 KV heads) and SDPA attention, fp32, eval mode."""
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                      initializer_range=init, tie_word_embeddings=False, eos_token_id=None, bos_token_id=None,
                      pad_token_id=None)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    return model.eval()


def random_heads(model, num_heads: int = 3, num_layers: int = 1, projection: str = "own", seed: int = 1,
                 truncated: int | None = None, scale: float = 1.0) -> MedusaHeads:
    """Heads with random (non-identity) blocks and projections, so their guesses are arbitrary."""
    cfg = model.config
    spec = HeadsSpec(num_heads=num_heads, num_layers=num_layers, hidden_size=cfg.hidden_size,
                     vocab_size=cfg.vocab_size, projection=projection, truncated_vocab_size=truncated,
                     base_model="random:llama")
    g = torch.Generator().manual_seed(seed)
    heads = MedusaHeads(spec)
    with torch.no_grad():
        for name, p in heads.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (scale / p.shape[-1] ** 0.5))
        if projection == "truncated":
            heads.token_map.copy_(torch.randperm(cfg.vocab_size, generator=g)[:truncated])
    return heads


def wrap(model, heads) -> MedusaModel:
    if isinstance(heads, MedusaHeads):
        return attach_heads(model, heads)
    return MedusaModel(model=model, tokenizer=None, heads=heads)


def one_hot_ranked(vocab: int, ranked: list[int]) -> torch.Tensor:
    """Logits whose top-k order is exactly ``ranked`` (then everything else)."""
    logits = torch.zeros(vocab)
    for r, tok in enumerate(ranked):
        logits[tok] = 10.0 - r
    return logits


class FixedHeads(IndependentDrafting, torch.nn.Module):
    """Stub heads: head k always ranks ``ranked[k]`` first, whatever the hidden state."""

    def __init__(self, vocab: int, ranked: list[list[int]]):
        super().__init__()
        self.spec = types.SimpleNamespace(num_heads=len(ranked), output_size=vocab)
        self.table = [one_hot_ranked(vocab, r) for r in ranked]

    def head_logits(self, hidden, k):
        return self.table[k].to(hidden.device).expand(*hidden.shape[:-1], -1)

    def to_vocab_ids(self, ids):
        return ids


class OracleHeads(IndependentDrafting, torch.nn.Module):
    """Stub heads that know the backbone's own greedy future: perfect guesses.

    ``reference`` holds the hidden state of every position of prompt + greedy continuation
    (one full forward); a hidden state is matched to its position by nearest neighbour, and
    head k ranks the token at position + k + 2 first.
    """

    def __init__(self, m: MedusaModel, sequence: list[int], num_heads: int):
        super().__init__()
        self.spec = types.SimpleNamespace(num_heads=num_heads, output_size=m.vocab_size)
        self.vocab = m.vocab_size
        self.seq = sequence
        with torch.no_grad():
            ids = torch.tensor([sequence])
            self.reference = m.body(input_ids=ids).last_hidden_state[0]   # any decoder body (GPT-2: .transformer)

    def head_logits(self, hidden, k):
        flat = hidden.reshape(-1, hidden.shape[-1])
        pos = torch.cdist(flat, self.reference).argmin(-1)
        out = torch.zeros(flat.shape[0], self.vocab)
        for i, t in enumerate(pos.tolist()):
            j = t + k + 2
            if j < len(self.seq):
                out[i, self.seq[j]] = 10.0
        return out.reshape(*hidden.shape[:-1], self.vocab)

    def to_vocab_ids(self, ids):
        return ids


def sequential_kv(m: MedusaModel, tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer keys/values after feeding ``tokens`` one at a time (the reference cache)."""
    cache = m.new_cache(len(tokens))
    with torch.inference_mode():
        for i, t in enumerate(tokens):
            m.hidden(torch.tensor([[t]]), torch.tensor([[i]]), cache)
    return [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]


PLAIN_PROMPT = [5, 17, 3, 88, 41, 9]


@pytest.fixture(scope="module", name="m")
def plain_model():
    """A tiny random Llama without heads (the training-free methods' tests); fixture name ``m``."""
    return MedusaModel(model=tiny_llama(vocab=96, seed=0), tokenizer=None, heads=None)


@pytest.fixture(scope="module", name="greedy")
def plain_greedy(m):
    """The plain model's own greedy continuation of PLAIN_PROMPT (48 tokens); fixture name ``greedy``."""
    from inference.methods import generate

    return generate(m, PLAIN_PROMPT, "autoregressive", max_new_tokens=48).tokens
