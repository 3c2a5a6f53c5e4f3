"""KV cache for batched tree decoding: one preallocated buffer, one write offset per row.

Rows of a batch accept different numbers of draft tokens each step, so after a few steps
their real lengths differ. Two ways to keep them in one [B, H, capacity, D] buffer:

``compact`` (default)  every row writes its next tokens at its own offset (``lengths[b]``) and
               keeps its accepted nodes in place there. Slots hold exactly the row's tokens
               in order, so a token's position id is its slot. The cost over batch 1 is that
               appends are a scatter (B x n rows per layer) instead of one slice copy.
``gaps``       every row writes at the same offset (the longest row's); a row that accepted
               fewer tokens than the longest leaves masked slots behind. Appends are slice
               copies, but every later step attends over the gaps too and the buffer must hold
               them (up to depth + 1 slots per generated token).

``valid[b, s]`` says which slots row b's later tokens may attend to; the step's own nodes are
placed by ``step_mask`` (the tree mask at each row's offset). Prompts are prefilled right-padded
in compact mode (pads sit past the row's length and are overwritten) and left-padded in gaps
mode (pads are never valid); position ids count real tokens only (``positions``) in both.
Measured (benchmarks/history.md "Batched decoding", SmolLM2-135M, 2 CPU cores, 96 new tokens): gaps / compact
tokens/s 1.02x and 1.07x with a 2-node chain at B = 4 and 16 (a rejected chain leaves one gap slot),
0.97x and 0.92x with a 4-node tree (gaps widen attention by 27-38% and keep growing with the
generation). Compact is the default: never far behind, and bounded in time and memory.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from transformers.cache_utils import Cache, DynamicLayer

from ..errors import UserError
from .graph_capture import to_device

RAGGED_MODES = ("compact", "gaps")


class _RowLayer(DynamicLayer):
    """One layer's keys/values in a [B, H, capacity, D] buffer; writes go to the owner's pending slots."""

    def __init__(self, owner: "RaggedKVCache"):
        super().__init__()
        self.owner = owner
        self._k = self._v = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, dk = key_states.shape
        dv = value_states.shape[-1]
        self.device = key_states.device
        self._k = torch.zeros(b, h, self.owner.capacity, dk, dtype=key_states.dtype, device=self.device)
        self._v = torch.zeros(b, h, self.owner.capacity, dv, dtype=value_states.dtype, device=self.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        w = self.owner._pending
        if w.start is not None:                      # every row writes at the same offset
            self._k[:, :, w.start:w.start + key_states.shape[2]] = key_states
            self._v[:, :, w.start:w.start + key_states.shape[2]] = value_states
        else:                                         # per-row offsets: [B, n] slots
            rows = w.rows[:, None]
            self._k[rows, :, w.slots] = key_states.transpose(1, 2)
            self._v[rows, :, w.slots] = value_states.transpose(1, 2)
        self.keys = self._k[:, :, :w.width]
        self.values = self._v[:, :, :w.width]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.owner._pending.width if self.owner._pending is not None else max(self.owner.host_lengths)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner._pending.width, 0

    def get_max_length(self) -> int:
        return self.owner.capacity

    def move(self, rows: torch.Tensor, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self.is_initialized:   # advanced indexing reads before it writes: overlap is safe
            self._k[rows, :, dst] = self._k[rows, :, src]
            self._v[rows, :, dst] = self._v[rows, :, src]

    def select(self, index: torch.Tensor) -> None:
        if self.is_initialized:
            self._k, self._v = self._k[index], self._v[index]


class _Pending:
    """Where the next forward writes: one shared start, or [B, n] slots; and the key width it sees."""

    def __init__(self, width: int, start: Optional[int] = None, rows=None, slots=None):
        self.width, self.start, self.rows, self.slots = width, start, rows, slots


class RaggedKVCache(Cache):
    """A batch's KV cache with a length per row (module docstring). Drive it with ``prefill_mask`` /
    ``step_mask`` (which also say where the next forward writes), then ``keep`` the accepted nodes."""

    def __init__(self, num_layers: int, batch: int, capacity: int, device, mode: str = "compact"):
        if mode not in RAGGED_MODES:
            raise UserError(f"ragged must be one of {', '.join(RAGGED_MODES)}, got {mode!r}")
        if capacity < 1 or batch < 1:
            raise UserError(f"a batch KV cache needs batch >= 1 and capacity >= 1, got {batch}, {capacity}")
        self.capacity, self.mode, self.device = capacity, mode, torch.device(device)
        super().__init__(layers=[_RowLayer(self) for _ in range(num_layers)])
        self.lengths = torch.zeros(batch, dtype=torch.long, device=self.device)    # slots in use per row
        self.positions = torch.zeros(batch, dtype=torch.long, device=self.device)  # real tokens per row
        self.valid = torch.zeros(batch, capacity, dtype=torch.bool, device=self.device)
        self.host_lengths = [0] * batch   # ``lengths`` on the host: a step is laid out without reading the device
        self._pending: Optional[_Pending] = None

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    # -- before a forward ------------------------------------------------------------------
    def prefill_mask(self, lengths: Sequence[int], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Lay out prompts of ``lengths`` (right-padded in compact mode, left-padded in gaps mode)
        from slot 0. Returns (the [B, 1, L, L] additive mask, the [B, L] position ids); the padded
        token ids must follow ``pad_layout``."""
        lens = to_device(list(lengths), self.device, torch.long)
        width = max(lengths)
        if width > self.capacity:
            raise RuntimeError(f"KV cache overflow: {width} > capacity {self.capacity}")
        s = torch.arange(width, device=self.device)
        if self.mode == "compact":
            real = s[None] < lens[:, None]                       # [B, L]
            # pads (masked, never valid) at position 0, as in gaps mode: a rotary that reads a row's largest
            # position (LongRoPE's switch, runtime/rope_switch.py) then reads its prompt's last
            pos = torch.where(real, s[None], 0)
            self.lengths, self.host_lengths = lens.clone(), list(lengths)
        else:
            pad = width - lens
            real = s[None] >= pad[:, None]
            pos = (s[None] - pad[:, None]).clamp(min=0)
            self.lengths, self.host_lengths = torch.full_like(lens, width), [width] * len(lengths)
        self.positions = lens.clone()
        self.valid.zero_()
        self.valid[:, :width] = real
        see = (s[None, :] <= s[:, None])[None] & real[:, None, :]  # causal, real keys only
        see |= torch.eye(width, dtype=torch.bool, device=self.device)[None]  # pad queries see themselves (no NaN)
        self._pending = _Pending(width, start=0)
        return _additive(see, dtype), pos

    def step_mask(self, tree_mask: torch.Tensor, depth: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """For a step of n nodes per row (``tree_mask`` [n, n] or [B, n, n], ``depth`` [n] or [B, n]):
        (the [B, 1, n, W] additive mask: each row's valid slots plus its tree at its own offset,
        the [B, n] position ids)."""
        b = self.batch
        n = tree_mask.shape[-1]
        offsets = self.lengths[:, None] + torch.arange(n, device=self.device)     # [B, n]
        width = max(self.host_lengths) + n
        if width > self.capacity:
            raise RuntimeError(f"KV cache overflow: {width} > capacity {self.capacity}")
        see = self.valid[:, None, :width].expand(b, n, width).clone()
        see.scatter_(2, offsets[:, None, :].expand(b, n, n), tree_mask.expand(b, n, n))
        if len(set(self.host_lengths)) == 1:
            self._pending = _Pending(width, start=self.host_lengths[0])
        else:
            self._pending = _Pending(width, rows=torch.arange(b, device=self.device), slots=offsets)
        return _additive(see, dtype), self.positions[:, None] + depth

    # -- after a forward -------------------------------------------------------------------
    def keep(self, paths: Sequence[Sequence[int]]) -> None:
        """Keep, in each row, its accepted nodes ``paths[b]`` (offsets into the step's nodes, root
        first, increasing) right after its earlier tokens; forget the rest of the step."""
        counts = to_device([len(p) for p in paths], self.device, torch.long)
        moved = [b for b, p in enumerate(paths) if list(p) != list(range(len(p)))]
        if moved:   # only rows whose accepted nodes are not already in place
            most = max(len(paths[b]) for b in moved)
            src = torch.zeros(len(moved), most, dtype=torch.long)
            for i, b in enumerate(moved):
                p = list(paths[b])
                src[i, :len(p)] = torch.tensor(p)   # padding repeats node 0, which stays in place
            rows = to_device(moved, self.device, torch.long)
            base = self.lengths[rows][:, None]
            src = src.to(self.device) + base
            dst = torch.arange(most, device=self.device)[None] * (src != base) + base
            for layer in self.layers:
                layer.move(rows[:, None], dst, src)
        n = self._pending.width - max(self.host_lengths)
        s = torch.arange(n, device=self.device)[None]
        slots = self.lengths[:, None] + s
        self.valid.scatter_(1, slots, s < counts[:, None])
        self.lengths = self.lengths + counts
        self.positions = self.positions + counts
        self.host_lengths = [a + len(p) for a, p in zip(self.host_lengths, paths)]
        if self.mode == "gaps":   # every row continues at the longest row's end; the rest are gaps
            longest = max(self.host_lengths)
            self.lengths, self.host_lengths = torch.full_like(self.lengths, longest), [longest] * self.batch
        self._pending = None

    def truncate_rows(self, lengths: Sequence[int]) -> None:
        """Compact mode: row b keeps at most its first ``lengths[b]`` tokens (a draft model's rejected drafts); the
        lengths are host numbers, as ``host_lengths``, so nothing is read from the device."""
        if self.mode != "compact":
            raise ValueError("truncate_rows needs a compact cache")
        self.host_lengths = [min(a, n) for a, n in zip(self.host_lengths, lengths)]
        new = to_device(self.host_lengths, self.device, self.lengths.dtype)
        self.valid &= torch.arange(self.capacity, device=self.device)[None] < new[:, None]
        self.lengths, self.positions = new, new.clone()

    def select_rows(self, index: Sequence[int]) -> None:
        """Keep only rows ``index`` (in that order): finished rows leave the batch."""
        idx = to_device(list(index), self.device, torch.long)
        for layer in self.layers:
            layer.select(idx)
        self.lengths, self.positions, self.valid = self.lengths[idx], self.positions[idx], self.valid[idx]
        self.host_lengths = [self.host_lengths[i] for i in index]

    def row_entries(self, b: int, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Row b's attended keys and values of ``layer`` ([H, T, D] each, T = its real tokens), in order."""
        slots = self.valid[b].nonzero()[:, 0]
        lay = self.layers[layer]
        return lay._k[b][:, slots], lay._v[b][:, slots]


def pad_layout(prompts: Sequence[Sequence[int]], mode: str, pad_id: int = 0) -> list[list[int]]:
    """The prompts as ``RaggedKVCache.prefill_mask`` lays them out: right-padded (compact) or left-padded (gaps)."""
    width = max(len(p) for p in prompts)
    if mode == "compact":
        return [list(p) + [pad_id] * (width - len(p)) for p in prompts]
    return [[pad_id] * (width - len(p)) + list(p) for p in prompts]


def _additive(see: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    mask = torch.zeros(see.shape, dtype=dtype, device=see.device)
    return mask.masked_fill_(~see, torch.finfo(dtype).min)[:, None]
