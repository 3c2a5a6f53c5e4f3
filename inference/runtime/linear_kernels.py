"""How ``nn.Linear`` multiplies a few rows on CPU: one kernel choice per weight shape and row count.

A tree step multiplies every weight matrix by 2-16 rows (the tree nodes) where plain decoding
multiplies it by one. On CPU the BLAS library picks its kernel from the operands' shapes and
layouts, and for ``F.linear(x, W)`` (x @ W^T) with a handful of rows it often picks a poor one.
Measured on cpu-2c (benchmarks/history.md, "Skinny products"), SmolLM2's lm_head [49152 x 576]:
1 row 11 ms, 2 rows 26 ms, 3 rows 39 ms with ``F.linear``; the same products computed as
``(W @ x^T)^T`` take 5 / 8 ms for 2 / 3 rows. Over a whole forward that made a 2-node tree step
cost 1.6x a 1-token step, enough to make every tree slower than plain decoding.

A third formulation reads a copy of the weight that oneDNN has reordered ("prepacked") into its
own blocked layout, ``torch.ops.mkldnn._linear_pointwise``: its kernel streams the blocked
weight once for any small row count, so 3-16 rows cost about what one or two cost (cpu-2c-b, the
whole SmolLM2 verification forward, routed, fastest of 25-30 calls: 8 rows 47 ms with packed weights
vs 76-78 ms without, 1-2 rows 31-38 ms either way; benchmarks/history.md "Prepacked weights"). It costs memory: one packed copy of
every weight whose shape uses it for some row count (fp32 weights only; skipped when the copies
would not fit in half the free memory, or where this torch build has no oneDNN).

``route_linear_kernels(model)`` times the formulations on this machine, over the model's own
weights of each shape, for every row count r <= ``max_rows`` (16: the tree sizes that pay on
CPU), and routes each ``nn.Linear`` through a per-shape plan that keeps the fastest for each r
(an alternative to ``F.linear`` must win by ``margin`` to be chosen). Packed copies of shapes
that never use them are dropped after timing. Routing is CPU only: GPU libraries handle skinny
products well, and a model on CUDA is left alone. A packed copy is checked against its weight
(same storage and dtype, no in-place change since packing) at every call; a weight changed
after routing through the parameter (an adapter merged with ``add_``, a state dict loaded) is
repacked rather than read stale, and one that can no longer be packed (another dtype) falls back
to ``F.linear``. Writes through ``weight.data`` bypass torch's version counter and are not
seen: unroute (or re-route) after changing weights that way.

Results differ from ``F.linear`` only by floating-point summation order (~1e-6 relative; ~5e-5
absolute on SmolLM2's logits through the packed path), as any two BLAS kernels do; greedy
verification compares the tree's logits with the same model's, so outputs stay token-identical
to plain decoding through the same routed model.

``stock_kernels()`` turns routing off inside a ``with`` block (the transformers ``generate``
baseline is measured with stock kernels, so its speedup column means what a user gets today).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .kernel_plan_cache import KernelPlanCache
from .memory import free_memory_bytes

STOCK = "linear"          # F.linear(x, W): x @ W^T
COLUMNS = "w_xt"           # (W @ x^T)^T: the weight times a block of columns
PACKED = "onednn_packed"   # oneDNN's linear over a reordered (prepacked) copy of W
_routing_on = True


@dataclass
class KernelPlan:
    """Which formulation each row count uses for one weight shape.

    ``members`` are every linear of that shape (timed together, see ``_measure``); row counts
    never measured (prefill, trees above ``max_rows``) use ``F.linear``. One row is measured too:
    as a two-row product with a zero row against BLAS's matrix-vector kernel. ``packed``: the
    members carry prepacked copies, so ``PACKED`` is a candidate.
    """

    shape: tuple[int, int]
    members: list = field(default_factory=list, repr=False)
    margin: float = 0.9
    repeats: int = 3
    packed: bool = False
    choice: dict[int, str] = field(default_factory=dict)
    timings: dict[int, dict[str, float]] = field(default_factory=dict)
    source: str = "measured"   # or "cached": taken from an earlier launch's measurement (kernel_plan_cache)

    def kernel(self, rows: int) -> str:
        return self.choice.get(rows, STOCK)

    @torch.inference_mode()
    def decide(self, rows: int) -> str:
        """Measure the formulations for ``rows`` and keep the fastest (F.linear unless another
        takes < ``margin`` of its time)."""
        t = _measure(self.members, rows, self.repeats, self.packed)
        self.timings[rows] = t
        self.choice[rows] = self.pick(t)
        return self.choice[rows]

    def pick(self, timings: dict[str, float]) -> str:
        """The formulation these ``timings`` (ms per formulation) choose."""
        best = min((k for k in timings if k != STOCK), key=timings.get, default=STOCK)
        return best if timings[best] < self.margin * timings[STOCK] else STOCK

    @torch.inference_mode()
    def warm(self) -> None:
        """Run each row count's chosen product once: a choice read from the cache has never run in this process,
        and oneDNN builds its kernel for a shape and row count on first use (a launch whose first decoding steps
        built them measured ~6% fewer tokens/s over 64 tokens)."""
        m = self.members[0]
        for rows, kernel in sorted(self.choice.items()):
            x = torch.zeros(rows, m.weight.shape[1], dtype=m.weight.dtype, device=m.weight.device)
            if kernel == COLUMNS:
                _columns_product(x, m.weight, m.bias)
            elif kernel == PACKED and getattr(m, "_packed_weight", None) is not None:
                _packed_product(x, m._packed_weight, m.bias)

    @property
    def uses_packed(self) -> bool:
        return PACKED in self.choice.values()


class RoutedLinear(nn.Linear):
    """An ``nn.Linear`` whose forward follows its shape's ``KernelPlan`` (same parameters, same state dict)."""

    kernel_plan: Optional[KernelPlan] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        plan = self.kernel_plan
        if plan is None or not _routing_on or x.device.type != "cpu" or not x.shape[-1]:
            return F.linear(x, self.weight, self.bias)
        kernel = plan.kernel(x.numel() // x.shape[-1])
        if kernel == COLUMNS:
            return _columns_product(x, self.weight, self.bias)
        if kernel == PACKED and not (torch.is_grad_enabled() and any(
                t is not None and t.requires_grad for t in (x, self.weight, self.bias))):
            # oneDNN's op has no backward: with autograd on, F.linear keeps gradients right
            packed = _packed_weight(self)
            if packed is not None:
                return _packed_product(x, packed, self.bias)
        return F.linear(x, self.weight, self.bias)

    def _apply(self, fn, recurse=True):
        # .to() / .cuda() / .half() replace the weight: its packed copy no longer matches and, off the
        # CPU, would only hold memory; it is repacked on next use if the weight can still be packed
        _drop_packed(self)
        return super()._apply(fn, recurse)


def _pack(weight: torch.Tensor) -> Optional[torch.Tensor]:
    """oneDNN's reordered copy of an fp32 CPU weight, or None where this torch build cannot make one."""
    if (weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.is_inference()
            or not torch.backends.mkldnn.is_available()):
        return None  # (an inference-mode tensor has no version counter to tell a stale copy by)
    try:
        with torch.inference_mode():
            return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 4)  # 4: a hint, any row count works
    except (RuntimeError, AttributeError, NotImplementedError):
        return None


