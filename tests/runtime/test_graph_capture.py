"""``graph_capture.cuda_capture`` on CPU, against stand-ins for the CUDA pieces it calls (streams, the sync debug
mode, ``torch.cuda.graph``): what it asks of the capture and what it leaves behind when a capture ends badly. The
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
                            ("get_sync_debug_mode", lambda: 0), ("set_sync_debug_mode", lambda mode: None),
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
    assert fake.graph_kwargs == {"pool": "pool", "capture_error_mode": "thread_local"}
    assert fake.current is fake.main and torch.equal(outs[0], torch.ones(1))


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
