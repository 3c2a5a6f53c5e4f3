"""transformers' own greedy ``generate`` (method ``hf_generate``): the baseline a user gets today.

Not a ``Decoder``: it registers a runner. Its default cache, timed like the others, with stock
kernels (no ``linear_kernels`` routing) and transformers' own sdpa (not ``runtime.attention``); the
output is cut after the first EOS, as the runtime cuts. Greedy mode only.

``hf_generate_batch`` is its batched form (the batched evaluation's second baseline): one
``generate`` call over left-padded prompts with an attention mask, each row cut after its first
EOS, returned as a ``BatchOutput`` like ``generate_batch``'s.
"""

from __future__ import annotations

import time

import torch

from ..runtime.attention import transformers_attention
from ..runtime.batch_decode import BatchOutput
from ..runtime.decode import GenerationOutput
from ..runtime.linear_kernels import stock_kernels
from ..runtime.model import MedusaModel
from .registry import Method, register


def hf_generate(m: MedusaModel, prompt_ids: list[int], max_new_tokens: int, sampling=None, seed=None,
                options=None) -> GenerationOutput:
    ids = torch.tensor([prompt_ids], device=m.device)
    new, dt = _generate(m, ids, torch.ones_like(ids), max_new_tokens)
    g = _output(new[0], len(prompt_ids))
    g.decode_s = dt
    return g


def pad_id(m: MedusaModel) -> int:
    """The id ``generate`` pads with: the tokenizer's, else the model's, else EOS (else 0)."""
    for pad in (getattr(m.tokenizer, "pad_token_id", None), getattr(m.model.config, "pad_token_id", None)):
        if isinstance(pad, int):
            return pad
    eos = list(m.eos_token_ids)
    return eos[0] if eos else 0  # no EOS at all (a random backbone, EOS disabled): any id pads nothing


def _generate(m: MedusaModel, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int) -> tuple[list, float]:
    """Greedy ``generate`` of [B, L] ids -> (each row's new tokens cut after its first EOS, wall seconds)."""
    eos = list(m.eos_token_ids)
    t0 = time.perf_counter()
    with torch.inference_mode(), stock_kernels(), transformers_attention(m.model):
        out = m.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                               do_sample=False, eos_token_id=eos or None, pad_token_id=pad_id(m))
    if m.device.type == "cuda":
        torch.cuda.synchronize(m.device)
    dt = time.perf_counter() - t0
    rows = []
    for row in out[:, ids.shape[1]:].tolist():
        for i, t in enumerate(row):
            if t in eos:
                row = row[:i + 1]
                break
        rows.append(row)
    return rows, dt


def _output(new: list[int], prompt_tokens: int) -> GenerationOutput:
    g = GenerationOutput(tokens=new, prompt_tokens=prompt_tokens, finish_reason="hf")
    g.accept_lengths = [1] * max(len(new) - 1, 0)
    return g


def hf_generate_batch(m: MedusaModel, prompts: list[list[int]], max_new_tokens: int) -> BatchOutput:
    """One greedy ``generate`` over the prompts, left-padded (``pad_id``) with an attention mask; each row
    counts its tokens up to and including its first EOS. The whole call's time is ``decode_s``."""
    width = max(len(p) for p in prompts)
    pad = pad_id(m)
    ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts], device=m.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=m.device)
    rows, dt = _generate(m, ids, mask, max_new_tokens)
    outs = [_output(new, len(p)) for new, p in zip(rows, prompts)]
    for g in outs:
        g.decode_s = dt
    return BatchOutput(outs, decode_s=dt)


register(Method("hf_generate", "transformers' greedy generate (baseline, greedy mode only)", runner=hf_generate,
                baseline=True, greedy_only=True))
