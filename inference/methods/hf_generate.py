"""transformers' own greedy ``generate`` (method ``hf_generate``): the baseline a user gets today.

Not a ``Decoder``: it registers a runner. Its default cache, timed like the others, with stock
kernels (no ``linear_kernels`` routing); the output is cut after the first EOS, as the runtime
cuts. Greedy mode only.
"""

from __future__ import annotations

import time

import torch

from ..runtime.decode import GenerationOutput
from ..runtime.linear_kernels import stock_kernels
from ..runtime.model import MedusaModel
from .registry import Method, register


def hf_generate(m: MedusaModel, prompt_ids: list[int], max_new_tokens: int, sampling=None, seed=None,
                options=None) -> GenerationOutput:
    ids = torch.tensor([prompt_ids], device=m.device)
    eos = list(m.eos_token_ids)
    pad = m.tokenizer.pad_token_id if m.tokenizer is not None and m.tokenizer.pad_token_id is not None else None
    if pad is None:
        pad = eos[0] if eos else 0  # no EOS at all (a random backbone, EOS disabled): any id pads nothing
    t0 = time.perf_counter()
    with torch.inference_mode(), stock_kernels():
        out = m.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                               do_sample=False, eos_token_id=eos or None, pad_token_id=pad)
    if m.device.type == "cuda":
        torch.cuda.synchronize(m.device)
    dt = time.perf_counter() - t0
    new = out[0, len(prompt_ids):].tolist()
    for i, t in enumerate(new):
        if t in eos:
            new = new[:i + 1]
            break
    g = GenerationOutput(tokens=new, prompt_tokens=len(prompt_ids), finish_reason="hf")
    g.decode_s = dt
    g.accept_lengths = [1] * max(len(new) - 1, 0)
    return g


register(Method("hf_generate", "transformers' greedy generate (baseline, greedy mode only)", runner=hf_generate,
                baseline=True, greedy_only=True))
