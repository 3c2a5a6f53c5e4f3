"""Draft heads with float16 weights: the heads' own linears read half the bytes.

The backbone verifies every draft, so what the heads compute changes how many drafts are
accepted, never the output: greedy decoding stays token-identical to plain decoding and exact
sampling keeps the backbone's distribution whatever the drafts are. The heads may therefore
compute approximately where the backbone may not. On CPU a drafting call of one or two rows is
bound by reading weights: EAGLE-3's drafter for SmolLM2 is 39 MB of fp32 per call (its 8192-row
lm_head alone 19 MB), read once per decoding step on the critical path (3.9 ms of a 58 ms step,
``scripts/profile_eagle3_step.py``).

``half_draft_weights(heads, backbone)`` replaces each ``nn.Linear`` the heads own (not one they
borrow from the backbone, such as a shared lm_head) with a ``HalfLinear``: the weight stored in
float16, the product taken in float16 and returned in the input's dtype. Measured on cpu-2c-b
(2 AVX2 cores, no native fp16 arithmetic; oneDNN converts as it streams), all nine linears of
that drafter for one row with the caches flushed: 3.9-5.6 ms in fp32, 1.7-1.8 ms in fp16; int8
weights (fbgemm's dynamic linear) were no faster (1.75 ms) and 40x less precise, and
``torch._weight_int8pack_mm`` was slower than fp32 on this CPU. fp16 keeps 11 bits of each
weight: a draft logit moves by ~1e-3 (SmolLM2 scale), so drafts rarely change.

Decoding only (``medusa-eval`` / ``medusa-generate`` ``draft_weights=float16``): training, export
and the fp32 logit checks against the engines use the heads as trained.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UserError

DRAFT_WEIGHTS = ("float", "float16")


class HalfLinear(nn.Module):
    """``y = x W^T + b`` with W (and b) stored in float16; the product is taken in float16 and
    returned in ``x``'s dtype."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # buffers, not parameters: .to(dtype) must not turn them back into float32
        self.register_buffer("weight_half", linear.weight.detach().to(torch.float16).clone())
        self.register_buffer("bias_half", None if linear.bias is None else linear.bias.detach().to(torch.float16).clone())

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        # a module-wide .to(float32) / .float() converts every floating buffer: keep these float16
        self.weight_half = self.weight_half.to(torch.float16)
        if self.bias_half is not None:
            self.bias_half = self.bias_half.to(torch.float16)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(torch.float16), self.weight_half, self.bias_half).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, float16 weights"


def check_draft_weights(value: str) -> None:
    if value not in DRAFT_WEIGHTS:
        raise UserError(f"draft_weights must be one of {', '.join(DRAFT_WEIGHTS)}, got {value!r}")


def half_draft_weights(heads: nn.Module, backbone: Optional[nn.Module] = None) -> int:
    """Replace every ``nn.Linear`` inside ``heads`` whose weight is not a parameter of ``backbone``
    with a ``HalfLinear``, in place; returns how many were replaced."""
    borrowed = set() if backbone is None else {p.data_ptr() for p in backbone.parameters()}
    replaced = 0
    for parent in list(heads.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and child.weight.data_ptr() not in borrowed:
                setattr(parent, name, HalfLinear(child))
                replaced += 1
    return replaced
