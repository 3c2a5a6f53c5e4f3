"""Static-shape backbone steps, captured as CUDA graphs on a GPU (``graphs=``).

On a GPU a decoding step of a small or mid-size backbone is bound by the host: transformers' forward
launches ~1,200-1,500 kernels one by one from Python, each step 9-14x its own kernel time (measured on an
H200 at SmolLM2's shape: 18-41 ms wall for 2-6 ms of kernels). Serving engines replay a step captured once as
a CUDA graph, which needs every tensor a step reads or writes at a fixed address and shape. This module
gives the backbone forward that form, under the same ``MedusaModel.hidden`` contract every decoding method
already uses, so every method steps through it unchanged, one prompt at a time (plain, Medusa trees,
EAGLE-3's verification, draft models, lookahead, prompt lookup) or batched (``static_batch``):

- one KV buffer [layers, 2, batch, kv_heads, capacity, head_dim] per model, zero-filled (attention reads all
  of it: an uninitialised NaN would poison every row through the additive mask), the last slot reserved
  as the write target of padding;
- a step of B sequences x n rows runs in the smallest (batch, rows) bucket holding it (``DEFAULT_BUCKETS``
  for both): input ids, positions, the [Bb, 1, nb, capacity] additive mask and the write slots are device
  tensors of that bucket's shape, filled in place before the step; padding writes to the reserved slot, sees
  only slot 0 (a finite softmax) and is cut off before anything downstream reads the output, so it can never
  be accepted; a generation's first forward (its prompts: once per request, and prompts of every length
  would capture every bucket) and steps larger than every bucket run uncaptured on the same buffer;
- attention always spans the whole capacity, masked: that is what makes the shape static;
- acceptance and compaction stay the method's (``keep``: one gather over every layer at once); a greedy step's
  one host read is its verdict, and a step that fills its bucket exactly (the plain loop's) skips the padding's
  fills: on a GPU what runs on the host between two replays is what the device waits for.

``graphs``: ``auto`` (captured on CUDA, off elsewhere), ``on`` (captured; CUDA only), ``off`` (the dynamic-shape
``TreeKVCache`` / ``RaggedKVCache`` path), ``uncaptured`` (these static shapes without capture, on any device: what
``on`` computes, for checking and for the CPU tests; on 2 CPU cores it costs 2-5% of a step, within the noise:
BENCHMARKS.md). A bucket is captured at its first step and never again while the buffer stands (``captures``
counts); a request the buffer cannot hold gets a new one (sized to the request, capacity rounded up by at most 12.5%
and at least 1.25x the old one, the old dimensions kept only where that costs at most twice as much; the graphs are
dropped and recaptured, said in one line) unless the capacity was fixed, the batch is above the largest bucket or
the memory is not there, in which case that request decodes on the dynamic path with a one-line warning. A capture
that fails (a host read inside the step, refused by ``graph_capture.HostReadGuard`` before the capture opens) turns
capture off for the model (one line; the static steps go on uncaptured), never a wrong token; a captured step whose
first replay on new inputs disagrees with the same step run eagerly runs uncaptured (each is checked so, once).
"""

from __future__ import annotations

import threading
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from ..errors import UserError
from .captured_calls import CapturedCalls
from .graph_capture import cuda_capture, measured_capture, on_device, outputs_agree, to_device
from .static_batch import StaticRaggedKV

GRAPH_MODES = ("auto", "on", "off", "uncaptured")
# 128: a 64-node EAGLE-3 tree verifies 65 rows (its root too), a 64-node tree with a prompt-lookup graft more; only
# the buckets a run's steps use are captured, so a larger one costs nothing until a step needs it
DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
MIN_CAPACITY = 256
# The largest step any method's bounds allow: lookahead's 1 + (N-1)(W+G) rows at N=16, W=G=64 (methods/lookahead.py;
# Medusa trees hold at most 256 nodes, EAGLE-3's 256 + 1 + 64 lookup tokens, a draft chain 65).
MAX_STEP_ROWS = 1 + (16 - 1) * (64 + 64)
# The largest graph bucket: the power of two holding that step (2048). A bucket is both a row count (a step's rows,
# the prompt's first forward's too, padded up to it) and a batch size (the batch padded up to it), so a larger one
# only allocates [bucket, capacity] masks and buffers (graph_buckets=[1,2,10**8]: 100 GB) for nothing; a batch above
# the largest bucket decodes on the dynamic cache (module docstring).
MAX_BUCKET = 1 << (MAX_STEP_ROWS - 1).bit_length()


