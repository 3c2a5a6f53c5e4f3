"""Candidate trees: which head guesses are verified together in one forward pass.

A tree is a Medusa "choices" list: each path is a tuple of top-k ranks, one per depth.
``(0,)`` is head 0's best guess for the token after the root, ``(0, 1)`` is head 1's
second-best guess placed after ``(0,)``, and so on. The root (node 0) is the token the
backbone itself already chose; a path of length d is verified at depth d and its token comes
from head d-1. Nodes are stored breadth-first, sorted by (depth, path) as Medusa does, so a
parent always precedes its children and an accepted path has increasing node indices (the
KV-cache compaction relies on that).

Buffers (``TreeBuffers``, built once per device and reused every step):
  attention mask   node i sees the prefix, the root, its ancestors and itself;
  position offsets prefix length + depth (siblings share a position);
  retrieve indices one row per leaf path (root first), padded with -1;
  node_head/node_rank/node_slot  vectorised candidate gathering: the token of node i is
                   ``topk_ids[node_head[i], node_rank[i]]`` (deterministic top-k) or
                   ``draws[node_head[i], node_slot[i]]`` (sampled drafts, see verify.py);
  children         [N, S] child node indices per node in rank order, -1 padded.

Tree from measurement (``grow_tree``): given per-depth, per-rank head accuracies
``acc[d][r]`` (probability that head d's rank-r token is the right one), a node's value is
the product of the accuracies along its path: Medusa's estimate of the probability that the
whole path is accepted. The expected number of tokens per step is 1 + the sum of node values
(the root/bonus token is always produced). Because a child is never worth more than its
parent (a product of factors <= 1), the best-B nodes form a prefix-closed set, so adding the
best frontier node B times is optimal for that objective, not only a heuristic.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import numbers
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence

import torch

from ..errors import UserError

TREE_FORMAT = "medusa-tree"
TREE_FORMAT_VERSION = 1
# The most nodes (root included) a named tree (treeN, chainN), tree=calibrated:N or a tree_budgets entry may
# ask for: the largest default is 64 nodes (mc_sim_7b_63) and the automatic budgets stop at 33, as EAGLE-3's
# eagle_nodes at 256; every node is a row verified each step, so beyond this a tree only costs.
MAX_TREE_NODES = 256

# Medusa's default 63-node tree for Vicuna-7B (FasterDecoding/Medusa medusa_choices.py,
# "mc_sim_7b_63"): depth <= 4, ranks <= 9. Kept verbatim so results compare with the paper's.
MC_SIM_7B_63 = (
    (0,), (0, 0), (1,), (0, 1), (2,), (0, 0, 0), (1, 0), (0, 2), (3,), (0, 3), (4,), (0, 4), (2, 0),
    (0, 5), (0, 0, 1), (5,), (0, 6), (6,), (0, 7), (0, 1, 0), (1, 1), (7,), (0, 8), (0, 0, 2), (3, 0),
    (0, 9), (8,), (9,), (1, 0, 0), (0, 2, 0), (1, 2), (0, 0, 3), (4, 0), (2, 1), (0, 0, 4), (0, 0, 5),
    (0, 0, 0, 0), (0, 1, 1), (0, 0, 6), (0, 3, 0), (5, 0), (1, 3), (0, 0, 7), (0, 0, 8), (0, 0, 9),
    (6, 0), (0, 4, 0), (1, 4), (7, 0), (0, 1, 2), (2, 0, 0), (3, 1), (2, 2), (8, 0), (0, 5, 0), (1, 5),
    (1, 0, 1), (0, 2, 1), (9, 0), (0, 6, 0), (0, 0, 0, 1), (1, 6), (0, 7, 0),
)

# Per-head top-1 / top-5 accuracy the Medusa paper (Cai et al. 2024) reports for Medusa-1 heads on
# Vicuna-7B. The default trees are grown from these with ``grow_tree`` so that every size follows
# one rule; a tree grown from *your* heads' measured accuracies
# (``methods.medusa_choice.measure_head_accuracy``) is better.
_REFERENCE_TOP1 = (0.56, 0.32, 0.20, 0.15, 0.12)
_REFERENCE_TOP5 = (0.78, 0.56, 0.42, 0.34, 0.30)
_PRIOR_RANKS = 10


def reference_accuracies(num_heads: int, topk: int = _PRIOR_RANKS) -> list[list[float]]:
    """Per-rank accuracies [num_heads][topk] derived from the Medusa paper's figures.

    Rank 0 gets the top-1 accuracy; ranks 1-4 share (top-5 - top-1) with a 0.6 geometric
    decay; later ranks continue the decay. Heads beyond the fifth decay by 0.8 per head.
    """
    rows = []
    for h in range(num_heads):
        i = min(h, len(_REFERENCE_TOP1) - 1)
        scale = 0.8 ** max(0, h - i)
        top1, rest = _REFERENCE_TOP1[i] * scale, (_REFERENCE_TOP5[i] - _REFERENCE_TOP1[i]) * scale
        w = [0.6 ** r for r in range(4)]
        unit = rest / sum(w)
        row = [top1] + [unit * 0.6 ** (r - 1) for r in range(1, topk)]
        rows.append(row[:topk])
    return rows


# Named default trees. "chainN" = the top-1 chain with N tokens (root included);
# "treeN" = N tokens (root included) grown from the reference accuracies, limited to the
# available heads; "mc_sim_7b_63" = Medusa's tree above (needs 4 heads, top-10).
DEFAULT_TREE_NAMES = ("chain2", "chain3", "chain4", "tree1", "tree4", "tree8", "tree16", "tree32",
                      "tree64", "mc_sim_7b_63")


def tree_additive_mask(tree_mask: torch.Tensor, past: int, dtype: torch.dtype) -> torch.Tensor:
    """[1, 1, N, past+N] float mask of a tree's [N, N] ``tree_mask`` after ``past`` prefix entries: 0 where
    visible, dtype-min elsewhere (the prefix all visible)."""
    n = tree_mask.shape[0]
    mask = torch.zeros(1, 1, n, past + n, dtype=dtype, device=tree_mask.device)
    mask[0, 0, :, past:].masked_fill_(~tree_mask, torch.finfo(dtype).min)
    return mask


@dataclass(frozen=True)
class TreeBuffers:
    """Device tensors of one tree (see module docstring). N = number of nodes incl. root."""

    num_nodes: int
    max_depth: int
    tree_mask: torch.Tensor          # [N, N] bool, True where node i may attend to node j
    position_offsets: torch.Tensor   # [N] long: depth of each node
    parents: torch.Tensor            # [N] long: parent node, -1 for the root
    retrieve_indices: torch.Tensor   # [L, D+1] long, -1 padded
    node_head: torch.Tensor          # [N-1] long: head (= depth-1) of nodes 1..N-1
    node_rank: torch.Tensor          # [N-1] long: top-k rank of nodes 1..N-1
    node_slot: torch.Tensor          # [N-1] long: position among siblings of nodes 1..N-1
    children: torch.Tensor           # [N, S] long, -1 padded, children in rank order
    topk_per_depth: tuple[int, ...]  # how many top-k ids each head must provide
    slots_per_depth: tuple[int, ...]  # most siblings at each depth (sampled drafts)

    def additive_mask(self, past: int, dtype: torch.dtype) -> torch.Tensor:
        """[1, 1, N, past+N] float mask: 0 where visible, dtype-min elsewhere (prefix all visible)."""
        return tree_additive_mask(self.tree_mask, past, dtype)

    @property
    def shape_key(self) -> str:
        """A short name of this tree's structure (its parents and ranks): buffers built apart for one tree share
        it, so a draft captured for the tree is recorded once, not once per decoder."""
        key = self.__dict__.get("_shape_key")
        if key is None:
            key = self.__dict__["_shape_key"] = structure_key(self.parents.tolist(), self.node_rank.tolist())
        return key


def structure_key(parents: list[int], ranks: list[int]) -> str:
    """``TreeBuffers.shape_key`` of a tree with these parents [N] and ranks [N-1] (host lists)."""
    return f"{len(parents)}n-{hashlib.sha1(repr((parents, ranks)).encode()).hexdigest()[:10]}"


class MedusaTree:
    """A validated choices list and the structure derived from it (device independent)."""

    def __init__(self, choices: Iterable[Sequence[int]], name: Optional[str] = None):
        self.paths: tuple[tuple[int, ...], ...] = _validate(choices)
        self.name = name
        index = {(): 0}
        for i, p in enumerate(self.paths):
            index[p] = i + 1
        self.num_nodes = len(self.paths) + 1
        self.parent = [-1] + [index[p[:-1]] for p in self.paths]
        self.depth = [0] + [len(p) for p in self.paths]
        self.rank = [0] + [p[-1] for p in self.paths]
        self.max_depth = max(self.depth)
        self.children: list[list[int]] = [[] for _ in range(self.num_nodes)]
        for i in range(1, self.num_nodes):  # paths are sorted, so children come in rank order
            self.children[self.parent[i]].append(i)
        self.slot = [0] * self.num_nodes
        for kids in self.children:
            for s, c in enumerate(kids):
                self.slot[c] = s
        self.leaves = [i for i in range(self.num_nodes) if not self.children[i]]
        self._buffers: dict[str, TreeBuffers] = {}

    # -- structure ---------------------------------------------------------------------
    def __len__(self) -> int:
        return self.num_nodes

    def __repr__(self) -> str:
        label = f"{self.name}: " if self.name else ""
        return f"MedusaTree({label}{self.num_nodes} nodes, depth {self.max_depth})"

    @property
    def choices(self) -> list[list[int]]:
        return [list(p) for p in self.paths]

    def ancestors(self, i: int) -> list[int]:
        """Node i's path from the root, root first, i last."""
        out = []
        while i >= 0:
            out.append(i)
            i = self.parent[i]
        return out[::-1]

    def topk_per_depth(self) -> list[int]:
        """How many ranked guesses each head must provide (max rank + 1 at each depth)."""
        out = [0] * self.max_depth
        for p in self.paths:
            out[len(p) - 1] = max(out[len(p) - 1], p[-1] + 1)
        return out

    def check_fits(self, num_heads: int, head_vocab: int) -> None:
        """Refuse a tree that needs more heads or more ranks than the heads have."""
        if self.max_depth > num_heads:
            label = f"tree {self.name}" if self.name else "the tree"
            raise UserError(f"{label} has depth {self.max_depth} but the heads only predict {num_heads} "
                            f"tokens ahead; use a tree of depth <= {num_heads}")
        ks = self.topk_per_depth()
        if ks and max(ks) > head_vocab:
            raise UserError(f"tree needs top-{max(ks)} guesses but the heads only have {head_vocab} outputs")

    # -- buffers -----------------------------------------------------------------------
    def buffers(self, device: str | torch.device = "cpu") -> TreeBuffers:
        key = str(torch.device(device))
        if key not in self._buffers:
            self._buffers[key] = self._build_buffers(torch.device(device))
        return self._buffers[key]

    def _build_buffers(self, device: torch.device) -> TreeBuffers:
        n, d = self.num_nodes, self.max_depth
        mask = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            mask[i, self.ancestors(i)] = True
        rows = []
        for leaf in self.leaves:
            path = self.ancestors(leaf)
            rows.append(path + [-1] * (d + 1 - len(path)))
        width = max([len(c) for c in self.children] + [1])
        kids = torch.full((n, width), -1, dtype=torch.long)
        for i, c in enumerate(self.children):
            kids[i, :len(c)] = torch.tensor(c, dtype=torch.long)
        slots = [0] * d
        for i in range(1, n):
            slots[self.depth[i] - 1] = max(slots[self.depth[i] - 1], self.slot[i] + 1)
        long = dict(dtype=torch.long, device=device)
        buf = TreeBuffers(
            num_nodes=n, max_depth=d, tree_mask=mask.to(device),
            position_offsets=torch.tensor(self.depth, **long),
            parents=torch.tensor(self.parent, **long),
            retrieve_indices=torch.tensor(rows, **long),
            node_head=torch.tensor([x - 1 for x in self.depth[1:]], **long),
            node_rank=torch.tensor(self.rank[1:], **long),
            node_slot=torch.tensor(self.slot[1:], **long),
            children=kids.to(device),
            topk_per_depth=tuple(self.topk_per_depth()),
            slots_per_depth=tuple(slots),
        )
        buf.__dict__["_shape_key"] = structure_key(self.parent, self.rank[1:])   # known here: no device read later
        return buf

    # -- files -------------------------------------------------------------------------
    def to_dict(self, **extra) -> dict:
        return {"format": TREE_FORMAT, "version": TREE_FORMAT_VERSION, "name": self.name,
                "num_nodes": self.num_nodes, "choices": self.choices, **extra}

    def save(self, path: str | os.PathLike, **extra) -> Path:
        """Write the tree as JSON; ``extra`` (e.g. expected_tau, accuracies) is stored alongside."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(self.to_dict(**extra), indent=1) + "\n")
        return p

    @classmethod
    def load(cls, path: str | os.PathLike) -> "MedusaTree":
        """Read a tree JSON written by ``save`` or a bare choices list (Medusa's format)."""
        p = Path(path)
        if p.is_dir():
            raise UserError(f"tree={p} is a folder, not a tree file: give a tree JSON file or a tree's name")
        if not p.is_file():
            raise UserError(f"tree file {p} is not a regular file" if p.exists() else f"tree file not found: {p}")
        try:
            raw = json.loads(p.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UserError(f"tree file {p} is not valid JSON ({e})") from None
        if isinstance(raw, dict):
            if raw.get("format") == "medusa-train tree schedule":   # the per-batch-size file before methods/choice_file.py
                raise UserError(f"tree file {p} is a batched evaluation's tree_schedule.json, a format from before the "
                                "one choice file: rerun medusa-eval ... batch_size=[...] choice=auto and give its "
                                "<method>_choice.json as choice=<file>")
            if raw.get("format") == "medusa-train speculation choice":   # methods/choice_file.py
                raise UserError(f"tree file {p} is a choice file written by medusa-eval: give it as choice={p}")
            if raw.get("format") != TREE_FORMAT or "choices" not in raw:
                raise UserError(f"tree file {p} is not a {TREE_FORMAT} file (needs format and choices)")
            version = raw.get("version", 0)
            if isinstance(version, bool) or not isinstance(version, int):   # compared below: "2" was a TypeError
                raise UserError(f"tree file {p}: its version is {version!r}, not a number")
            if version > TREE_FORMAT_VERSION:
                raise UserError(f"tree file {p} was written by a newer medusa-train (version {version})")
        choices = raw["choices"] if isinstance(raw, dict) else raw
        if isinstance(choices, list) and not choices:   # plain decoding is a method of its own, never a tree file
            raise UserError(f"tree file {p} holds no tree paths: give at least one, such as [[0], [0, 0], [1]]")
        refuse_oversized(choices, f"tree file {p}")
        return cls(choices, name=(raw.get("name") if isinstance(raw, dict) else None) or p.stem)


def _validate(choices) -> tuple[tuple[int, ...], ...]:
    if isinstance(choices, (str, bytes)) or not isinstance(choices, Iterable):
        raise UserError("tree choices must be a list of paths such as [[0], [0, 0], [1]]")
    paths = []
    for raw in choices:
        if isinstance(raw, (str, bytes)) or not isinstance(raw, Iterable):
            raise UserError(f"tree path {raw!r} is not a list of ranks")
        path = tuple(raw)
        if not path:
            raise UserError("tree paths must not be empty (the root is implicit)")
        if any(isinstance(r, bool) or not isinstance(r, numbers.Integral) or r < 0 for r in path):
            raise UserError(f"tree path {list(path)} must hold non-negative integer ranks")
        paths.append(tuple(int(r) for r in path))   # numpy ints as ints: paths are compared and hashed
    seen = set()
    for p in paths:
        if p in seen:
            raise UserError(f"tree path {list(p)} appears twice")
        seen.add(p)
    for p in paths:
        if len(p) > 1 and p[:-1] not in seen:
            raise UserError(f"tree path {list(p)} has no parent {list(p[:-1])} in the tree")
    return tuple(sorted(paths, key=lambda p: (len(p), p)))


# -- trees from accuracies ---------------------------------------------------------------
def _check_accuracies(accuracies) -> list[list[float]]:
    acc = accuracies.tolist() if isinstance(accuracies, torch.Tensor) else [list(r) for r in accuracies]
    if not acc or not acc[0] or any(len(r) != len(acc[0]) for r in acc):
        raise UserError("head accuracies must be a non-empty [depth][rank] matrix")
    for row in acc:
        for a in row:
            if not 0.0 <= float(a) <= 1.0:
                raise UserError(f"head accuracies must lie in [0, 1], got {a}")
    return [[float(a) for a in r] for r in acc]


def path_value(path: Sequence[int], accuracies) -> float:
    """Estimated probability that every token on ``path`` is accepted."""
    v = 1.0
    for d, r in enumerate(path):
        v *= accuracies[d][r]
    return v


def expected_tau(tree: MedusaTree, accuracies) -> float:
    """Expected tokens per step of ``tree``: 1 + the sum of its node values."""
    acc = _check_accuracies(accuracies)
    if tree.max_depth > len(acc) or any(k > len(acc[0]) for k in tree.topk_per_depth()):
        raise UserError("the accuracy matrix does not cover this tree's depth or ranks")
    return 1.0 + sum(path_value(p, acc) for p in tree.paths)


def grow_tree(accuracies, budget: int, name: Optional[str] = None, fill: bool = False) -> tuple[MedusaTree, float]:
    """Greedy tree under a node budget (root excluded); returns (tree, expected tau).

    Ties are broken towards shallower, then lexicographically smaller paths, so the result
    is deterministic. Growth stops early when no frontier node has a positive value, unless
    ``fill`` (then the tree has exactly ``budget`` nodes, as far as depth x top-k allows).
    """
    acc = _check_accuracies(accuracies)
    if budget < 0:
        raise UserError(f"tree budget must be >= 0 nodes, got {budget}")
    depth, topk = len(acc), len(acc[0])
    heap = [(-acc[0][r], 1, (r,)) for r in range(topk)]
    heapq.heapify(heap)
    chosen, total = [], 0.0
    while heap and len(chosen) < budget:
        neg, _, path = heapq.heappop(heap)
        if -neg <= 0.0 and not fill:
            break
        chosen.append(path)
        total += -neg
        if len(path) < depth:
            for r in range(topk):
                child = path + (r,)
                heapq.heappush(heap, (neg * acc[len(path)][r], len(child), child))
    return MedusaTree(chosen, name=name), 1.0 + total


def tree_buffers(parents: torch.Tensor, depth: torch.Tensor, max_depth: int) -> TreeBuffers:
    """``TreeBuffers`` of a tree given by parents [N] (node 0 the root, parent -1; every parent
    before its children; siblings in rank order) and depths [N], with tensor ops only and no
    Python walk over nodes: dynamic trees (method ``eagle3``) build one every step, where
    ``MedusaTree`` walks every path in Python. Same buffers as ``MedusaTree.buffers`` for the same
    node order (ranks = order among siblings)."""
    dev = parents.device
    n = parents.numel()
    idx = torch.arange(n, device=dev)
    up = parents.clamp(min=0)                      # the root is its own parent here
    mask = torch.zeros(n, n, dtype=torch.bool, device=dev)
    mask[idx, idx] = True
    cur = idx
    for _ in range(max_depth):                     # every node's ancestors, one level per pass
        cur = up[cur]
        mask[idx, cur] = True
    has_child = torch.zeros(n, dtype=torch.bool, device=dev)
    has_child[parents[1:]] = True
    leaves = (~has_child).nonzero()[:, 0]
    rows = torch.full((leaves.numel(), max_depth + 1), -1, dtype=torch.long, device=dev)
    lanes = torch.arange(leaves.numel(), device=dev)
    cur = leaves
    for _ in range(max_depth + 1):                 # each leaf's path, written at its depths
        rows[lanes, depth[cur]] = cur
        cur = up[cur]
    p = parents[1:]
    earlier = torch.ones(n - 1, n - 1, dtype=torch.bool, device=dev).tril(-1)
    slot = ((p[:, None] == p[None, :]) & earlier).sum(1)     # earlier siblings of each node
    width = int(slot.max()) + 1 if n > 1 else 1
    kids = torch.full((n, width), -1, dtype=torch.long, device=dev)
    kids[p, slot] = idx[1:]
    head = depth[1:] - 1
    most = torch.zeros(max(max_depth, 0), dtype=torch.long, device=dev).scatter_reduce(0, head, slot + 1, "amax")
    per_depth = tuple(most.tolist())
    return TreeBuffers(num_nodes=n, max_depth=max_depth, tree_mask=mask, position_offsets=depth, parents=parents,
                       retrieve_indices=rows, node_head=head, node_rank=slot, node_slot=slot, children=kids,
                       topk_per_depth=per_depth, slots_per_depth=per_depth)


def select_nodes(score: torch.Tensor, parent: torch.Tensor, nodes: int,
                 min_score: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The tree an EAGLE-2 rerank keeps from drafted nodes with cumulative log-probabilities ``score`` [M]
    and ``parent`` [M] (-1: the root; parents drafted before their children): the ``nodes`` best-scored
    (stable sort: ties go to the earlier node), those below ``min_score`` dropped. Returns (the kept
    nodes' indices in drafting order [K], their parents [K + 1] as nodes of the kept tree: the root
    first with parent -1, kept node i at i + 1). A child never scores above its parent (its score adds a
    log-probability), so every kept node's parent is kept, by the rank and by the threshold alike."""
    keep = torch.sort(score, descending=True, stable=True).indices[:nodes]
    if min_score is not None:
        keep = keep[score[keep] >= min_score]
    keep = keep.sort().values
    where = torch.zeros(score.numel(), dtype=torch.long, device=score.device)
    where[keep] = torch.arange(1, keep.numel() + 1, device=score.device)
    up = parent[keep]
    return keep, torch.cat([up.new_tensor([-1]), torch.where(up < 0, 0, where[up.clamp(min=0)])])


@dataclass(frozen=True)
class RowTrees:
    """One tree per row of a batch (dynamic trees: each row grows its own, method ``eagle3``): the
    rows' own ``TreeBuffers`` and their fields stacked to the widest row, so the one verification
    forward and the one verification (``verify.verify_rows``, one host read for the batch) see every
    row at once. A narrower row is padded with nodes that see only themselves at depth 0, nobody's
    parent or child; its candidates carry token -1 there, so they are computed but outside its own
    tree, never accepted or kept. Its leaf paths are padded with root-only paths placed after its own,
    which the first-longest-path rule never prefers: every row's verdict is its own tree's."""

    rows: tuple[TreeBuffers, ...]
    tree_mask: torch.Tensor          # [B, n, n] bool
    position_offsets: torch.Tensor   # [B, n] long: depth of each node
    parents: torch.Tensor            # [B, n] long: -1 for the root and padding
    retrieve_indices: torch.Tensor   # [B, L, D+1] long: each row's leaf paths, then [0, -1, ...]
    children: torch.Tensor           # [B, n, S] long, -1 padded, children in rank order

    @classmethod
    def stack(cls, rows: Sequence[TreeBuffers]) -> "RowTrees":
        b, n, dev = len(rows), max(t.num_nodes for t in rows), rows[0].tree_mask.device
        paths = max(t.retrieve_indices.shape[0] for t in rows)
        width = max(t.retrieve_indices.shape[1] for t in rows)
        slots = max(t.children.shape[1] for t in rows)
        mask = torch.eye(n, dtype=torch.bool, device=dev).repeat(b, 1, 1)
        depth = torch.zeros(b, n, dtype=torch.long, device=dev)
        parents = torch.full((b, n), -1, dtype=torch.long, device=dev)
        retrieve = torch.full((b, paths, width), -1, dtype=torch.long, device=dev)
        retrieve[:, :, 0] = 0
        children = torch.full((b, n, slots), -1, dtype=torch.long, device=dev)
        for i, t in enumerate(rows):
            k, ri, ch = t.num_nodes, t.retrieve_indices, t.children
            mask[i, :k, :k] = t.tree_mask
            depth[i, :k] = t.position_offsets
            parents[i, :k] = t.parents
            retrieve[i, :ri.shape[0], :ri.shape[1]] = ri
            children[i, :k, :ch.shape[1]] = ch
        return cls(tuple(rows), mask, depth, parents, retrieve, children)

    @property
    def num_nodes(self) -> int:
        """Nodes per row in the verification forward (the widest row's)."""
        return self.tree_mask.shape[-1]

    @property
    def max_depth(self) -> int:
        return max(t.max_depth for t in self.rows)


def chain_tree(length: int) -> MedusaTree:
    """The top-1 chain with ``length`` tokens including the root (vLLM-style drafting)."""
    if length < 1:
        raise UserError(f"a chain needs at least 1 token, got {length}")
    return MedusaTree([(0,) * d for d in range(1, length)], name=f"chain{length}")


def default_tree(name: str, num_heads: int) -> MedusaTree:
    """A named default tree (``DEFAULT_TREE_NAMES``) fitted to ``num_heads`` heads."""
    digits = name[5:] if name.startswith("chain") else name[4:] if name.startswith("tree") else ""
    if digits.isdigit() and int(digits) > MAX_TREE_NODES:   # before growing it: tree10^8 is a MemoryError
        raise UserError(f"tree {name} has more than {MAX_TREE_NODES} nodes (every node is verified each step): "
                        f"use at most {name[:-len(digits)]}{MAX_TREE_NODES}")
    if name == "mc_sim_7b_63":
        tree = MedusaTree(MC_SIM_7B_63, name=name)
    elif name.startswith("chain") and name[5:].isdigit():
        tree = chain_tree(int(name[5:]))
    elif name.startswith("tree") and name[4:].isdigit() and int(name[4:]) >= 1:
        size = int(name[4:])
        ranks = max(_PRIOR_RANKS, size)  # a single head needs size-1 ranks to fill the tree
        tree, _ = grow_tree(reference_accuracies(num_heads, ranks), size - 1, name=name)
    elif name.startswith("calibrated:"):   # grown from accuracies measured on calibration prompts: medusa-eval's
        raise UserError(f"tree {name} is measured by medusa-eval on its calibration prompts; with the Python API "
                        "give the tree it chose (its choice file's tree, or its JSON) or a named tree")
    else:
        raise UserError(f"unknown tree {name!r}; use one of {', '.join(DEFAULT_TREE_NAMES)}, "
                        "chainN, treeN, a tree JSON file or a choices list")
    if tree.max_depth > num_heads:
        raise UserError(f"tree {name} needs {tree.max_depth} heads, these heads have {num_heads}")
    return tree


def resolve_tree(tree, num_heads: int, rootless_ok: bool = False) -> MedusaTree:
    """Accept a MedusaTree, a default name, a path to a tree JSON file, or a choices list. A tree to decode with
    needs a draft node; ``rootless_ok``: a root-only tree (``tree1``) is what a step-cost measurement compares with."""
    if isinstance(tree, MedusaTree):
        refuse_oversized(tree.paths, f"tree {tree.name or ''}".rstrip())
        return tree
    if isinstance(tree, (str, os.PathLike)):
        s = str(tree)
        if s.endswith(".json") or os.sep in s:
            return MedusaTree.load(s)   # one holding no path is refused there
        try:
            named = default_tree(s, num_heads)
        except UserError as e:   # no tree's name: a folder of that name says it is one (a name wins over a folder)
            if os.path.isdir(s) and str(e).startswith("unknown tree"):
                return MedusaTree.load(s)
            raise
        if not rootless_ok:
            refuse_rootless(named, f"tree={s}")   # chain1: the root alone, as tree=[]
        return named
    refuse_oversized(tree, f"tree={_shown(tree)}")
    resolved = MedusaTree(tree)
    if not rootless_ok:
        refuse_rootless(resolved, f"tree={tree!r}")
    return resolved


def _shown(tree) -> str:
    """A tree given inline as the user would recognise it, cut short: a refusal stays one readable line."""
    text = repr(tree)
    return text if len(text) <= 60 else text[:57] + "..."


def refuse_oversized(paths, what: str) -> None:
    """The cap named trees and budgets have (``MAX_TREE_NODES``), for a tree given any other way (a file, a list, a
    choice file): a 16,512-node file decoded at 0.2 tok/s. Counted before the tree is built, which walks every path."""
    try:
        nodes = len(paths) + 1   # the root
    except TypeError:   # not a list: ``_validate`` says what it is
        return
    if nodes > MAX_TREE_NODES:
        raise UserError(f"{what} has {nodes} nodes (root included), more than {MAX_TREE_NODES}: every node is "
                        f"verified each step; give a tree of at most {MAX_TREE_NODES} nodes")


def refuse_rootless(tree: MedusaTree, what: str) -> None:
    """A tree a user gives with no draft node (``tree=[]``) decoded as plain decoding with the heads' cost on top,
    saying nothing: refused. Trees the runtime grows itself (a node budget of 0) may be empty."""
    if tree.num_nodes == 1:
        raise UserError(f"{what} has no draft node: give at least one path, e.g. [[0]] (or a tree name such as "
                        "tree8); plain decoding is method autoregressive")
