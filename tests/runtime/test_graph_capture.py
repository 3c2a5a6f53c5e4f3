"""``graph_capture.cuda_capture`` on CPU, against stand-ins for the CUDA pieces it calls (streams,
``torch.cuda.graph``): what it asks of the capture and what it leaves behind when a capture ends badly. The
capture itself runs in the gpu tier (tests/runtime/test_static_steps_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from inference.runtime import graph_capture


class FakeCuda:
    """The ``torch.cuda`` calls ``cuda_capture`` makes, recorded: ``current`` is the current stream; the capture
    context (``graph``) makes its own stream current, and its exit, like CUDA's ``capture_end``, raises
    ``end_raises`` (leaving the capture stream current, as torch's ``graph.__exit__`` does when it raises)."""

    def __init__(self, monkeypatch, end_raises: BaseException | None = None):
        fake = self

        class Stream:
            def __init__(self, name="side"):
                self.name = name

            def wait_stream(self, other):
                pass

        self.main, self.capturing = Stream("main"), Stream("capture")
        self.warmed_on = []   # the stream current during each eager warm-up run
        monkeypatch.setattr(graph_capture, "_STREAMS", {})   # a fake stream never outlives its test
        self.current, self.graph_kwargs, self.ended_pool, self.end_raises = self.main, None, [], end_raises

        class StreamCtx:
            def __init__(self, s):
                self.s = s

            def __enter__(self):
                self.saved, fake.current = fake.current, self.s

            def __exit__(self, *exc):
                fake.current = self.saved

        class Graph:
            def __init__(self, graph, **kwargs):
                fake.graph_kwargs = kwargs

            def __enter__(self):
                self.saved, fake.current = fake.current, fake.capturing

            def __exit__(self, *exc):
                if fake.end_raises is not None:
                    raise fake.end_raises
                fake.current = self.saved

        class CUDAGraph:
            def replay(self):
                pass

        for name, value in (("Stream", Stream), ("current_stream", lambda: fake.current),
                            ("stream", StreamCtx), ("graph", Graph), ("CUDAGraph", CUDAGraph),
                            ("set_stream", lambda s: setattr(fake, "current", s)), ("current_device", lambda: 0)):
            monkeypatch.setattr(torch.cuda, name, value, raising=False)
        monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", lambda dev, pool: fake.ended_pool.append(pool),
                            raising=False)


class Deadline(BaseException):
    """A signal's exception (benchmarks/gpu_check.py's part deadline): not an ``Exception``."""


def test_captures_in_thread_local_error_mode(monkeypatch):
    """Guards against capturing in CUDA's default "global" capture mode, where another thread's CUDA call during
    the capture (an NCCL watchdog polling its events) breaks it: the capture asks for "thread_local"."""
    fake = FakeCuda(monkeypatch)
    replay, outs = graph_capture.cuda_capture(lambda: (torch.ones(1),), pool="pool")
    side = graph_capture._STREAMS[0]
    assert fake.graph_kwargs == {"pool": "pool", "stream": side, "capture_error_mode": "thread_local"}
    assert fake.current is fake.main and torch.equal(outs[0], torch.ones(1))


def test_every_capture_warms_up_and_captures_on_one_kept_stream(monkeypatch):
    """Guards against a new torch.cuda.Stream() per capture: torch lends its pooled streams in turn and cuBLAS
    keeps a workspace per (handle, stream), allocated on each new stream's first matmul and counted as that
    graph's memory; the capture ran on torch's own default capture stream, not the one warmed up on."""
    fake = FakeCuda(monkeypatch)
    seen = []

    def step():
        seen.append(fake.current)
        return (torch.ones(1),)

    graph_capture.cuda_capture(step, pool="pool")
    graph_capture.cuda_capture(step, pool="pool")
    side = graph_capture._STREAMS[0]
    assert seen[0] is side and seen[2] is side and fake.graph_kwargs["stream"] is side


