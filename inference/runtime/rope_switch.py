"""LongRoPE's switch from short to long factors, made per position during decoding steps.

transformers' LongRoPE (Phi-3, Phi-3.5, Phi-4-mini) rotates a whole forward with the long factors as soon as its
largest position reaches ``original_max_position_embeddings`` (T), and with the short ones otherwise
(``dynamic_rope_update``'s ``longrope_frequency_update``). Decoding one token at a time, a token at position q
is therefore rotated short when q < T and long when q >= T. A speculative step verifies tokens at positions
past .. past + depth in one forward: when it straddles T, the whole forward went long, its accepted tokens below
T included, and greedy output differed from plain decoding around that position.

Inside the runtime's forwards (``MedusaModel.body_hidden``) the rotary module is called twice, once with the
positions capped at T - 1 (short factors, exact below T) and once with one more position at T (long factors at
every true position). During decoding steps (``stepping``) each position takes its own, what one-token decoding
computes; for prompts each row takes transformers' rule for itself (long throughout when the row reaches T),
where transformers decides for the whole batch at once and a long prompt turned a short one beside it long. Both
calls are transformers' own code: where its switch is device ops (transformers 5.25's ``torch.where``) a captured
step stays capturable; where it reads the host, steps run uncaptured, as before. Other callers of the backbone
(transformers' ``generate``, the baselines) see it unchanged.

Like one-token decoding over a KV cache (and vLLM), keys computed below T keep their short rotation after the
switch; transformers' Phi-3 ``generate`` instead drops its cache at the switch and recomputes it all long.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Optional

import torch


def longrope_switch(config) -> Optional[int]:
    """T, where a LongRoPE backbone switches to its long factors (None for other RoPE or none below the limit)."""
    rope = getattr(config, "rope_scaling", None) or getattr(config, "rope_parameters", None) or {}
    if not isinstance(rope, dict) or (rope.get("rope_type") or rope.get("type")) != "longrope":
        return None
    limit = getattr(config, "max_position_embeddings", None)
    switch = getattr(config, "original_max_position_embeddings", None) or rope.get("original_max_position_embeddings")
    return int(switch) if switch and limit and int(switch) < int(limit) else None


class PerPositionLongRope:
    """Wraps a LongRoPE backbone's rotary module (module docstring): per row inside ``runtime``, per position
    inside ``stepping`` as well, unchanged elsewhere."""

    def __init__(self, rotary: torch.nn.Module, switch: int):
        self.rotary, self.switch = rotary, switch
        self.inside = self.per_position = False
        self.forward = rotary.forward
        rotary.forward = self

    def __call__(self, x, position_ids, *args, **kwargs):
        if not self.inside:
            return self.forward(x, position_ids, *args, **kwargs)
        # short factors: a forward whose largest position is below T (positions from T on are moved, never used);
        # long ones at every true position: one more column at T makes transformers take them, then it is dropped
        short = self.forward(x, position_ids.clamp(max=self.switch - 1), *args, **kwargs)
        reach = torch.full_like(position_ids[..., :1], self.switch)
        long = tuple(t[..., :-1, :] for t in self.forward(x, torch.cat([position_ids, reach], -1), *args, **kwargs))
        past = position_ids >= self.switch if self.per_position else self._prompt_reaches(position_ids)
        return tuple(torch.where(past[..., None], lo, sh) for sh, lo in zip(short, long))

    def _prompt_reaches(self, position_ids: torch.Tensor) -> torch.Tensor:
        """Per position, whether its prompt reaches T. A batch's prompts lie side by side in a row (the compact
        layout) or one a row: each starts at position 0, as does each padding token (masked, on its own)."""
        pos = position_ids.expand(max(position_ids.shape[0], 1), -1)
        prompt = torch.cumsum(pos == 0, dim=-1)                       # which prompt each position belongs to
        reach = torch.zeros(pos.shape[0], pos.shape[1] + 1, dtype=pos.dtype, device=pos.device)
        reach.scatter_reduce_(-1, prompt, pos, reduce="amax")
        return reach.gather(-1, prompt) >= self.switch

    @contextmanager
    def runtime(self):
        self.inside = True
        try:
            yield
        finally:
            self.inside = False

    @contextmanager
    def stepping(self):
        # re-entrant: a self-draft shares this wrapper, and its steps run inside the target's; leaving the inner one
        # must not turn the target's verification forward back to the prompt rule
        was, self.per_position = self.per_position, True
        try:
            yield
        finally:
            self.per_position = was


def per_position_longrope(body) -> Optional[PerPositionLongRope]:
    """The wrapper installed on ``body``'s rotary module when the backbone uses LongRoPE below its limit."""
    rotary = getattr(body, "rotary_emb", None)
    switch = longrope_switch(getattr(body, "config", None))
    if rotary is None or switch is None:
        return None
    if isinstance(rotary.forward, PerPositionLongRope):   # another MedusaModel over the same backbone
        return rotary.forward
    return PerPositionLongRope(rotary, switch)
