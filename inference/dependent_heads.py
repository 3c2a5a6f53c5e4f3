"""Heads that also see the drafted tokens: Hydra and the MLP speculator (vLLM's ``mlp_speculator``).

A Medusa head k guesses x_{t+k+2} from the hidden state h_t alone (0-based k; the backbone
itself gives x_{t+1}): it cannot know which tokens the heads before it drafted, so its
accuracy collapses with depth. A *dependent* head k is also fed the tokens x_{t+1..t+k+1} of
the path it extends (Hydra, arXiv 2402.05109; IBM's MLP speculator, arXiv 2404.19124). At
training time those are the true tokens (teacher forcing); at decoding time they are the
tokens of the tree path, so the tree is drafted level by level (``tree_draft``).

Both families expose one recurrent interface, which is all the decoder and trainer use:

  ``init_state(h)``            state before any token, from the backbone's hidden state [n, H]
  ``step(k, state, tokens)``   feed head k the path token at depth k (``tokens`` [n]); returns
                               (state', features [n, D]); ``project(features, k)`` gives head
                               k's logits for the token at depth k+1, ``state'`` is what the
                               node's children are drafted from
  ``teacher_forced_features(h, future)``  all K heads at once for training: ``future[..., j]``
                               = x_{t+1+j}; head k's features depend on ``future[..., :k+1]`` only

Families:
  hydra           head k: ``ResBlocks(W_k [h_t; e(x_{t+1}); ...; e(x_{t+k+1})] + b_k)`` then the
                  projection modes of ``HeadsSpec`` (own / shared / truncated); e() is the
                  backbone's own input embedding, frozen and never stored. W_k starts as
                  [I, 0, ...], so a fresh Hydra head is a fresh Medusa head.
  mlp_speculator  vLLM's layout and arithmetic (vllm/model_executor/models/mlp_speculator.py):
                  s_0 = h_t (or ``ln0(h_t) / sqrt 2`` with ``scale_input``),
                  s_{k+1} = GELU(LN_k(proj_k(s_k) + (emb_weight / state_weight) * emb_k(x))),
                  logits = head_k(s_{k+1}); state_weight = 0.5 ** (0.5 / K),
                  emb_weight = sqrt((1 - state_weight^2) * inner_dim / 2); LN is RMS-style with
                  weight and bias, eps 1e-6. ``tie_weights`` keeps one emb/ln/head and one proj
                  after the first (vLLM stores emb.0, proj.0, proj.1, ln.0, head.0). The head is a
                  full-vocabulary ``head.{k}`` for vLLM (``projection=own``); ``truncated`` and
                  ``shared`` are ours (cheaper on CPU) and cannot be exported to vLLM.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn
import torch.nn.functional as F

from .errors import UserError
from .heads import HeadsSpec, ProjectedHeads, ResBlock
from .tree_draft import PathDrafting


class DependentHeads(PathDrafting, ProjectedHeads):
    """Shared driver of the recurrent interface; subclasses define ``init_state``/``step``."""

    def init_state(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def step(self, k: int, state: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def teacher_forced_features(self, hidden: torch.Tensor, future: torch.Tensor,
                                count: Optional[int] = None) -> list[torch.Tensor]:
        """Features of heads 0..count-1 at every position, fed the true tokens ``future``
        ([..., >= count], ``future[..., j]`` = x_{t+1+j}); head k never sees ``future[..., k+1:]``."""
        count = self.spec.num_heads if count is None else count
        lead = hidden.shape[:-1]
        state = self.init_state(hidden.reshape(-1, hidden.shape[-1]))
        flat = future.reshape(-1, future.shape[-1])
        feats = []
        for k in range(count):
            state, f = self.step(k, state, flat[:, k])
            feats.append(f.reshape(*lead, f.shape[-1]))
        return feats

    def teacher_forced_logits(self, hidden: torch.Tensor, future: torch.Tensor, k: int) -> torch.Tensor:
        return self.project(self.teacher_forced_features(hidden, future, k + 1)[k], k)


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
        heads = cls(spec)
        heads._init_projection_from_lm_head(lm_head_weight, token_map)
        heads.attach_backbone(lm_head_weight, input_embeddings)
        return heads

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
        inner = spec.inner_dim or h
        k_count, tied = spec.num_heads, spec.tie_weights
        n_unique = 1 if tied else k_count
        self.emb = nn.ModuleList(nn.Embedding(spec.vocab_size, inner) for _ in range(n_unique))
        self.proj = nn.ModuleList(nn.Linear(h if i == 0 else inner, inner, bias=False)
                                  for i in range(2 if tied else k_count))
        self.ln = nn.ModuleList(RMSNormWithBias(inner) for _ in range(n_unique))
        self.ln0 = RMSNormWithBias(h, affine=False) if spec.scale_input else None
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
        inner = spec.inner_dim or spec.hidden_size
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


HEAD_FAMILIES = {"hydra": HydraHeads, "mlp_speculator": MLPSpeculatorHeads}
