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

When the lookup finds nothing, or everything it finds is already in the tree, the step is exactly an
eagle3 step. Greedy decoding is token-identical to plain greedy decoding; in sample mode the rule is
eagle3's exact one for deterministic candidates (draft=topk; draft=sampled is refused, as by eagle3): the
drafter's top-k and the looked-up tokens are all fixed before any target randomness. eagle_nodes=0 is
prompt lookup alone.

Why ``min_ngram`` matters here more than for prompt lookup alone: a one-token suffix almost always
matches somewhere and its continuation is rarely right, and on a CPU every verified row costs (a
5-row step ~1.2x a 1-row one with the prepacked kernels). BENCHMARKS.md "EAGLE-3 plus prompt lookup"
measures the settings. Proposed per step = the trie's depth (the most it could accept), as
``medusa_lookup`` counts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, Optional, Sequence

import torch

from ..runtime.batch_decode import BatchTreeDecoder
from ..runtime.model import MedusaModel
from ..runtime.verify import SamplingConfig
from .draft import chain_sampling
from .eagle3 import Eagle3Decoder, Eagle3Options, eagle3_batch_decoder, eagle3_costs, fit_options, refuse_heads
from .eagle3_batch import Eagle3BatchDrafter
from .prompt_lookup import (LookupDrafter, NGramIndex, PromptLookupDecoder, PromptLookupSettings,
                            check_lookup_settings, match_in_tree)
from .registry import Method, option, register, slot_costs


@dataclass
class Eagle3LookupOptions(Eagle3Options):
    """eagle3's tree keys plus the looked-up branch's own keys (its defaults differ from prompt_lookup's:
    grafted rows cost every step they are verified, so only suffixes of 2+ tokens are looked up)."""

    METHOD: ClassVar[str] = "eagle3_lookup"
    num_tokens: int = option(6, "eagle_lookup_tokens", "most tokens looked up per step")
    max_ngram: int = option(3, "eagle_lookup_max_ngram", "longest suffix looked up")
    min_ngram: int = option(2, "eagle_lookup_min_ngram", "shortest suffix looked up")

    def __post_init__(self):
        super().__post_init__()
        keys = {f.name: f.metadata["key"] for f in dataclasses.fields(self)}
        check_lookup_settings(self, keys.get)          # named by this method's keys (eagle_lookup_*)
        self.lookup = PromptLookupSettings(self.num_tokens, self.max_ngram, self.min_ngram)

    @property
    def label(self) -> str:
        branch = f"t{self.num_tokens}-m{self.min_ngram}"
        return f"n{self.nodes}-d{self.depth}-k{self.topk}+{branch}" if self.nodes else f"prompt lookup {branch}"

    def fixed_choice(self):
        return self                  # eagle_nodes=0 is prompt lookup alone, not plain decoding

    @property
    def steps_vary(self) -> bool:
        return self.num_tokens > 0 or super().steps_vary   # a chain is grafted only where the context repeats itself

    def batch_drafter(self, m: MedusaModel, schedule) -> "Eagle3LookupBatchDrafter":
        """The batched drafter of ``schedule``'s tree settings with this method's looked-up branch."""
        return Eagle3LookupBatchDrafter(m, schedule, self.lookup)


