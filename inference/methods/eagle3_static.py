"""EAGLE-3's drafter forwards at fixed shapes, as captured calls (``graphs=``: ``runtime.captured_calls``).

With static steps the backbone's forward replays as a graph, and what is left on the host each step is the
drafter: its depth-1 top-k, D-1 expansion forwards and the catch-up, a few dozen kernels each launched from
Python. Here each is one function of tensor inputs over a fixed-shape cache (``heads.eagle3.StaticDraftKV``),
so ``MedusaModel.static.calls`` captures it once per key and replays it after that:

- the draft (``draft_call``): one call per (depth, top-k), inputs the root's draft distribution and state and
  the committed count; the same arithmetic as ``Eagle3Decoder._draft`` (``Eagle3BatchDrafter._grow``), its
  entries written after the committed ones at slots computed on the device;
- greedy decoding calls the draft with the rerank after it (``tree_call``): the step's tree comes out at its
  setting's fixed size, built on the device (``runtime.static_tree``), and the step's one host read is its verdict;
- the catch-up (``catch_up_call``): one call per row count n, inputs the accepted path's features, the tokens
  fed after them and its start; the prompt's runs once, eagerly, through the same function;
- attention spans the cache's whole capacity under an additive mask built on the device from those inputs
  (committed entries, the ancestors' and the node's own draft entries): every shape is fixed for the key.

Nothing inside reads the host (``.item()``, a branch on a tensor, a data-dependent shape): a CUDA capture
refuses that, or freezes it. Every Python number the functions close over is fixed for their name: the tree call's
name and function come from the same values (``tree_step``), never from a setting's label. Tensors
they read besides their inputs are the drafter's weights and the cache, which lives as long as the model's
static steps (``draft_cache``: one per batch size, grown by at least 1.25x, kept with the calls captured over
it), so a generation does not capture anew.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..heads.eagle3 import StaticDraftKV
from ..runtime.static_steps import rounded_capacity
from ..runtime.static_tree import root_tree, static_graft, static_tree
from .eagle3_expand import expand

MIN_SLOTS = 256
KEPT = "eagle3 draft caches"   # under the static steps' ``kept``: {batch: (drafter, cache)}, outliving a generation


def draft_cache(m, batch: int, need: int) -> StaticDraftKV:
    """The static steps' drafter cache of ``batch`` rows holding at least ``need`` slots: the one already there,
    or a new one (``cache_slots``); the calls captured over the old one are released with it
    (``CapturedCalls.release``)."""
    store = m.static.kept.setdefault(KEPT, {})
    d, held = m.heads, store.get(batch)
    capacity = cache_slots(m, batch, need)
    if not capacity:
        return held[1]
    if held is not None:   # its calls are never made again (names carry the cache's tag): their graphs go now
        m.static.calls.release(held[1])
    attn = d.midlayer.self_attn
    cache = StaticDraftKV(batch, attn.kv_heads, capacity, attn.head_dim, d.fc.weight.dtype, m.device)
    store[batch] = (d, cache)
    return cache


def cache_slots(m, batch: int, need: int) -> int:
    """The capacity ``draft_cache`` allocates for ``batch`` rows of ``need`` slots: 0 when the cache held for this
    drafter holds them already, else ``rounded_capacity`` (at least ``MIN_SLOTS``, and 1.25x the cache it replaces:
    a longer request regrows it rarely). The memory check asks it too, so it counts what is allocated."""
    held = m.static.kept.get(KEPT, {}).get(batch)
    mine = held[1] if held is not None and held[0] is m.heads else None   # another drafter's is replaced whole
    if mine is not None and mine.capacity >= need:
        return 0
    return rounded_capacity(need, MIN_SLOTS, mine.capacity if mine is not None else 0)


def static_rows(m, batch: int) -> int:
    """Rows of the drafter cache a batch of ``batch`` decodes on: its batch bucket (the captured calls pad to it)."""
    return next((b for b in m.static.buckets if b >= batch), batch)


def tag(cache: StaticDraftKV) -> str:
    """What names a call captured over ``cache`` (a regrown cache's calls are new ones): its serial, not its id,
    which a cache made after a released one may get again (its calls would then be captured a second time)."""
    return f"{cache.serial:x}"


def _neg(cache: StaticDraftKV) -> float:
    return torch.finfo(cache.k.dtype).min


def catch_up_call(d, cache: StaticDraftKV, n: int):
    """fn(aux [n, 3H], nxt [n] long, start [] long) -> (root_logits [V'], root_state [H]): commits the entries of
    positions start..start+n-1 (``Eagle3Decoder._catch_up``), each row seeing the committed entries and the
    earlier new rows; the last row's outputs draft the next root's children."""
    neg = _neg(cache)

    def fn(aux, nxt, start):
        dev = nxt.device
        slots = start + torch.arange(n, device=dev)                                   # = the positions
        hidden = torch.arange(cache.capacity, device=dev)[None] > slots[:, None]      # [n, capacity]
        mask = torch.zeros(hidden.shape, dtype=cache.k.dtype, device=dev).masked_fill_(hidden, neg)
        normed, pre = d.forward_static(nxt[None], d.combine(aux)[None], slots[None], cache, slots, mask[None, None])
        return d.project(normed[0, -1]), pre[0, -1]
    return fn


def draft_call(d, cache: StaticDraftKV, depth: int, k: int):
    """fn(root_logits [V'], root_state [H], committed [] long) -> (tokens, scores, parents, depths): the
    dynamic tree of ``Eagle3Decoder._draft`` (same nodes, same scores, same order), its draft entries at
    slots committed.. of ``cache`` (``batch_draft_call`` with one row)."""
    batched = batch_draft_call(d, cache, depth, k)

    def fn(root_logits, root_state, committed):
        return tuple(x[0] for x in batched(root_logits[None], root_state[None], committed.reshape(1)))
    return fn


def tree_call(draft, nodes: int, depth: int, min_score: Optional[float], graft: int = 0):
    """fn(root_logits, root_state, committed, root) -> ``StaticTree``'s fields: ``draft`` (``draft_call`` or
    ``batch_draft_call``: its inputs are the first three), then the rerank of ``Eagle3Decoder.tree`` (the ``nodes``
    best, those below ``min_score`` masked) at the fixed size nodes + 1 (``runtime.static_tree``), so a greedy
    step reads the host once (its verdict). ``graft``: the length of a looked-up chain (``eagle3_lookup``) grafted
    on the device (``static_graft``): fn takes the proposal [graft] (-1 padded) and, batched, which rows verify the
    chain alone [B] bool, and returns the fields at nodes + 1 + graft and the nodes grafted."""
    def fn(root_logits, root_state, committed, root, *lookup):
        tok, score, parent, level = draft(root_logits, root_state, committed)
        fields = static_tree(root, tok, score, parent, level, nodes, depth, min_score)
        if not graft:
            return fields
        if root.dim() == 0:                                  # batch 1: a row axis for the graft
            return tuple(f[0] for f in static_graft(*(f[None] for f in fields), lookup[0][None]))
        return static_graft(*fields, *lookup)
    return fn


def tree_step(d, cache: StaticDraftKV, o, graft: int = 0, batched: bool = False):
    """(name, fn) of the captured tree call of options ``o`` (eagle3's tree fields: nodes, depth, topk, min_prob)
    over ``cache``: ``tree_call`` over ``draft_call`` (``batch_draft_call`` when ``batched``). Name and function are
    built from the same values, and the name holds every Python value the function freezes into its graph: the
    tree's size, depth and top-k, the floor (``repr``, exact: a label's ``:g`` rounds 0.3 and 0.30000001 alike, and
    eagle3_lookup's label has no floor), the graft's length and the cache (``tag``); never a label, which names a
    setting for people and may leave out or round what a graph freezes. Settings that freeze the same values (eagle3
    and eagle3_lookup where it grafts nothing) share the call."""
    draft = (batch_draft_call if batched else draft_call)(d, cache, o.depth, o.topk)
    floor = "" if o.min_score is None else f"-p{o.min_prob!r}"     # min_score: log(min_prob), None for 0
    name = f"eagle3.tree-n{o.nodes}-d{o.depth}-k{o.topk}{floor}" + (f".graft{graft}" if graft else "")
    return f"{name}:{tag(cache)}", tree_call(draft, o.nodes, o.depth, o.min_score, graft)


def chain_call(graft: int):
    """fn(root [B] or [], proposal [B, graft] or [graft]) -> the fields of the root with the looked-up chain alone
    (``static_graft`` on ``root_tree``) and the nodes grafted: ``eagle3_lookup``'s switch at batch 1 (no drafting)."""
    def fn(root, proposal):
        if root.dim() == 0:
            return tuple(f[0] for f in static_graft(*root_tree(root.reshape(1)), proposal[None]))
        return static_graft(*root_tree(root), proposal)
    return fn


# -- batches (``eagle3_batch.Eagle3BatchDrafter``) ------------------------------------------------------------
class StaticRowDraftKV:
    """``eagle3_batch.RowDraftKV`` on a static cache: row b's committed entries at slots 0..committed[b]-1, its
    draft entries right after them (not at a shared offset: that offset is a maximum over the rows, a host read).
    The cache has a row per lane of the batch's bucket (the captured calls pad the batch to it, and a padded
    lane writes its own row, never a real one) and one slot more than the batch needs: the last, where a
    catch-up's padding steps write. ``lengths``: ``committed`` on the host, to refuse an overflow without a
    device read."""

    def __init__(self, m, batch: int, need: int):
        lanes = static_rows(m, batch)
        self.cache = draft_cache(m, lanes, need + 1)
        self.claimed = self.cache.claim()
        self.capacity = self.cache.capacity
        self.committed = torch.zeros(batch, dtype=torch.long, device=m.device)
        self.lengths = [0] * batch

    def reserve(self, slots: int) -> None:
        """Refuse (as ``RowDraftKV`` does) a call writing beyond the cache: ``slots`` past the longest row."""
        self.cache.check(self.claimed)
        if max(self.lengths) + slots > self.capacity - 1:
            raise RuntimeError(f"draft KV cache full ({self.capacity - 1} slots)")

    def committed_more(self, counts: torch.Tensor, host: list) -> None:
        self.committed = self.committed + counts
        self.lengths = [n + c for n, c in zip(self.lengths, host)]

    def row_entries(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row b's committed keys and values [kv_heads, committed[b], D] (``RowDraftKV``'s, for a row's check)."""
        n = self.lengths[b]
        return self.cache.k[b, :, :n], self.cache.v[b, :, :n]

    def select(self, index: torch.Tensor, rows: list) -> None:
        """Rows ``index`` go on, moved to lanes 0..len-1 of the same cache (the captured calls read it there)."""
        n = len(rows)
        if list(rows) == sorted(rows):   # lanes move only towards the front: each one's entries, no gathered copy
            for i, j in enumerate(rows):
                if i != j:
                    used = self.lengths[j]
                    self.cache.k[i, :, :used].copy_(self.cache.k[j, :, :used])
                    self.cache.v[i, :, :used].copy_(self.cache.v[j, :, :used])
        else:
            self.cache.k[:n] = self.cache.k[index]
            self.cache.v[:n] = self.cache.v[index]
        self.committed = self.committed[index]
        self.lengths = [self.lengths[i] for i in rows]


def batch_catch_up_call(d, cache: StaticDraftKV, t: int):
    """fn(aux [B, t, 3H], nxt [B, t], start [B], counts [B]) -> (root_logits [B, V'], root_state [B, H]):
    ``Eagle3BatchDrafter._catch_up``: row b commits positions start[b]..start[b]+counts[b]-1, each step seeing
    its row's committed entries and its earlier steps; a padding step (beyond counts[b]) writes to the reserved
    last slot, where no real row looks."""
    neg = _neg(cache)

    def fn(aux, nxt, start, counts):
        b, dev = nxt.shape[0], nxt.device
        lanes = torch.arange(b, device=dev)[:, None]
        step = torch.arange(t, device=dev)[None]
        pos = start[:, None] + step                                                   # [B, t]
        slots = torch.where(step < counts[:, None], pos, cache.capacity - 1)
        hidden = torch.arange(cache.capacity, device=dev)[None, None] > pos[..., None]  # [B, t, capacity]
        mask = torch.zeros(hidden.shape, dtype=cache.k.dtype, device=dev).masked_fill_(hidden, neg)
        normed, pre = d.forward_static(nxt, d.combine(aux), pos, cache, slots, mask[:, None], rows=lanes)
        last = counts - 1
        return d.project(normed[lanes[:, 0], last]), pre[lanes[:, 0], last]
    return fn


def batch_draft_call(d, cache: StaticDraftKV, depth: int, k: int):
    """fn(root_logits [B, V'], root_state [B, H], committed [B]) -> (tokens, scores, parents, depths) [B, nodes]:
    ``Eagle3BatchDrafter._grow`` (``eagle3_expand.expand``), row b's draft entries at slots committed[b]..., each
    depth's attention over the cache's whole capacity under a mask: the row's committed entries, and of the step's
    draft entries its ancestors' and its own."""
    neg, width = _neg(cache), (depth - 1) * k

    def fn(root_logits, root_state, committed):
        b, dev = root_logits.shape[0], root_logits.device
        lanes = torch.arange(b, device=dev)[:, None]
        seen = torch.zeros(b, cache.capacity, dtype=cache.k.dtype, device=dev).masked_fill_(
            torch.arange(cache.capacity, device=dev)[None] >= committed[:, None], neg)   # [B, capacity]
        slots = committed[:, None] + torch.arange(width, device=dev)[None]              # [B, width]

        def attend(level, entries, rows, tok, state, sees):
            drafted = torch.zeros(sees.shape, dtype=seen.dtype, device=dev).masked_fill_(~sees, neg)
            mask = seen[:, None].repeat(1, rows, 1).scatter_(2, slots[:, None].expand(b, rows, width), drafted)
            positions = (committed - 1 + level)[:, None].expand(b, rows)
            return d.forward_static(tok, state, positions, cache, slots[:, entries:entries + rows], mask[:, None],
                                    rows=lanes)
        return expand(d, root_logits, root_state, depth, k, attend)
    return fn
