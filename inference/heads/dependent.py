"""Heads that also see the drafted tokens, and the one recurrent interface they share.

A Medusa head k guesses x_{t+k+2} from the hidden state h_t alone (0-based k; the backbone
itself gives x_{t+1}): it cannot know which tokens the heads before it drafted, so its
accuracy collapses with depth. A *dependent* head k is also fed the tokens x_{t+1..t+k+1} of
the path it extends (Hydra, arXiv 2402.05109; IBM's MLP speculator, arXiv 2404.19124). At
training time those are the true tokens (teacher forcing); at decoding time they are the
tokens of the tree path, so the tree is drafted level by level (``drafting.PathDrafting``).

Every dependent family (``hydra``, ``mlp_speculator``) exposes one recurrent interface, which is
all the decoder and trainer use:

  ``init_state(h)``            state before any token, from the backbone's hidden state [n, H]
  ``step(k, state, tokens)``   feed head k the path token at depth k (``tokens`` [n]); returns
                               (state', features [n, D]); ``project(features, k)`` gives head
                               k's logits for the token at depth k+1, ``state'`` is what the
                               node's children are drafted from
  ``teacher_forced_features(h, future)``  all K heads at once for training: ``future[..., j]``
                               = x_{t+1+j}; head k's features depend on ``future[..., :k+1]`` only
"""

from __future__ import annotations

from typing import Optional

import torch

from .drafting import PathDrafting
from .projection import ProjectedHeads


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

