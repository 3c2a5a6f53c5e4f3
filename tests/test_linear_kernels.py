"""Routed CPU linear kernels (inference/linear_kernels.py): same products, same outputs, no side effects."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from inference.runtime import linear_kernels as lk
from inference.methods import generate
from inference.errors import UserError
from inference.heads.native import save_heads
from inference.loading import load_medusa
from runtime_support import one_thread, random_heads, tiny_llama, wrap  # noqa: F401


def _force(plans, choice: str, rows=range(1, 40)) -> None:
    """Fix every plan's choice (no timing): the tests exercise each path deterministically."""
    for p in plans:
        for r in rows:
            p.choice[r] = choice


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16, 33])
def test_columns_product_equals_linear(rows, bias):
    """Guards against the (W @ x^T)^T path computing a different product (transposes, bias, the
    zero row padded onto a single row, a 3-D batch shape lost)."""
    torch.manual_seed(0)
    lin = nn.Linear(24, 40, bias=bias)
    x = torch.randn(1, rows, 24)
    want = nn.functional.linear(x, lin.weight, lin.bias)
    plans = lk.route_linear_kernels(lin)
    _force(plans, lk.COLUMNS)
    got = lin(x)
    assert got.shape == want.shape and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_routing_keeps_module_identity_and_state():
    """Guards against routing replacing parameters or modules (tied weights untied, state dicts
    renamed, checkpoints no longer loading) instead of only changing how forward multiplies."""
    model = tiny_llama()
    before = {k: v.data_ptr() for k, v in model.state_dict().items()}
    plans = lk.route_linear_kernels(model)
    assert plans and all(isinstance(m, nn.Linear) for m in model.modules() if isinstance(m, lk.RoutedLinear))
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == before
    lk.unroute_linear_kernels(model)
    assert not any(type(m) is lk.RoutedLinear for m in model.modules())


def test_one_plan_per_shape_and_shared_modules_once():
    """Guards against timing a tied/shared module twice (skewed choice) or mixing shapes in one plan."""
    shared = nn.Linear(8, 8)
    model = nn.Sequential(shared, nn.Linear(8, 16), shared, nn.Linear(8, 16))
    plans = lk.route_linear_kernels(model)
    by_shape = {p.shape: p for p in plans}
    assert set(by_shape) == {(8, 8), (16, 8)}
    assert len(by_shape[(8, 8)].members) == 1 and len(by_shape[(16, 8)].members) == 2


def test_rows_measured_once_at_routing_and_never_while_decoding(monkeypatch):
    """Guards against timing inside a forward (a timed decoding step or prefill would pay for the
    measurement) and against measuring row counts above max_rows (prefill-sized inputs stay stock)."""
    calls = []
    real = lk._measure
    monkeypatch.setattr(lk, "_measure", lambda *a: calls.append(a[1]) or real(*a))
    lin = nn.Linear(16, 32)
    (plan,) = lk.route_linear_kernels(lin, max_rows=4)
    assert calls == [1, 2, 3, 4] and set(plan.timings) == {1, 2, 3, 4}
    assert all(set(t) == {lk.STOCK, lk.COLUMNS} for t in plan.timings.values())
    for rows in (1, 3, 50):
        lin(torch.randn(rows, 16))
    assert calls == [1, 2, 3, 4] and plan.kernel(50) == lk.STOCK


def test_measuring_leaves_the_global_random_state_alone():
    """Guards against kernel timing advancing torch's global RNG (a seeded run would sample
    differently depending on which row counts were measured first)."""
    lin = nn.Linear(16, 32)
    lk.route_linear_kernels(lin)
    torch.manual_seed(123)
    want = torch.rand(4)
    torch.manual_seed(123)
    lin(torch.randn(5, 16, generator=torch.Generator().manual_seed(0)))
    assert torch.equal(torch.rand(4), want)


def test_stock_kernels_block_bypasses_routing(monkeypatch):
    """Guards against the transformers `generate` baseline being timed with our kernels (its
    speedup column would no longer mean what a user gets from stock transformers)."""
    lin = nn.Linear(16, 32)
    plans = lk.route_linear_kernels(lin)
    _force(plans, lk.COLUMNS)
    used = []
    monkeypatch.setattr(lk, "_columns_product", lambda *a: used.append(1) or nn.functional.linear(*a))
    with lk.stock_kernels():
        lin(torch.randn(4, 16))
    assert not used
    lin(torch.randn(4, 16))
    assert used == [1]


def test_not_routed_off_cpu():
    """Guards against touching models on other devices (GPU libraries handle skinny products)."""
    lin = nn.Linear(4, 4, device="meta")
    assert lk.route_linear_kernels(lin) == [] and type(lin) is nn.Linear


@pytest.mark.parametrize("choice", [lk.STOCK, lk.COLUMNS])
def test_greedy_decoding_identical_through_routed_kernels(choice):
    """Guards against a routed model breaking lossless verification: Medusa through either kernel
    must emit exactly the plain greedy tokens of the same routed model."""
    model = tiny_llama(init=0.2)
    m = wrap(model, random_heads(model, num_heads=3))
    m.route_kernels()
    assert m.kernel_plans
    _force(m.kernel_plans, choice)
    prompt = [5, 17, 3, 42, 8]
    plain = generate(m, prompt, "autoregressive", max_new_tokens=24, eos_token_ids=())
    for tree in ("chain3", "tree4", "tree8"):
        out = generate(m, prompt, tree=tree, max_new_tokens=24, eos_token_ids=())
        assert out.tokens == plain.tokens, tree


def test_load_medusa_kernels_option(tmp_path):
    """Guards against a given model object being changed behind the user's back by default, and
    against a bad `kernels` value being ignored instead of refused."""
    model = tiny_llama()
    save_heads(random_heads(model), tmp_path / "heads")
    m = load_medusa(tmp_path / "heads", backbone=model)
    assert m.kernel_plans == [] and not any(type(x) is lk.RoutedLinear for x in model.modules())
    m = load_medusa(tmp_path / "heads", backbone=model, kernels="auto")
    assert m.kernel_plans and any(type(x) is lk.RoutedLinear for x in m.heads.modules())
    with pytest.raises(UserError, match="kernels must be one of"):
        load_medusa(tmp_path / "heads", backbone=model, kernels="fast")


def test_hf_generate_baseline_runs_stock_kernels(monkeypatch):
    """Guards against the transformers `generate` baseline silently using the routed kernels in
    medusa-eval (speedup_vs_hf_generate would then compare against a faster-than-stock baseline)."""
    from inference.methods.hf_generate import hf_generate
    from inference.runtime.model import MedusaModel

    model = tiny_llama()
    m = MedusaModel(model=model, tokenizer=None, heads=None, eos_token_ids=[0])
    m.route_kernels()
    _force(m.kernel_plans, lk.COLUMNS)
    used = []
    real = lk._columns_product
    monkeypatch.setattr(lk, "_columns_product", lambda *a: used.append(1) or real(*a))
    out = hf_generate(m, [5, 6, 7], max_new_tokens=4)
    assert len(out.tokens) >= 1 and not used
    generate(m, [5, 6, 7], "autoregressive", max_new_tokens=4, eos_token_ids=())
    assert used  # the runtime's own loop does use them
