"""Counting what makes the host wait for the device (a test support module).

On a GPU a step's host work runs ahead of the device until it reads a value back: then it waits for every
kernel queued before, and nothing is queued while Python decides what to do next. A CUDA capture refuses the
same reads. ``HostReads`` counts them on any device, so a CPU test can hold a step to its reads."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

READ_METHODS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")
SHAPE_FROM_VALUES = ("nonzero", "masked_select", "unique", "_unique2", "unique_consecutive", "unique_dim")


class HostReads(TorchDispatchMode):
    """Counts, while active, the tensor reads into Python (``.item()``, ``.tolist()``, ``int()`` / ``bool()`` /
    ``float()`` of a tensor, a tensor used as a Python index) and the ops whose output shape depends on the
    values (``nonzero``, a boolean index, ``repeat_interleave`` of a tensor of counts without ``output_size``,
    ``unique``): each one waits for the device on a GPU. ``count``; ``seen``: their names, in order;
    ``take()``: the count since the last take."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []
        self._taken = 0
        self._saved = {}

    @property
    def count(self) -> int:
        return len(self.seen)

    def take(self) -> int:
        n, self._taken = self.count - self._taken, self.count
        return n

    def __enter__(self):
        self._saved = {name: getattr(torch.Tensor, name) for name in READ_METHODS}
        for name, fn in self._saved.items():
            setattr(torch.Tensor, name, self._reading(name, fn))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(torch.Tensor, name, fn)
        return super().__exit__(*exc)

    def _reading(self, name, fn):
        def read(*args, **kwargs):
            self.seen.append(name)
            return fn(*args, **kwargs)
        return read

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in SHAPE_FROM_VALUES:
            self.seen.append(name)
        elif (name == "repeat_interleave" and func._overloadname in ("Tensor", "self_Tensor")
              and kwargs.get("output_size") is None):
            self.seen.append(name)
        elif name in ("index", "index_put", "index_put_") and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]):
            self.seen.append(f"{name}[bool]")
        return func(*args, **kwargs)
