"""vLLM's ``mlp_speculator`` (IBM's MLP speculator, arXiv 2404.19124) as a head family.

vLLM's layout and arithmetic (vllm/model_executor/models/mlp_speculator.py):
s_0 = h_t (or ``ln0(h_t) / sqrt 2`` with ``scale_input``),
s_{k+1} = GELU(LN_k(proj_k(s_k) + (emb_weight / state_weight) * emb_k(x))),
logits = head_k(s_{k+1}); state_weight = 0.5 ** (0.5 / K),
emb_weight = sqrt((1 - state_weight^2) * inner_dim / 2); LN is RMS-style with weight and bias,
eps 1e-6. ``tie_weights`` keeps one emb/ln/head and one proj after the first (vLLM stores emb.0,
proj.0, proj.1, ln.0, head.0). The head is a full-vocabulary ``head.{k}`` for vLLM
(``projection=own``); ``truncated`` and ``shared`` are ours (cheaper on CPU) and cannot be
exported to vLLM without materialising them.

The family's own settings (``spec.settings``, vLLM's config keys): ``MLPSpeculatorSettings`` below,
validated by ``validate``. Drafted level by level (``dependent``); trained fed the true path tokens.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
from torch import nn
import torch.nn.functional as F

from ..errors import UserError
from .dependent import DependentHeads
from .drafting import PathDrafting
from .inputs import BackboneInputs
from .registry import HeadFamily, register_family
from .spec import HeadsSpec


@dataclasses.dataclass
class MLPSpeculatorSettings:
    """vLLM's mlp_speculator config keys (stored flat in config.json under these names)."""

    inner_dim: Optional[int] = dataclasses.field(
        default=None, metadata={"help": "state width of every step (None = the backbone's hidden size)"})
    tie_weights: bool = dataclasses.field(
        default=False, metadata={"help": "one emb/ln/head and one proj after the first for every step >= 2"})
    scale_input: bool = dataclasses.field(
        default=False, metadata={"help": "RMS-normalise the backbone state first (vLLM's ln0)"})


class RMSNormWithBias(nn.Module):
    """vLLM's ``MLPSpeculatorLayerNorm``: x / rms(x) (eps 1e-6), then ``weight * x + bias``."""

    def __init__(self, dim: int, eps: float = 1e-6, affine: bool = True):
        super().__init__()
        self.eps = eps
        if affine:
            self.weight = nn.Parameter(torch.ones(dim))
            self.bias = nn.Parameter(torch.zeros(dim))
        else:
            self.weight = self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight is not None:
            x = self.weight * x + self.bias
        return x


class MLPSpeculatorHeads(DependentHeads):
    """vLLM's ``mlp_speculator`` (names, shapes and constants as its loader reads them)."""

    _projection_name = "head"

    def __init__(self, spec: HeadsSpec):
        super().__init__()
        h = spec.hidden_size
        own = spec.settings
        inner = own.inner_dim or h
        k_count, tied = spec.num_heads, own.tie_weights
        n_unique = 1 if tied else k_count
        self.emb = nn.ModuleList(nn.Embedding(spec.vocab_size, inner) for _ in range(n_unique))
        self.proj = nn.ModuleList(nn.Linear(h if i == 0 else inner, inner, bias=False)
                                  for i in range(2 if tied else k_count))
        self.ln = nn.ModuleList(RMSNormWithBias(inner) for _ in range(n_unique))
        self.ln0 = RMSNormWithBias(h, affine=False) if own.scale_input else None
        self.state_weight = 0.5 ** (0.5 / k_count)
        self.emb_weight = math.sqrt((1 - self.state_weight ** 2) * (inner / 2))
        self._init_projection(spec, inner)
        if tied:  # one head for every step: keep a single projection module
            proj_list = self.projections_list
            if proj_list is not None:
                setattr(self, self._projection_name, nn.ModuleList([proj_list[0]]))

    @classmethod
    def from_backbone(cls, spec: HeadsSpec, lm_head_weight: torch.Tensor, input_embeddings: Optional[torch.Tensor],
                      token_map: Optional[torch.Tensor] = None) -> "MLPSpeculatorHeads":
        """Start close to the backbone: embeddings copied from its input table, the first
        projection the identity, heads from its lm_head (IBM initialises randomly; on a small
        training budget a warm start converges much faster)."""
        heads = cls(spec)
        heads._init_projection_from_lm_head(lm_head_weight, token_map)
        inner = spec.settings.inner_dim or spec.hidden_size
        with torch.no_grad():
            for emb in heads.emb:
                if input_embeddings is not None and tuple(input_embeddings.shape) == tuple(emb.weight.shape):
                    emb.weight.copy_(input_embeddings)
                else:
                    nn.init.normal_(emb.weight, std=1.0 / math.sqrt(inner))
            for i, proj in enumerate(heads.proj):
                if proj.weight.shape[0] == proj.weight.shape[1]:
                    proj.weight.copy_(torch.eye(inner))
        return heads

    def _at(self, modules: nn.ModuleList, k: int):
        return modules[min(k, len(modules) - 1)]

    def project(self, x: torch.Tensor, k: int) -> torch.Tensor:
        projections = self.projections_list
        if projections is not None and len(projections) == 1 and k > 0:  # tied head
            return projections[0](x)
        return super().project(x, k)

    def init_state(self, hidden):
        if self.ln0 is not None:
            return self.ln0(hidden) / math.sqrt(2.0)
        return hidden

    def step(self, k, state, tokens):
        z = self._at(self.emb, k)(tokens).to(state.dtype)
        s = self._at(self.proj, k)(state) + (self.emb_weight / self.state_weight) * z
        s = F.gelu(self._at(self.ln, k)(s))
        return s, s


def describe(spec) -> str:
    own = spec.settings
    return (f"MLP speculator: {spec.num_heads} steps of width {own.inner_dim or spec.hidden_size}"
            + (", weights tied after the first" if own.tie_weights else ""))


def validate(spec) -> None:
    if spec.settings.tie_weights and spec.num_heads < 2:
        raise UserError("mlp_speculator tie_weights needs at least 2 heads")


register_family(HeadFamily("mlp_speculator", MLPSpeculatorHeads, PathDrafting, settings=MLPSpeculatorSettings,
                           inputs=BackboneInputs(path_tokens=True), validate=validate, describe=describe))
