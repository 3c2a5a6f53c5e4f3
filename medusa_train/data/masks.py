"""Attention masks for the micro-batches the stream builds.

Packed rows hold several conversations, each with positions restarting at 0 and its own document
id; the backbone must see them as separate sequences (causal within one, nothing across), or the
hidden states the heads learn from would leak between conversations. Unpacked rows only need the
padding hidden. The mask belongs with the batch layout, so it lives beside the stream.
"""

from __future__ import annotations

import torch


def block_causal_mask(doc_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive 4D mask for packed rows: causal within a conversation, nothing across."""
    t = doc_ids.shape[1]
    same = doc_ids[:, :, None] == doc_ids[:, None, :]
    causal = torch.ones(t, t, dtype=torch.bool, device=doc_ids.device).tril()
    allowed = (same & causal) | torch.eye(t, dtype=torch.bool, device=doc_ids.device)  # padding sees itself
    mask = torch.zeros(allowed.shape, dtype=dtype, device=doc_ids.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None]


def attention_mask(doc_ids: torch.Tensor, packed: bool, dtype: torch.dtype) -> torch.Tensor:
    """The mask a batch needs: block-causal for packed rows, the padding mask (1 = token) otherwise."""
    return block_causal_mask(doc_ids, dtype) if packed else (doc_ids > 0).long()
