"""A dynamic draft tree's verification buffers at a fixed shape, built on the device.

A dynamic tree (EAGLE-2's rerank, method ``eagle3``) is chosen anew each step. ``tree.select_nodes`` and
``tree.tree_buffers`` build it at its own size, which the host must read: how many nodes passed the probability
floor, how deep the kept tree is, which nodes are leaves (three or more reads a step, and on a GPU each read waits
for the device). Here the same tree comes out at a shape fixed by the setting, with tensor ops only, so it can be
part of a captured call and greedy verification reads the host once a step:

- the ``nodes`` best-scored drafted nodes (stable: ties go to the earlier node), in drafting order, as
  ``select_nodes`` keeps them; a node below the floor (``min_score``) is not dropped but kept as a masked node at the
  end: token -1 (it never matches the backbone's choice, so it is never accepted), depth 0, child of the root,
  seeing only the prefix, the root and itself. The nodes that pass keep ``select_nodes``' indices 1..K;
- ``retrieve_indices`` holds one row per node (its path from the root), not one per leaf: which nodes are leaves is
  data, and every node's path is a prefix of a leaf's, so the longest accepted prefix is the same;
- the verification forward runs ``nodes + 1`` rows whatever passes the floor: on a GPU a few more rows in one
  forward cost about nothing, and the row count stays one captured bucket.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

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
    size = nodes + 1
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
    return tokens, parents, depths, mask, paths
