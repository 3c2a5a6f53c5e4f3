"""Medusa + prompt lookup in one verification forward (method ``medusa_lookup``).

Prompt lookup (``prompt_lookup.py``) hits when the answer copies its context; Medusa heads hit on
common continuations. Each step of ``HybridDecoder`` puts up both and verifies them together:

  1. the heads draft the fixed Medusa tree exactly as ``medusa.TreeDecoder.step`` does
     (the family's ``draft_tree``: one call per depth for Medusa heads, level by level for
     Hydra / MLP speculator heads);
  2. ``prompt_lookup.NGramIndex`` (incremental, as in ``PromptLookupDecoder``) proposes up to
     ``num_tokens`` tokens after the root;
  3. the proposal is merged into the tree as a trie: it walks down the tree while a child carries
     its next token (identical prefixes share nodes), and the rest of it becomes one new chain
     under the last matched node (the graft). The trie has at most
     ``tree nodes + num_tokens`` nodes; the tree's nodes keep their tokens, and the trie is an
     ordinary ``MedusaTree`` (the tree's paths + the chain's), so its buffers (mask, positions,
     retrieve indices, children) come from the same code as every tree's and are built once per
     (tree, graft point, chain length) and reused;
  4. ONE forward of the backbone over root + trie nodes (position past + depth, the trie's 4D
     additive mask), ``verify.verify`` on the trie, ``TreeKVCache.keep`` to the accepted path;
     the accepted tokens and the bonus are emitted and fed to the n-gram index.

When the lookup finds nothing, or everything it finds is already in the tree, the step is exactly
a Medusa step with the fixed tree (same buffers, same tokens, same accepted path).

With static steps (``graphs=``) steps graft on the device instead
(``runtime.static_tree.static_graft``, a captured call per tree): walking the proposal down the tree needs the heads'
tokens, which the host would have to read (on a GPU a wait for the device); there the chain sits at fixed slots after
the tree, unused slots masked, and the step reads the host once (its verdict).

Modes: greedy is token-identical to plain greedy decoding (whatever the guesses). typical:
Medusa's lossy rule on the trie. sample: exact, with the deterministic-candidate rule
(``draft="topk"``: draw Y ~ p at an accepted node, descend into the child carrying Y, else Y is
the bonus; see verify.py): the heads' top-k tokens and the looked-up tokens are all fixed before
any target randomness, which is what that rule needs. ``draft="sampled"`` would need a draft
distribution q for the looked-up tokens, which does not exist, so it is replaced by "topk" here
(as lookahead and prompt lookup do, ``draft.chain_sampling``).

Proposed per step = the trie's depth (the most one step can accept), as the evaluation harness
counts Medusa's tree and lookahead's trie. Extra KV cache: tree nodes + ``num_tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from ..heads.drafting import static_tree_refusal
from ..runtime.decode import prefill_token, seeded_generator
from ..runtime.graph_capture import to_device
from ..runtime.model import MedusaModel
from ..runtime.static_tree import StaticTree, padded_proposals, static_graft, tree_structure
from ..runtime.tree import MedusaTree, TreeBuffers, resolve_tree
from ..runtime.verify import SamplingConfig, verify
from .draft import chain_sampling
from .medusa import MEDUSA_TREE, check_tree_heads, checked_tree, tree_nodes
from .prompt_lookup import NGramIndex, PromptLookupDecoder, PromptLookupSettings, match_in_tree
from .registry import Method, heads_costs, option, register

@dataclass
class MedusaLookupOptions(PromptLookupSettings):
    """The prompt-lookup settings (same keys as method prompt_lookup) and the Medusa tree."""

    tree: Any = option("tree8", "tree", "as method medusa's; None: prompt lookup alone")


# (tree paths, device) -> {(graft node, chain length): (trie buffers, token gather index)}.
# Bounded by nodes x num_tokens per tree; shared by every decoder on the same tree.
_GRAFTS: dict[tuple, dict[tuple[int, int], tuple[TreeBuffers, torch.Tensor]]] = {}


def match_prefix(tree: MedusaTree, node_tokens: Sequence[int], proposal: Sequence[int]) -> tuple[int, int]:
    """Walk ``proposal`` down ``tree`` from the root while a child carries its next token.

    ``node_tokens[i]`` is the token of tree node i (node 0 = the root). Returns (the last matched
    node, how many proposal tokens it matched); the unmatched rest is what the trie adds."""
    return match_in_tree(tree.children, node_tokens, proposal)


def graft_tree(tree: MedusaTree, node: int, length: int) -> tuple[MedusaTree, list[int]]:
    """``tree`` with a chain of ``length`` new nodes under ``node`` (ranked after its children).

    Returns (the trie, source of each trie node): source i < N is tree node i, source N + j is
    the chain's j-th token, so trie tokens = cat(tree tokens, chain tokens)[source]."""
    if length < 1:
        raise ValueError("a graft adds at least one node")
    base = tree.paths[node - 1] if node else ()
    first = base + (len(tree.children[node]),)
    chain = [first + (0,) * j for j in range(length)]
    trie = MedusaTree(list(tree.paths) + chain, name=f"{tree.name or 'tree'}+lookup")
    index = {p: i + 1 for i, p in enumerate(tree.paths)}
    n = tree.num_nodes
    source = [0] + [index[p] if p in index else n + len(p) - len(first) for p in trie.paths]
    return trie, source


