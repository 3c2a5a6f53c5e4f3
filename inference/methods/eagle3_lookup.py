"""EAGLE-3's dynamic tree plus a prompt-lookup branch in one verification forward (method ``eagle3_lookup``).

The EAGLE-3 drafter guesses common continuations; prompt lookup (``prompt_lookup.py``) guesses the
ones that repeat the context: an answer that quotes its question, code that reuses identifiers, a
list that repeats its pattern, and the loops a small model falls into under greedy decoding. What one
misses the other often has, and a looked-up continuation is several tokens long where the drafter's
depth-1 guess is one. Each step (batch 1):

  1. the drafter grows its tree exactly as ``eagle3.Eagle3Decoder.tree`` does (same nodes, same tokens);
  2. ``prompt_lookup.NGramIndex`` (incremental, over prompt + emitted tokens) proposes up to
     ``num_tokens`` tokens after the root: what followed the latest earlier occurrence of the
     context's last n tokens, n from ``max_ngram`` down to ``min_ngram``;
  3. the proposal walks down the tree while a child carries its next token (shared prefixes share
     nodes) and the rest of it is grafted as one chain under the last matched node, ranked after that
     node's drafted children (``graft``): the trie has at most N + 1 + ``num_tokens`` nodes;
  4. one backbone forward over the trie (its mask and positions from ``tree_buffers``, as every dynamic
     tree's), the tap reading the drafter's aux layers of every node; ``verify`` picks the path; the
     drafter catches up over the accepted path with those true features, wherever the path ran
     (drafted nodes or looked-up ones), exactly as in ``eagle3``.

Batches (``generate_batch``, ``Eagle3LookupBatchDrafter``): every row grows its tree as batched eagle3
does and grafts its own looked-up branch as here; the rows' tries, of different sizes, are verified
in one forward (narrower ones padded with nodes that are never accepted).

With static steps (``graphs=``) steps graft on the device instead, inside eagle3's captured
tree call (``runtime.static_tree.static_graft``): the proposal (the host knows it: the index holds the emitted tokens)
goes in as a fixed-length input, the chain sits at fixed slots after the tree, and the step reads the host once (its
verdict, which brings the nodes grafted too), batch 1 and batches alike; a step that looks up nothing is eagle3's.

When the lookup finds nothing, or everything it finds is already in the tree, the step is exactly an
eagle3 step. Greedy decoding is token-identical to plain greedy decoding; in sample mode the rule is
eagle3's exact one for deterministic candidates (draft=topk; draft=sampled is refused, as by eagle3): the
drafter's top-k and the looked-up tokens are all fixed before any target randomness. eagle_nodes=0 is
prompt lookup alone, eagle_lookup_tokens=0 the drafter alone (eagle3), both 0 plain decoding: the parts
``choice=auto`` races beside the combined shapes, so the choice is never below either part on the
calibration prompts (code prompts favour the lookup alone, chat prompts the combination).

Switching per step (``eagle_lookup_switch``): where the lookup matched a suffix of at least that many
tokens, the text is most likely being copied, and the step verifies root + the looked-up chain alone; the
drafted nodes' rows are not verified (batch 1 does not draft them). The drafter still catches up over the
accepted tokens with their true features, so the next step drafts as usual.

Why ``min_ngram`` matters here more than for prompt lookup alone: a one-token suffix almost always
matches somewhere and its continuation is rarely right, and on a CPU every verified row costs (a
5-row step ~1.2x a 1-row one with the prepacked kernels). benchmarks/history.md "EAGLE-3 plus prompt lookup"
measures the settings. Proposed per step = the trie's depth (the most it could accept), as
``medusa_lookup`` counts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, Optional, Sequence

import torch

from ..errors import UserError
from ..runtime.batch_decode import BatchTreeDecoder
from ..runtime.graph_capture import to_device
from ..runtime.model import MedusaModel
from ..runtime.static_tree import StaticTree, padded_proposals
from ..runtime.verify import SamplingConfig
from .autoregressive import AutoregressiveDecoder
from .draft import chain_sampling
from .eagle3 import Eagle3Decoder, Eagle3Options, eagle3_batch_decoder, eagle3_costs, fit_options, refuse_heads
from .eagle3_batch import Eagle3BatchDrafter
from .eagle3_choice import Eagle3Shape
from .eagle3_static import chain_call, tree_step
from .prompt_lookup import (LookupDrafter, NGramIndex, PromptLookupDecoder, PromptLookupSettings,
                            check_lookup_settings, match_in_tree)
from .registry import Method, option, register, slot_costs


# (nodes, depth, topk) raced with the lookup off and switching (``Eagle3LookupOptions.part_shapes``)
DRAFTER_PARTS = ((2, 1, 2), (4, 1, 4), (8, 2, 4))
SWITCH_PARTS = ((4, 1, 4), (8, 2, 4))


@dataclass
class Eagle3LookupOptions(Eagle3Options):
    """eagle3's tree keys plus the looked-up branch's own keys (its defaults differ from prompt_lookup's:
    grafted rows cost every step they are verified, so only suffixes of 2+ tokens are looked up)."""

    METHOD: ClassVar[str] = "eagle3_lookup"
    num_tokens: int = option(6, "eagle_lookup_tokens", "most tokens looked up per step; 0: no looked-up branch "
                             "(the drafter alone, as eagle3)")
    max_ngram: int = option(3, "eagle_lookup_max_ngram", "longest suffix looked up")
    min_ngram: int = option(2, "eagle_lookup_min_ngram", "shortest suffix looked up")
    switch: int = option(0, "eagle_lookup_switch", "a step whose lookup matched a suffix of at least this many "
                         "tokens verifies the looked-up chain alone (no drafted nodes: text being copied); "
                         "0: never, at most eagle_lookup_max_ngram")

    def __post_init__(self):
        super().__post_init__()
        keys = {f.name: f.metadata["key"] for f in dataclasses.fields(self)}
        check_lookup_settings(self, keys.get, min_tokens=0)   # named by this method's keys (eagle_lookup_*)
        s = self.switch
        if isinstance(s, bool) or not isinstance(s, int) or not (s == 0 or self.min_ngram <= s <= self.max_ngram):
            raise UserError(f"eagle_lookup_switch must be 0 or a suffix length in {self.min_ngram}..{self.max_ngram} "
                            f"(eagle_lookup_min_ngram..max_ngram), got {s!r}")
        self.lookup = PromptLookupSettings(max(self.num_tokens, 1), self.max_ngram, self.min_ngram)

    @property
    def label(self) -> str:
        """eagle3's label (the floor too: settings differing in eagle_min_prob alone are two settings, e.g. in a
        schedule's rates) plus the looked-up branch's keys."""
        branch = f"t{self.num_tokens}-m{self.min_ngram}" + (f"-s{self.switch}" if self.switch else "")
        if not self.num_tokens:
            return super().label                        # the drafter alone (or, without nodes, plain decoding)
        return f"{super().label}+{branch}" if self.nodes != 0 else f"prompt lookup {branch}"

    @property
    def looks_up(self) -> bool:
        return self.num_tokens > 0

    def part_shapes(self) -> tuple:
        """What ``choice=auto`` races besides the combined shapes (``eagle3_choice.eagle3_fields``'s
        tuples: nodes, depth, topk, min_prob, num_tokens, switch; None keeps these options' value): the
        lookup alone, the drafter alone at the shallow shapes that pay on a one-step drafter, and the
        combination switching to the chain alone on a full-length or any suffix match. Which pays depends on
        the prompts: text that copies its context (code) favours the lookup alone, chat the combination."""
        lookup_only = ((0, 1, 1),)
        drafter_only = tuple((n, d, k, None, 0) for n, d, k in DRAFTER_PARTS)
        switching = tuple((n, d, k, None, None, s) for n, d, k in SWITCH_PARTS
                          for s in dict.fromkeys((self.max_ngram, self.min_ngram)))
        return lookup_only + drafter_only + switching if self.looks_up else ()

    @property
    def plain_shape(self) -> tuple:
        """Plain decoding in these options' fields: no drafted nodes and no looked-up branch."""
        return (0, 1, 1, None, 0)

    def fixed_choice(self):
        # eagle_nodes=0 is prompt lookup alone, not plain decoding; plain only without the lookup too
        return self if self.nodes or self.looks_up else None

    @property
    def steps_vary(self) -> bool:
        return self.looks_up or super().steps_vary   # a chain is grafted only where the context repeats itself

    def batch_drafter(self, m: MedusaModel, schedule) -> "Eagle3BatchDrafter":
        """The batched drafter of ``schedule``'s tree settings with this method's looked-up branch (eagle3's
        own without one)."""
        if not self.looks_up:
            return Eagle3BatchDrafter(m, schedule)
        return Eagle3LookupBatchDrafter(m, schedule, self.lookup, self.switch)


def graft(tokens: Sequence[int], parents: Sequence[int], proposal: Sequence[int]) -> tuple[int, int]:
    """Where ``proposal`` leaves the tree (node 0 the root; ``parents[i]`` node i's parent, parents before
    children): (the last node whose path it follows, how many of its tokens that path covers); the rest
    hangs under that node as a new chain."""
    children: list[list[int]] = [[] for _ in parents]
    for i in range(1, len(parents)):
        children[int(parents[i])].append(i)
    return match_in_tree(children, tokens, proposal)


def switches(switch: int, proposal: Sequence[int], matched: int) -> bool:
    """Whether a step verifies the looked-up chain alone: its suffix match is at least ``switch`` tokens
    long (0: never). Copied text (code that repeats identifiers, an answer quoting its question) is where the lookup is
    right for several tokens and the drafter's nodes are rows verified for nothing (~7% of a step each on
    a CPU)."""
    return bool(switch) and bool(proposal) and matched >= switch


def root_only(root: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A tree of the root alone (tokens [1], parents [-1], depths [0]), for a graft to hang its chain on."""
    return root, torch.full((1,), -1, dtype=torch.long, device=root.device), torch.zeros(1, dtype=torch.long,
                                                                                       device=root.device)


def graft_branch(tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, proposal: Sequence[int]):
    """One tree (tokens with the root first, parents (-1: the root), depths [T]) with ``proposal``'s
    part that the tree lacks hung on as one chain (``graft``): (tokens, parents, depths, nodes added)."""
    if not proposal:
        return tokens, parents, depths, 0
    node, n = graft(tokens.tolist(), parents.tolist(), proposal)
    rest = len(proposal) - n
    if not rest:                                # already in the tree: a plain eagle3 step
        return tokens, parents, depths, 0
    first = tokens.numel()
    chain_parents = torch.arange(first - 1, first + rest - 1, device=parents.device)
    chain_parents[0] = node
    chain_depths = depths[node] + torch.arange(1, rest + 1, device=depths.device)
    return (torch.cat([tokens, tokens.new_tensor(proposal[n:])]), torch.cat([parents, chain_parents]),
            torch.cat([depths, chain_depths]), rest)


class Eagle3LookupDecoder(Eagle3Decoder):
    """``Eagle3Decoder`` whose tree gets the looked-up continuation grafted on; see the module docstring."""

    def __init__(self, m: MedusaModel, options: Eagle3LookupOptions, sampling: Optional[SamplingConfig] = None,
                 seed: Optional[int] = None):
        super().__init__(m, options, sampling, seed)    # refuses draft=sampled, as eagle3 does
        self.s = options.lookup
        self.index = NGramIndex(self.s.min_ngram, self.s.max_ngram)
        self.extra_nodes = options.num_tokens
        self.grafted = self.grafted_nodes = 0   # steps that grafted a chain, nodes grafted (for scripts' reports)
        self.switched = 0                       # steps that verified the looked-up chain alone (``switch``)

    @torch.inference_mode()
    def prefill(self, prompt: torch.Tensor, max_new_tokens: int) -> int:
        root = super().prefill(prompt, max_new_tokens)
        self.index.extend(prompt[0].tolist() + [root])
        return root

    def tree(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        proposal = self.index.propose(self.o.num_tokens) if self.o.looks_up else []
        if switches(self.o.switch, proposal, self.index.last_match):    # text being copied: the chain alone
            self.switched += 1
            tokens, parents, depths = root_only(torch.full((1,), self.root, dtype=torch.long, device=self.m.device))
        else:
            tokens, parents, depths = super().tree()
        tokens, parents, depths, rest = graft_branch(tokens, parents, depths, proposal)
        self.grafted += int(rest > 0)
        self.grafted_nodes += rest
        return tokens, parents, depths

    def _static_tree(self) -> tuple[StaticTree, tuple]:
        """``tree`` on the device (static steps): eagle3's captured tree call with the looked-up
        chain grafted on in it (``static_graft``) at the fixed size nodes + 1 + eagle_lookup_tokens; a step that
        switches verifies the root and the chain alone without drafting (``chain_call``), one that looks up nothing
        is eagle3's. The nodes grafted come back with the step's one host read (``also_read``)."""
        proposal = self.index.propose(self.o.num_tokens) if self.o.looks_up else []
        if not proposal:
            return super()._static_tree()
        o, kv, dev = self.o, self.dkv, self.m.device
        padded = padded_proposals([proposal], o.num_tokens, dev)[0]
        root = torch.full((), self.root, dtype=torch.long, device=dev)
        if switches(o.switch, proposal, self.index.last_match):
            self.switched += 1
            fields = self.m.static.calls.run(f"eagle3.chain{o.num_tokens}", chain_call(o.num_tokens), (root, padded))
        else:
            name, fn = tree_step(self.drafter, kv, o, o.num_tokens)     # named by every value it freezes
            fields = self.m.static.calls.run(name, fn, (*self._draft_inputs(), root, padded), keep=kv)
        return StaticTree(*fields[:5]), fields[5:]

    @torch.inference_mode()
    def step(self) -> tuple[list[int], int]:
        new, depth = super().step()
        if self.also_read:            # a device-built graft: its node count came with the verdict
            self.grafted += int(self.also_read[0] > 0)
            self.grafted_nodes += self.also_read[0]
        self.index.extend(new)
        return new, depth


class Eagle3LookupBatchDrafter(Eagle3BatchDrafter):
    """Batched ``eagle3_lookup`` (``generate_batch``): every row grows its eagle3 tree exactly as
    ``Eagle3BatchDrafter`` does, and gets its own looked-up branch grafted on as at batch 1 (each row
    looks up its own context); a row whose graft is shorter than another's pads with nodes that are
    computed and never accepted (``RowTrees``). A plain step of the schedule (None) drafts and looks
    up nothing. Proposed per row and step = its tree's depth, as at batch 1."""

    def __init__(self, m: MedusaModel, options, lookup: PromptLookupSettings, switch: int = 0):
        super().__init__(m, options)
        self.s, self.switch = lookup, switch
        self.max_nodes += lookup.num_tokens
        self.max_depth = max(self.max_depth, lookup.num_tokens)   # a graft's depth is its proposal's length
        self.indexes: list[NGramIndex] = []
        self.seen: list[int] = []

    def prefilled(self, dec: BatchTreeDecoder, paths, aux) -> None:
        self.indexes = []            # a new batch (the batch sizing reuses one drafter for many)
        super().prefilled(dec, paths, aux)

    def _lookups(self, dec: BatchTreeDecoder) -> list[tuple[list[int], bool]]:
        """Every row's looked-up proposal and whether the row verifies it alone (``switches``), its index first
        brought up to date with the row's history."""
        if not self.indexes:
            self.indexes = [NGramIndex(self.s.min_ngram, self.s.max_ngram) for _ in dec.history]
            self.seen = [0] * len(dec.history)
        out = []
        for b, hist in enumerate(dec.history):
            self.indexes[b].extend(hist[self.seen[b]:])
            self.seen[b] = len(hist)
            proposal = self.indexes[b].propose(self.s.num_tokens)
            out.append((proposal, switches(self.switch, proposal, self.indexes[b].last_match)))
        return out

    def amend(self, dec: BatchTreeDecoder, rows: list) -> list:
        out = []
        for row, (proposal, alone) in zip(rows, self._lookups(dec)):
            if alone:                   # this row: its looked-up chain alone
                row = root_only(row[0][:1])
            out.append(graft_branch(*row, proposal)[:3])
        return out

    def _static_trees(self, o, dec: BatchTreeDecoder) -> StaticTree:
        """``amend`` on the device (static steps): eagle3's captured tree call with every row's
        looked-up chain grafted on in it (``static_graft``), each tree nodes + 1 + eagle_lookup_tokens; a switching
        row's drafted nodes masked. A step where no row looks anything up is eagle3's."""
        lookups = self._lookups(dec)
        if not any(p for p, _ in lookups):
            return super()._static_trees(o, dec)
        kv, dev, width = self.dkv, self.m.device, self.s.num_tokens
        kv.reserve((o.depth - 1) * o.topk)
        proposals = padded_proposals([p for p, _ in lookups], width, dev)
        alone = to_device([a for _, a in lookups], dev)
        name, fn = tree_step(self.d, kv.cache, o, width, batched=True)     # named by every value it freezes
        fields = self.m.static.calls.run(name, fn,
                                         (self.root_logits, self.root_state, kv.committed, dec.root, proposals, alone),
                                         rows=dec.batch, keep=kv.cache)
        return StaticTree(*fields[:5])

    def rows_kept(self, index: list[int]) -> None:
        super().rows_kept(index)
        if self.indexes:
            self.indexes = [self.indexes[i] for i in index]
            self.seen = [self.seen[i] for i in index]


def eagle3_lookup_batch_decoder(m: MedusaModel, o: Eagle3LookupOptions, sampling: Optional[SamplingConfig], seed,
                                ragged: str) -> BatchTreeDecoder:
    """Every row eagle3's tree plus its looked-up branch (eagle3's batched decoder, through these
    options' ``batch_drafter``). eagle_nodes=0 without a schedule is batched prompt lookup with this
    method's lookup keys, as batch 1 decodes prompt lookup alone then; a schedule's None is a plain step
    (the batch sizing raced the settings against plain decoding), as for eagle3."""
    if o.schedule is None and not o.nodes and o.looks_up:
        return BatchTreeDecoder(m, LookupDrafter(m, o.lookup), chain_sampling(sampling or SamplingConfig()), seed,
                                ragged)
    return eagle3_batch_decoder(m, o, sampling, seed, ragged)   # plain where neither drafts


def eagle3_lookup_decoder(m: MedusaModel, o: Eagle3LookupOptions, sampling: Optional[SamplingConfig], seed):
    """Batch 1: the drafter's tree plus the looked-up branch; eagle_nodes=0 prompt lookup alone with this
    method's lookup keys; eagle_lookup_tokens=0 the drafter alone (an eagle3 step); neither: plain decoding."""
    if o.nodes:
        return Eagle3LookupDecoder(m, o, sampling, seed) if o.looks_up else Eagle3Decoder(m, o, sampling, seed)
    if o.looks_up:
        return PromptLookupDecoder(m, o.lookup, sampling, seed)
    return AutoregressiveDecoder(m, sampling, seed)


def eagle3_lookup_costs(m: MedusaModel, o: Eagle3LookupOptions, run_length: int):
    """eagle3's costs plus the looked-up chain's backbone cache slots."""
    if not o.nodes:
        return slot_costs(m, o.lookup.extra_kv_tokens if o.looks_up else 0)
    costs = eagle3_costs(m, o, run_length)
    costs.extra_kv_cache_bytes += slot_costs(m, o.num_tokens).extra_kv_cache_bytes
    return costs


register(Method(
    "eagle3_lookup", "EAGLE-3's dynamic tree plus a prompt-lookup branch, verified in one forward (needs eagle3 "
    "heads=; eagle_* and eagle_lookup_* keys)", Eagle3LookupOptions,
    decoder=eagle3_lookup_decoder,
    batch_decoder=eagle3_lookup_batch_decoder,
    costs=eagle3_lookup_costs, needs_heads=True, refuses=lambda spec: refuse_heads(spec, "eagle3_lookup"),
    fit=fit_options, shape=Eagle3Shape(),
    # EAGLE-3 heads' default: faster than eagle3 in every interleaved run on the recipe's drafter (1.09-1.21x
    # over it; 1.48x vs 1.23x the loop, each at choice=auto) and lossless alike (benchmarks/history.md "Decoding
    # defaults fitted to the drafter")
    default_priority=1))
