"""A drafter's own forwards as captured calls: the static steps' graphs for what runs beside the backbone.

Once the backbone's step is a replayed graph (``static_steps``), what is left on the host each step is the
drafter: a Medusa head's residual blocks and projection, a Hydra / MLP-speculator level per tree depth, the
EAGLE-3 drafter's expansion over its own KV cache; a few dozen kernels launched one by one, each costing
more in Python than on the device. A method hands such a call to ``CapturedCalls.run`` with its tensor
inputs; the call is captured once per (name, input shapes) and replayed after that:

- its first run is eager (lazy caches such as a tree's level tables, and the host reads they need, happen
  there, not in a capture), then it is captured on a fixed copy of those inputs; its second run, the first
  replay on other inputs, is checked against the same call run eagerly (``graph_capture.outputs_agree``): a
  host value the capture froze makes the call run eagerly from then on, said in one line, never a wrong token.
  Capture and check so fall in a generation's first two steps, as the backbone's do: the two warm-up steps
  the choices (``choice=auto``, per-batch sizing) drop absorb both;
- ``rows``: the inputs' leading dimension is a batch; it is padded up to the static steps' batch bucket (with
  copies of the last real row, a valid input whatever the call computes) and the outputs cut back, so a batch
  that shrinks replays a smaller captured call instead of capturing one per batch size;
- a call that cannot be captured (a host read inside it) runs eagerly from then on, said in one line; the
  backbone's steps stay captured.

Everything a captured call reads must be an input or fixed for the life of the key: the name must change
whenever a host value the call closes over does (a tree, a setting). Outputs are copied before they are
returned: the next replay overwrites them.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from .graph_capture import cuda_capture, measured_capture, on_device, outputs_agree


@dataclass
class _Call:
    """One captured call: its fixed inputs, (replay, outputs) once captured, how often it ran."""

    inputs: list = field(default_factory=list)
    captured: Optional[tuple] = None
    runs: int = 0
    eager: bool = False            # capture failed or a replay disagreed: run eagerly from now on
    keep: object = None            # what the key's name stands for (a tree's buffers), kept alive with it


class CapturedCalls:
    """The drafter calls of one model's static steps (module docstring). ``owner``: its ``StaticSteps`` (the
    capture function, buckets, log and report)."""

    def __init__(self, owner):
        self.owner = owner
        self.captures: dict[str, int] = {}
        self.capture_s = 0.0
        self.graph_bytes = 0
        self.failed = self.checked = self.disagreed = 0
        self._calls: dict[tuple, _Call] = {}
        self._retired = weakref.WeakSet()   # ``keep`` objects released: calls still made for them run eagerly
        self._pool = None
        # one call at a time: two threads' replays of one graph would each read the other's fixed inputs or outputs
        self._lock = threading.RLock()

    def run(self, name: str, fn: Callable[..., Sequence[torch.Tensor]], inputs: Sequence[torch.Tensor],
            rows: Optional[int] = None, keep: object = None) -> tuple[torch.Tensor, ...]:
        """``fn(*inputs)`` (a tuple of tensors), captured under ``name`` and the inputs' shapes once it has run
        eagerly once; ``rows``: the real batch in the inputs' (and outputs') leading dimension."""
        with self._lock:
            return self._run(name, fn, inputs, rows, keep)

    def release(self, keep: object) -> None:
        """Drop the calls made with ``keep`` (a drafter cache replaced by a larger one): their graphs and fixed
        inputs go with it instead of living as long as the model (~0.5 GiB a cache at 32 lanes x 4,096 slots). A
        generation still running on it (another thread's) makes those calls eagerly: captured again under the
        same name, they would be a second capture."""
        with self._lock:
            self._retired.add(keep)
            for key in [k for k, call in self._calls.items() if call.keep is keep]:
                del self._calls[key]

    def _run(self, name, fn, inputs, rows, keep) -> tuple[torch.Tensor, ...]:
        capture = self.owner.capture
        if capture is None or (keep is not None and keep in self._retired):
            return tuple(fn(*inputs))
        size = rows
        if rows is not None:
            size = next((b for b in self.owner.buckets if b >= rows), None)
            if size is None:        # above the largest bucket: as the backbone's step, uncaptured
                return tuple(fn(*inputs))
        key = (name, size, tuple((tuple(x.shape[1:] if rows is not None else x.shape), x.dtype, x.device)
                                 for x in inputs))
        call = self._calls.get(key)
        if call is None:
            call = self._calls[key] = _Call(keep=keep)
        call.runs += 1
        if call.eager:
            return tuple(fn(*inputs))
        if call.captured is None:   # the first run: eager, then captured on its inputs (their side effects again)
            out = tuple(fn(*inputs))
            call.inputs = [x.new_empty((size, *x.shape[1:]) if rows is not None else x.shape) for x in inputs]
            self._fill(call, inputs, rows)
            call.captured = self._capture(self._label(name, size, key), lambda: tuple(fn(*call.inputs)),
                                          inputs[0].device)
            call.eager = call.captured is None
            return out
        self._fill(call, inputs, rows)
        replay, outs = call.captured
        with on_device(inputs[0].device):
            replay()
        real = [o[:rows] if rows is not None else o for o in outs]
        if call.runs == 2:     # the first replay on other inputs than the capture's: checked once
            real = self._checked(call, name, real, fn, rows)
        return tuple(o.clone() for o in real)

    def _label(self, name: str, size: Optional[int], key: tuple) -> str:
        """The report's name of a call: ``name``, ``@`` its batch bucket, and its input shapes where another call
        of that name already has the short one (a recapture of one key raises; two keys are two calls)."""
        label = name if size is None else f"{name}@{size}"
        if label in self.captures:
            label += "[" + ",".join("x".join(map(str, shape)) for shape, _, _ in key[2]) + "]"
        return label

    def _fill(self, call: _Call, inputs: Sequence[torch.Tensor], rows: Optional[int]) -> None:
        for fixed, x in zip(call.inputs, inputs):
            if rows is None:
                fixed.copy_(x)
            else:
                fixed[:rows].copy_(x)
                fixed[rows:].copy_(x[rows - 1:rows].expand_as(fixed[rows:]))

    def _checked(self, call: _Call, name: str, replayed: list, fn, rows: Optional[int]) -> list:
        """The replay against the call run eagerly on the same fixed inputs: a frozen host value shows here."""
        eager = [e[:rows] if rows is not None else e for e in fn(*call.inputs)]
        self.checked += 1
        if outputs_agree(replayed, eager):
            return replayed
        self.disagreed += 1
        call.eager, call.captured = True, None
        self.owner.log(f"graphs: the captured {name} call disagreed with the same call uncaptured; it runs "
                       "uncaptured")
        return eager

    def _capture(self, label: str, step, step_device: torch.device) -> Optional[tuple]:
        if label in self.captures:   # a captured call is replayed, never silently captured again
            raise RuntimeError(f"graphs: the {label} call would be captured a second time")
        capture = self.owner.capture
        if self._pool is None and capture is cuda_capture:
            self._pool = torch.cuda.graph_pool_handle()
        try:
            with on_device(step_device):
                captured, seconds, grown = measured_capture(capture, step, self._pool)
        except Exception as exc:    # this call stays eager; the backbone's steps keep their graphs
            self.failed += 1
            self.owner.log(f"graphs: capturing the {label} call failed ({type(exc).__name__}: {exc}); "
                           "it runs uncaptured")
            return None
        self.capture_s += seconds
        self.graph_bytes += grown
        self.captures[label] = 1
        return captured

    def summary(self) -> dict:
        """What report.json records of the captured calls."""
        return {"captures": dict(self.captures), "capture_s": round(self.capture_s, 4),
                "graph_memory_bytes": self.graph_bytes, "failed_captures": self.failed,
                "checked_replays": self.checked, "disagreeing_replays": self.disagreed}

