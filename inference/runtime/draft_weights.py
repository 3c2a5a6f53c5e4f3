"""Draft heads with float16 weights: the heads' own linears read half the bytes.

The backbone verifies every draft, so what the heads compute changes how many drafts are
accepted, never the output: greedy decoding stays token-identical to plain decoding and exact
sampling keeps the backbone's distribution whatever the drafts are. The heads may therefore
compute approximately where the backbone may not. On CPU a drafting call of one or two rows is
bound by reading weights: EAGLE-3's drafter for SmolLM2 is 39 MB of fp32 per call (its 8192-row
lm_head alone 19 MB), read once per decoding step on the critical path (3.9-6.6 ms per step in fp32,
``git show f1527f2:scripts/profile_eagle3_step.py``).

``half_draft_weights(heads, backbone)`` replaces each ``nn.Linear`` the heads own (not one they
borrow from the backbone, such as a shared lm_head) and whose weight is float32 with a
``HalfLinear``: the weight stored in float16, the product taken in float16 and returned in the
input's dtype. For fp32 decoding: heads already in bf16 / fp16 read 2 bytes per weight and are left
as they are (converting them would only round again and narrow bf16's range). Measured on cpu-2c-b
(2 AVX2 cores, no native fp16 arithmetic; oneDNN converts as it streams), all nine linears of
that drafter for one row with the caches flushed: 3.9-5.6 ms in fp32, 1.7-1.8 ms in fp16; int8
weights (fbgemm's dynamic linear) were no faster (1.75 ms) and 40x less precise, and
``torch._weight_int8pack_mm`` was slower than fp32 on this CPU. fp16 keeps 11 bits of each
weight: a draft logit moves by ~1e-3 (SmolLM2 scale), so drafts rarely change.

What changes is which drafts are proposed, rarely: greedy outputs stay identical and exact sampling
keeps the backbone's distribution, but a seeded sample or typical acceptance (lossy by design) can
produce other tokens when a draft changes. Decoding only (``medusa-eval`` / ``medusa-generate``
``draft_weights=float16``): training, export and the fp32 logit checks against the engines use the
heads as trained; the converted heads are not for saving (their state-dict keys are ``*_half``).
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
    returned in ``x``'s dtype. The weights are frozen parameters, so parameter counts and bytes
    (``methods.registry.extra_parameters``) see them at 2 bytes each."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight_half = nn.Parameter(linear.weight.detach().to(torch.float16).clone(), requires_grad=False)
        self.bias_half = (None if linear.bias is None else
                          nn.Parameter(linear.bias.detach().to(torch.float16).clone(), requires_grad=False))

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        # a module-wide .to(float32) / .float() converts every floating parameter: keep these float16
        for p in (self.weight_half, self.bias_half):
            if p is not None and p.dtype != torch.float16:
                p.data = p.data.to(torch.float16)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(torch.float16), self.weight_half, self.bias_half).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, float16 weights"


def check_draft_weights(value: str) -> None:
    if value not in DRAFT_WEIGHTS:
        raise UserError(f"draft_weights must be one of {', '.join(DRAFT_WEIGHTS)}, got {value!r}")


def half_draft_weights(heads: nn.Module, backbone: Optional[nn.Module] = None) -> int:
    """Replace every float32 ``nn.Linear`` inside ``heads`` whose weight does not live in a tensor of
    ``backbone`` with a ``HalfLinear``, in place (a linear reached from two parents becomes one
    ``HalfLinear``, still shared); returns how many were replaced."""
    def storage(t: torch.Tensor) -> int:
        return t.untyped_storage().data_ptr()

    borrowed = set() if backbone is None else {storage(p) for p in backbone.parameters()}
    converted: dict[int, HalfLinear] = {}
    for parent in list(heads.modules()):
        for name, child in list(parent.named_children()):
            if id(child) in converted:
                setattr(parent, name, converted[id(child)])
            elif (isinstance(child, nn.Linear) and child.weight.dtype == torch.float32
                  and storage(child.weight) not in borrowed):
                converted[id(child)] = HalfLinear(child)
                setattr(parent, name, converted[id(child)])
    return len(converted)
