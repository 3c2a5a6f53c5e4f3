"""float16 draft weights (inference/runtime/draft_weights.py): the heads' own linears in float16.

Tiny random Llama backbones; EAGLE-3 drafters perturbed so their drafts are arbitrary, Medusa heads
with their own projection.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from inference.errors import UserError
from inference.heads.native import save_heads
from inference.loading import load_medusa
from inference.methods import generate
from inference.runtime.draft_weights import HalfLinear, half_draft_weights
from inference.runtime.model import attach_heads

from runtime_support import one_thread, random_heads, tiny_llama  # noqa: F401 (autouse fixture)
from test_eagle3_decoding import PROMPTS, random_drafter


@pytest.mark.parametrize("bias", [False, True])
def test_half_linear_matches_the_float_product(bias):
    """Guards against: a transposed weight, a dropped bias or a result left in float16 (the drafter's
    next ops, and the fp32 backbone features it is combined with, expect the input's dtype)."""
    torch.manual_seed(0)
    lin = nn.Linear(96, 200, bias=bias)
    h = HalfLinear(lin)
    assert h.weight_half.dtype == torch.float16 and h.weight_half.shape == (200, 96)
    x = torch.randn(2, 5, 96)
    ref = lin(x)
    got = h(x)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    torch.testing.assert_close(got, ref, rtol=2e-2, atol=5e-3)
    assert h(x.double()).dtype == torch.float64


def test_half_weights_stay_half_through_module_casts():
    """Guards against: ``heads.to(dtype=float32)`` (what ``attach_heads`` does) or ``.float()`` silently
    turning the stored weights back into float32, which would keep the memory traffic this is for."""
    h = HalfLinear(nn.Linear(16, 8, bias=True))
    h.float()
    h.to(dtype=torch.float32)
    assert h.weight_half.dtype == torch.float16 and h.bias_half.dtype == torch.float16


def test_only_the_heads_own_linears_are_converted():
    """Guards against: converting a linear the heads borrow from the backbone (a shared lm_head),
    which would change the backbone's own logits and so the output."""
    model = tiny_llama(seed=0)
    heads = nn.Module()
    heads.own = nn.Linear(64, 64)
    heads.borrowed = model.lm_head               # the backbone's module, reached through the heads
    heads.inner = nn.Sequential(nn.Linear(64, 8))
    assert half_draft_weights(heads, model) == 2
    assert isinstance(heads.own, HalfLinear) and isinstance(heads.inner[0], HalfLinear)
    assert heads.borrowed is model.lm_head and type(model.lm_head) is nn.Linear


def test_eagle3_with_half_drafter_stays_token_identical():
    """Guards against: approximate drafts leaking into the output. The backbone verifies every draft, so
    greedy decoding with a float16 drafter must equal plain greedy decoding token for token."""
    model = tiny_llama(seed=2)
    m = random_drafter(model)
    assert half_draft_weights(m.heads, m.model) == 9   # fc, q/k/v/o, gate/up/down, lm_head
    for p in PROMPTS:
        plain = generate(m, p, "autoregressive", max_new_tokens=24).tokens
        for n, d, k in ((1, 1, 1), (6, 3, 2)):
            out = generate(m, p, "eagle3", nodes=n, depth=d, topk=k, max_new_tokens=24)
            assert out.tokens == plain, (n, d, k)


def test_half_drafts_are_the_float_drafts():
    """Guards against: a float16 drafter whose drafts are no longer the trained drafter's (overflow, a
    lost ranking), which would cost acceptance for nothing."""
    model = tiny_llama(seed=3)
    m = random_drafter(model, scale=0.02)
    hidden = torch.randn(64, m.heads.spec.hidden_size)
    ref = m.heads.project(hidden)
    half_draft_weights(m.heads, m.model)
    got = m.heads.project(hidden)
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.95
    assert (got - ref).abs().max() < 1e-2 * ref.abs().max()


def test_load_medusa_converts_on_request_and_refuses_bad_values(tmp_path):
    """Guards against: ``draft_weights=`` ignored by the loader, or a misspelt value loading the backbone
    before failing (one line, nothing heavy first)."""
    model = tiny_llama(seed=4)
    d = save_heads(random_heads(model, projection="own"), tmp_path / "heads")
    with pytest.raises(UserError, match="draft_weights must be one of float, float16"):
        load_medusa(d, backbone="/nonexistent/backbone", draft_weights="int4")
    m = load_medusa(d, backbone=model, kernels="stock", draft_weights="float16")
    assert any(isinstance(x, HalfLinear) for x in m.heads.modules())
    assert type(m.lm_head) is nn.Linear and m.lm_head.weight.dtype == torch.float32
    plain = load_medusa(d, backbone=model, kernels="stock")
    assert not any(isinstance(x, HalfLinear) for x in plain.heads.modules())
    p = PROMPTS[0]
    assert generate(m, p, "medusa", max_new_tokens=16).tokens == generate(plain, p, "autoregressive",
                                                                           max_new_tokens=16).tokens


def test_half_heads_attach_and_decode_like_float_heads():
    """Guards against: converted heads failing ``attach_heads``' dtype and device placement."""
    model = tiny_llama(seed=5)
    heads = random_heads(model, projection="own")
    half_draft_weights(heads, model)
    m = attach_heads(model, heads)
    assert all(b.dtype == torch.float16 for n, b in m.heads.named_buffers() if n.endswith("_half"))
    assert generate(m, PROMPTS[1], "medusa", max_new_tokens=8).tokens == \
        generate(m, PROMPTS[1], "autoregressive", max_new_tokens=8).tokens
