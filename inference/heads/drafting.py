"""How heads fill a draft tree: the drafting interface every head family provides.

A decoding method never asks which family it holds; it calls three methods every heads module
has (from one of the two mixins below):

  ``check_sampling(cfg)``            refuse a sampling setting the family cannot draft exactly
  ``draft_tree(buf, h_last, root, cfg, gen, vocab_size)``
                                     tokens of tree nodes 1..N-1 (tree order) and the draft
                                     distributions (``None`` for deterministic top-k drafts)
  ``path_logits(hidden, future, k)`` head k's logits at ``hidden`` given the path tokens
                                     ``future[..., :k+1]`` (ignored by heads that see h_t alone):
                                     what calibration and training score

``IndependentDrafting`` is for heads that see only h_t (Medusa); ``PathDrafting`` for heads
fed the path they extend (Hydra, MLP speculator), drafted level by level as below;
``ContextDrafting`` for drafters with their own KV cache (EAGLE-3), which draft dynamic trees
in their own decoding method.

Medusa heads see only h_t, so one call per head fills a whole depth of the tree
(``verify.propose``). A dependent head must be fed the path it extends: the head for depth
d runs once for every node at depth d-1 that has children, with that node's token and the
state of its own path, and its top-k become that node's children. A tree of depth D costs
D small sequential head calls (each on a handful of rows) before the one verification
forward, which is the cost ``measure_step_latency`` then counts when sizing the tree.

Node i of the tree (choices of ranks, ``MedusaTree``) with rank r at depth d carries the
r-th most likely token of head d-1 *given its parent's path*; for Medusa heads the same
choice list means the r-th guess of head d-1 at h_t. Verification (greedy, typical, exact
sampling with ``draft="topk"``) is unchanged: it only needs the tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..errors import UserError
from ..runtime.tree import TreeBuffers
from ..runtime.verify import SamplingConfig, propose
from .registry import family


@dataclass
class _Level:
    """Depth d of a tree: which nodes at d-1 have children, and where each child comes from."""

    parent_rows: torch.Tensor   # [P] rows of the parents within level d-1's node list
    parent_nodes: torch.Tensor  # [P] node indices of those parents
    nodes: torch.Tensor         # [C] node indices at depth d (tree order)
    from_parent: torch.Tensor   # [C] index into parent_rows of each node's parent
    rank: torch.Tensor          # [C] top-k rank of each node among its parent's guesses
    topk: int                   # how many guesses each parent must provide


def _levels(buf: TreeBuffers) -> list[_Level]:
    cached = buf.__dict__.get("_dependent_levels")
    if cached is not None:
        return cached
    depth = buf.position_offsets.tolist()
    parents = buf.parents.tolist()
    rank = [0] + buf.node_rank.tolist()
    dev = buf.parents.device
    by_depth: list[list[int]] = [[] for _ in range(buf.max_depth + 1)]
    for i, d in enumerate(depth):
        by_depth[d].append(i)
    levels = []
    for d in range(1, buf.max_depth + 1):
        prev = by_depth[d - 1]
        kids = by_depth[d]
        parent_nodes = sorted({parents[c] for c in kids}, key=prev.index)
        where = {p: j for j, p in enumerate(parent_nodes)}
        long = dict(dtype=torch.long, device=dev)
        levels.append(_Level(
            parent_rows=torch.tensor([prev.index(p) for p in parent_nodes], **long),
            parent_nodes=torch.tensor(parent_nodes, **long),
            nodes=torch.tensor(kids, **long),
            from_parent=torch.tensor([where[parents[c]] for c in kids], **long),
            rank=torch.tensor([rank[c] for c in kids], **long),
            topk=max(rank[c] for c in kids) + 1,
        ))
    buf.__dict__["_dependent_levels"] = levels
    return levels


def check_dependent_sampling(cfg: SamplingConfig) -> None:
    if cfg.mode == "sample" and cfg.draft == "sampled":
        raise UserError("draft=sampled is not available for dependent (hydra / mlp_speculator) heads; "
                        "use draft=topk, which is exact too")


def draft_dependent(buf: TreeBuffers, heads, h_last: torch.Tensor, root) -> torch.Tensor:
    """Tokens of tree nodes 1..N-1 (tree order) drafted from ``h_last`` [..., H] and the root token(s)
    (an int, or a [...] tensor: leading dims are independent rows, e.g. a batch)."""
    lead = h_last.shape[:-1]
    tokens = torch.empty(*lead, buf.num_nodes, dtype=torch.long, device=h_last.device)
    tokens[..., 0] = root
    state = heads.init_state(h_last[..., None, :])   # level 0: the root alone
    for d, level in enumerate(_levels(buf)):
        parent_state = state[..., level.parent_rows, :]
        new_state, feats = heads.step(d, parent_state, tokens[..., level.parent_nodes])
        guesses = heads.project(feats, d).topk(level.topk, dim=-1).indices      # [..., P, topk]
        tokens[..., level.nodes] = heads.to_vocab_ids(guesses[..., level.from_parent, level.rank])
        state = new_state[..., level.from_parent, :]   # level d: one row per node, tree order
    return tokens[..., 1:]


class IndependentDrafting:
    """Drafting for heads that see h_t only: one call per head fills a whole depth of the tree
    (needs ``head_logits(hidden, k)`` and ``to_vocab_ids``)."""

    sequential = False  # head k is not fed the drafted tokens

    def check_sampling(self, cfg: SamplingConfig) -> None:
        """Every sampling setting drafts exactly from independent heads."""

    def draft_tree(self, buf: TreeBuffers, h_last: torch.Tensor, root: int, cfg: SamplingConfig,
                   gen, vocab_size: int):
        logits = [self.head_logits(h_last, k) for k in range(buf.max_depth)]
        return propose(buf, logits, self.to_vocab_ids, cfg, gen, vocab_size)

    def path_logits(self, hidden: torch.Tensor, future: torch.Tensor, k: int) -> torch.Tensor:
        return self.head_logits(hidden, k)


class PathDrafting:
    """Drafting for heads fed the path they extend (needs ``init_state``, ``step``, ``project``,
    ``to_vocab_ids`` and ``teacher_forced_logits``): level by level, top-k per parent."""

    sequential = True  # head k is fed the tokens of the path it extends

    def check_sampling(self, cfg: SamplingConfig) -> None:
        check_dependent_sampling(cfg)

    def draft_tree(self, buf: TreeBuffers, h_last: torch.Tensor, root: int, cfg: SamplingConfig,
                   gen, vocab_size: int):
        return draft_dependent(buf, self, h_last, root), None

    def path_logits(self, hidden: torch.Tensor, future: torch.Tensor, k: int) -> torch.Tensor:
        return self.teacher_forced_logits(hidden, future, k)


class ContextDrafting:
    """Drafting for drafters that read the whole context through their own KV cache (EAGLE-3): they
    draft their own dynamic trees in their decoding method (``methods/eagle3.py``), so the static-tree
    interface refuses in one line instead of drafting without the context."""

    sequential = True  # fed the drafted tokens

    def check_sampling(self, cfg: SamplingConfig) -> None:
        if cfg.mode == "sample" and cfg.draft == "sampled":
            raise UserError(f"draft=sampled is not available for {self.spec.kind} drafters; use draft=topk, "
                            "which is exact too")

    def draft_tree(self, buf: TreeBuffers, h_last: torch.Tensor, root: int, cfg: SamplingConfig,
                   gen, vocab_size: int):
        raise UserError(static_tree_refusal(self.spec))

    def path_logits(self, hidden: torch.Tensor, future: torch.Tensor, k: int) -> torch.Tensor:
        raise UserError(f"{self.spec.kind} drafters need the context, not one hidden state: use methods=[eagle3]")


def static_tree_refusal(spec) -> Optional[str]:
    """Why heads of ``spec`` cannot fill a static tree (methods medusa, medusa_lookup) in one line, or
    None: drafters with their own context (``ContextDrafting``) only draft dynamic trees."""
    kind = getattr(spec, "kind", None)
    if kind is not None and issubclass(family(kind).drafting, ContextDrafting):
        return f"{kind} drafters decode with dynamic trees: use methods=[eagle3]"
    return None
