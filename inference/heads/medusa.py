"""Medusa heads: K independent heads over the backbone's last hidden state.

A head is L residual blocks on the backbone's last hidden state (after the final norm) followed
by a projection to the vocabulary (``projection``). Head k (k = 1..K) predicts the token k+1
positions ahead of the backbone's own next token: from position t, the backbone predicts t+1
and head k predicts t+k+1. Because a head sees h_t alone, one call per head fills a whole depth
of a draft tree (``IndependentDrafting``).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .drafting import IndependentDrafting
from .projection import ProjectedHeads, ResBlock
from .registry import HeadFamily, register_family


class MedusaHeads(IndependentDrafting, ProjectedHeads):
    """K heads over the backbone's last hidden state.

    ``forward(hidden)`` returns a list of K logit tensors (``[..., output_size]``). For
    ``truncated`` heads, logits are over the local vocabulary; ``token_map`` maps them back.
    For ``shared`` heads, call ``attach_lm_head`` with the backbone's lm_head weight first.
    """

    def __init__(self, spec):
        super().__init__()
        h = spec.hidden_size
        self.blocks = nn.ModuleList(
            nn.Sequential(*[ResBlock(h) for _ in range(spec.num_layers)]) for _ in range(spec.num_heads)
        )
        self._init_projection(spec, h)

    # -- construction ------------------------------------------------------------------
    @classmethod
    def from_lm_head(cls, spec, lm_head_weight: torch.Tensor,
                     token_map: Optional[torch.Tensor] = None) -> "MedusaHeads":
        """Fresh heads whose projections start as (rows of) the base lm_head, as Medusa does."""
        return cls.from_backbone(spec, lm_head_weight, None, token_map)

    # -- compute -----------------------------------------------------------------------
    def head_hidden(self, hidden: torch.Tensor, k: int) -> torch.Tensor:
        """The residual-block output of head k (0-based) before projection."""
        return self.blocks[k](hidden)

    def head_logits(self, hidden: torch.Tensor, k: int) -> torch.Tensor:
        return self.project(self.head_hidden(hidden, k), k)

    def forward(self, hidden: torch.Tensor) -> list[torch.Tensor]:
        return [self.head_logits(hidden, k) for k in range(self.spec.num_heads)]


register_family(HeadFamily("medusa", MedusaHeads, IndependentDrafting))
