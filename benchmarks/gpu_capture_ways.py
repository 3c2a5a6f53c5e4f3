"""The GPU check's two ways of capturing a static step (benchmarks/gpu_graphs.py runs it): torch.cuda.CUDAGraph
directly (``runtime.static_steps.cuda_capture``) against torch.compile(mode="reduce-overhead") of the same
uncaptured step, the uncaptured step beside them: step time, compile time, graph breaks, equal outputs."""

from __future__ import annotations

import time
import traceback

import torch

from benchmarks.timing import spread, sync
from inference.runtime.model import MedusaModel
from inference.runtime.static_steps import StaticSteps, cuda_capture


WAYS = ("uncaptured", "cuda_graph", "reduce_overhead")
REDUCE_OVERHEAD_ISSUES = ("https://github.com/pytorch/pytorch/issues/174575",
                          "https://github.com/pytorch/pytorch/issues/150488")


def static_step(m: MedusaModel, prompt: list[int], capture):
    """A fresh ``StaticSteps`` of ``m`` (its own buffer; ``capture`` as its constructor takes it), ``prompt``
    prefilled through it (uncaptured: a generation's first forward), and its (1, 1) bucket's zero-argument
    1-token step, inputs filled once as ``StaticSteps.forward`` fills them: (steps, bucket, step)."""
    st = StaticSteps(m, capture=capture, log=print)
    view, dev, n = st.cache(len(prompt) + 2), m.device, len(prompt)
    st.forward(view, torch.tensor([prompt], device=dev), torch.arange(n, device=dev)[None], None)
    slots, _ = view.write_slots(1)          # the next slot; the token's position is the same number
    b = st._bucket(1, 1)
    st._fill(b, torch.tensor([[prompt[-1]]], device=dev), slots, None, slots, view.length)   # causal after the prompt
    return st, b, st._step_fn(b, None)


def reduce_overhead(st: StaticSteps, b, step, warmup: int):
    """``step`` compiled with torch.compile(mode="reduce-overhead"), warmed up (inductor compiles at the first
    call, the CUDA-graph trees record after their warm-up runs): (a call returning its outputs, its figures).
    The buffer and the bucket's inputs are marked static (as transformers' StaticCache marks its KV): the trees
    then neither copy them into their own inputs each call nor skip graphs for the KV writes (mutated inputs)."""
    from torch._dynamo.utils import counters
    layers = [t for layer in st.body_cache.layers for t in (layer.keys, layer.values)]
    for t in (st.kv, b.ids, b.pos, b.mask, b.rows, b.slots, *layers):
        torch._dynamo.mark_static_address(t)

    def snap():
        return (sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"],
                counters["inductor"]["cudagraph_skips"])

    before, fn = snap(), torch.compile(step, mode="reduce-overhead", fullgraph=False)

    def call():
        torch.compiler.cudagraph_mark_step_begin()   # each call a new step: the last one's outputs may go
        return fn()

    secs = []
    for _ in range(warmup):
        t = time.perf_counter()
        call()
        torch.cuda.synchronize()
        secs.append(time.perf_counter() - t)
    breaks, graphs, skips = (after - was for after, was in zip(snap(), before))
    return call, {"compile_s": round(secs[0], 2), "warmup_s": round(sum(secs), 2), "warmup_calls": warmup,
                  "warmup_ms": [round(x * 1e3, 2) for x in secs[1:]], "graph_breaks": breaks, "graphs": graphs,
                  "cudagraph_skips": skips}