def graft(tokens: Sequence[int], parents: Sequence[int], proposal: Sequence[int]) -> tuple[int, int]:
    """Where ``proposal`` leaves the tree (node 0 the root; ``parents[i]`` node i's parent, parents before
    children): (the last node whose path it follows, how many of its tokens that path covers); the rest
    hangs under that node as a new chain."""
    children: list[list[int]] = [[] for _ in parents]
    for i in range(1, len(parents)):
        children[int(parents[i])].append(i)
    return match_in_tree(children, tokens, proposal)


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
        self.extra_nodes = self.s.num_tokens
        self.grafted = self.grafted_nodes = 0   # steps that grafted a chain, nodes grafted (for scripts' reports)

    @torch.inference_mode()
    def prefill(self, prompt: torch.Tensor, max_new_tokens: int) -> int:
        root = super().prefill(prompt, max_new_tokens)
        self.index.extend(prompt[0].tolist() + [root])
        return root

    def tree(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tokens, parents, depths = super().tree()
        tokens, parents, depths, rest = graft_branch(tokens, parents, depths, self.index.propose(self.s.num_tokens))
        self.grafted += int(rest > 0)
        self.grafted_nodes += rest
        return tokens, parents, depths

    @torch.inference_mode()
    def step(self) -> tuple[list[int], int]:
        new, depth = super().step()
        self.index.extend(new)
        return new, depth


class Eagle3LookupBatchDrafter(Eagle3BatchDrafter):
    """Batched ``eagle3_lookup`` (``generate_batch``): every row grows its eagle3 tree exactly as
    ``Eagle3BatchDrafter`` does, and gets its own looked-up branch grafted on as at batch 1 (each row
    looks up its own context); a row whose graft is shorter than another's pads with nodes that are
    computed and never accepted (``RowTrees``). A plain step of the schedule (None) drafts and looks
    up nothing. Proposed per row and step = its tree's depth, as at batch 1."""

    def __init__(self, m: MedusaModel, options, lookup: PromptLookupSettings):
        super().__init__(m, options)
        self.s = lookup
        self.max_nodes += lookup.num_tokens
        self.max_depth = max(self.max_depth, lookup.num_tokens)   # a graft's depth is its proposal's length
        self.indexes: list[NGramIndex] = []
        self.seen: list[int] = []

    def prefilled(self, dec: BatchTreeDecoder, paths, aux) -> None:
        self.indexes = []            # a new batch (the batch sizing reuses one drafter for many)
        super().prefilled(dec, paths, aux)

    def amend(self, dec: BatchTreeDecoder, rows: list) -> list:
        if not self.indexes:
            self.indexes = [NGramIndex(self.s.min_ngram, self.s.max_ngram) for _ in dec.history]
            self.seen = [0] * len(dec.history)
        out = []
        for b, (hist, row) in enumerate(zip(dec.history, rows)):
            self.indexes[b].extend(hist[self.seen[b]:])
            self.seen[b] = len(hist)
            out.append(graft_branch(*row, self.indexes[b].propose(self.s.num_tokens))[:3])
        return out

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
    if o.schedule is None and not o.nodes:
        return BatchTreeDecoder(m, LookupDrafter(m, o.lookup), chain_sampling(sampling or SamplingConfig()), seed,
                                ragged)
    return eagle3_batch_decoder(m, o, sampling, seed, ragged)


def eagle3_lookup_costs(m: MedusaModel, o: Eagle3LookupOptions, run_length: int):
    """eagle3's costs plus the looked-up chain's backbone cache slots."""
    if not o.nodes:
        return slot_costs(m, o.lookup.extra_kv_tokens)
    costs = eagle3_costs(m, o, run_length)
    costs.extra_kv_cache_bytes += slot_costs(m, o.num_tokens).extra_kv_cache_bytes
    return costs


register(Method(
    "eagle3_lookup", "EAGLE-3's dynamic tree plus a prompt-lookup branch, verified in one forward (needs eagle3 "
    "heads=; eagle_* and eagle_lookup_* keys)", Eagle3LookupOptions,
    decoder=lambda m, o, sampling, seed: (Eagle3LookupDecoder(m, o, sampling, seed) if o.nodes
                                          else PromptLookupDecoder(m, o.lookup, sampling, seed)),
    batch_decoder=eagle3_lookup_batch_decoder,
    costs=eagle3_lookup_costs, needs_heads=True, refuses=lambda spec: refuse_heads(spec, "eagle3_lookup"),
    fit=fit_options,
    # EAGLE-3 heads' default: faster than eagle3 in every interleaved run on the recipe's drafter (1.09-1.21x
    # over it; 1.48x vs 1.23x the loop, each at eagle_tree=auto) and lossless alike (BENCHMARKS.md "Decoding
    # defaults fitted to the drafter")
    default_priority=1))
