"""A dynamic draft tree's verification buffers at a fixed shape, built on the device.

A dynamic tree (EAGLE-2's rerank, method ``eagle3``) is chosen anew each step. ``tree.select_nodes`` and
``tree.tree_buffers`` build it at its own size, which the host must read: how many nodes passed the probability
floor, how deep the kept tree is, which nodes are leaves (three or more reads a step, and on a GPU each read waits
for the device). Here the same tree comes out at a shape fixed by the setting, with tensor ops only, so it can be
part of a captured call and verification (greedy, exact sampling, typical) reads the host once a step:

- the ``nodes`` best-scored drafted nodes (stable: ties go to the earlier node), in drafting order, as
  ``select_nodes`` keeps them; a node below the floor (``min_score``) is not dropped but kept as a masked node at the
  end: token -1 (it never matches the backbone's choice, so it is never accepted), depth 0, child of the root,
  seeing only the prefix, the root and itself. The nodes that pass keep ``select_nodes``' indices 1..K;
- ``retrieve_indices`` holds one row per node (its path from the root), not one per leaf: which nodes are leaves is
  data, and every node's path is a prefix of a leaf's, so the longest accepted prefix is the same;
- the verification forward runs ``nodes + 1`` rows whatever passes the floor: on a GPU a few more rows in one
  forward cost about nothing, and the row count stays one captured bucket.

A looked-up continuation (methods that add a prompt-lookup branch) is grafted onto such a tree on the device too
(``static_graft``): the proposal is host knowledge, the tree's tokens are not, so the walk down the tree happens here
and the rest of the proposal hangs at fixed slots after the tree.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Optional

import torch

from .graph_capture import to_device
from .tree import tree_additive_mask


@dataclass(frozen=True)
class StaticTree:
    """One step's tree at its setting's fixed size T = nodes + 1 (module docstring); what greedy verification
    (``verify.verify_greedy``, ``verify.verify_rows``) and the verification forward read. Every field is a device
    tensor; a batch's trees (one per row) have a leading [B] axis on each."""

    tokens: torch.Tensor             # [T] long: the root's token, then the kept nodes' (-1: below the floor; the
    #                                  verification forward feeds such a node any valid id, its output unread)
    parents: torch.Tensor            # [T] long: -1 for the root
    position_offsets: torch.Tensor   # [T] long: each node's depth (0: the root, and nodes below the floor)
    tree_mask: torch.Tensor          # [T, T] bool: node i sees node j
    retrieve_indices: torch.Tensor   # [T, D+1] long: node i's path from the root at its depths, -1 padded

    def additive_mask(self, past: int, dtype: torch.dtype) -> torch.Tensor:
        """[1, 1, T, past+T] float mask of a single tree: 0 where visible, dtype-min elsewhere (prefix all visible)."""
        return tree_additive_mask(self.tree_mask, past, dtype)

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[-1]

    @cached_property
    def children(self) -> torch.Tensor:
        """[T, T-1] long ([B, T, T-1] for a batch's trees): each node's children in node order, -1 padded, for exact
        sampling's walk down the tree (``verify.verify_sample``); masked nodes are nobody's children."""
        return tree_children(self.parents, self.position_offsets)


def static_tree(root: torch.Tensor, tok: torch.Tensor, score: torch.Tensor, parent: torch.Tensor,
                depth: torch.Tensor, nodes: int, max_depth: int,
                min_score: Optional[float]) -> tuple[torch.Tensor, ...]:
    """The fields of ``StaticTree`` (in its order) for drafted nodes tok, score, parent (-1: the root; parents
    drafted first), depth [M] and the root's token ``root`` [] long: the ``nodes`` best, at most ``max_depth``
    deep. Every input may carry a leading batch axis ([B, M], root [B]): each row its own tree, the fields
    [B, ...]. No host read and no shape that depends on the values: it can run inside a captured call."""
    if score.dim() == 1:
        return tuple(f[0] for f in static_tree(root.reshape(1), tok[None], score[None], parent[None], depth[None],
                                               nodes, max_depth, min_score))
    dev, (b, m) = tok.device, score.shape
    best = torch.sort(score, dim=1, descending=True, stable=True).indices[:, :nodes]   # select_nodes' rank
    passes = score.gather(1, best) >= min_score if min_score is not None else torch.ones_like(best, dtype=torch.bool)
    order = torch.sort(torch.where(passes, best, best + m), dim=1).indices            # drafting order, below-floor last
    keep, passes = best.gather(1, order), passes.gather(1, order)
    where = torch.zeros(b, m, dtype=torch.long, device=dev).scatter_(
        1, keep, torch.arange(1, nodes + 1, device=dev).expand(b, nodes))               # drafted index -> kept node
    up = parent.gather(1, keep)
    up = torch.where(passes & (up >= 0), where.gather(1, up.clamp(min=0)), 0)
    first = torch.full((b, 1), -1, dtype=torch.long, device=dev)
    parents = torch.cat([first, up], 1)
    depths = torch.cat([first + 1, torch.where(passes, depth.gather(1, keep), 0)], 1)
    tokens = torch.cat([root.reshape(b, 1), torch.where(passes, tok.gather(1, keep), -1)], 1)
    return (tokens, parents, depths, *tree_structure(parents, depths, max_depth))


