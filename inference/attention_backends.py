"""Which fused SDPA kernels decoding may use on CUDA: every one but cuDNN's; and masked grouped-query attention
that needs no fused kernel to refuse its mask (``folded_attention``), for the backbone and the EAGLE-3 drafter.

While decoding, the attention's key length grows by one or more every call. torch's cuDNN SDPA backend
builds (and caches) an execution plan per distinct shape, so on a decoding loop every call is a new plan:
on an H200 (torch 2.11, SmolLM2-135M shape, bf16) that cost 1.4 ms of host time per call against 0.05 ms
for a shape it had seen, 30 layers x 1.4 ms = 42 of a batched step's 66 ms (``python scripts/bench.py profile-gpu``,
benchmarks/history.md "GPU check"). The memory-efficient and flash kernels take any length at no planning cost;
torch picks among them (and the math fallback) as usual. Training, whose shapes are fixed, is left alone.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F

_NO_CHANGE = nullcontext()  # reusable: entered on every CPU attention call, so built once
# Query rows up to which folded_attention folds the groups into one call: a verification step's tree (the
# default buckets end at 64 nodes). Longer calls (a prompt's first forward) run one call per group.
FOLDED_ROWS = 64


class _WithoutCudnnSdp:
    """Turns torch's cuDNN SDPA backend off for the block and restores it after. Three flag calls (~1 us)
    instead of ``torch.nn.attention.sdpa_kernel`` (~12 us): this is entered once per layer per step."""

    __slots__ = ("was",)

    def __enter__(self):
        self.was = torch.backends.cuda.cudnn_sdp_enabled()
        if self.was:
            torch.backends.cuda.enable_cudnn_sdp(False)
        return self

    def __exit__(self, *exc):
        if self.was:
            torch.backends.cuda.enable_cudnn_sdp(True)
        return False


def decoding_sdpa(device: torch.device):
    """A context in which scaled_dot_product_attention on ``device`` never plans a cuDNN graph (CUDA only):
    torch then picks among the flash, memory-efficient and math kernels as usual."""
    return _WithoutCudnnSdp() if device.type == "cuda" else _NO_CHANGE


def folded_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                     dropout: float = 0.0, scaling=None) -> torch.Tensor:
    """Masked grouped-query attention without repeating keys and values: query [B, Hq, n, D] (query head h reads
    key/value head h // G, as transformers' ``repeat_kv`` lays them out), key / value [B, Hkv, S, D], mask
    [B or 1, 1, n, S]; the G query heads of a key/value head become G*n rows of one head (up to ``FOLDED_ROWS``
    rows per call; longer calls attend per query group). Returns [B, n, Hq, D]."""
    b, hq, n, d = query.shape
    hkv = key.shape[1]
    g = hq // hkv
    if n > FOLDED_ROWS:
        # One call per query group, each over the unrepeated mask: folding would copy the mask G times, which
        # for a prompt read through a static buffer is B x G x n x capacity elements per layer (~2 GB at
        # Llama-3.1-8B's 4 groups, 32 rows of 2,000 tokens). Query head k*g + j reads key/value head k.
        outs = [F.scaled_dot_product_attention(query[:, j::g], key, value, attn_mask=mask, dropout_p=dropout,
                                               scale=scaling) for j in range(g)]
        return torch.stack(outs, dim=2).reshape(b, hq, n, value.shape[-1]).transpose(1, 2).contiguous()
    rows = query.reshape(b, hkv, g * n, d)                     # row j*n + i: query head k*g + j, position i
    if n > 1:                                                  # one row: the mask broadcasts over the G rows
        mask = mask.expand(b, 1, n, mask.shape[-1]).repeat(1, 1, g, 1)
    out = F.scaled_dot_product_attention(rows, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling)
    return out.reshape(b, hq, n, value.shape[-1]).transpose(1, 2).contiguous()
