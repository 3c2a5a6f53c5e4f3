"""Batched speculative decoding: many prompts of different lengths decoded together, every row lossless.

A step drafts for every active row, verifies all rows' drafts in ONE backbone forward ([B, n]
tokens, each row's tree at its own cache offset with its own 4D mask and position ids:
``RaggedKVCache``), and accepts per row (``verify.verify_rows``): rows accept different numbers
of tokens, each keeps its own accepted path. A row that reaches EOS or ``max_new_tokens`` leaves
the batch (its cache rows are dropped), so finished rows cost nothing afterwards.

``BatchTreeDecoder`` is the one batched decoder: what it verifies each step comes from a
``Drafter`` (``draft(decoder) -> (tree buffers, candidate tokens [B, n-1], draft probs)``), which
a method supplies: Medusa/Hydra/MLP-speculator heads fill static trees, prompt lookup fills
chains, an EAGLE-3 drafter grows one dynamic tree per row (``tree.RowTrees``: per-row masks and
depths in the one forward, stacked leaf paths in the one verification), ``PlainDrafter`` proposes nothing (the plain
batched loop, the baseline). A drafter that reads backbone features (EAGLE-3) names the layers
(``tap_layers``) and is handed them, with the positions each row committed, after the prefill
and after every step. How much a method speculates may depend on how many rows are active
(``speculation.SpeculationSchedule``): on a machine where the verification forward is bound by
reading the weights, extra rows are free at batch 1 and cost compute at batch 32.

``run_batch`` drives a decoder with one timing rule (each step from before drafting to after
the device sync) and returns a ``BatchOutput``: a ``GenerationOutput`` per row plus the batch's
step times and active row counts.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Optional, Protocol, Sequence

import torch

from ..errors import UserError
from .batch_cache import RaggedKVCache, pad_layout
from .decode import (GenerationOutput, _Emitter, _sync, check_budget, encoding_rows, eos_set, is_array, is_integer,
                     refuse_padding, seeded_generator, short_repr)
from .graph_capture import to_device
from .memory import free_memory_bytes
from .model import MedusaModel, kv_bytes_per_token
from .static_tree import StaticTree
from .tree import MedusaTree, TreeBuffers
from .verify import SamplingConfig, choose_token, verify_rows


# -- what a batch run returns ---------------------------------------------------------------
@dataclass
class BatchOutput:
    """Per-row generations of one batched run, and the batch's own timeline."""

    rows: list[GenerationOutput]
    prefill_s: float = 0.0
    decode_s: float = 0.0
    step_s: list[float] = field(default_factory=list)        # wall time of each batch step
    active: list[int] = field(default_factory=list)          # rows decoded by each step
    speculation: list[int] = field(default_factory=list)     # nodes per row verified by each step

    @property
    def new_tokens(self) -> int:
        return sum(len(r.tokens) for r in self.rows)

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens of all rows / wall time of the whole run (prefill included)."""
        total = self.prefill_s + self.decode_s
        return self.new_tokens / total if total > 0 else 0.0

    @property
    def tau(self) -> float:
        """Tokens per row-step over all rows (bonus included; plain decoding = 1.0)."""
        steps = sum(r.steps for r in self.rows)
        return sum(sum(r.accept_lengths) for r in self.rows) / max(1, steps)


# -- checks before anything runs --------------------------------------------------------------
def check_batch_size(batch_size) -> int:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise UserError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    return batch_size


def prompt_rows(m: MedusaModel, prompts) -> list[list[int]]:
    """Each prompt as a list of token ids in the vocabulary; one ``UserError`` line otherwise. A tokenizer's output
    gives its rows without the padding its mask marks (``encoding_rows``)."""
    if isinstance(prompts, Mapping):
        prompts = encoding_rows(prompts)
    if isinstance(prompts, torch.Tensor) or is_array(prompts):   # a [B, L] tensor or numpy array
        if prompts.ndim != 2:
            raise UserError("a batch of prompts must be a list of id lists or a [B, L] tensor")
        if prompts.dtype == torch.bool or str(prompts.dtype) == "bool" or \
                "float" in str(prompts.dtype) or "complex" in str(prompts.dtype):
            raise UserError(f"a batch of prompts must hold integer token ids, got a {prompts.dtype} array")
        prompts = prompts.tolist()
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
        raise UserError("give a non-empty list of prompts (each a list of token ids)")
    rows = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            raise UserError(f"prompt {i} is text; encode it first (e.g. MedusaModel.encode_chat)")
        if (isinstance(p, torch.Tensor) or is_array(p)) and p.ndim == 1:   # a row as a tensor or numpy array
            p = p.tolist()
        if isinstance(p, (bytes, torch.Tensor)) or not isinstance(p, Sequence):
            raise UserError(f"prompt {i} ({type(p).__name__}) is not a list of token ids: a batch is a list of "
                            "prompts (one prompt: [ids])")
        bad = next((t for t in p if not is_integer(t)), None)
        if bad is not None:   # int() would truncate 1.7 to 1 (and True to 1), as generate refuses to
            raise UserError(f"prompt {i} must be a list of integer token ids, got {short_repr(bad)}")
        ids = [int(t) for t in p]
        if not ids:
            raise UserError(f"prompt {i} is empty: give at least one token")
        if min(ids) < 0 or max(ids) >= m.vocab_size:
            raise UserError(f"prompt {i}: token ids must lie in 0..{m.vocab_size - 1}")
        refuse_padding(m, ids, f"prompt {i}")
        rows.append(ids)
    refuse_padded_batch(m, rows)
    return rows


def refuse_padded_batch(m: MedusaModel, rows: list[list[int]]) -> None:
    """Refuse rows of one length of which some, not all, end (or start) with a pad token that is also an end or
    start of text (``refuse_padding`` lets such a token be): a batch padded by its tokenizer, whose padding would be
    decoded as part of the shorter prompts (``padding=True``: the longest row ends, and starts, with its own text;
    every row padded, ``padding="max_length"``, cannot be told from rows ending alike)."""
    pad = getattr(getattr(m, "tokenizer", None), "pad_token_id", None)
    if len(rows) < 2 or not isinstance(pad, int) or len({len(r) for r in rows}) != 1:
        return
    for where, at in (("end", -1), ("start", 0)):
        marked = [i for i, r in enumerate(rows) if r[at] == pad]
        if marked and len(marked) < len(rows):
            several = len(marked) > 1
            raise UserError(f"prompt{'s' if several else ''} {', '.join(map(str, marked[:5]))} "
                            f"{where if several else where + 's'} with the pad token (id {pad}) and others do not: a "
                            "padded batch; pass the tokenizer's output with its attention_mask "
                            "(generate_batch(m, tokenizer(texts, padding=True))) or the rows unpadded")


def batch_cache_bytes(m: MedusaModel, prompt_lengths: Sequence[int], max_new_tokens: int, extra_slots: int,
                      mode: str = "compact", max_depth: int = 0) -> int:
    """Bytes the batch's KV cache, prefill activations and logits will take (the estimate checked
    against free memory before anything is allocated)."""
    capacity = batch_capacity(prompt_lengths, max_new_tokens, extra_slots, mode, max_depth)
    b, width = len(prompt_lengths), max(prompt_lengths)
    item = torch.empty((), dtype=m.dtype).element_size()
    cfg = m.config
    prefill = b * width * (cfg.hidden_size * 4 + getattr(cfg, "intermediate_size", 4 * cfg.hidden_size) * 2) * item
    static = m.static.bytes_needed(b, capacity) if m.static is not None and mode == "compact" else -1
    prefill += b * width * (capacity if static >= 0 else width) * item   # the 4D prefill mask (static: every slot)
    logits = b * max(1, extra_slots) * m.vocab_size * 4
    kv = static if static >= 0 else b * capacity * kv_bytes_per_token(m)   # the static buffer's rounding, or its own
    return kv + prefill + logits


def batch_capacity(prompt_lengths: Sequence[int], max_new_tokens: int, extra_slots: int, mode: str,
                   max_depth: int) -> int:
    width = max(prompt_lengths)
    if mode == "compact":
        return width + max_new_tokens + extra_slots
    return width + max_new_tokens * (max_depth + 1) + extra_slots   # gaps: up to depth+1 slots per token


def check_batch_fits(m: MedusaModel, prompt_lengths: Sequence[int], max_new_tokens: int, extra_slots: int,
                     mode: str = "compact", max_depth: int = 0, drafter_bytes: int = 0) -> None:
    """Refuse, in one line and before allocating, prompts over the context or a batch over free memory
    (``drafter_bytes``: what the drafter's own caches add, e.g. a draft model's KV cache)."""
    for i, n in enumerate(prompt_lengths):
        try:
            check_budget(m, n, max_new_tokens)
        except UserError as e:
            raise UserError(f"prompt {i}: {e}") from None
    need = batch_cache_bytes(m, prompt_lengths, max_new_tokens, extra_slots, mode, max_depth) + drafter_bytes
    free = free_memory_bytes(m.device)
    if free is not None and need > 0.9 * free:
        raise UserError(f"a batch of {len(prompt_lengths)} prompts (longest {max(prompt_lengths)} tokens, "
                        f"max_new_tokens={max_new_tokens}) needs about {need / 2**30:.1f} GiB for its KV cache and "
                        f"activations, more than the {free / 2**30:.1f} GiB free on {m.device}: lower batch_size or "
                        "max_new_tokens")


# -- the decoder ------------------------------------------------------------------------------
class Drafter(Protocol):
    """What a batched method proposes each step (see the module docstring)."""

    max_nodes: int   # most nodes per row one step verifies (root included): sizes the cache
    max_depth: int   # deepest draft (sizes the cache in gaps mode)

    def draft(self, dec: "BatchTreeDecoder") -> tuple[TreeBuffers, torch.Tensor, Optional[torch.Tensor]]:
        """(the step's tree buffers, candidate tokens [B, n-1] for nodes 1..n-1, -1 where a row has no
        draft for a node (it is run but never accepted), draft probs [B, D, V] or None)."""

    def rows_kept(self, index: list[int]) -> None:
        """Rows ``index`` stay in the batch (in that order); drop per-row state of the others.
        A drafter whose rows propose different numbers of tokens sets ``row_proposed`` (per row,
        for the acceptance rate); otherwise each row counts the tree's depth.

        Optional, for drafters fed the backbone's features (EAGLE-3): ``tap_layers`` (hidden-state
        ids: the prefill and every verification forward then run ``m.hidden_aux`` with a tap on
        them), ``prefilled(dec, paths, aux)`` after the prefill and ``accepted(dec, paths, aux)``
        after each step. ``aux`` [B, n, F] holds the forward's tapped features (None without
        ``tap_layers``); ``paths[b]`` are the offsets, in that forward, of the positions row b has
        now committed (its prompt; the root and its accepted nodes), each followed in its sequence
        by the last ``len(paths[b])`` tokens of ``dec.history[b]``.

        Optional too: ``cache_bytes(prompt_lengths, max_new_tokens)``, the bytes of the drafter's own
        caches for that batch (a draft model's KV cache, EAGLE-3's drafter cache), and
        ``prompt_bytes(prompt_lengths, max_new_tokens)``, what its first call over the prompts takes beside
        them, counted in the memory check before anything is allocated."""


_ROOT_ONLY: dict[torch.device, TreeBuffers] = {}


def root_only(device: torch.device) -> TreeBuffers:
    """The one-node tree: a plain decoding step."""
    if device not in _ROOT_ONLY:
        _ROOT_ONLY[device] = MedusaTree([], name="plain").buffers(device)
    return _ROOT_ONLY[device]


class PlainDrafter:
    """Proposes nothing: ``BatchTreeDecoder`` with it is the plain batched loop (the baseline)."""

    max_nodes, max_depth = 1, 0

    def draft(self, dec):
        return root_only(dec.m.device), torch.empty(dec.batch, 0, dtype=torch.long, device=dec.m.device), None

    def rows_kept(self, index):
        pass


class BatchTreeDecoder:
    """Decoding state of a batch: ``prefill`` once, then ``step`` until every row is done.

    After each step, for every active row b: the cache holds its prompt and every emitted token
    but the last (``root[b]``), ``h_last[b]`` is the backbone's last hidden state at that root's
    parent position, ``history[b]`` is its prompt + emitted tokens (for drafters that look
    back). ``rows`` maps active rows to the caller's prompt indices."""

    def __init__(self, m: MedusaModel, drafter: Drafter, sampling: Optional[SamplingConfig] = None,
                 seed: Optional[int] = None, ragged: str = "compact"):
        self.m, self.drafter = m, drafter
        self.cfg = sampling or SamplingConfig()
        if hasattr(drafter, "check_sampling") and drafter.max_depth > 0:   # heads that draft refuse settings
            drafter.check_sampling(self.cfg)                                # they cannot draft exactly
        self.gen = seeded_generator(m.device, seed)
        self.ragged = ragged
        layers = getattr(drafter, "tap_layers", None)
        self.tap = m.aux_tap(layers) if layers is not None else None
        self.cache: Optional[RaggedKVCache] = None
        self.root: Optional[torch.Tensor] = None     # [B] last emitted token per row
        self.h_last: Optional[torch.Tensor] = None   # [B, H]
        self.history: list[list[int]] = []
        self.rows: list[int] = []
        self.last_nodes = 0

    @property
    def batch(self) -> int:
        return len(self.rows)

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], max_new_tokens: int) -> list[int]:
        m = self.m
        lens = [len(p) for p in prompts]
        self.prompt_lengths, self.max_new_tokens = lens, max_new_tokens   # what a drafter sizes its own cache by
        capacity = batch_capacity(lens, max_new_tokens, self.drafter.max_nodes, self.ragged, self.drafter.max_depth)
        self.cache = m.new_batch_cache(len(prompts), capacity, self.ragged)
        mask, pos = self.cache.prefill_mask(lens, m.dtype)
        ids = torch.tensor(pad_layout(prompts, self.ragged), dtype=torch.long, device=m.device)
        h, aux = self._forward(ids, pos, mask)
        width = ids.shape[1]
        last = torch.tensor([n - 1 if self.ragged == "compact" else width - 1 for n in lens], device=m.device)
        self.h_last = h[torch.arange(len(lens), device=m.device), last]
        self.root = choose_token(m.logits(self.h_last), self.cfg, self.gen).reshape(-1)
        self.rows = list(range(len(prompts)))
        roots = self.root.tolist()
        self.history = [list(p) + [r] for p, r in zip(prompts, roots)]
        if hasattr(self.drafter, "prefilled"):
            starts = [0 if self.ragged == "compact" else width - n for n in lens]
            self.drafter.prefilled(self, [list(range(s, s + n)) for s, n in zip(starts, lens)], aux)
        return roots

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor):
        """Backbone hidden states [B, n, H] and the tapped features [B, n, F] (None without a tap)."""
        if self.tap is None:
            return self.m.hidden(ids, pos, self.cache, mask), None
        return self.m.hidden_aux(ids, pos, self.cache, self.tap, mask)

    @torch.inference_mode()
    def step(self) -> list[tuple[list[int], int]]:
        """One draft-verify-keep step for every active row: per row (emitted tokens, draft tokens proposed)."""
        m = self.m
        buf, cand, draft_q = self.drafter.draft(self)
        tokens = torch.cat([self.root[:, None], cand], dim=1)                  # [B, n]; -1: no draft
        mask, pos = self.cache.step_mask(buf.tree_mask, buf.position_offsets, m.dtype)
        h, aux = self._forward(tokens.clamp(min=0), pos, mask)                  # [B, n, H]
        # a tree built on the device: how deep each row's is (what it proposed) comes with the verdicts
        deepest = (buf.position_offsets.max(-1).values,) if isinstance(buf, StaticTree) else ()
        v = verify_rows(buf, tokens, m.logits(h), self.cfg, draft_q, self.gen, deepest)
        paths, bonus = v.paths, v.bonus
        self.cache.keep(paths)
        rows = torch.arange(len(paths), device=m.device)
        self.h_last = h[rows, to_device([p[-1] for p in paths], m.device)]
        self.root = to_device(bonus, m.device, torch.long)
        self.last_nodes = buf.num_nodes
        path_tokens = v.tokens
        if None in path_tokens:                      # not read with the paths: read them now
            tok = tokens.tolist()
            path_tokens = [[tok[b][i] for i in path] for b, path in enumerate(paths)]
        if deepest:
            proposed = [a[0] for a in v.also]
        else:
            proposed = getattr(self.drafter, "row_proposed", None) or [buf.max_depth] * len(paths)
        out = []
        for b, (path, bon) in enumerate(zip(paths, bonus)):
            new = path_tokens[b][1:] + [bon]
            self.history[b].extend(new)
            out.append((new, proposed[b]))
        if hasattr(self.drafter, "accepted"):
            self.drafter.accepted(self, paths, aux)
        return out

    def keep_rows(self, index: list[int]) -> None:
        """Only rows ``index`` (positions in the active batch) go on; the rest leave the batch."""
        if index == list(range(self.batch)):
            return
        self.cache.select_rows(index)
        sel = to_device(index, self.m.device, torch.long)
        self.root, self.h_last = self.root[sel], self.h_last[sel]
        self.history = [self.history[i] for i in index]
        self.rows = [self.rows[i] for i in index]
        self.drafter.rows_kept(index)


