"""A scripted stand-in for ``MedusaModel`` (tests of the draft-model, lookahead and prompt-lookup
decoders): forced acceptance lengths and readable KV caches, with no real model.

``ScriptedLM(script, vocab)``: the token it predicts after position t is ``script[t + 1]``,
whatever the context (a one-hot logit of 20, so greedy and sampling agree). Its one-layer
``TreeKVCache`` stores, as the key, the token id fed at each cache row, so
``cached_tokens(cache)`` says exactly which tokens a cache holds after a roll-back or a
compaction. ``calls`` records the number of tokens of every forward.
"""

from __future__ import annotations

import contextlib
import types

import torch

from inference.runtime.cache import TreeKVCache


class ScriptedLM:
    def __init__(self, script: list[int], vocab: int):
        self.script = list(script)
        self.vocab_size = vocab
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.max_positions = None
        self.eos_token_ids: list[int] = []
        self.heads = None
        self.tokenizer = None
        self.config = types.SimpleNamespace(num_hidden_layers=1)
        self.calls: list[int] = []

    def new_cache(self, capacity: int) -> TreeKVCache:
        return TreeKVCache(1, capacity)

    def stepping(self):
        return contextlib.nullcontext()   # MedusaModel's decoding-step context: no LongRoPE switch to make here

    def hidden(self, input_ids, position_ids, cache, attention_mask=None):
        k = input_ids.float()[:, None, :, None]                  # [1, 1, n, 1]: the token ids
        cache.layers[0].update(k, k)
        self.calls.append(input_ids.shape[1])
        return position_ids.float()[..., None]                   # "hidden state" = the position

    def logits(self, hidden):
        pos = hidden[..., 0].long()
        nxt = torch.tensor(self.script)[(pos + 1).clamp(max=len(self.script) - 1)]
        return torch.nn.functional.one_hot(nxt, self.vocab_size).float() * 20.0


def cached_tokens(cache: TreeKVCache) -> list[int]:
    return cache.layers[0].keys[0, 0, :, 0].long().tolist()
