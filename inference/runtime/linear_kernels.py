"""How ``nn.Linear`` multiplies a few rows on CPU: one kernel choice per weight shape and row count.

A tree step multiplies every weight matrix by 2-16 rows (the tree nodes) where plain decoding
multiplies it by one. On CPU the BLAS library picks its kernel from the operands' shapes and
layouts, and for ``F.linear(x, W)`` (x @ W^T) with a handful of rows it often picks a poor one.
Measured on cpu-2c (BENCHMARKS.md, "Skinny products"), SmolLM2's lm_head [49152 x 576]:
1 row 11 ms, 2 rows 26 ms, 3 rows 39 ms with ``F.linear``; the same products computed as
``(W @ x^T)^T`` take 5 / 8 ms for 2 / 3 rows. Over a whole forward that made a 2-node tree step
cost 1.6x a 1-token step, enough to make every tree slower than plain decoding.

``route_linear_kernels(model)`` times both formulations on this machine, over the model's own
weights of each shape, for every row count r <= ``max_rows`` (16: the tree sizes that pay on
CPU), and routes each ``nn.Linear`` through a per-shape plan that keeps the faster for each r
(the alternative must win by ``margin`` to be chosen). The same weights
are read; nothing is copied, so memory does not change. Routing is CPU only: GPU libraries
handle skinny products well, and a model on CUDA is left alone.

Results differ from ``F.linear`` only by floating-point summation order (~1e-6 relative), as
any two BLAS kernels do; greedy verification compares the tree's logits with the same model's,
so outputs stay token-identical to plain decoding through the same routed model.

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

STOCK = "linear"          # F.linear(x, W): x @ W^T
COLUMNS = "w_xt"           # (W @ x^T)^T: the weight times a block of columns
_routing_on = True


@dataclass
class KernelPlan:
    """Which formulation each row count uses for one weight shape.

    ``members`` are every linear of that shape (timed together, see ``_measure``); row counts
    never measured (prefill, trees above ``max_rows``) use ``F.linear``. One row is measured too:
    as a two-row product with a zero row against BLAS's matrix-vector kernel.
    """

    shape: tuple[int, int]
    members: list = field(default_factory=list, repr=False)
    margin: float = 0.9
    repeats: int = 3
    choice: dict[int, str] = field(default_factory=dict)
    timings: dict[int, dict[str, float]] = field(default_factory=dict)

    def kernel(self, rows: int) -> str:
        return self.choice.get(rows, STOCK)

    @torch.inference_mode()
    def decide(self, rows: int) -> str:
        """Measure both formulations for ``rows`` and keep the faster."""
        t = _measure(self.members, rows, self.repeats)
        self.timings[rows] = t
        self.choice[rows] = COLUMNS if t[COLUMNS] < self.margin * t[STOCK] else STOCK
        return self.choice[rows]


class RoutedLinear(nn.Linear):
    """An ``nn.Linear`` whose forward follows its shape's ``KernelPlan`` (same parameters, same state dict)."""

    kernel_plan: Optional[KernelPlan] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        plan = self.kernel_plan
        if plan is None or not _routing_on or x.device.type != "cpu" or not x.shape[-1]:
            return F.linear(x, self.weight, self.bias)
        if plan.kernel(x.numel() // x.shape[-1]) != COLUMNS:
            return F.linear(x, self.weight, self.bias)
        return _columns_product(x, self.weight, self.bias)


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


def _measure(modules: list[nn.Linear], rows: int, repeats: int) -> dict[str, float]:
    """Time both formulations over every module of one shape in turn, so the weights stream from
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

    stock(), columns()  # warm-up
    times = {STOCK: float("inf"), COLUMNS: float("inf")}
    for _ in range(repeats):  # interleaved, best of each: noise on a shared machine only adds time
        times[STOCK] = min(times[STOCK], _time_ms(stock, 1))
        times[COLUMNS] = min(times[COLUMNS], _time_ms(columns, 1))
    return times


def route_linear_kernels(model: nn.Module, *, extra: Iterable[nn.Module] = (), max_rows: int = 16,
                         margin: float = 0.9, repeats: int = 3) -> list[KernelPlan]:
    """Route every ``nn.Linear`` of ``model`` (and of the ``extra`` modules, e.g. the heads) on CPU;
    returns one plan per weight shape, or [] on other devices. Every row count 1..``max_rows``
    is measured here, once (~5 s for SmolLM2-135M), never inside a timed decoding step. A row
    count uses ``(W @ x^T)^T`` only where that took < ``margin`` x the time of ``F.linear``.
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
    for plan in groups.values():
        for rows in range(1, max_rows + 1):
            plan.decide(rows)
    for plan in groups.values():  # routed only once every shape is measured: timing ran stock code
        for m in plan.members:
            m.__class__ = RoutedLinear
            m.kernel_plan = plan
    return list(groups.values())


def unroute_linear_kernels(*modules: nn.Module) -> None:
    """Undo ``route_linear_kernels``: every routed linear becomes a plain ``nn.Linear`` again."""
    for root in modules:
        for m in root.modules():
            if type(m) is RoutedLinear:
                m.__class__ = nn.Linear
                del m.kernel_plan


def routing_summary(plans: list[KernelPlan]) -> dict:
    """What report.json records: per weight shape, the row counts measured and those routed
    through ``(W @ x^T)^T``."""
    return {f"{p.shape[0]}x{p.shape[1]}": {"measured_rows": sorted(p.timings),
                                          "columns_rows": sorted(r for r, c in p.choice.items() if c == COLUMNS)}
            for p in plans}