def run_batch(decoder: BatchTreeDecoder, m: MedusaModel, prompts, max_new_tokens: int, eos_token_ids=None,
              max_steps: Optional[int] = None) -> BatchOutput:
    """Prefill every prompt, then step until each row has stopped (EOS kept, ``max_new_tokens``) or
    ``max_steps``; finished rows leave the batch. Each row stops exactly where batch-1 decoding would."""
    rows = prompt_rows(m, prompts)
    lengths = [len(r) for r in rows]
    # a drafter's own cache and what its prompts' first call takes (optional: a drafter that keeps neither has neither)
    sizers = [getattr(decoder.drafter, name, None) for name in ("cache_bytes", "prompt_bytes")]
    check_batch_fits(m, lengths, max_new_tokens, decoder.drafter.max_nodes, decoder.ragged, decoder.drafter.max_depth,
                     sum(size(lengths, max_new_tokens) for size in sizers if size is not None))
    eos = eos_set(m, eos_token_ids)
    emit = [_Emitter(max_new_tokens, eos) for _ in rows]
    outs = [GenerationOutput(tokens=e.tokens, prompt_tokens=len(r), finish_reason="length")
            for e, r in zip(emit, rows)]
    out = BatchOutput(outs)
    t0 = time.perf_counter()
    roots = decoder.prefill(rows, max_new_tokens)
    _sync(m.device)
    out.prefill_s = time.perf_counter() - t0
    for e, r in zip(emit, roots):
        e.add([r])
    steps = 0
    while True:
        live = [i for i, row in enumerate(decoder.rows) if not emit[row].finish]
        decoder.keep_rows(live)
        if not decoder.rows or (max_steps is not None and steps >= max_steps):
            break
        t = time.perf_counter()
        with m.stepping():
            result = decoder.step()
        _sync(m.device)
        out.step_s.append(time.perf_counter() - t)
        out.active.append(decoder.batch)
        out.speculation.append(decoder.last_nodes)
        for row, (new, proposed) in zip(decoder.rows, result):
            outs[row].accept_lengths.append(len(emit[row].add(new)))   # emitted: cut at EOS / the budget
            outs[row].accepted.append(len(new))
            outs[row].proposed.append(proposed)
            outs[row].step_s.append(out.step_s[-1])
        steps += 1
    out.decode_s = time.perf_counter() - t0 - out.prefill_s
    for e, o in zip(emit, outs):
        o.finish_reason = e.finish or "steps"
        o.prefill_s = out.prefill_s
        o.decode_s = out.decode_s
    return out
