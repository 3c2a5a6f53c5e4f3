"""Batched EAGLE-3 decoding (method ``eagle3`` through ``generate_batch``): every row grows its own
EAGLE-2 dynamic tree exactly as ``Eagle3Decoder`` does at batch 1 (methods/eagle3.py), and the
rows' trees are verified together in one backbone forward (``BatchTreeDecoder``).

The drafter's cache (``RowDraftKV``) holds, per row, one committed entry per backbone position whose
features are known (0..committed[b]-1, as batch 1's ``DraftKV``), and, during a step, the step's
draft entries. One step for the B active rows (``Eagle3BatchDrafter``):
  1. depth 1: each row's top-k of its root distribution, scored by log-probability;
  2. depths 2..D: ONE drafter call over B x k expanded nodes (each row's k best of the last depth),
     row b's nodes at position committed[b]-1+d, each seeing its row's committed entries, its
     ancestors' draft entries and itself (a per-row additive mask); same scores, same top-k;
  3. rerank per row: its N best nodes (stable sort: ties to the earlier node, ancestors kept), less
     those below eagle_min_prob, as at batch 1. Rows differ in shape (and, with eagle_min_prob, in
     size), so each row gets its own ``TreeBuffers``, stacked (``RowTrees``) and verified together;
  4. ``accepted``: after the (tapped) verification forward, every row catches up over its root and
     accepted nodes with their TRUE aux features, fed the next accepted token / the bonus, in one
     drafter call (paths right-padded to the longest); that step's draft entries are dropped.
A plain step (the schedule's None) drafts nothing; its root's features wait (``pending``) until
the next drafting step commits them all in one call, so a stretch of plain steps costs no drafter
call, and later steps still draft from a complete cache. Per step: D-1 expansion calls, one verification forward, one
catch-up call, for the whole batch.

With static steps (``graphs=``) the cache is ``eagle3_static.StaticRowDraftKV`` and the expansion and a
step's catch-up are captured calls, the batch padded to its bucket (``eagle3_static``). A step's
rerank runs in the expansion's call too: every row's tree at the setting's fixed size, built on the device
(``runtime.static_tree``, a ``StaticTree`` with a row axis), verified with the other rows in one host read.

Speculation per batch size: fixed ``Eagle3Options``, or a ``SpeculationSchedule`` whose choices are
``Eagle3Options`` or None, consulted every step with the number of active rows (as
``medusa.HeadsDrafter``); caches are sized for its largest setting.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..errors import UserError
from ..heads.eagle3 import draft_kv_bytes_per_slot
from ..runtime.batch_decode import BatchTreeDecoder, batch_capacity, root_only
from ..runtime.graph_capture import to_device
from ..runtime.model import MedusaModel
from ..runtime.speculation import ScheduleCursor, SpeculationSchedule
from ..runtime.static_tree import StaticTree
from ..runtime.tree import RowTrees, select_nodes, tree_buffers
from ..runtime.verify import SamplingConfig
from .eagle3_expand import expand
from .eagle3_static import (StaticRowDraftKV, batch_catch_up_call, batch_draft_call, cache_slots, static_rows, tag,
                            tree_step)


def _additive(see: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, T, S] visibility -> the [B, 1, T, S] additive mask the drafter's attention takes."""
    mask = torch.zeros(see.shape, dtype=dtype, device=see.device)
    return mask.masked_fill_(~see, torch.finfo(dtype).min)[:, None]


