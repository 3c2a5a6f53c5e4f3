"""A dynamic tree built on the device at a fixed size (``runtime.static_tree``), against the host-sized tree
``select_nodes`` + ``tree_buffers`` build from the same drafts, and its greedy verification."""

from __future__ import annotations

import pytest
import torch

from inference.runtime.static_tree import StaticTree, static_tree
from inference.runtime.tree import select_nodes, tree_buffers
from inference.runtime.verify import verify_greedy
from benchmarks.host_reads import HostReads
from runtime_support import one_thread  # noqa: F401 (autouse fixture)

VOCAB = 50


def drafted(k: int, depth: int, seed: int, ties: bool = False):
    """Drafts shaped as EAGLE-2 expansion makes them (``Eagle3Decoder._draft``): k nodes at depth 1, then the k
    best of each depth get k children each, scored parent + log q. ``ties``: log-probabilities floored to
    multiples of 0.5, so many scores tie (a child still never scores above its parent)."""
    g = torch.Generator().manual_seed(seed)

    def level(rows):
        logq = torch.log_softmax(torch.randn(rows, VOCAB, generator=g) * 2, -1)
        if ties:
            logq = (logq * 2).floor() / 2
        return logq.topk(k, dim=-1)
    score, tok = level(1)
    score, tok = score[0], tok[0]
    toks, scores, parents, depths = [tok], [score], [torch.full((k,), -1)], [torch.ones(k, dtype=torch.long)]
    first = 0
    for d in range(1, depth):
        pick = score.topk(k).indices
        child_score, child_tok = level(k)
        score = (score[pick][:, None] + child_score).reshape(-1)
        tok = child_tok.reshape(-1)
        toks.append(tok)
        scores.append(score)
        parents.append((first + pick).repeat_interleave(k))
        depths.append(torch.full((score.numel(),), d + 1))
        first += toks[-2].numel()
    return torch.cat(toks), torch.cat(scores), torch.cat(parents), torch.cat(depths)


def host_tree(root: int, tok, score, parent, depth, nodes: int, min_score):
    keep, parents = select_nodes(score, parent, nodes, min_score)
    depths = torch.cat([depth.new_zeros(1), depth[keep]])
    tokens = torch.cat([tok.new_tensor([root]), tok[keep]])
    return tokens, tree_buffers(parents, depths, int(depths.max()))


CASES = [(4, 1, 4, None), (2, 3, 8, None), (4, 3, 20, None), (3, 4, 12, None), (2, 3, 8, -3.0), (4, 3, 20, -4.0),
         (4, 4, 40, -2.5), (3, 3, 21, -1.0)]


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("k, depth, nodes, min_score", CASES)
def test_the_device_tree_is_the_host_tree_with_masked_nodes_after_it(k, depth, nodes, min_score, ties):
    """Guards against the rerank on the device keeping other nodes than ``select_nodes`` (tie order, the floor),
    numbering them otherwise (the KV compaction and the catch-up read node indices), or a node below the floor
    that could be seen or accepted: the nodes that pass are the host tree node for node (tokens, parents,
    depths, mask, every leaf's path); the rest are token -1, depth 0, children of the root that see only the
    root and themselves and that no other node sees."""
    for seed in range(6):
        tok, score, parent, level = drafted(k, depth, seed, ties)
        tokens, buf = host_tree(7, tok, score, parent, level, nodes, min_score)
        t = StaticTree(*static_tree(torch.tensor(7), tok, score, parent, level, nodes, depth, min_score))
        n = buf.num_nodes
        assert t.tokens.shape == (nodes + 1,) and t.retrieve_indices.shape == (nodes + 1, depth + 1)
        assert torch.equal(t.tokens[:n], tokens) and torch.equal(t.parents[:n], buf.parents)
        assert torch.equal(t.position_offsets[:n], buf.position_offsets)
        assert torch.equal(t.tree_mask[:n, :n], buf.tree_mask)
        for row in buf.retrieve_indices:
            leaf = row[row >= 0][-1]
            assert torch.equal(t.retrieve_indices[leaf, :buf.max_depth + 1], row)
            assert (t.retrieve_indices[leaf, buf.max_depth + 1:] == -1).all()
        rest = torch.arange(n, nodes + 1)
        assert (t.tokens[rest] == -1).all() and (t.position_offsets[rest] == 0).all() and (t.parents[rest] == 0).all()
        assert torch.equal(t.tree_mask[:, rest], torch.arange(nodes + 1)[:, None] == rest[None])   # seen by itself
        for i in rest.tolist():
            assert t.tree_mask[i].nonzero().flatten().tolist() == [0, i]
        if min_score is None:
            assert n == nodes + 1


@pytest.mark.parametrize("k, depth, nodes, min_score", CASES)
def test_greedy_verification_of_the_device_tree_is_the_host_trees(k, depth, nodes, min_score):
    """Guards against the device tree's all-node paths (one per node, not per leaf) or its masked nodes changing
    greedy verification: with backbone choices planted along random paths (and random elsewhere), the accepted
    path, its tokens and the bonus equal the host tree's verdict; ``also`` comes back in the same read."""
    g = torch.Generator().manual_seed(k * 100 + nodes)
    for seed in range(8):
        tok, score, parent, level = drafted(k, depth, seed)
        tokens, buf = host_tree(7, tok, score, parent, level, nodes, min_score)
        t = StaticTree(*static_tree(torch.tensor(7), tok, score, parent, level, nodes, depth, min_score))
        n = buf.num_nodes
        logits = torch.randn(nodes + 1, VOCAB, generator=g)
        cur = 0
        while True:     # plant a walk: each accepted node's choice is one of its children's tokens
            kids = (buf.parents == cur).nonzero().flatten()
            if not kids.numel() or torch.rand(1, generator=g) < 0.2:
                break
            cur = int(kids[torch.randint(kids.numel(), (1,), generator=g)])
            logits[buf.parents[cur], tokens[cur]] = 100.0
        host = verify_greedy(buf, tokens, logits[:n])
        dev = verify_greedy(t, t.tokens, logits, also=[t.position_offsets.max(), torch.tensor(5)])
        assert (dev.path, dev.bonus, dev.tokens) == (host.path, host.bonus, host.tokens)
        assert dev.also == [buf.max_depth, 5] and len(host.path) >= 1


def test_building_the_device_tree_reads_nothing_from_the_host():
    """Guards against a host read or a data-dependent shape (``nonzero``, a boolean index) creeping into the
    tree built on the device: inside a CUDA capture it fails (the call then runs eagerly) or freezes a value."""
    tok, score, parent, level = drafted(4, 3, 0)
    with HostReads() as reads:
        static_tree(torch.tensor(7), tok, score, parent, level, 20, 3, -4.0)
    assert reads.count == 0, reads.seen
    with HostReads() as reads:             # the counter sees both kinds
        select_nodes(score, parent, 20, -4.0)
        score.max().item()
    assert "index[bool]" in reads.seen and "item" in reads.seen
