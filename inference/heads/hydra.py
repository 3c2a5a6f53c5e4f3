"""Hydra heads: Medusa heads that are also fed the embeddings of the path they extend.

Head k: ``ResBlocks(W_k [h_t; e(x_{t+1}); ...; e(x_{t+k+1})] + b_k)`` then the projection modes
of ``HeadsSpec`` (own / shared / truncated); e() is the backbone's own input embedding, frozen
and never stored. W_k starts as [I, 0, ...], so a fresh Hydra head is a fresh Medusa head
(Hydra, arXiv 2402.05109). Drafted level by level (``dependent``, ``drafting.PathDrafting``).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
import torch.nn.functional as F

from ..errors import UserError
from .dependent import DependentHeads
from .drafting import PathDrafting
from .inputs import BackboneInputs
from .projection import ResBlock
from .registry import HeadFamily, register_family
from .spec import HeadsSpec


class HydraHeads(DependentHeads):
    """Head k = residual MLP over [h_t; embeddings of the k+1 path tokens] (module docstring)."""

    def __init__(self, spec: HeadsSpec):
        super().__init__()
        h = spec.hidden_size
        self.inputs = nn.ModuleList(nn.Linear((k + 2) * h, h) for k in range(spec.num_heads))
        for k, lin in enumerate(self.inputs):
            nn.init.zeros_(lin.weight)
            nn.init.zeros_(lin.bias)
            with torch.no_grad():
                lin.weight[:, :h].copy_(torch.eye(h))  # starts as the identity on h_t
        self.blocks = nn.ModuleList(
            nn.Sequential(*[ResBlock(h) for _ in range(spec.num_layers)]) for _ in range(spec.num_heads))
        self._init_projection(spec, h)
        # The backbone's input embedding table, borrowed (frozen, never exported).
        self.register_buffer("embed_weight", None, persistent=False)

    @classmethod
    def from_backbone(cls, spec: HeadsSpec, lm_head_weight: torch.Tensor, input_embeddings: Optional[torch.Tensor],
                      token_map: Optional[torch.Tensor] = None) -> "HydraHeads":
        if input_embeddings is None:
            raise UserError("hydra heads need the backbone's input embeddings")
        return super().from_backbone(spec, lm_head_weight, input_embeddings, token_map)

    @property
    def needs_input_embeddings(self) -> bool:
        return True

    def attach_backbone(self, lm_head_weight=None, input_embeddings=None) -> None:
        super().attach_backbone(lm_head_weight, input_embeddings)
        if input_embeddings is not None:
            if tuple(input_embeddings.shape) != (self.spec.vocab_size, self.spec.hidden_size):
                raise UserError(f"hydra heads need input embeddings of shape {(self.spec.vocab_size, self.spec.hidden_size)}"
                                f", got {tuple(input_embeddings.shape)}")
            self.embed_weight = input_embeddings.detach()

    def embed(self, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.embed_weight is None:
            raise RuntimeError("hydra heads need attach_backbone(input_embeddings=...) first")
        return F.embedding(tokens, self.embed_weight).to(dtype)

    def init_state(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden

    def step(self, k, state, tokens):
        state = torch.cat([state, self.embed(tokens, state.dtype)], dim=-1)   # [h; e_1; ...; e_{k+1}]
        return state, self.blocks[k](self.inputs[k](state))

    def teacher_forced_features(self, hidden, future, count=None):
        # Same arithmetic as the recurrence, but each head's input is built once (no growing cat).
        count = self.spec.num_heads if count is None else count
        emb = self.embed(future[..., :count], hidden.dtype)                 # [..., count, H]
        feats, parts = [], [hidden]
        for k in range(count):
            parts.append(emb[..., k, :])
            feats.append(self.blocks[k](self.inputs[k](torch.cat(parts, dim=-1))))
        return feats



register_family(HeadFamily("hydra", HydraHeads, PathDrafting, inputs=BackboneInputs(path_tokens=True)))