def rounded_capacity(slots: int, minimum: int, grown_from: int = 0) -> int:
    """Slots of a static cache made for ``slots``: rounded up in eighths of an octave (at most 12.5% more), at
    least ``minimum``, and at least 1.25x ``grown_from`` (the buffer it replaces), so that growing requests
    regrow it (dropping every graph) a few times, not once per request. Powers of two wasted up to half of it,
    and every step attends over all of it: 4,096 slots for 2,370 needed, 16 GiB of KV read per step at 32
    rows of Llama-3.1-8B's shape, by arithmetic."""
    slots = max(slots, minimum, (grown_from * 5 + 3) // 4)
    grain = 1 << max(0, (slots - 1).bit_length() - 4)   # (2^k, 2^(k+1)] in steps of 2^(k-3)
    return -(-slots // grain) * grain


def graphs_mode(mode) -> str:
    """``mode`` as one of ``GRAPH_MODES``: a command line's ``graphs=on`` / ``off`` reach the config as YAML's
    booleans (True / False, or their words once the key's type made them strings)."""
    return {True: "on", False: "off", "True": "on", "False": "off"}.get(mode, mode)


def check_graphs(mode: str, buckets: Sequence[int] = DEFAULT_BUCKETS, device: Optional[str] = None) -> None:
    """Refuse, in one line and before any model loads, a graphs mode or bucket list that cannot run."""
    mode = graphs_mode(mode)
    if mode not in GRAPH_MODES:
        raise UserError(f"graphs must be one of {', '.join(GRAPH_MODES)}, got {mode!r}")
    if (not isinstance(buckets, (list, tuple)) or not buckets
            or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in buckets)
            or any(a >= b for a, b in zip(buckets, buckets[1:]))):
        raise UserError(f"graph_buckets must be a strictly increasing list of row counts >= 1, got {buckets!r}")
    if buckets[-1] > MAX_BUCKET:
        raise UserError(f"graph_buckets must be at most {MAX_BUCKET} (rows per step and batch sizes are padded up "
                        f"to their bucket; the largest step any method verifies is {MAX_STEP_ROWS} rows), "
                        f"got {buckets[-1]}")
    if mode == "on" and device is not None and not str(device).startswith("cuda"):
        raise UserError(f"graphs=on captures CUDA graphs: it needs device=cuda (this run decodes on {device}); "
                        "give graphs=uncaptured for the same static-shape steps without capture")
    if mode == "on" and not torch.cuda.is_available():
        raise UserError("graphs=on captures CUDA graphs, but no CUDA device is available: give graphs=off or "
                        "graphs=uncaptured")


def captures_on(mode: str, device: torch.device) -> Optional[bool]:
    """None: dynamic-shape steps (off); False: static shapes uncaptured; True: captured."""
    if mode == "off" or (mode == "auto" and device.type != "cuda"):
        return None
    return mode != "uncaptured"


class _StaticLayer(DynamicLayer):
    """One layer's keys/values: the owner's full-capacity [batch, kv_heads, capacity, head_dim] buffers, written
    at the owner's write slots (rows [Bb, 1], slots [Bb, n]); attention sees the step's Bb rows whole."""

    def __init__(self, owner: "StaticSteps", index: int):
        super().__init__()
        self.owner = owner
        self.keys, self.values = owner.kv[index, 0], owner.kv[index, 1]
        self._k, self._v = self.keys, self.values          # RaggedKVCache's names (row_entries, move)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        rows, slots = self.owner.write_rows, self.owner.write_slots
        self.keys[rows, :, slots] = key_states.transpose(1, 2)
        self.values[rows, :, slots] = value_states.transpose(1, 2)
        b = rows.shape[0]
        return self.keys[:b], self.values[:b]

    def move(self, rows: torch.Tensor, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.keys[rows, :, dst] = self.keys[rows, :, src]
        self.values[rows, :, dst] = self.values[rows, :, src]

    def get_seq_length(self) -> int:
        return self.owner.kv.shape[4]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.kv.shape[4], 0


class StaticKV:
    """One generation's view of its model's static KV buffer (row 0): the ``TreeKVCache`` interface decoders
    use (``length``, ``keep``, ``truncate``). A newer generation on the same model takes the buffer over; a
    step through an older view is refused (it would read another sequence's entries)."""

    def __init__(self, steps: "StaticSteps", capacity: int, generation: int):
        self.steps, self.capacity, self.generation = steps, capacity, generation
        self.length = 0

    def check_current(self) -> None:
        self.steps.check_current(self.generation)

    def write_slots(self, n: int) -> tuple[torch.Tensor, bool]:
        """([1, n] slots the next n rows write to, whether it is the generation's first forward)."""
        if self.length + n > self.capacity:
            raise RuntimeError(f"KV cache overflow: {self.length + n} > capacity {self.capacity}")
        return torch.arange(self.length, self.length + n, device=self.steps.kv.device)[None], self.length == 0

    def advance(self, n: int) -> None:
        self.length += n

    def keep(self, start: int, nodes: Sequence[int]) -> None:
        """Keep the first ``start`` entries plus tree nodes ``nodes`` (offsets from ``start``, increasing)."""
        self.check_current()
        count = len(nodes)
        if list(nodes) != list(range(count)):   # else already in place
            src = to_device([start + i for i in nodes], self.steps.kv.device, torch.long)
            row = self.steps.kv[:, :, :1]
            row[:, :, :, :, start:start + count] = row.index_select(4, src)   # every layer at once
        self.length = start + count

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)


@dataclass
class _Bucket:
    """A (batch, rows) bucket's fixed input tensors, and its captured step per tap (None: no aux features)."""

    ids: torch.Tensor      # [Bb, n]
    pos: torch.Tensor      # [Bb, n]
    mask: torch.Tensor     # [Bb, 1, n, capacity]
    rows: torch.Tensor     # [Bb, 1]: 0..Bb-1
    slots: torch.Tensor    # [Bb, n]: where each row's entries are written
    replays: dict = field(default_factory=dict)   # tap key -> (replay, outputs) or None (capture failed)
    uses: dict = field(default_factory=dict)      # tap key -> replays so far (the second one is checked)


class StaticSteps:
    """A model's static KV buffer and its bucketed steps (module docstring). ``capture``: a function
    (fn, pool) -> (replay, outputs) or None (uncaptured); ``capacity``: fixed KV slots, else grown. Batch
    sizes are bucketed like rows (``buckets``); a batch above the largest decodes on the dynamic cache."""

    def __init__(self, m, buckets: Sequence[int] = DEFAULT_BUCKETS, capture: Optional[Callable] = None,
                 capacity: Optional[int] = None, log: Callable[[str], None] = print):
        check_graphs("auto", list(buckets))
        self.m, self.buckets, self.capture, self.log = m, tuple(buckets), capture, log
        self.fixed_capacity = capacity
        self.kv: Optional[torch.Tensor] = None       # [layers, 2, batch, kv_heads, capacity, head_dim]
        self.write_rows = self.write_slots = None
        self.generation = 0
        self.captures: dict[str, int] = {}        # step ("rows", "BxN", "+aux") -> captures while the buffer stands
        self.capture_s = 0.0
        self.graph_bytes = 0
        self.regrown = self.fallbacks = self.failed = self.checked = self.disagreed = self.oversized = 0
        self._oversized_seen: set = set()
        self._buckets: dict[tuple[int, int], _Bucket] = {}
        self._blocks: dict = {}       # small constant masks, made once
        self._pool = None
        self.calls = CapturedCalls(self)   # the drafter's own forwards, captured beside the steps
        self.kept: dict = {}   # buffers a method's captured calls read (a drafter's cache): as long-lived as the calls
        self.siblings: dict = {}   # key -> the static steps of a model decoding beside this one (a self-draft)
        # every draft model's static steps made here, while its model lives: report.json counts their captures too
        self.drafts: list = []   # weak references, in the order made
        self.whose = "this request"   # what a fallback warning names ("the draft model", in a sibling's)
        self.unfit: Optional[str] = None   # "" once the backbone's cache is seen to fit the buffer, else what it holds
        # The buffer's current generation: its view (weakly: a finished generation's view is gone) and its thread.
        # Another thread's request meanwhile decodes on the dynamic cache: a takeover between two of the first
        # one's steps would hand each the other's entries (a step's check and its writes are not one operation).
        self._holder: Optional[tuple] = None
        self._holding = threading.Lock()

    def check_current(self, generation: int) -> None:
        """Refuse a step through a view of an older generation (a newer one took the buffer over)."""
        if generation != self.generation:
            raise RuntimeError("two generations are decoding on one model's static KV cache at once; "
                               "finish one before starting another (or decode with graphs=off)")

    def sibling(self, other) -> "StaticSteps":
        """Static steps for another model decoding beside this one (a draft model): the same buckets and
        capture, its own buffer."""
        steps = StaticSteps(other, self.buckets, self.capture, self.fixed_capacity, self.log)
        steps.whose = "the draft model"   # the target warns for the request; the draft's own line says it is its own
        self.drafts = [r for r in self.drafts if r() is not None] + [weakref.ref(steps)]
        return steps

    # -- the buffer ----------------------------------------------------------------------------------
    def cache(self, need: int) -> Optional[StaticKV]:
        """A view for a generation of at most ``need`` entries, or None where a fixed capacity is too small (or
        another thread's generation holds the buffer)."""
        return self._take(lambda: StaticKV(self, need, self._next()), need + 1, 1)

    def batch_cache(self, batch: int, need: int):
        """A ``RaggedKVCache`` (compact) over the buffer's first ``batch`` rows, or None beyond its limits (or
        another thread's generation holds the buffer)."""
        return self._take(lambda: StaticRaggedKV(self, batch, need, self._next()), need + 1, batch)

    def _take(self, view: Callable, slots: int, batch: int):
        """The buffer for a new generation made by ``view()``, or None: it decodes on the dynamic cache. Another
        thread's live generation keeps it, and so does a stream of this thread suspended between its steps
        (``decode.handed_out``: two streams read in turn by one thread, an asyncio server's pattern, had the first
        die mid-answer); this thread's other older generation (a decoder stepped by hand, a timing's) is taken over,
        a step through it then refused."""
        with self._holding:
            held = self._holder[0]() if self._holder is not None else None
            other = self._holder is not None and self._holder[1] != threading.get_ident()
            if held is not None and (other or getattr(held, "in_stream", False)):
                self.fallbacks += 1
                whom = "another thread" if other else "an unfinished stream"
                warnings.warn(f"graphs: {whom} is decoding on this model's static KV buffer: {self.whose} "
                              "decodes uncaptured on the dynamic cache", stacklevel=4)
                return None
            if not self._reserve(slots, batch):
                return None
            made = view()
            self._holder = (weakref.ref(made), threading.get_ident())
            return made

    def bytes_needed(self, batch: int, need: int) -> int:
        """Bytes a batch of ``batch`` rows of ``need`` entries would allocate here: 0 where the buffer already
        holds it, -1 where it would decode on the dynamic cache (the caller counts that), else the new buffer's."""
        slots = need + 1
        rows, _ = self._limit(slots, batch)
        if rows is None or not self._fits():
            return -1
        if self.kv is not None and slots <= self.kv.shape[4] and rows <= self.kv.shape[2]:
            return 0
        capacity, size = self._dims(slots, rows)
        layers, kv_heads, head_dim = self._layout()
        return size * capacity * layers * 2 * kv_heads * head_dim * torch.empty((), dtype=self._dtype()).element_size()

    def _limit(self, slots: int, batch: int) -> tuple[Optional[int], str]:
        """(the batch bucket of ``batch`` rows of ``slots`` entries, "") or (None, what goes beyond the limits)."""
        if self.fixed_capacity is not None and slots > self.fixed_capacity:
            return None, f"{slots} KV slots, beyond the fixed capacity {self.fixed_capacity}"
        rows = next((b for b in self.buckets if b >= batch), None)
        beyond = f"a batch of {batch}, beyond the largest graph bucket {self.buckets[-1]}"
        return rows, "" if rows is not None else beyond

    def _dims(self, slots: int, rows: int) -> tuple[int, int]:
        """(capacity, batch rows) of a new buffer for ``slots`` x ``rows``: the request's own size (capacity rounded:
        ``rounded_capacity``), or the old buffer's larger dimensions kept where that costs at most twice as much."""
        grown_from = self.kv.shape[4] if self.kv is not None and slots > self.kv.shape[4] else 0   # outgrown
        capacity = self.fixed_capacity or rounded_capacity(slots, MIN_CAPACITY, grown_from)
        if self.kv is None:
            return capacity, rows
        kept = max(capacity, self.kv.shape[4]), max(rows, self.kv.shape[2])
        return kept if kept[0] * kept[1] <= 2 * capacity * rows else (capacity, rows)

    def _next(self) -> int:
        self.generation += 1
        return self.generation

    def _reserve(self, slots: int, batch: int) -> bool:
        """A buffer of at least ``slots`` entries (+ the padding slot) for ``batch`` rows, grown if need be."""
        rows, beyond = self._limit(slots, batch)
        if not self._fits():
            self.fallbacks += 1
            return False
        if rows is None:
            self.fallbacks += 1
            warnings.warn(f"graphs: {self.whose} needs {beyond}: it decodes uncaptured on the dynamic cache",
                          stacklevel=5)
            return False
        if self.kv is None or slots > self.kv.shape[4] or rows > self.kv.shape[2]:
            try:
                self._allocate(*self._dims(slots, rows))
            except (torch.OutOfMemoryError, RuntimeError) as e:
                # CUDA says OutOfMemoryError; the CPU allocator (graphs=uncaptured) a RuntimeError naming it
                if not isinstance(e, torch.OutOfMemoryError) and "can't allocate memory" not in str(e):
                    raise
                self.kv, self.fallbacks = None, self.fallbacks + 1
                self.generation += 1      # a view of the freed buffer is refused, not read
                warnings.warn(f"graphs: no memory for a static KV buffer of {rows} x {slots} slots: {self.whose} "
                              "decodes uncaptured on the dynamic cache", stacklevel=5)
                return False
        return True

    def _allocate(self, capacity: int, batch: int) -> None:
        if self.kv is not None:
            self.regrown += 1
            self.log(f"graphs: KV buffer {self.kv.shape[2]} x {self.kv.shape[4]} -> {batch} x {capacity}; "
                     "steps are captured again")
        layers, kv_heads, head_dim = self._layout()
        self.kv = self._buckets = self.body_cache = None   # the old buffer, its views and graphs go first
        self.kv = torch.zeros(layers, 2, batch, kv_heads, capacity, head_dim, dtype=self._dtype(),
                              device=self.m.device)
        self.body_cache = Cache(layers=[_StaticLayer(self, i) for i in range(layers)])
        # the graphs went with the old buffer: their memory with them (capture_s keeps every capture's time)
        self._buckets, self.captures, self.graph_bytes = {}, {}, 0
        self._pool = torch.cuda.graph_pool_handle() if self.capture is cuda_capture else None

    def _fits(self) -> bool:
        """Whether the backbone's own cache has the buffer's layout (``_cache_layout_differs``, read once; a model
        whose cache does not decodes on the dynamic cache, said in one line)."""
        if self.unfit is None:
            self.unfit = self._cache_layout_differs()
            if self.unfit:
                warnings.warn(f"graphs: the backbone's KV cache holds {self.unfit}, not the [kv_heads, head_dim] keys "
                              "and values in every layer that the static buffer holds: it decodes uncaptured on the "
                              "dynamic cache", stacklevel=6)
        return not self.unfit

    def _cache_layout_differs(self) -> str:
        """"" where one 1-token forward on transformers' own cache leaves keys and values of ``_layout``'s shape in
        every layer, else what it leaves. Read once per model, from the model itself: a config does not say it
        for every architecture (DeepSeek-V3's multi-head latent attention caches one latent and one rotary part,
        of other widths than its heads; a graph would write them into the wrong shapes)."""
        layers, kv_heads, head_dim = self._layout()
        cache = DynamicCache()
        ids = torch.zeros(1, 1, dtype=torch.long, device=self.m.device)
        with torch.no_grad():
            self.m.body_hidden(ids, torch.zeros_like(ids), cache)
        seen = [(tuple(getattr(layer, "keys", torch.empty(0, 0, 0)).shape[1::2]),
                 tuple(getattr(layer, "values", torch.empty(0, 0, 0)).shape[1::2])) for layer in cache.layers]
        if len(seen) == layers and all(k == v == (kv_heads, head_dim) for k, v in seen):
            return ""
        widths = sorted({f"keys {k[0]} x {k[1]} / values {v[0]} x {v[1]}" for k, v in seen})
        return f"{len(seen)} layers of {', '.join(widths)} (heads x width)"

    def _dtype(self) -> torch.dtype:
        """The backbone body's dtype (its keys and values), which the lm_head's need not be."""
        return next((p.dtype for p in self.m.body.parameters() if p.is_floating_point()), self.m.dtype)

    def _layout(self) -> tuple[int, int, int]:
        """(layers, kv_heads, head_dim) of the model's KV cache."""
        cfg = self.m.config
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cfg.num_hidden_layers, kv_heads, head_dim

    # -- a step ----------------------------------------------------------------------------------------
    def forward(self, view, ids: torch.Tensor, pos: torch.Tensor, mask: Optional[torch.Tensor],
                tap=None) -> tuple[torch.Tensor, ...]:
        """``MedusaModel.hidden`` (tap: ``hidden_aux``) on the static buffer: (hidden [B, n, H], features)."""
        view.check_current()
        batch, n = ids.shape
        slots, first = view.write_slots(n)
        size = next(b for b in self.buckets if b >= batch)     # the buffer was reserved for this batch
        rows = next((b for b in self.buckets if b >= n), None)
        b = self._bucket(size, rows) if rows is not None else self._inputs(size, n)
        self._fill(b, ids, pos, mask, slots, view.length if mask is None else None)
        key = None if tap is None else tuple(tap.ids)
        step = self._step_fn(b, tap)
        fixed = False   # outputs in the graph's own buffers, which the next replay overwrites
        if rows is not None and self.capture is not None and not first and self._may_capture():
            with on_device(self.kv.device):
                outs = self._replayed(b, key, step, batch, n)
            captured = b.replays.get(key)
            fixed = captured is not None and outs is captured[1]
        else:
            if rows is None and self.capture is not None and not first:
                self._beyond_buckets(n)
            outs = step()
        view.advance(n)
        # an eager step's outputs are its own (a prompt's: ~2 GB of hidden states and EAGLE-3 features at 32 rows
        # of 2,000 tokens, Llama-3.1-8B's shape, cloned for nothing)
        if b.ids.shape == (batch, n):
            return tuple(o.clone() for o in outs) if fixed else tuple(outs)
        return tuple(o[:batch, :n].clone() if fixed else o[:batch, :n] for o in outs)

    def _beyond_buckets(self, n: int) -> None:
        """A step of more rows than the largest bucket runs uncaptured (~1,300 kernels launched one by one, fresh
        buffers): counted in report.json (``oversized_steps``) and said once per size, never silently slow."""
        self.oversized += 1
        if n not in self._oversized_seen:
            self._oversized_seen.add(n)
            self.log(f"graphs: a {n}-row step is beyond the largest graph bucket ({self.buckets[-1]}): steps of "
                     f"that size run uncaptured (graph_buckets= up to {MAX_BUCKET} captures them)")

    def _may_capture(self) -> bool:
        """Whether a graph may be captured or replayed here: prompts never are (module docstring), and on a LongRoPE
        backbone only steps inside ``MedusaModel.stepping``, whose per-position rule a graph freezes (a step
        outside it, a caller timing ``step()`` bare, would capture the prompt rule for every later replay)."""
        switch = getattr(self.m, "_rope_switch", None)
        return switch is None or switch.per_position

    def _step_fn(self, b: _Bucket, tap) -> Callable[[], tuple]:
        def step():
            self.write_rows, self.write_slots = b.rows, b.slots
            if tap is None:
                return (self.m.body_hidden(b.ids, b.pos, self.body_cache, b.mask),)
            with tap:
                h = self.m.body_hidden(b.ids, b.pos, self.body_cache, b.mask)
            return h, tap.features()
        return step

    def _replayed(self, b: _Bucket, key, step, batch: int, n: int) -> tuple:
        if key not in b.replays:
            size, rows = b.ids.shape
            label = (f"{rows}" if size == 1 else f"{size}x{rows}") + ("" if key is None else f"+aux{list(key)}")
            b.replays[key] = self._capture(label, step)
        captured = b.replays[key]
        if captured is None:
            return step()
        replay, outs = captured
        self.write_rows, self.write_slots = b.rows, b.slots
        replay()
        b.uses[key] = b.uses.get(key, 0) + 1
        if b.uses[key] == 2:     # the first replay on other inputs than the capture's: checked once
            return self._checked(b, key, outs, step, batch, n)
        return outs

    def _checked(self, b: _Bucket, key, outs: tuple, step, batch: int, n: int) -> tuple:
        """The replayed outputs against the same step run eagerly (it rewrites the same cache entries): a value
        the capture froze (a host number turned into a constant) shows here, and the bucket then runs
        uncaptured (one line) instead of decoding wrong tokens."""
        eager = step()
        same = outputs_agree([o[:batch, :n] for o in outs], [e[:batch, :n] for e in eager])   # padding is never read
        self.checked += 1
        if not same:
            self.disagreed += 1
            b.replays[key] = None
            self.log(f"graphs: a captured {b.ids.shape[0]}x{b.ids.shape[1]} step disagreed with the same step "
                     "uncaptured; that step runs uncaptured")
        return eager

    def _capture(self, label: str, step) -> Optional[tuple]:
        if label in self.captures:   # a captured step is replayed, never silently captured again
            raise RuntimeError(f"graphs: the {label}-row step would be captured a second time")
        try:
            captured, seconds, grown = measured_capture(self.capture, step, self._pool)
        except Exception as exc:   # a step that cannot be captured here: static steps go on uncaptured, correct
            self.failed += 1
            self.capture = None    # every other bucket would fail the same way, each after a costly attempt
            self.log(f"graphs: capturing the {label}-row step failed ({type(exc).__name__}: {exc}); "
                     "every step runs uncaptured")
            return None
        self.capture_s += seconds
        self.graph_bytes += grown
        self.captures[label] = 1
        return captured

    def _bucket(self, size: int, rows: int) -> _Bucket:
        if (size, rows) not in self._buckets:
            self._buckets[size, rows] = self._inputs(size, rows)
        return self._buckets[size, rows]

    def _inputs(self, size: int, rows: int) -> _Bucket:
        dev, cap = self.kv.device, self.kv.shape[4]
        return _Bucket(torch.zeros(size, rows, dtype=torch.long, device=dev),
                       torch.zeros(size, rows, dtype=torch.long, device=dev),
                       torch.zeros(size, 1, rows, cap, dtype=self.kv.dtype, device=dev),
                       torch.arange(size, device=dev)[:, None],
                       torch.full((size, rows), cap - 1, dtype=torch.long, device=dev))

    def _fill(self, b: _Bucket, ids, pos, mask, slots, causal_after: Optional[int] = None) -> None:
        """The step's ids, positions, write slots and mask into the bucket's tensors; padding (rows of the
        batch bucket, nodes of the row bucket) writes to the last slot and sees slot 0 only. ``mask`` None: each
        row sees the first ``causal_after`` entries, the earlier rows and itself. A step that fills its bucket
        exactly (the plain loop's, a tree of a bucket's size) skips the padding: on a GPU each of these small
        ops is a launch between two replays."""
        batch, n = ids.shape
        exact = b.ids.shape == (batch, n)
        if exact:
            b.ids.copy_(ids)
            b.pos.copy_(pos.expand(batch, n))
            b.slots.copy_(slots.expand(batch, n))
        else:
            b.ids.zero_()
            b.ids[:batch, :n].copy_(ids)
            b.pos.zero_()
            b.pos[:batch, :n].copy_(pos.expand(batch, n))
            b.slots.fill_(b.mask.shape[-1] - 1)
            b.slots[:batch, :n].copy_(slots.expand(batch, n))
        b.mask.fill_(torch.finfo(b.mask.dtype).min)
        rows = b.mask if exact else b.mask[:batch, :, :n]
        if mask is None:
            rows[..., :causal_after + 1].zero_()          # the prefix and the first new row itself
            if n > 1:
                rows[..., causal_after:causal_after + n].copy_(self._causal_block(n))
        else:
            rows[..., :mask.shape[-1]].copy_(mask.expand(batch, 1, n, mask.shape[-1]))
        if not exact:
            b.mask[batch:, :, :, 0] = 0
            b.mask[:, :, n:, 0] = 0

    def _causal_block(self, n: int) -> torch.Tensor:
        """[n, n] additive mask of n new rows among themselves (each sees the earlier ones and itself), kept."""
        key = ("causal", n, self.kv.dtype, self.kv.device)
        if key not in self._blocks:
            see = torch.ones(n, n, dtype=torch.bool, device=self.kv.device).tril()
            self._blocks[key] = torch.zeros(n, n, dtype=self.kv.dtype, device=self.kv.device).masked_fill_(
                ~see, torch.finfo(self.kv.dtype).min)
        return self._blocks[key]

    def captured_replay(self, batch: int = 1, rows: int = 1) -> Optional[Callable[[], None]]:
        """The replay of the (batch, rows) bucket's captured step without aux features, None where it is not
        captured: a measurement times the device's share of a step alone with it (replays back to back)."""
        b = (self._buckets or {}).get((batch, rows))
        captured = b.replays.get(None) if b is not None else None
        return captured[0] if captured else None

    def summary(self) -> dict:
        """What report.json records of the static steps."""
        return {"captured": self.capture is not None, "buckets": list(self.buckets),
                "kv_capacity": None if self.kv is None else self.kv.shape[4],
                "kv_batch": None if self.kv is None else self.kv.shape[2], "captures": dict(self.captures),
                "capture_s": round(self.capture_s, 4), "graph_memory_bytes": self.graph_bytes,
                "buffer_regrown": self.regrown, "uncaptured_requests": self.fallbacks, "failed_captures": self.failed,
                "oversized_steps": self.oversized,
                "checked_replays": self.checked, "disagreeing_replays": self.disagreed,
                "drafter_calls": self.calls.summary(),
                "draft_models": [s.summary() for r in self.drafts if (s := r()) is not None]}


def apply_graphs(m, mode: str, buckets: Sequence[int] = DEFAULT_BUCKETS, capacity: Optional[int] = None,
                 log: Callable[[str], None] = print):
    """Give ``m`` static-shape steps per ``mode`` (module docstring), or take them away (off); returns ``m``."""
    mode = graphs_mode(mode)
    check_graphs(mode, list(buckets), None if mode != "on" else str(m.device))
    on = captures_on(mode, m.device)
    m.static = None if on is None else StaticSteps(m, buckets, cuda_capture if on else None, capacity, log)
    return m
