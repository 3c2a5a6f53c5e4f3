"""A dynamic tree built on the device at a fixed size (``runtime.static_tree``), against the host-sized tree
``select_nodes`` + ``tree_buffers`` build from the same drafts, and its greedy verification; a looked-up chain
grafted on it on the device (``static_graft``) against ``eagle3_lookup.graft_branch`` on the host."""

from __future__ import annotations

import pytest
import torch

from inference.methods.eagle3_lookup import graft_branch
from inference.runtime.static_tree import StaticTree, root_tree, static_graft, static_tree
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


# -- a looked-up chain grafted on the device (eagle3_lookup) ---------------------------------------------------
def proposals(tokens: torch.Tensor, parents: torch.Tensor, g: torch.Generator, length: int) -> list[list[int]]:
    """Proposals of up to ``length`` tokens as a lookup makes them against a host tree: one that leaves it after a
    random walk down it, one already wholly in it, one sharing nothing, one shorter than the tree is deep, none."""
    walk, cur = [], 0
    while len(walk) < length:
        kids = (parents == cur).nonzero().flatten()
        if not kids.numel() or torch.rand(1, generator=g) < 0.3:
            break
        cur = int(kids[torch.randint(kids.numel(), (1,), generator=g)])
        walk.append(int(tokens[cur]))
    fresh = (torch.randint(VOCAB, (length,), generator=g) + VOCAB).tolist()      # tokens no drafted node has
    leaves = [i for i in range(1, tokens.numel()) if not (parents == i).any()]
    whole, i = [], leaves[int(torch.randint(len(leaves), (1,), generator=g))] if leaves else 0
    while i > 0:
        whole.insert(0, int(tokens[i]))
        i = int(parents[i])
    return [(walk + fresh)[:length], whole[:length], fresh, fresh[:1], []]


def padded(proposal: list[int], length: int) -> torch.Tensor:
    return torch.tensor(proposal + [-1] * (length - len(proposal)), dtype=torch.long)


@pytest.mark.parametrize("k, depth, nodes, min_score", CASES)
@pytest.mark.parametrize("length", [1, 3, 6])
def test_the_device_graft_is_the_host_graft_with_masked_slots(k, depth, nodes, min_score, length):
    """Guards against the graft on the device hanging the looked-up chain elsewhere than ``graft_branch`` does (under
    another node than the deepest one the proposal reaches, a token the tree already has repeated, a wrong depth or
    mask), or a slot it does not use (tokens the tree has, padding) that could be seen or accepted: the host tree's
    nodes are the device tree's first ones, its chain the device slots T + n.., and the other slots are masked
    nodes (token -1, depth 0, seen by none but themselves); the nodes grafted count alike."""
    g = torch.Generator().manual_seed(nodes * 10 + length)
    for seed in range(4):
        tok, score, parent, level = drafted(k, depth, seed)
        host_tokens, buf = host_tree(7, tok, score, parent, level, nodes, min_score)
        fields = static_tree(torch.tensor(7), tok, score, parent, level, nodes, depth, min_score)
        size, kept = nodes + 1, buf.num_nodes
        for proposal in proposals(host_tokens, buf.parents, g, length):
            h_tokens, h_parents, h_depths, rest = graft_branch(host_tokens, buf.parents, buf.position_offsets,
                                                               proposal)
            h = tree_buffers(h_parents, h_depths, int(h_depths.max()))
            *out, grafted = static_graft(*(f[None] for f in fields), padded(proposal, length)[None])
            t = StaticTree(*(f[0] for f in out))
            assert t.num_nodes == size + length and int(grafted) == rest
            start = size + len(proposal) - rest                        # the chain's first slot: T + n
            ours = list(range(kept)) + list(range(start, start + rest))   # device slot of each host node
            index = torch.tensor(ours)
            back = {d: i for i, d in enumerate(ours)}
            assert torch.equal(t.tokens[index], h_tokens) and torch.equal(t.position_offsets[index], h_depths)
            assert [back.get(int(p), -1) for p in t.parents[index]] == h_parents.tolist()
            assert torch.equal(t.tree_mask[index][:, index], h.tree_mask)
            unused = torch.tensor(sorted(set(range(size + length)) - set(ours)), dtype=torch.long)
            if unused.numel():
                assert (t.tokens[unused] == -1).all() and (t.position_offsets[unused] == 0).all()
                assert not t.tree_mask[index][:, unused].any()           # no used node sees an unused one
            for row in h.retrieve_indices:
                leaf = int(row[row >= 0][-1])
                assert [back[int(i)] for i in t.retrieve_indices[ours[leaf]] if i >= 0] == [
                    i for i in row.tolist() if i >= 0]


def test_a_switching_row_verifies_the_chain_alone_and_rows_are_independent():
    """Guards against ``drop`` (a row that verifies its looked-up chain alone, ``eagle_lookup_switch``) leaving a
    drafted node visible or acceptable, or one row's proposal landing in another's tree: batched, each row equals
    its own graft at batch 1, and a dropped row's drafted slots are masked nodes, its chain hung on the root."""
    g = torch.Generator().manual_seed(3)
    rows = [drafted(2, 3, seed) for seed in range(3)]
    tok, score, parent, level = (torch.stack(x) for x in zip(*rows))
    root = torch.tensor([7, 8, 9])
    fields = static_tree(root, tok, score, parent, level, 8, 3, None)
    props = torch.stack([padded(p, 4) for p in ([int(tok[0, 0]), 60, 61], [62, 63, 64, 65], [int(tok[2, 1])])])
    drop = torch.tensor([False, True, False])
    together = static_graft(*fields, props, drop)
    for b in range(3):
        alone = static_graft(*(f[b:b + 1] for f in fields), props[b:b + 1], drop[b:b + 1])
        assert all(torch.equal(x[b], y[0]) for x, y in zip(together, alone))
    t = StaticTree(*(f[1] for f in together[:5]))
    assert (t.tokens[1:9] == -1).all() and t.tokens[9:].tolist() == [62, 63, 64, 65]
    assert t.parents[9:].tolist() == [0, 9, 10, 11] and t.position_offsets[9:].tolist() == [1, 2, 3, 4]
    assert not t.tree_mask[9:, 1:9].any() and int(together[5][1]) == 4
    logits = torch.randn(13, VOCAB + 70, generator=g)
    logits[0, 62] = logits[9, 63] = logits[10, 5] = 100.0   # the chain's first two right, then 5, not 64
    logits[0, int(tok[1, 0])] = 99.0                        # a dropped node's token a close second: never accepted
    v = verify_greedy(t, t.tokens, logits)
    assert v.path == [0, 9, 10] and v.tokens == [8, 62, 63] and v.bonus == 5


def test_grafting_on_the_device_reads_nothing_from_the_host():
    """Guards against a host read or a data-dependent shape in the device graft (it runs inside eagle3_lookup's
    captured tree call)."""
    tok, score, parent, level = drafted(4, 3, 0)
    fields = static_tree(torch.tensor(7), tok, score, parent, level, 20, 3, -4.0)
    proposal = padded([int(tok[0]), 3, 4], 6)[None]
    with HostReads() as reads:
        static_graft(*(f[None] for f in fields), proposal, torch.tensor([False]))
        static_graft(*root_tree(torch.tensor([7])), padded([3, 4], 6)[None])
    assert reads.count == 0, reads.seen