class HybridDecoder:
    """Medusa tree + prompt-lookup branch, one forward per step; see the module docstring.

    After each step: ``cache`` holds prompt + every emitted token except ``root``; ``last_path``
    is the accepted trie path and ``last_trie`` the trie's buffers (the tree's own when nothing
    was grafted; a ``StaticTree`` where the graft was built on the device)."""

    def __init__(self, m: MedusaModel, tree, settings: Optional[PromptLookupSettings] = None,
                 sampling: Optional[SamplingConfig] = None, seed: Optional[int] = None):
        check_tree_heads(m, "method medusa_lookup needs Medusa heads (heads=<export directory>); prompt_lookup "
                            "alone runs without them")
        self.m = m
        self.tree: MedusaTree = checked_tree(m, resolve_tree(tree, m.num_heads))
        self.buf = self.tree.buffers(m.device)
        self.s = settings or PromptLookupSettings()
        self.cfg = chain_sampling(sampling or SamplingConfig())   # sample mode: the exact fixed-candidate rule
        m.heads.check_sampling(self.cfg)
        self.gen = seeded_generator(m.device, seed)
        self.index = NGramIndex(self.s.min_ngram, self.s.max_ngram)
        self._grafts = _GRAFTS.setdefault((self.tree.paths, str(m.device)), {})
        self.cache = None
        self.past = 0
        self.root: Optional[int] = None
        self.h_last: Optional[torch.Tensor] = None
        self.last_path: list[int] = []
        self.last_trie: TreeBuffers = self.buf
        self._graft_call = None     # ``_device_trie``'s captured function (static steps)

    @property
    def extra_kv_tokens(self) -> int:
        """Cache slots beyond prompt + max_new_tokens: the largest trie."""
        return self.buf.num_nodes + self.s.num_tokens

    def _graft(self, node: int, length: int) -> tuple[TreeBuffers, torch.Tensor]:
        key = (node, length)
        if key not in self._grafts:
            trie, source = graft_tree(self.tree, node, length)
            self._grafts[key] = (trie.buffers(self.m.device),
                                 to_device(source, self.m.device, torch.long))
        return self._grafts[key]

    @torch.inference_mode()
    def prefill(self, prompt: torch.Tensor, max_new_tokens: int) -> int:
        self.past = prompt.shape[1]
        self.cache = self.m.new_cache(self.past + max_new_tokens + self.extra_kv_tokens)
        self.h_last, self.root = prefill_token(self.m, prompt, self.cache, self.cfg, self.gen)
        self.index.extend(prompt[0].tolist() + [self.root])
        return self.root

    def trie_tokens(self, on_device: bool = False) -> tuple[TreeBuffers | StaticTree, torch.Tensor]:
        """This step's trie and its tokens [T] (node 0 = the root): heads' tree + lookup branch. ``on_device``: the
        graft built on the device (``_device_trie``), its unused slots masked (token -1)."""
        m, buf = self.m, self.buf
        cand, _ = m.draft_tree(buf, self.h_last, self.root, self.cfg, self.gen)   # draft_q None: draft=topk
        tokens = torch.cat([torch.full((1,), self.root, dtype=torch.long, device=m.device), cand])   # no host copy
        proposal = self.index.propose(self.s.num_tokens)
        if not proposal:
            return buf, tokens
        if on_device:
            trie = self._device_trie(tokens, proposal)
            return trie, trie.tokens
        node, n = match_prefix(self.tree, tokens.tolist(), proposal)
        if n == len(proposal):                            # already in the tree: a plain Medusa step
            return buf, tokens
        trie, source = self._graft(node, len(proposal) - n)
        rest = to_device(proposal[n:], m.device, torch.long)
        return trie, torch.cat([tokens, rest])[source]

    def _device_trie(self, tokens: torch.Tensor, proposal: list[int]) -> StaticTree:
        """The graft without reading the tree's tokens: a captured call (named by the tree's structure) of
        ``static_graft`` over the fixed tree, the proposal a fixed-length input (-1 padded)."""
        buf, width = self.buf, self.s.num_tokens
        if self._graft_call is None:      # the tree's fields, fixed: built once, not each step
            parents, depths = buf.parents[None], buf.position_offsets[None]
            mask, paths = tree_structure(parents, depths, buf.max_depth)
            self._graft_call = lambda tokens, proposal: tuple(
                f[0] for f in static_graft(tokens[None], parents, depths, mask, paths, proposal[None])[:5])
        padded = padded_proposals([proposal], width, self.m.device)[0]
        # keep: the function holds the fixed fields the captured graph reads (a graph keeps no tensor alive itself)
        return StaticTree(*self.m.static.calls.run(f"medusa_lookup.graft{width}-{buf.shape_key}", self._graft_call,
                                                   (tokens, padded), keep=(buf, self._graft_call)))

    @torch.inference_mode()
    def step(self) -> tuple[list[int], int]:
        """One draft-verify-compact step; returns (accepted tokens + the bonus token, the trie's depth).

        "Proposed" is the depth (the most one step can accept), as the harness counts Medusa's
        tree and lookahead's trie, so acceptance rates compare across methods. With static steps a step's graft
        is built on the device, its depth read with the verdict: one host read a step."""
        m, past = self.m, self.past
        trie, tokens = self.trie_tokens(on_device=getattr(m, "static", None) is not None)
        positions = (trie.position_offsets + past)[None]
        static = isinstance(trie, StaticTree)
        ids = tokens.clamp(min=0) if static else tokens    # a masked slot's -1 is for verification, not the embedding
        h = m.hidden(ids[None], positions, self.cache, trie.additive_mask(past, m.dtype))[0]
        if static:
            verdict = verify(trie, tokens, m.logits(h), self.cfg, None, self.gen, also=[trie.position_offsets.max()])
            depth = verdict.also[0]
        else:
            verdict, depth = verify(trie, tokens, m.logits(h), self.cfg, None, self.gen), trie.max_depth
        self.cache.keep(past, verdict.path)
        new = verdict.accepted_tokens(tokens) + [verdict.bonus]
        self.index.extend(new)
        self.last_path, self.last_trie = verdict.path, trie
        self.h_last = h[verdict.path[-1]]
        self.past = past + len(verdict.path)
        self.root = verdict.bonus
        return new, depth


register(Method(
    "medusa_lookup", "Medusa's tree plus a prompt-lookup branch, verified in the same forward (needs heads=; "
    "tree= and the prompt_lookup_* keys)", MedusaLookupOptions,
    decoder=lambda m, o, sampling, seed: (HybridDecoder(m, o.tree, o, sampling, seed) if o.tree is not None
                                          else PromptLookupDecoder(m, o, sampling, seed)),
    costs=lambda m, o, run_length: heads_costs(m, (tree_nodes(m, o.tree) if o.tree is not None else 1) + o.num_tokens),
    needs_heads=True, shape=MEDUSA_TREE, refuses=static_tree_refusal, grafted=lambda o: o.num_tokens))