def _weight_key(weight: torch.Tensor) -> tuple:
    """What identifies a weight's current values cheaply: its storage and its in-place version."""
    return weight.data_ptr(), weight._version, weight.dtype


def _attach_packed(m: nn.Linear) -> bool:
    packed = _pack(m.weight)
    if packed is None:
        return False
    m._packed_weight, m._packed_key = packed, _weight_key(m.weight)
    return True


def _packed_weight(m: nn.Linear) -> Optional[torch.Tensor]:
    """The module's packed copy, repacked if its weight changed since; None (use F.linear) when it
    can no longer be packed (another dtype or device)."""
    if m.weight.is_inference():
        return None
    if getattr(m, "_packed_key", None) != _weight_key(m.weight) and not _attach_packed(m):
        _drop_packed(m)
        return None
    return m._packed_weight


def _packed_product(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1])
    if not flat.is_contiguous():
        flat = flat.contiguous()
    y = torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [], "")
    return y.reshape(*x.shape[:-1], y.shape[-1])


def _columns_product(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x @ W^T computed as (W @ x^T)^T; x^T stays a transposed view (copying it brings the slow kernel back)."""
    flat = x.reshape(-1, x.shape[-1])
    rows = flat.shape[0]
    if rows == 1:  # one row would fall back to matrix-vector code; a zero second row keeps the gemm kernel
        flat = torch.cat([flat, flat.new_zeros(1, flat.shape[1])])
    if bias is None:
        y = torch.mm(weight, flat.t())
    else:
        y = torch.addmm(bias[:, None], weight, flat.t())
    return y[:, :rows].t().contiguous().reshape(*x.shape[:-1], weight.shape[0])


@contextlib.contextmanager
def stock_kernels() -> Iterator[None]:
    """Run every routed linear as plain ``F.linear`` inside the block."""
    global _routing_on
    before, _routing_on = _routing_on, False
    try:
        yield
    finally:
        _routing_on = before


def _time_ms(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def _measure(modules: list[nn.Linear], rows: int, repeats: int, packed: bool = False) -> dict[str, float]:
    """Time the formulations over every module of one shape in turn, so the weights stream from
    memory as in a forward pass (one matrix timed alone would sit in cache and mislead)."""
    w = modules[0].weight
    # fixed values, not torch.randn: timing must not advance the global random state
    x = torch.linspace(-1, 1, rows * w.shape[1], dtype=w.dtype, device=w.device).reshape(rows, -1)

    def stock():
        for m in modules:
            F.linear(x, m.weight, m.bias)

    def columns():
        for m in modules:
            _columns_product(x, m.weight, m.bias)

    def prepacked():
        for m in modules:
            _packed_product(x, m._packed_weight, m.bias)

    runs = {STOCK: stock, COLUMNS: columns, **({PACKED: prepacked} if packed else {})}
    for run in runs.values():  # warm-up
        run()
    times = dict.fromkeys(runs, float("inf"))
    for _ in range(repeats):  # interleaved, best of each: noise on a shared machine only adds time
        for name, run in runs.items():
            times[name] = min(times[name], _time_ms(run, 1))
    return times


def route_linear_kernels(model: nn.Module, *, extra: Iterable[nn.Module] = (), max_rows: int = 16,
                         margin: float = 0.9, repeats: int = 3, pack: bool = True,
                         cache: Optional[KernelPlanCache] = None, remeasure: bool = False) -> list[KernelPlan]:
    """Route every ``nn.Linear`` of ``model`` (and of the ``extra`` modules, e.g. the heads) on CPU;
    returns one plan per weight shape, or [] on other devices. Every row count 1..``max_rows``
    is measured here, once (~8-12 s for SmolLM2-135M), never inside a timed decoding step. A row
    count uses ``(W @ x^T)^T`` or the prepacked weight only where that took < ``margin`` x the
    time of ``F.linear``. ``pack=False``: no packed copies (no extra memory). ``cache``: choices stored
    by an earlier launch on this machine are taken from it instead of measured (``remeasure``: measure
    all the same), and new measurements are stored (``kernel_plan_cache``).
    """
    linears = [m for root in (model, *extra) for m in root.modules() if type(m) in (nn.Linear, RoutedLinear)]
    if not linears or linears[0].weight.device.type != "cpu":
        return []
    groups: dict[tuple, KernelPlan] = {}
    for m in linears:
        key = (tuple(m.weight.shape), m.weight.dtype, m.bias is not None)
        plan = groups.setdefault(key, KernelPlan(shape=key[0], margin=margin, repeats=repeats))
        if not any(m is other for other in plan.members):  # a module reached twice (shared) is timed once
            plan.members.append(m)
    if pack:
        need = sum(m.weight.numel() * m.weight.element_size() for p in groups.values() for m in p.members)
        free = free_memory_bytes(torch.device("cpu"))
        if free is not None and need < free // 2:  # unknown free memory: no copies
            for plan in groups.values():
                plan.packed = all([_attach_packed(m) for m in plan.members])
                if not plan.packed:
                    for m in plan.members:
                        _drop_packed(m)
    for (shape, dtype, bias), plan in groups.items():
        key = KernelPlanCache.key(shape, dtype, bias, plan.packed, max_rows, margin) if cache is not None else None
        stored = cache.get(key) if cache is not None and not remeasure else None
        if stored is not None and set(stored) == set(range(1, max_rows + 1)) and \
                (plan.packed or PACKED not in stored.values()):
            plan.choice, plan.source = stored, "cached"
            plan.warm()
        else:
            for rows in range(1, max_rows + 1):
                plan.decide(rows)
            if cache is not None:
                cache.put(key, plan.choice, plan.timings)
        if not plan.uses_packed:  # no row count reads the copies: give their memory back
            plan.packed = False
            for m in plan.members:
                _drop_packed(m)
    for plan in groups.values():  # routed only once every shape is measured: timing ran stock code
        for m in plan.members:
            m.__class__ = RoutedLinear
            m.kernel_plan = plan
    if cache is not None:
        cache.save()
    return list(groups.values())


def unroute_linear_kernels(*modules: nn.Module) -> None:
    """Undo ``route_linear_kernels``: every routed linear becomes a plain ``nn.Linear`` again."""
    for root in modules:
        for m in root.modules():
            if type(m) is RoutedLinear:
                m.__class__ = nn.Linear
                del m.kernel_plan
                _drop_packed(m)


def _drop_packed(m: nn.Module) -> None:
    for name in ("_packed_weight", "_packed_key"):
        m.__dict__.pop(name, None)


def routing_summary(plans: list[KernelPlan]) -> dict:
    """What report.json records: per weight shape, the row counts measured and those routed
    through ``(W @ x^T)^T`` and through the prepacked weight, and whether they were measured by this
    launch or read from an earlier one's (``source``: measured | cached)."""
    return {f"{p.shape[0]}x{p.shape[1]}": {"measured_rows": sorted(p.choice),
                                          "columns_rows": sorted(r for r, c in p.choice.items() if c == COLUMNS),
                                          "packed_rows": sorted(r for r, c in p.choice.items() if c == PACKED),
                                          "source": p.source}
            for p in plans}