class RowDraftKV:
    """The drafter's KV cache for a batch: keys / values [B, kv_heads, capacity, D]; row b's committed
    entries at slots 0..committed[b]-1, and during a step every row's draft entries at one shared
    offset, the longest row's committed count.

    Not a ``RaggedKVCache``: the drafter's ``forward_step`` attends over the (past, new) it is handed,
    not through a transformers ``Cache``, and draft entries are never kept (committing is the
    catch-up's job), so they need no per-row offsets and no ``keep``: a shared offset makes each
    depth's append one slice copy and leaves batch 1's ancestor-visibility pattern unchanged. They
    are dropped by not being shown: row b only ever attends to its first committed[b] slots."""

    def __init__(self, batch: int, capacity: int, device):
        self.capacity = capacity
        self.committed = torch.zeros(batch, dtype=torch.long, device=device)
        self.k: Optional[torch.Tensor] = None
        self.v: Optional[torch.Tensor] = None

    def _allocate(self, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.k is None:
            b = self.committed.shape[0]
            self.k = k.new_zeros(b, k.shape[1], self.capacity, k.shape[-1])
            self.v = v.new_zeros(b, v.shape[1], self.capacity, v.shape[-1])

    def view(self, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[:, :, :width], self.v[:, :, :width]

    def commit(self, k: torch.Tensor, v: torch.Tensor, counts: torch.Tensor) -> None:
        """k, v [B, kv_heads, T, D]: row b's first counts[b] entries go to its slots committed[b].. (the
        rest are padding of a shorter row, dropped)."""
        self._allocate(k, v)
        b, t = k.shape[0], k.shape[2]
        steps = torch.arange(t, device=k.device)[None]
        real = steps < counts[:, None]
        slots = (self.committed[:, None] + steps)[real]
        if slots.numel() and int(slots.max()) >= self.capacity:
            raise RuntimeError(f"draft KV cache full ({self.capacity} slots)")
        rows = torch.arange(b, device=k.device)[:, None].expand(b, t)[real]
        self.k[rows, :, slots] = k.transpose(1, 2)[real]
        self.v[rows, :, slots] = v.transpose(1, 2)[real]
        self.committed = self.committed + counts

    def put_draft(self, k: torch.Tensor, v: torch.Tensor, at: int) -> None:
        """Every row's draft entries k, v [B, kv_heads, n, D] at slots at..at+n-1."""
        n = k.shape[2]
        if at + n > self.capacity:
            raise RuntimeError(f"draft KV cache full ({self.capacity} slots)")
        self.k[:, :, at:at + n] = k
        self.v[:, :, at:at + n] = v

    def row_entries(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row b's committed keys and values [kv_heads, committed[b], D]."""
        n = int(self.committed[b])
        return self.k[b, :, :n], self.v[b, :, :n]

    def select(self, index: torch.Tensor) -> None:
        self.committed = self.committed[index]
        if self.k is not None:
            self.k, self.v = self.k[index], self.v[index]


class Eagle3BatchDrafter:
    """``BatchTreeDecoder``'s drafter for EAGLE-3 heads (module docstring): one dynamic tree per row.
    ``options``: ``Eagle3Options`` (one setting at every batch size) or a ``SpeculationSchedule`` of
    them and None (plain steps)."""

    def __init__(self, m: MedusaModel, options):
        schedule = options if isinstance(options, SpeculationSchedule) else SpeculationSchedule({1: options})
        settings = [c for c in schedule.choices.values() if c is not None]
        if not settings:
            raise UserError("an eagle3 schedule needs at least one eagle3 setting (None at every batch size is "
                            "plain decoding: use method autoregressive)")
        for c in settings:
            # duck-typed: Eagle3Options lives in methods/eagle3.py, which imports this module
            if not callable(getattr(c, "check_model", None)):
                raise UserError(f"an eagle3 schedule holds eagle3 options or None, got {type(c).__name__}")
            c.check_model(m)
        if any(c.nodes is None or c.depth is None for c in settings):   # built directly with the tree left unset
            schedule = SpeculationSchedule({b: c.fitted(m.heads.spec) if c is not None else None
                                            for b, c in schedule.choices.items()}, schedule.rates, schedule.switch_gain)
            settings = [c for c in schedule.choices.values() if c is not None]
        for c in settings:
            if not c.nodes:
                raise UserError("eagle_nodes=0 is plain decoding: a schedule says so with None")
        self.m, self.d, self.schedule = m, m.heads, schedule
        self.tap_layers = list(self.d.spec.settings.aux_layers)
        self.max_nodes = max(c.nodes for c in settings) + 1
        self.max_depth = max(c.depth for c in settings)
        self.max_entries = max((c.depth - 1) * c.topk for c in settings)   # one step's draft entries per row
        self.cursor = ScheduleCursor(schedule)
        self.dkv: Optional[RowDraftKV] = None
        self.root_logits: Optional[torch.Tensor] = None   # [B, draft vocab]: the roots' children
        self.root_state: Optional[torch.Tensor] = None    # [B, H]: what depth 1 continues from
        self.pending: list[list] = []                     # per row: (features, tokens) not yet committed
        self.row_proposed: list[int] = []

    def check_sampling(self, cfg: SamplingConfig) -> None:
        self.d.check_sampling(cfg)

    # -- the cache: prompt, then every step's accepted positions ------------------------------------
    def prefilled(self, dec: BatchTreeDecoder, paths: list[list[int]], aux: torch.Tensor) -> None:
        need = self._capacity(dec.prompt_lengths, dec.max_new_tokens)
        if self.m.on_static(dec.cache):     # the drafter's calls go through captured calls (eagle3_static)
            self.dkv = StaticRowDraftKV(self.m, dec.batch, need)
        else:
            self.dkv = RowDraftKV(dec.batch, need, self.m.device)
        self.cursor = ScheduleCursor(self.schedule)
        self.pending = [[] for _ in paths]
        self.accepted(dec, paths, aux)

    def accepted(self, dec: BatchTreeDecoder, paths: list[list[int]], aux: torch.Tensor) -> None:
        """Commit every row's positions ``paths[b]`` of the last forward (true features ``aux``),
        each fed the token after it: the last ``len(paths[b])`` tokens of the row's history.

        After a plain step (or the prefill, before any step has drafted) the entries wait in
        ``pending`` instead: while the schedule says plain, the drafter's layer and its projection
        would run every step for drafts nobody asks for, which at large batches costs a visible
        share of a plain step. The first drafting step commits everything pending in one call."""
        if self.cursor.current is None:
            for b, p in enumerate(paths):   # a run of positions (a prompt's) as a view: ~1.5 GiB at 32 x 2,000 tokens
                contiguous = bool(p) and p == list(range(p[0], p[0] + len(p)))
                self.pending[b].append((aux[b, p[0]:p[0] + len(p)] if contiguous else aux[b, p],
                                        dec.history[b][-len(p):]))
            return
        dev = self.m.device
        width = max(len(p) for p in paths)   # one gather for all rows, paths right-padded
        index = to_device([p + [p[-1]] * (width - len(p)) for p in paths], dev)
        feats = aux.gather(1, index[..., None].expand(-1, -1, aux.shape[-1]))
        nxt = to_device([h[-len(p):] + [0] * (width - len(p)) for h, p in zip(dec.history, paths)], dev)
        self._catch_up(feats, nxt, [len(p) for p in paths], captured=True)

    def catch_up_pending(self) -> None:
        """Commit what plain steps left pending (``accepted``): the cache then covers every row's
        accepted positions."""
        if any(self.pending):
            self._commit([(rows[0][0] if len(rows) == 1 else torch.cat([f for f, _ in rows]),
                           [t for _, n in rows for t in n]) for rows in self.pending])
            self.pending = [[] for _ in self.pending]

    def _commit(self, per_row) -> None:
        """One catch-up call over each row's (features [c, F], tokens fed after them [c]), padded."""
        dev = self.m.device
        width = max(len(n) for _, n in per_row)
        first = per_row[0][0]
        feats = first.new_empty((len(per_row), width, first.shape[-1]))   # one copy, each row padded in place
        for b, (f, n) in enumerate(per_row):
            feats[b, :len(n)] = f
            feats[b, len(n):] = f[-1:]
        nxt = to_device([n + [0] * (width - len(n)) for _, n in per_row], dev)
        self._catch_up(feats, nxt, [len(n) for _, n in per_row])

    def _catch_up(self, aux: torch.Tensor, nxt: torch.Tensor, host_counts: list, captured: bool = False) -> None:
        """One drafter call over aux [B, T, 3H] / nxt [B, T], row b's first counts[b] real; each row's
        last real output drafts its next root's children. ``captured``: a step's catch-up, a captured call
        with static steps (the prompts' and what plain steps left pending run it eagerly: lengths of every
        size, once in a while)."""
        d, kv, dev = self.d, self.dkv, self.m.device
        counts = to_device(host_counts, dev)
        b, t = nxt.shape
        if isinstance(kv, StaticRowDraftKV):
            kv.reserve(t)
            fn = batch_catch_up_call(d, kv.cache, t)
            inputs = (aux, nxt, kv.committed, counts)
            out = self.m.static.calls.run(f"eagle3.catchup{t}:{tag(kv.cache)}", fn, inputs, rows=b, keep=kv.cache) \
                if captured else fn(*inputs)
            self.root_logits, self.root_state = out
            kv.committed_more(counts, host_counts)
            return
        start = kv.committed
        width = int(start.max())
        see = torch.zeros(b, t, width + t, dtype=torch.bool, device=dev)
        see[:, :, :width] = (torch.arange(width, device=dev)[None] < start[:, None])[:, None]
        see[:, :, width:] = torch.ones(t, t, dtype=torch.bool, device=dev).tril()   # padding comes last
        positions = start[:, None] + torch.arange(t, device=dev)
        normed, pre, (k, v) = d.forward_step(nxt, d.combine(aux), positions, kv.view(width) if width else None,
                                             _additive(see, self.m.dtype))
        kv.commit(k, v, counts)
        lanes, last = torch.arange(b, device=dev), counts - 1
        self.root_logits, self.root_state = d.project(normed[lanes, last]), pre[lanes, last]

    # -- drafting -------------------------------------------------------------------------------------
    def draft(self, dec: BatchTreeDecoder):
        o, dev = self.cursor.next(dec.batch), self.m.device
        if o is None:
            self.row_proposed = [0] * dec.batch
            return root_only(dev), torch.empty(dec.batch, 0, dtype=torch.long, device=dev), None
        self.catch_up_pending()
        if isinstance(self.dkv, StaticRowDraftKV):
            trees = self._static_trees(o, dec)     # built on the device: the step's one host read is its verdict
            return trees, trees.tokens[:, 1:], None
        tok, score, parent, depth = self._grow(o)
        rows = []
        for i in range(tok.shape[0]):       # batch 1's rerank, row by row
            keep, parents = select_nodes(score[i], parent[i], o.nodes, o.min_score)
            rows.append((torch.cat([dec.root[i:i + 1], tok[i, keep]]), parents,
                         torch.cat([depth.new_zeros(1), depth[i, keep]])))
        rows = self.amend(dec, rows)
        # rows differ in size where eagle_min_prob drops nodes or ``amend`` adds some (padded: -1)
        trees = RowTrees.stack([tree_buffers(p, d, int(d.max())) for _, p, d in rows])
        width = trees.num_nodes
        cand = torch.stack([torch.cat([t[1:], t.new_full((width - t.numel(),), -1)]) for t, _, _ in rows])
        self.row_proposed = [t.max_depth for t in trees.rows]
        return trees, cand, None

    def _static_trees(self, o, dec: BatchTreeDecoder) -> StaticTree:
        """Steps 1-3 for every row as one captured call (``eagle3_static.tree_call`` over ``batch_draft_call``):
        each row's tree at the setting's fixed size, built on the device (``runtime.static_tree``). A subclass may
        add nodes per row there (``eagle3_lookup`` grafts its looked-up branch)."""
        kv, root = self.dkv, dec.root
        kv.reserve((o.depth - 1) * o.topk)
        name, fn = tree_step(self.d, kv.cache, o, batched=True)     # named by every value it freezes
        fields = self.m.static.calls.run(name, fn, (self.root_logits, self.root_state, kv.committed, root),
                                         rows=root.shape[0], keep=kv.cache)
        return StaticTree(*fields)

    def amend(self, dec: BatchTreeDecoder, rows: list) -> list:
        """Each row's tree (tokens with the root first, parents (-1: the root), depths) as drafted; a
        subclass may add nodes per row (``eagle3_lookup`` grafts its looked-up branch)."""
        return rows

    def _grow(self, o):
        """Every row's dynamic tree (``eagle3_expand.expand``, as batch 1's ``Eagle3Decoder._draft``): token, score,
        parent (-1: the root) and depth of each drafted node [B, k + (D-1) k^2], in drafting order; every row's
        draft entries at one shared offset, the longest row's committed count."""
        d, kv, dev = self.d, self.dkv, self.m.device
        k, committed = o.topk, kv.committed
        b = committed.shape[0]
        if isinstance(kv, StaticRowDraftKV):    # one captured call per setting (eagle3_static.batch_draft_call)
            kv.reserve((o.depth - 1) * k)
            return self.m.static.calls.run(f"eagle3.draft-d{o.depth}k{k}:{tag(kv.cache)}",
                                           batch_draft_call(d, kv.cache, o.depth, k),
                                           (self.root_logits, self.root_state, committed), rows=b, keep=kv.cache)
        base = int(committed.max())             # where the draft entries start, in every row
        neg = torch.finfo(self.m.dtype).min
        own_committed = torch.arange(base, device=dev)[None] < committed[:, None]           # [B, base]

        def attend(level, entries, rows, tok, state, sees):    # over each row's committed and draft entries
            mask = torch.full((b, 1, rows, base + entries + rows), neg, dtype=self.m.dtype, device=dev)
            mask[:, 0, :, :base].masked_fill_(own_committed[:, None], 0)
            mask[:, 0, :, base:].masked_fill_(sees[..., :entries + rows], 0)    # ancestors' and its own
            positions = (committed - 1 + level)[:, None].expand(b, rows)
            normed, pre, (kk, vv) = d.forward_step(tok, state, positions, kv.view(base + entries), mask)
            kv.put_draft(kk, vv, base + entries)
            return normed, pre
        return expand(d, self.root_logits, self.root_state, o.depth, k, attend)

    def cache_bytes(self, prompt_lengths, max_new_tokens: int) -> int:
        """The drafter's own cache for this batch (one layer: keys and values per slot), for the memory check; with
        static steps, as ``StaticRowDraftKV`` allocates it (rows up to the batch bucket, capacity rounded up; none
        where the cache held already holds the batch)."""
        rows, slots = len(prompt_lengths), self._capacity(prompt_lengths, max_new_tokens)
        if self.m.static is not None:
            rows = static_rows(self.m, rows)
            slots = cache_slots(self.m, rows, slots + 1)
        return rows * slots * draft_kv_bytes_per_slot(self.d.spec, self.m.dtype)

    def prompt_bytes(self, prompt_lengths, max_new_tokens: int) -> int:
        """What the prompts' catch-up takes beside that cache, for the memory check: their tapped features (three
        layers' widths a position), the padded copy it reads, and its mask over the cache (a boolean and the
        dtype's): ~3.5 GiB at 32 prompts of 2,000 tokens, Llama-3.1-8B's shape, by arithmetic."""
        rows, slots = len(prompt_lengths), self._capacity(prompt_lengths, max_new_tokens)
        item = torch.empty((), dtype=self.m.dtype).element_size()
        return rows * max(prompt_lengths) * (2 * self.d.fc.weight.shape[1] * item + slots * (1 + item))

    def _capacity(self, prompt_lengths, max_new_tokens: int) -> int:
        # Committed entries are real tokens only (never the gaps a ``ragged=gaps`` backbone cache keeps), so
        # the backbone's compact capacity holds them in either mode, plus one step's draft entries.
        return batch_capacity(prompt_lengths, max_new_tokens, self.max_nodes, "compact", 0) + self.max_entries

    def rows_kept(self, index: list[int]) -> None:
        if self.dkv is not None:
            sel = to_device(index, self.m.device, torch.long)
            if isinstance(self.dkv, StaticRowDraftKV):
                self.dkv.select(sel, index)
            else:
                self.dkv.select(sel)
            self.pending = [self.pending[i] for i in index]
            if self.root_logits is not None:   # None until the first commit (all pending so far)
                self.root_logits, self.root_state = self.root_logits[sel], self.root_state[sel]