def capture_ways(m: MedusaModel, prompt: list[int], sz: dict, errors: dict, where: str,
                 with_compile: bool = True) -> dict:
    """The 1-token static step (backbone ``hidden``, no logits) three ways, each on its own static buffer with
    the same prompt: ``uncaptured`` (capture=None), ``cuda_graph`` (capture=cuda_capture: graphs=on) and
    ``reduce_overhead`` (the uncaptured step through torch.compile); interleaved rotating rounds, median ms +
    min / max, each output against the uncaptured one (bf16 tolerance). Dry run (CPU): no capture, so
    ``cuda_graph`` is the uncaptured step again and reduce-overhead is skipped (``skipped`` says why); a
    reduce-overhead failure is recorded in ``errors`` and the other two are still timed. ``with_compile`` False: the
    time left does not cover reduce-overhead's compile (gpu_graphs.PART_S), which is then skipped, said so."""
    cuda = m.device.type == "cuda"
    out = {"cuda_graph_captured": cuda, "ms": dict.fromkeys(WAYS), "matches_uncaptured": dict.fromkeys(WAYS[1:]),
           "max_abs_diff": dict.fromkeys(WAYS[1:]), "capture_s": None, "graph_memory_bytes": None,
           "reduce_overhead": None, "skipped": None, "torch": torch.__version__, "issues": list(REDUCE_OVERHEAD_ISSUES)}
    fns = {}
    with torch.no_grad():
        _, _, step = static_step(m, prompt, None)
        fns["uncaptured"] = step
        stb, _, step = static_step(m, prompt, cuda_capture if cuda else None)
        fns["cuda_graph"] = step   # the dry run's stand-in; captured on CUDA
        if not cuda:
            out["skipped"] = "torch.compile reduce-overhead needs CUDA graphs: GPU only"
        elif not with_compile:
            out["skipped"] = ("not run for time: its compile (60-120 s at the 8B shape) did not fit what was left "
                              "of the budget")
        if cuda:
            replay, outs = stb._capture("1", step) or (None, None)   # None on failure (its line logged)
            if replay is None:
                raise RuntimeError("capturing the 1-token static step failed")
            fns["cuda_graph"] = lambda: (replay(), outs)[1]
            out["capture_s"], out["graph_memory_bytes"] = round(stb.capture_s, 4), stb.graph_bytes
        if cuda and with_compile:
            try:   # a failure here leaves the other two timed
                stc, bc, step = static_step(m, prompt, None)
                fns["reduce_overhead"], out["reduce_overhead"] = reduce_overhead(stc, bc, step, sz["compile_warmup"])
            except Exception:
                errors[f"{where}.reduce_overhead"] = traceback.format_exc()
                out["skipped"] = "failed: " + traceback.format_exc(limit=0).strip().splitlines()[-1][:300]
        out.update(ways_times(fns, m.device, sz))
    out["which"] = which_way(out)
    return out


def ways_times(fns: dict, device: torch.device, sz: dict) -> dict:
    """Each step's output against the uncaptured one's, then interleaved rotating rounds of synchronized calls."""
    ref = fns["uncaptured"]()[0].float().clone()
    same, diff = {}, {}
    for way in list(fns)[1:]:
        got = fns[way]()[0].float().clone()
        diff[way] = round((got - ref).abs().max().item(), 5)
        same[way] = bool(torch.allclose(got, ref, rtol=3e-2, atol=3e-2))
    times: dict = {way: [] for way in fns}
    names = list(fns)
    for r in range(sz["ways_rounds"]):
        for way in names[r % len(names):] + names[:r % len(names)]:
            for _ in range(sz["ways_per_round"]):
                sync(device)
                t = time.perf_counter()
                fns[way]()
                sync(device)
                times[way].append((time.perf_counter() - t) * 1e3)
    return {"ms": {way: spread(times[way], 3) if way in times else None for way in WAYS},
            "matches_uncaptured": {way: same.get(way) for way in WAYS[1:]},
            "max_abs_diff": {way: diff.get(way) for way in WAYS[1:]}}


def which_way(w: dict) -> str:
    """One line: which way of capturing the runtime uses, and why (the figures behind it)."""
    ms = w["ms"]
    if not w["cuda_graph_captured"]:
        return "dry run (CPU): nothing captured; the GPU run compares CUDAGraph with reduce-overhead"
    g, u = ms["cuda_graph"]["median"], ms["uncaptured"]["median"]
    ro = w["reduce_overhead"]
    if ms["reduce_overhead"] is None or ro is None:
        return f"CUDAGraph directly ({g} ms a step vs {u} uncaptured): reduce-overhead did not run ({w['skipped']})"
    c = ms["reduce_overhead"]["median"]
    cost = (f"reduce-overhead costs {ro['compile_s']} s of compile ({ro['warmup_s']} s warm-up in all), "
            f"{ro['graph_breaks']} graph breaks, {ro['cudagraph_skips']} cudagraph skips"
            + ("" if w["matches_uncaptured"]["reduce_overhead"] else
               ", and its output differs from the uncaptured step"))
    if g <= c * 1.03:
        return (f"CUDAGraph directly: {g} ms a step vs reduce-overhead's {c} (uncaptured {u}): the same replay "
                f"without compile time, dynamo's guards or the CUDA-graph trees' per-call work; {cost}")
    return (f"reduce-overhead is {g / c:.2f}x faster a step ({c} vs {g} ms, uncaptured {u}): inductor's fused "
            f"kernels; {cost}, per shape and per bucket")
