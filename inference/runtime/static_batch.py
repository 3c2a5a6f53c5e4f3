"""A batch's KV cache on the static buffer (``static_steps``): ``RaggedKVCache`` in compact mode, every row's
entries in the model's one fixed buffer, so a batched step can be captured like a single prompt's.

The bookkeeping (lengths, positions, valid slots, masks, the accepted nodes moved in place) is
``RaggedKVCache``'s own; what changes is where the keys and values live and how a forward reaches them:
``MedusaModel.hidden`` hands the step to ``StaticSteps.forward``, which pads the batch up to a bucket (padding
rows write to the reserved last slot and are cut off) and attends over the whole capacity. Rows that leave the
batch are dropped by moving the rows that stay to the front of the buffer (a copy, not a new tensor: captured
steps keep reading the same memory), so the next step runs in the bucket of the smaller batch.
"""

from __future__ import annotations

from typing import Sequence

import torch
from transformers.cache_utils import Cache

from .batch_cache import RaggedKVCache
from .graph_capture import to_device


class StaticRaggedKV(RaggedKVCache):
    """A compact ``RaggedKVCache`` of ``batch`` rows over ``steps``' buffer (module docstring)."""

    def __init__(self, steps, batch: int, capacity: int, generation: int):
        self.capacity, self.mode, self.device = capacity, "compact", steps.kv.device
        Cache.__init__(self, layers=steps.body_cache.layers)
        self.steps, self.generation = steps, generation
        self.lengths = torch.zeros(batch, dtype=torch.long, device=self.device)
        self.positions = torch.zeros(batch, dtype=torch.long, device=self.device)
        self.valid = torch.zeros(batch, capacity, dtype=torch.bool, device=self.device)
        self.host_lengths = [0] * batch
        self._pending = None
        self._first = True

    def check_current(self) -> None:
        self.steps.check_current(self.generation)

    def write_slots(self, n: int) -> tuple[torch.Tensor, bool]:
        """([B, n] slots the pending forward writes to, whether it is the prompts' forward)."""
        w = self._pending
        slots = w.slots if w.start is None else torch.arange(w.start, w.start + n, device=self.device)[None]
        return slots, self._first

    def advance(self, n: int) -> None:
        self._first = False

    def prefill_mask(self, lengths: Sequence[int], dtype: torch.dtype):
        self.check_current()
        self._first = True
        return super().prefill_mask(lengths, dtype)

    def select_rows(self, index: Sequence[int]) -> None:
        """Keep only rows ``index`` (in that order), moved to the front of the buffer."""
        self.check_current()
        index = list(index)
        idx = to_device(index, self.device, torch.long)
        kv = self.steps.kv
        if index == sorted(index):   # rows move only towards the front: one row at a time, no copy of the buffer
            for i, j in enumerate(index):
                if i != j:   # its entries only (compact: [0, length)); the capacity beyond holds nothing read
                    used = self.host_lengths[j]
                    kv[:, :, i, :, :used].copy_(kv[:, :, j, :, :used])
        else:
            kv[:, :, :len(idx)] = kv.index_select(2, idx)
        self.lengths, self.positions, self.valid = self.lengths[idx], self.positions[idx], self.valid[idx]
        self.host_lengths = [self.host_lengths[i] for i in index]
