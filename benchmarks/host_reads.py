"""Counting what makes the host wait for the device (the tests and `bench.py host-work` use it).

On a GPU a step's host work runs ahead of the device until it reads a value back: then it waits for every
kernel queued before, and nothing is queued while Python decides what to do next. A CUDA capture refuses the
same reads. ``HostReads`` counts them on any device, so a CPU test can hold a step to its reads."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# read into Python. The Tensor methods are counted where Python calls them (on CPU, ``int()`` of a tensor reaches
# no dispatch); ``torch.equal`` / ``allclose`` (a Python bool) and a read from C++ where they dispatch
READ_METHODS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")
READS = {"_local_scalar_dense": "item", "equal": "equal", "allclose": "allclose"}
SHAPE_FROM_VALUES = ("nonzero", "masked_select", "unique", "_unique2", "unique_consecutive", "unique_dim")


class HostReads(TorchDispatchMode):
    """Counts, while active, the tensor reads into Python (``.item()``, ``.tolist()``, ``int()`` / ``bool()`` /
    ``float()`` of a tensor, a tensor used as a Python index, ``torch.equal`` / ``allclose``) and the ops whose
    output shape depends on the values (``nonzero``, a boolean index, ``repeat_interleave`` of a tensor of counts
    without ``output_size``, ``unique``): each one waits for the device on a GPU. ``count``; ``seen``: their
    names, in order; ``take()``: the count since the last take."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []
        self._taken = 0
        self._saved = {}
        self._reading = False     # inside a counted Tensor method: what it dispatches is that one read

    @property
    def count(self) -> int:
        return len(self.seen)

    def take(self) -> int:
        n, self._taken = self.count - self._taken, self.count
        return n

    def __enter__(self):
        self._saved = {name: getattr(torch.Tensor, name) for name in READ_METHODS}
        for name, fn in self._saved.items():
            setattr(torch.Tensor, name, self._counted(name, fn))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(torch.Tensor, name, fn)
        return super().__exit__(*exc)

    def _counted(self, name, fn):
        def read(*args, **kwargs):
            if self._reading:
                return fn(*args, **kwargs)
            self.seen.append(name)
            self._reading = True
            try:
                return fn(*args, **kwargs)
            finally:
                self._reading = False
        return read

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in READS:
            if not self._reading:
                self.seen.append(READS[name])
        elif name in SHAPE_FROM_VALUES:
            self.seen.append(name)
        elif (name == "repeat_interleave" and func._overloadname in ("Tensor", "self_Tensor")
              and kwargs.get("output_size") is None):
            self.seen.append(name)
        elif name in ("index", "index_put", "index_put_") and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]):
            self.seen.append(f"{name}[bool]")
        return func(*args, **kwargs)
