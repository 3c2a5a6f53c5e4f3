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
    timed = {lk.STOCK, lk.COLUMNS} | ({lk.PACKED} if lk._pack(lin.weight) is not None else set())
    assert all(set(t) == timed for t in plan.timings.values())
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


needs_onednn = pytest.mark.skipif(lk._pack(torch.zeros(2, 2)) is None, reason="this torch build has no oneDNN")


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16, 33])
def test_packed_product_equals_linear(rows, bias):
    """Guards against the prepacked path computing another product (bias dropped, a 3-D batch
    shape lost, a non-contiguous input read with the wrong strides)."""
    torch.manual_seed(0)
    lin = nn.Linear(24, 40, bias=bias)
    x = torch.randn(1, rows, 48)[..., ::2]  # non-contiguous rows
    want = nn.functional.linear(x, lin.weight, lin.bias)
    plans = lk.route_linear_kernels(lin)
    _force(plans, lk.PACKED)
    with torch.inference_mode():
        got = lin(x)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_onednn
def test_packed_copy_follows_the_weight():
    """Guards against a stale packed copy: a weight changed in place after routing (a LoRA merge, a
    state dict loaded into the module) must be multiplied with its new values, not the packed old ones."""
    torch.manual_seed(0)
    lin = nn.Linear(16, 32)
    _force(lk.route_linear_kernels(lin), lk.PACKED)
    x = torch.randn(3, 16)
    with torch.inference_mode():
        lin(x)
    with torch.no_grad():
        lin.weight.mul_(-2.0)
    lin.load_state_dict({"weight": lin.weight.detach() + 1.0, "bias": lin.bias.detach()})
    with torch.inference_mode():
        torch.testing.assert_close(lin(x), nn.functional.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_packed_copy_gives_way_when_the_weight_cannot_be_packed():
    """Guards against a routed model breaking when converted after routing (e.g. to bfloat16): its
    packed copy cannot follow, so the product falls back to F.linear and the stale copy is dropped."""
    lin = nn.Linear(16, 32)
    _force(lk.route_linear_kernels(lin), lk.PACKED)
    lin.to(torch.bfloat16)
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    with torch.inference_mode():
        got = lin(x)
    assert torch.equal(got, nn.functional.linear(x, lin.weight, lin.bias)) and not hasattr(lin, "_packed_weight")


def test_routing_a_model_made_in_inference_mode():
    """Guards against routing failing on weights created under torch.inference_mode() (they have no
    version counter to check a packed copy against, so they are routed without one)."""
    with torch.inference_mode():
        lin = nn.Linear(16, 32)
    plans = lk.route_linear_kernels(lin)
    _force(plans, lk.PACKED)
    x = torch.randn(3, 16)
    with torch.inference_mode():
        torch.testing.assert_close(lin(x), nn.functional.linear(x, lin.weight, lin.bias))
    assert not any(p.packed for p in plans)


@needs_onednn
def test_packed_path_never_used_for_gradients():
    """Guards against silently wrong gradients: oneDNN's op has no backward, so with autograd on a
    routed linear must fall back to F.linear (the gradient then equals the unrouted module's)."""
    torch.manual_seed(0)
    lin = nn.Linear(8, 4)
    want = torch.autograd.grad(lin(torch.ones(3, 8)).square().sum(), lin.weight)[0]
    _force(lk.route_linear_kernels(lin), lk.PACKED)
    got = torch.autograd.grad(lin(torch.ones(3, 8)).square().sum(), lin.weight)[0]
    torch.testing.assert_close(got, want)
    lin.weight.requires_grad_(False)  # only the bias trains (e.g. a bias-only fine-tune)
    got = torch.autograd.grad(lin(torch.ones(3, 8)).square().sum(), lin.bias)[0]
    lin.weight.requires_grad_(True)
    lk.unroute_linear_kernels(lin)
    torch.testing.assert_close(got, torch.autograd.grad(lin(torch.ones(3, 8)).square().sum(), lin.bias)[0])


@needs_onednn
def test_packed_copies_only_where_used_and_only_when_they_fit(monkeypatch):
    """Guards against memory that buys nothing: shapes whose row counts all chose another product
    keep no packed copy, and no copy is made when the copies would not fit in half the free memory."""
    monkeypatch.setattr(lk, "free_memory_bytes", lambda device: 1 << 40)
    monkeypatch.setattr(lk, "_measure", lambda mods, rows, repeats, packed=False: {
        lk.STOCK: 3.0, lk.COLUMNS: 1.0, **({lk.PACKED: 2.0} if packed else {})})
    lin = nn.Linear(16, 32)
    (plan,) = lk.route_linear_kernels(lin, max_rows=2)
    assert set(plan.choice.values()) == {lk.COLUMNS} and not hasattr(lin, "_packed_weight")
    monkeypatch.setattr(lk, "_measure", lambda mods, rows, repeats, packed=False: {
        lk.STOCK: 3.0, lk.COLUMNS: 2.0, **({lk.PACKED: 1.0} if packed else {})})
    lin = nn.Linear(16, 32)
    (plan,) = lk.route_linear_kernels(lin, max_rows=2)
    assert set(plan.choice.values()) == {lk.PACKED} and hasattr(lin, "_packed_weight")
    assert lk.routing_summary([plan])["32x16"]["packed_rows"] == [1, 2]
    lk.unroute_linear_kernels(lin)
    assert not hasattr(lin, "_packed_weight")
    for free in (1000, None):  # too little room, or unknown: no copies
        monkeypatch.setattr(lk, "free_memory_bytes", lambda device: free)
        lin = nn.Linear(16, 32)
        (plan,) = lk.route_linear_kernels(lin, max_rows=2)
        assert not plan.packed and set(plan.choice.values()) == {lk.COLUMNS} and not hasattr(lin, "_packed_weight")


@pytest.mark.parametrize("choice", [lk.STOCK, lk.COLUMNS, pytest.param(lk.PACKED, marks=needs_onednn)])
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


# -- kernel choices kept between launches (runtime/kernel_plan_cache.py) --------------------------------
def _no_timing(monkeypatch):
    monkeypatch.setattr(lk.KernelPlan, "decide", lambda self, rows: pytest.fail("measured a stored choice"))


def test_stored_choices_route_the_next_launch_without_timing(tmp_path, monkeypatch):
    """Guards against every launch paying the ~12 s measurement again (the choice depends on machine, torch,
    threads and shape only), and against a stored choice routing differently from the measured one."""
    from inference.runtime.kernel_plan_cache import KernelPlanCache

    path = tmp_path / "plans.json"
    model = tiny_llama()
    first = {p.shape: dict(p.choice) for p in lk.route_linear_kernels(model, cache=KernelPlanCache(path))}
    lk.unroute_linear_kernels(model)
    assert path.is_file() and not list(tmp_path.glob("*.tmp"))
    with monkeypatch.context() as mp:
        _no_timing(mp)
        plans = lk.route_linear_kernels(model, cache=KernelPlanCache(path))
    assert {p.shape: p.choice for p in plans} == first and {p.source for p in plans} == {"cached"}
    assert {v["source"] for v in lk.routing_summary(plans).values()} == {"cached"}
    lk.unroute_linear_kernels(model)
    calls = []
    original = lk.KernelPlan.decide
    monkeypatch.setattr(lk.KernelPlan, "decide", lambda self, rows: calls.append(rows) or original(self, rows))
    plans = lk.route_linear_kernels(model, cache=KernelPlanCache(path), remeasure=True)   # kernels=measure
    assert calls and {p.source for p in plans} == {"measured"}


def test_stored_choices_are_keyed_by_what_they_depend_on(tmp_path, monkeypatch):
    """Guards against choices measured under other conditions being reused: another thread count, no
    prepacked copies (a stored oneDNN choice cannot run), another row range; and against a damaged file
    stopping a launch instead of being measured over."""
    from inference.runtime.kernel_plan_cache import KernelPlanCache

    path = tmp_path / "plans.json"
    lin = nn.Linear(32, 48)
    plans = lk.route_linear_kernels(lin, cache=KernelPlanCache(path), max_rows=4)
    lk.unroute_linear_kernels(lin)
    cache = KernelPlanCache(path)
    (key,) = cache.entries
    cache.entries[key]["choice"] = {str(r): lk.PACKED for r in range(1, 5)}   # as if oneDNN's won everywhere
    cache.changed = True
    cache.save()
    measured = []
    original = lk.KernelPlan.decide
    monkeypatch.setattr(lk.KernelPlan, "decide", lambda self, rows: measured.append(rows) or original(self, rows))
    lk.route_linear_kernels(lin, cache=KernelPlanCache(path), max_rows=4, pack=False)   # no copies: measured
    lk.unroute_linear_kernels(lin)
    assert measured == [1, 2, 3, 4]
    measured.clear()
    lk.route_linear_kernels(lin, cache=KernelPlanCache(path), max_rows=6)                # other rows: measured
    lk.unroute_linear_kernels(lin)
    assert measured == [1, 2, 3, 4, 5, 6]
    measured.clear()
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        lk.route_linear_kernels(lin, cache=KernelPlanCache(path), max_rows=4)           # other threads: measured
    finally:
        torch.set_num_threads(threads)
    lk.unroute_linear_kernels(lin)
    assert measured == [1, 2, 3, 4] and plans
    path.write_text("{not json")
    assert KernelPlanCache(path).entries == {}
    lk.route_linear_kernels(lin, cache=KernelPlanCache(path), max_rows=4)
    lk.unroute_linear_kernels(lin)
    assert KernelPlanCache(path).entries   # rewritten whole


def test_load_medusa_reuses_the_machine_s_choices(tmp_path, monkeypatch):
    """Guards against load_medusa (medusa-generate, medusa-eval) measuring at every launch, against
    kernels=measure not refreshing the file, and against MEDUSA_TRAIN_KERNEL_PLANS=none still keeping one."""
    model = tiny_llama()
    save_heads(random_heads(model), tmp_path / "heads")
    path = tmp_path / "plans.json"
    monkeypatch.setenv("MEDUSA_TRAIN_KERNEL_PLANS", str(path))
    first = load_medusa(tmp_path / "heads", backbone=tiny_llama(), kernels="auto")
    assert path.is_file() and {p.source for p in first.kernel_plans} == {"measured"}
    with monkeypatch.context() as mp:
        _no_timing(mp)
        again = load_medusa(tmp_path / "heads", backbone=tiny_llama(), kernels="auto")
    assert {p.source for p in again.kernel_plans} == {"cached"}
    fresh = load_medusa(tmp_path / "heads", backbone=tiny_llama(), kernels="measure")
    assert {p.source for p in fresh.kernel_plans} == {"measured"}
    path.unlink()
    monkeypatch.setenv("MEDUSA_TRAIN_KERNEL_PLANS", "none")
    load_medusa(tmp_path / "heads", backbone=tiny_llama(), kernels="auto")
    assert not path.exists()


def test_an_unwritable_cache_only_costs_the_measurement(tmp_path):
    """Guards against a cache that cannot be written (its directory a file here; read-only elsewhere) failing
    a launch: the choices are measured and used."""
    from inference.runtime.kernel_plan_cache import KernelPlanCache

    blocker = tmp_path / "not_a_directory"
    blocker.write_text("x")
    plans = lk.route_linear_kernels(nn.Linear(16, 16), cache=KernelPlanCache(blocker / "plans.json"), max_rows=2)
    assert plans and plans[0].source == "measured" and blocker.read_text() == "x"
