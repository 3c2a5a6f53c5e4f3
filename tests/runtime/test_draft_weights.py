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
from inference.loading import attach_heads

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
    """Guards against: a float16 drafter whose drafts are no longer the trained drafter's (overflow on
    the backbone's raw features, a lost ranking anywhere in fc / attention / MLP / lm_head), which would
    cost acceptance for nothing."""
    model = tiny_llama(seed=3)
    m = random_drafter(model, scale=0.02)
    d = m.heads
    torch.manual_seed(0)
    n, h = 24, d.spec.hidden_size
    aux = torch.randn(1, n, 3 * h) * 30.0          # raw residual-stream features: large, unnormalised
    tokens = torch.randint(0, d.spec.vocab_size, (1, n))
    pos = torch.arange(n)[None]

    def drafts():
        normed, pre, _ = d.forward_step(tokens, d.combine(aux), pos)
        return d.project(normed)[0], pre

    ref, ref_pre = drafts()
    assert half_draft_weights(d, m.model) == 9
    got, got_pre = drafts()
    assert torch.isfinite(got).all() and torch.isfinite(got_pre).all()
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.95
    assert (got.topk(3).indices == ref.topk(3).indices).float().mean() >= 0.9
    assert (got - ref).abs().max() < 1e-2 * ref.abs().max()
    assert (got - ref).abs().max() > 0               # converted: the drafts come from float16 weights


def test_parameter_costs_count_half_weights_at_two_bytes():
    """Guards against: converted heads reported as costing nothing (weights hidden from parameter
    counts), which would put 0 in report.json's costs and compare.md's parameter column."""
    from inference.methods.registry import extra_parameters

    model = tiny_llama(seed=6)
    m = random_drafter(model)
    count, size = extra_parameters(m.heads, m.model)
    linear_bytes = sum(x.weight.numel() * 4 for x in m.heads.modules() if isinstance(x, nn.Linear))
    half_draft_weights(m.heads, m.model)
    count16, size16 = extra_parameters(m.heads, m.model)
    assert count16 == count
    assert size16 == size - linear_bytes // 2


def test_half_conversion_skips_non_fp32_heads_and_keeps_sharing():
    """Guards against: bf16 heads rounded again into float16 (no bytes saved, bf16's range lost), and a
    linear reached from two parents turned into two unshared copies."""
    model = tiny_llama(seed=7)
    heads = nn.Module()
    heads.a = nn.Linear(64, 64).to(torch.bfloat16)
    shared = nn.Linear(64, 8)
    heads.b, heads.c = nn.Sequential(shared), nn.Sequential(shared)
    assert half_draft_weights(heads, model) == 1
    assert type(heads.a) is nn.Linear and heads.a.weight.dtype == torch.bfloat16
    assert isinstance(heads.b[0], HalfLinear) and heads.b[0] is heads.c[0]


def test_load_medusa_converts_on_request_and_refuses_bad_values(tmp_path):
    """Guards against: ``draft_weights=`` ignored by the loader, or a misspelt value loading the backbone
    before failing (one line, nothing heavy first)."""
    model = tiny_llama(seed=4)
    d = save_heads(random_heads(model, projection="own"), tmp_path / "heads")
    with pytest.raises(UserError, match="draft_weights must be one of float, float16"):
        load_medusa(d, backbone="/nonexistent/backbone", draft_weights="int4")
    m = load_medusa(d, backbone=model, kernels="stock", draft_weights="float16")
    assert any(isinstance(x, HalfLinear) for x in m.heads.modules())
    plain = load_medusa(d, backbone=model, kernels="stock")
    assert not any(isinstance(x, HalfLinear) for x in plain.heads.modules())
    p = PROMPTS[0]
    assert generate(m, p, "medusa", max_new_tokens=16).tokens == generate(plain, p, "autoregressive",
                                                                           max_new_tokens=16).tokens


def test_half_heads_attach_and_decode_like_float_heads():
    """Guards against: converted heads failing ``attach_heads``' dtype and device placement, or drafting
    differently from the float heads they came from (acceptance lost to the conversion)."""
    model = tiny_llama(seed=5)
    heads = random_heads(model, projection="own", scale=0.2)
    m_float = attach_heads(model, heads)
    half = random_heads(model, projection="own", scale=0.2)     # same seed: the same weights
    assert half_draft_weights(half, model) > 0
    m_half = attach_heads(model, half)
    halves = [b for n, b in m_half.heads.named_parameters() if n.endswith("_half")]
    assert halves and all(b.dtype == torch.float16 for b in halves)
    for p in PROMPTS:
        a = generate(m_float, p, "medusa", max_new_tokens=16)
        b = generate(m_half, p, "medusa", max_new_tokens=16)
        assert b.tokens == a.tokens
        assert abs(sum(b.accept_lengths) / len(b.accept_lengths) - sum(a.accept_lengths) / len(a.accept_lengths)) < 0.2