def tree_structure(parents: torch.Tensor, depths: torch.Tensor, max_depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The tree mask [B, T, T] and every node's path [B, T, D+1] of trees given by parents (-1: the root) and
    depths [B, T], at most ``max_depth`` deep; on the device, no host read."""
    b, size = parents.shape
    dev = parents.device
    idx = torch.arange(size, device=dev)
    ups = parents.clamp(min=0)
    mask = (idx[:, None] == idx[None]).expand(b, size, size)
    paths = torch.full((b, size, max_depth + 1), -1, dtype=torch.long, device=dev)
    column = torch.arange(max_depth + 1, device=dev)
    cur = idx.expand(b, size)
    for _ in range(max_depth + 1):      # every node's ancestors and its path, one level per pass
        mask = mask | (idx == cur[..., None])
        paths = torch.where(column == depths.gather(1, cur)[..., None], cur[..., None], paths)
        cur = ups.gather(1, cur)
    return mask, paths


def static_graft(tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, mask: torch.Tensor,
                 paths: torch.Tensor, proposal: torch.Tensor,
                 drop: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, ...]:
    """A looked-up continuation grafted onto trees of ``StaticTree``'s fields ([B, T, ...]) at the fixed size T + L,
    on the device (a lookup method's host graft without reading the tree): ``proposal`` [B, L] long, -1 padded
    at its end. The proposal walks down the tree while a node carries its next token; the rest of it hangs under the
    deepest node it reached as one chain, proposal token j at node T + j with depth j + 1. Slots of the tokens the tree
    already had, and of the padding, are masked nodes (token -1, depth 0, child of the root). ``drop`` [B] bool: rows
    whose drafted nodes are masked too (the chain alone is verified). Returns the fields at max(D, L) deep (the mask
    and paths recomputed: ``mask`` is not read) and the nodes grafted per row [B]."""
    b, size = tokens.shape
    length, dev = proposal.shape[1], tokens.device
    if drop is not None:
        drafted = drop[:, None] & (torch.arange(size, device=dev) > 0)
        tokens = tokens.masked_fill(drafted, -1)
        parents = torch.where(drafted, 0, parents)
        depths = depths.masked_fill(drafted, 0)
        paths = torch.where(drafted[..., None], _root_path(paths), paths)
    # node i lies on the proposal when every token on its path (depths 1..) is the proposal's at that depth; beyond
    # the proposal's length no token matches (-2), nor does its padding (-1) match a drafted token
    want = torch.cat([proposal.new_full((b, 1), -1), proposal,
                      proposal.new_full((b, max(paths.shape[2] - 1 - length, 0)), -2)], 1)[:, :paths.shape[2]]
    on_path = tokens.gather(1, paths.clamp(min=0).reshape(b, -1)).reshape(paths.shape)
    agrees = (paths < 0) | (on_path == want[:, None]) | (torch.arange(paths.shape[2], device=dev) == 0)
    matched = agrees.all(-1)
    idx = torch.arange(size, device=dev)
    rank = torch.where(matched, depths * (size + 1) + size - idx, -1)     # deepest, then the earliest (the root)
    anchor = rank.argmax(1)                                                # [B]
    n = depths.gather(1, anchor[:, None])                                  # proposal tokens the tree has
    j = torch.arange(length, device=dev)[None]
    real = (j >= n) & (proposal >= 0)
    chain_parents = torch.where(j == n, anchor[:, None], size + j - 1)
    tokens = torch.cat([tokens, torch.where(real, proposal, -1)], 1)
    parents = torch.cat([parents, torch.where(real, chain_parents, 0)], 1)
    depths = torch.cat([depths, torch.where(real, j + 1, 0)], 1)
    return (tokens, parents, depths, *tree_structure(parents, depths, max(paths.shape[2] - 1, length)),
            real.sum(1))


def padded_proposals(proposals: list[list[int]], width: int, device) -> torch.Tensor:
    """``static_graft``'s proposal input: each proposal [width] long, -1 padded at its end, one row each."""
    return to_device([p + [-1] * (width - len(p)) for p in proposals], device, torch.long)


def _root_path(paths: torch.Tensor) -> torch.Tensor:
    """The path of the root alone, [0, -1, ...], in ``paths``' shape."""
    root = torch.full_like(paths, -1)
    root[..., 0] = 0
    return root


def tree_children(parents: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
    """``StaticTree.children`` of parents and depths [T] or [B, T], on the device: a node below the root has depth
    >= 1 (the root and masked nodes have depth 0), and its rank among its siblings is the count of earlier ones."""
    if parents.dim() == 1:
        return tree_children(parents[None], depths[None])[0]
    b, size = parents.shape
    idx = torch.arange(size, device=parents.device)
    real = depths > 0
    sibling = (parents[:, :, None] == parents[:, None, :]) & real[:, :, None] & real[:, None, :]
    rank = (sibling & (idx[None, :] < idx[:, None])).sum(-1)                   # earlier siblings of each node
    slot = torch.where(real, parents.clamp(min=0) * size + rank, size * size)   # the others to a spare slot
    table = torch.full((b, size * size + 1), -1, dtype=torch.long, device=parents.device)
    table.scatter_(1, slot, idx.expand(b, size).contiguous())
    return table[:, :size * size].reshape(b, size, size)[..., :max(size - 1, 1)]


def root_tree(root: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``StaticTree``'s fields of trees of the root alone (tokens ``root`` [B]), for a looked-up chain to be grafted
    on (``static_graft``)."""
    b, dev = root.shape[0], root.device
    zeros = torch.zeros(b, 1, dtype=torch.long, device=dev)
    return (root.reshape(b, 1), zeros - 1, zeros, torch.ones(b, 1, 1, dtype=torch.bool, device=dev), zeros[..., None])
