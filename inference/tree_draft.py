"""Drafting a tree with dependent heads (Hydra / MLP speculator), level by level.

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

import torch

from .errors import UserError
from .runtime.tree import TreeBuffers
from .runtime.verify import SamplingConfig


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


def draft_dependent(buf: TreeBuffers, heads, h_last: torch.Tensor, root: int) -> torch.Tensor:
    """Tokens of tree nodes 1..N-1 (tree order) drafted from ``h_last`` [H] and the root token."""
    dev = h_last.device
    tokens = torch.empty(buf.num_nodes, dtype=torch.long, device=dev)
    tokens[0] = root
    state = heads.init_state(h_last[None])          # level 0: the root alone
    for d, level in enumerate(_levels(buf)):
        parent_state = state[level.parent_rows]
        new_state, feats = heads.step(d, parent_state, tokens[level.parent_nodes])
        guesses = heads.project(feats, d).topk(level.topk, dim=-1).indices      # [P, topk]
        tokens[level.nodes] = heads.to_vocab_ids(guesses[level.from_parent, level.rank])
        state = new_state[level.from_parent]         # level d: one row per node, tree order
    return tokens[1:]
