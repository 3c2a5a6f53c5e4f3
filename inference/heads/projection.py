"""What every head family is built from: residual blocks and K projections to the vocabulary.

A Medusa-style block is ``x + SiLU(W x + b)`` with W zero-initialised, so a fresh block is the
identity. Unlike the reference implementation, every block is its own module (the reference's
``[ResBlock(h)] * L`` silently shares one).

Projection modes (``HeadsSpec.projection``), shared by all families:
  own        one full-vocabulary projection per head, initialised from the base lm_head
             (the reference / TensorRT-LLM layout).
  shared     every head reuses the frozen base lm_head; the export stores no projection.
  truncated  one projection per head over the N most frequent target tokens of the
             training data; ``token_map[i]`` is the vocabulary id of local index i
             (vLLM's ``token_map``, EAGLE-3's draft vocabulary). Cheapest on CPU.

Kept in one place so that a family only writes what differs (its blocks, its recurrence) and the
loaders, exporters and the trainer can treat every family's projections alike.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
import torch.nn.functional as F

from ..errors import UserError


class ResBlock(nn.Module):
    """``x + SiLU(W x + b)`` with W zero-initialised, so a fresh block is the identity."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class ProjectedHeads(nn.Module):
    """What every head family shares: K projections to the vocabulary in one of the three
    ``HeadsSpec.projection`` modes, the truncated token map, and the backbone tensors a family
    borrows without storing them (the lm_head for ``shared``, the input embeddings for Hydra).

    Subclasses call ``_init_projection`` and define ``head_hidden``/``forward`` (Medusa) or the
    recurrent interface (``dependent``). ``_projection_name`` is the state-dict prefix of the
    projections (``projections`` here, ``head`` in vLLM's MLP speculator).
    """

    _projection_name = "projections"

    def _init_projection(self, spec, in_dim: int) -> None:
        self.spec = spec
        if spec.projection == "shared":
            if in_dim != spec.hidden_size:
                raise UserError(f"shared projection needs head width {spec.hidden_size}, got {in_dim}")
            setattr(self, self._projection_name, None)
            # Not persistent: the export never stores the backbone's own matrix.
            self.register_buffer("shared_weight", None, persistent=False)
        else:
            setattr(self, self._projection_name, nn.ModuleList(
                nn.Linear(in_dim, spec.output_size, bias=False) for _ in range(spec.num_heads)))
        if spec.projection == "truncated":
            self.register_buffer("token_map", torch.arange(spec.output_size, dtype=torch.long))
        else:
            self.token_map = None

    @classmethod
    def from_backbone(cls, spec, lm_head_weight: torch.Tensor, input_embeddings: Optional[torch.Tensor] = None,
                      token_map: Optional[torch.Tensor] = None) -> "ProjectedHeads":
        """Fresh heads whose projections start as (rows of) the base lm_head, as Medusa does, with
        the backbone tensors they borrow attached. Families with more to initialise override it."""
        heads = cls(spec)
        heads._init_projection_from_lm_head(lm_head_weight, token_map)
        heads.attach_backbone(lm_head_weight, input_embeddings)
        return heads

    @property
    def projections_list(self) -> Optional[nn.ModuleList]:
        return getattr(self, self._projection_name)

    def _init_projection_from_lm_head(self, lm_head_weight: torch.Tensor,
                                      token_map: Optional[torch.Tensor]) -> None:
        """Projections start as (rows of) the base lm_head, as Medusa does."""
        spec, w = self.spec, lm_head_weight.detach()
        if spec.projection == "shared":
            self.attach_lm_head(w)
            return
        if spec.projection == "truncated":
            if token_map is None or token_map.numel() != spec.output_size:
                raise UserError("truncated heads need a token_map of truncated_vocab_size ids")
            self.token_map.copy_(token_map.to(torch.long))
            w = w[token_map.to(w.device)]
        for proj in self.projections_list:
            if proj.weight.shape == w.shape:
                proj.weight.data.copy_(w)

    def attach_lm_head(self, lm_head_weight: torch.Tensor) -> None:
        """Point shared heads at the (frozen) backbone lm_head; a no-op for other modes."""
        if self.spec.projection == "shared":
            self.shared_weight = lm_head_weight.detach()

    def attach_backbone(self, lm_head_weight: Optional[torch.Tensor] = None,
                        input_embeddings: Optional[torch.Tensor] = None) -> None:
        """Give the heads the frozen backbone tensors they borrow (see ``needs_*``)."""
        if lm_head_weight is not None:
            self.attach_lm_head(lm_head_weight)

    @property
    def needs_lm_head(self) -> bool:
        return self.spec.projection == "shared"

    @property
    def needs_input_embeddings(self) -> bool:
        return False

    def project(self, x: torch.Tensor, k: int) -> torch.Tensor:
        projections = self.projections_list
        if projections is None:
            if self.shared_weight is None:
                raise RuntimeError("shared heads need attach_lm_head(backbone lm_head weight) first")
            return F.linear(x, self.shared_weight.to(x.dtype))
        return projections[k](x)

    def to_vocab_ids(self, local_ids: torch.Tensor) -> torch.Tensor:
        """Map indices into a head's logits to vocabulary ids (identity unless truncated)."""
        return local_ids if self.token_map is None else self.token_map[local_ids]