def test_a_host_read_is_refused_in_this_thread_only(monkeypatch):
    """Guards against torch's sync debugging as the warm-up's host-read check: one setting for the whole process,
    so another thread's ``.tolist()`` or ``.item()`` while this one warmed up a capture raised "called a
    synchronizing CUDA operation" and failed that thread's request. The guard is this thread's: a step's own
    read (item, a boolean index, nonzero, a copy to or from the host) is refused, another thread's is not."""
    import threading

    x = torch.arange(6.0)
    reads = [lambda: x[1].item(), lambda: bool(x[2]), lambda: x[x > 2], lambda: x.nonzero(), lambda: x.to("meta"),
             lambda: torch.zeros(2, device="meta").copy_(x[:2]), lambda: torch.repeat_interleave(x[:2].long())]
    for read in reads:
        with pytest.raises(graph_capture.HostReadInStep), graph_capture.HostReadGuard():
            read()
    # torch.tensor(values, device=...) copies below the dispatcher (torch's tensor_new.h, "torch.tensor, lift_fresh,
    # and device movement"): a mode sees the lift_fresh of a tensor already off the host, refused; on the host, not
    assert graph_capture._made_from_values("lift_fresh", (torch.empty(2, device="meta"),))
    assert not graph_capture._made_from_values("lift_fresh", (torch.empty(2),))
    with graph_capture.HostReadGuard():   # what a step does: device-side arithmetic and indexing by tensors
        y = (x * 2).index_select(0, torch.tensor([1, 2])) + x.new_full((2,), 3.0)
        z = torch.repeat_interleave(x[:2].long(), output_size=1)
    assert y.tolist() == [5.0, 7.0] and z.numel() == 1
    other = []
    with graph_capture.HostReadGuard():
        t = threading.Thread(target=lambda: other.append(x[3].item()))
        t.start()
        t.join()
    assert other == [3.0]

    fake = FakeCuda(monkeypatch)   # in the warm-up run, before any capture starts
    assert graph_capture.to_device(torch.arange(2), "cpu").dtype == torch.long
    with pytest.raises(graph_capture.HostReadInStep, match="_local_scalar_dense"):
        graph_capture.cuda_capture(lambda: (x[0].item(),), pool="pool")
    assert fake.graph_kwargs is None and fake.current is fake.main


def test_an_interrupted_capture_restores_the_stream_and_propagates_as_itself(monkeypatch):
    """Guards against an interrupt during a capture (the GPU check's per-part deadline, ^C) leaving the capture
    stream current and the pool allocating (every later CUDA call of the run then fails), or being turned into a
    "capture failed" that the static steps log and go on from: the stream is restored, the pool's allocation
    ended, and the interrupt itself propagates, also when the capture's end raises because of it."""
    calls = []

    def step():
        calls.append(1)
        if len(calls) == 2:     # the capture, after the eager warm-up run
            raise Deadline("part deadline")
        return (torch.ones(1),)

    for end_raises in (None, RuntimeError("operation not permitted when stream is capturing")):
        calls.clear()
        fake = FakeCuda(monkeypatch, end_raises)
        with pytest.raises(Deadline):
            graph_capture.cuda_capture(step, pool="pool")
        assert fake.current is fake.main and fake.ended_pool == ["pool"], end_raises
    fake = FakeCuda(monkeypatch, RuntimeError("capture failed"))   # a failure without an interrupt stays one
    with pytest.raises(RuntimeError, match="capture failed"):
        graph_capture.cuda_capture(lambda: (torch.ones(1),), pool="pool")
    assert fake.current is fake.main


def test_the_memory_around_a_capture_is_measured_under_the_capture_lock(monkeypatch):
    """Guards against measuring a graph's memory outside the one-capture-at-a-time lock: another thread's capture
    between this one's "before" and "after" readings was counted in both graphs' memory."""
    FakeCuda(monkeypatch)
    held = []
    for name in ("synchronize", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda: held.append(graph_capture._CAPTURING._is_owned()),
                            raising=False)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: held.append(graph_capture._CAPTURING._is_owned()) or 0,
                        raising=False)
    graph_capture.measured_capture(graph_capture.cuda_capture, lambda: (torch.ones(1),), pool="pool")
    assert len(held) == 5 and all(held)
    assert not graph_capture._CAPTURING._is_owned()
