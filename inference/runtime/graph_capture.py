"""Capturing a step as a CUDA graph, and checking a replay: what the backbone's static steps
(``static_steps``) and the drafters' captured calls (``captured_calls``) share.

A captured graph replays the kernels it recorded on the tensors it recorded: every input must be a fixed
tensor filled in place, every output is read back from the same tensors (and copied before another graph of
the same pool replays: the pool lends one graph's freed blocks to the next capture), and a value the step
read on the host is frozen into the graph. ``cuda_capture`` refuses the host reads it can see (``HostReadGuard``);
``outputs_agree`` is the check run on a graph's first replay on new inputs, for the ones it cannot.
"""

from __future__ import annotations

import threading
import time
from contextlib import nullcontext
from typing import Callable, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode


# What makes the host wait for the device, as the dispatcher sees it: a value read into Python, an output shape
# that depends on values. ``HostReadGuard`` refuses them (and copies between the host and a device) in a step.
HOST_READS = frozenset({"_local_scalar_dense", "is_nonzero", "equal", "allclose", "nonzero", "masked_select",
                        "unique", "_unique2", "unique_consecutive", "unique_dim"})


class HostReadInStep(RuntimeError):
    """A step to be captured read a device value on the host (or copied between host and device)."""


class HostReadGuard(TorchDispatchMode):
    """Raises ``HostReadInStep`` at a host read (``HOST_READS``, a boolean index, ``repeat_interleave`` of
    counts without ``output_size``) or a copy between the host and a device, while active. A dispatch mode is
    this thread's alone: torch's sync debugging (``set_sync_debug_mode("error")``, used here before) is one
    setting for the whole process, so another thread's ``.tolist()`` during a warm-up failed its request."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if (name in HOST_READS or _value_shaped(name, func, args, kwargs) or _crosses_host(name, args, kwargs)
                or _made_from_values(name, args)):
            raise HostReadInStep(f"the step reads the device on the host ({name}): it cannot be captured")
        return func(*args, **kwargs)


def _value_shaped(name: str, func, args, kwargs) -> bool:
    if name == "repeat_interleave":
        return func._overloadname in ("Tensor", "self_Tensor") and kwargs.get("output_size") is None
    return name in ("index", "index_put", "index_put_") and any(
        isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ()))


def _made_from_values(name: str, args) -> bool:
    """``torch.tensor(values, device=...)`` off the host: torch copies the values below the dispatcher, so a mode
    sees only the ``lift_fresh`` of a tensor already on the device (torch's fake_tensor.py says so)."""
    return name in ("lift_fresh", "lift_fresh_copy") and args[0].device.type != "cpu"


def _crosses_host(name: str, args, kwargs) -> bool:
    """A copy whose source and destination are not both on the host, or both off it (``.cpu()``, ``.tolist()``
    of a device tensor, ``torch.tensor(values, device=...)``): a blocking transfer, frozen into a capture."""
    if name == "_to_copy" and kwargs.get("device") is not None:
        return (args[0].device.type == "cpu") != (torch.device(kwargs["device"]).type == "cpu")
    if name == "copy_":
        return (args[0].device.type == "cpu") != (args[1].device.type == "cpu")
    return False


def to_device(values, device, dtype=None) -> torch.Tensor:
    """``torch.as_tensor(values, dtype=dtype, device=device)`` without waiting for the device: torch copies host
    memory to a GPU with a stream synchronisation unless asked ``non_blocking`` (pytorch#120996), so every index
    list a step sent after queueing work waited for all of it, and the GPU then idled while the host built the
    rest. CUDA copies a pageable source to its staging buffer before the call returns: the list may go at once."""
    if isinstance(values, torch.Tensor):
        return values.to(device=device, dtype=dtype or values.dtype, non_blocking=True)
    host = torch.tensor(values, dtype=dtype)
    return host if torch.device(device).type == "cpu" else host.to(device, non_blocking=True)


# One capture at a time in the process: torch.cuda.graph's default capture stream is one for all, and a capture
# started while another thread's is open fails both. Held around warm-up, capture and the memory measured around
# them (``measured_capture``: re-entered there), whatever the model.
_CAPTURING = threading.RLock()
# One warm-up and capture stream per device, kept: each new torch.cuda.Stream() is another of torch's pooled
# streams, and cuBLAS keeps a workspace per (handle, stream) that was then counted as each graph's memory.
_STREAMS: dict = {}


def _capture_stream() -> "torch.cuda.Stream":
    device = torch.cuda.current_device()
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream()
    return _STREAMS[device]


def cuda_capture(fn: Callable[[], tuple], pool) -> tuple[Callable[[], None], tuple]:
    """Capture ``fn`` (which reads and writes only fixed tensors) as a CUDA graph: (replay, its outputs).
    One eager run first on a side stream (lazy initialisations and the allocator's first blocks must not
    happen inside the capture; it writes the same cache entries the step itself writes), under
    ``HostReadGuard``: a step that reads a device value on the host (``.item()``, a data-dependent branch)
    cannot be captured, and is refused here, before a capture it would leave half-open. A capture that
    fails all the same, or is interrupted (a signal's exception: it propagates as itself, never as a failed
    capture that a caller would log and go on from), restores the stream and ends the pool's allocation before
    raising. One capture at a time in the process (``_CAPTURING``)."""
    with _CAPTURING:
        return _capture(fn, pool)


def _capture(fn: Callable[[], tuple], pool) -> tuple[Callable[[], None], tuple]:
    stream = _capture_stream()
    stream.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(stream), HostReadGuard():
            fn()
    finally:   # joined even when refused: the eager rerun that follows must not race the warm-up's writes
        torch.cuda.current_stream().wait_stream(stream)
    graph, before = torch.cuda.CUDAGraph(), torch.cuda.current_stream()
    try:
        # "thread_local": only this thread's unsafe calls break the capture. The default "global" also fails it
        # on another thread's (an NCCL / DeepSpeed watchdog polling its events, a data loader's pinned copy), which
        # the step never depends on; this thread's own host reads are still refused. torch's own CUDA-graph trees
        # (torch.compile mode="reduce-overhead") capture the same way.
        with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
            outs = fn()
    except BaseException as exc:   # an interrupt too (a deadline's signal, ^C): the stream is restored either way
        torch.cuda.set_stream(before)      # graph.__exit__ raising leaves the capture stream current
        end = getattr(torch._C, "_cuda_endAllocateToPool", None)
        if end is not None:
            try:
                end(torch.cuda.current_device(), pool)
            except Exception:
                pass
        interrupt = exc.__context__ if isinstance(exc, Exception) else None
        if interrupt is not None and not isinstance(interrupt, Exception):
            raise interrupt    # the capture's end failed because of it: the interrupt, not a capture failure
        raise
    return graph.replay, outs


def measured_capture(capture: Callable, fn: Callable[[], tuple], pool) -> tuple[tuple, float, int]:
    """``capture(fn, pool)`` -> ((replay, outputs), seconds, graph memory in bytes); raises what it raises.
    torch.cuda.graph empties the allocator's cache on entry: the memory is measured from there."""
    on_cuda = capture is cuda_capture
    with _CAPTURING if on_cuda else nullcontext():   # another thread's capture would count in this one's memory
        if on_cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved() if on_cuda else 0
        t0 = time.perf_counter()
        captured = capture(fn, pool)
        grown = 0
        if on_cuda:
            torch.cuda.synchronize()
            grown = torch.cuda.memory_reserved() - before
        return captured, time.perf_counter() - t0, grown


def outputs_agree(replayed: Sequence[torch.Tensor], eager: Sequence[torch.Tensor]) -> bool:
    """Whether a replay's outputs equal the same step run eagerly, within the dtype's rounding (fp32: 1e-4;
    half precision: 3e-2). Integer outputs (drafted token ids) must be equal."""
    for r, e in zip(replayed, eager):
        if not r.is_floating_point():
            if not torch.equal(r, e):
                return False
            continue
        tol = 1e-4 if e.dtype == torch.float32 else 3e-2
        if not torch.allclose(r.float(), e.float(), rtol=tol, atol=tol):
            return False
    return True


def on_device(device: torch.device):
    """Capture and replay with ``device`` current (streams and graphs are per device); nothing off CUDA."""
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()
