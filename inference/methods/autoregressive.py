"""Plain autoregressive decoding: one token per forward, the speedup baseline.

Same model wrapper, KV cache and token choice as every other method, driven by the same
``run_decoder`` loop and timing rule, so a speedup isolates what a method's drafting buys.
A step does only what plain decoding needs (write the token, one forward of one position, pick
the next token). Typical mode samples like sample mode here (there is nothing to accept).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..runtime.batch_decode import BatchTreeDecoder, PlainDrafter
from ..runtime.decode import prefill_token, seeded_generator
from ..runtime.model import MedusaModel
from ..runtime.verify import SamplingConfig, plain_token
from .registry import Method, register


class AutoregressiveDecoder:
    """Plain decoding state for one sequence; works on a ``MedusaModel`` with or without heads."""

    def __init__(self, m: MedusaModel, sampling: Optional[SamplingConfig] = None, seed: Optional[int] = None):
        self.m = m
        self.cfg = sampling or SamplingConfig()
        self.gen = seeded_generator(m.device, seed)
        self.cache = None
        self.past = 0
        self.tok: Optional[int] = None
        self._input: Optional[torch.Tensor] = None

    def prefill(self, prompt: torch.Tensor, max_new_tokens: int) -> int:
        self.past = prompt.shape[1]
        self.cache = self.m.new_cache(self.past + max_new_tokens)
        _, self.tok = prefill_token(self.m, prompt, self.cache, self.cfg, self.gen)
        self._input = torch.empty(1, 1, dtype=torch.long, device=self.m.device)
        return self.tok

    def step(self) -> tuple[list[int], int]:
        m = self.m
        self._input.fill_(self.tok)
        pos = torch.full((1, 1), self.past, dtype=torch.long, device=m.device)
        h = m.hidden(self._input, pos, self.cache)[0, -1]
        self.tok = int(plain_token(m.logits(h), self.cfg, self.gen))   # as the batched loop draws: one seed, one output
        self.past += 1
        return [self.tok], 0


register(Method("autoregressive", "the runtime's own one-token loop (same cache and token choice): the speedup "
                "baseline, always run", decoder=lambda m, o, sampling, seed: AutoregressiveDecoder(m, sampling, seed),
                batch_decoder=lambda m, o, sampling, seed, ragged: BatchTreeDecoder(m, PlainDrafter(), sampling, seed,
                                                                                    ragged),
                baseline=True))
