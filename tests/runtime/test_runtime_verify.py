"""Acceptance rules on hand-made logits (inference/verify.py): greedy, typical, filtering, config."""

import math

import pytest
import torch

from inference.errors import UserError
from inference.runtime.tree import MedusaTree, RowTrees, default_tree
from inference.runtime.verify import (SamplingConfig, filter_probs, propose, verify, verify_greedy, verify_rows,
                                      verify_sample, verify_typical)

from test_runtime_sampling import chi_square_pvalue

# nodes: 0 root, 1 [0], 2 [1], 3 [0,0], 4 [0,1], 5 [1,0], 6 [0,0,0]
TREE = MedusaTree([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
TOKENS = torch.tensor([10, 11, 12, 13, 14, 15, 16])
V = 20


def peaked(targets: dict[int, int]) -> torch.Tensor:
    """[N, V] logits whose argmax at node i is targets[i] (token 0 where unspecified)."""
    logits = torch.zeros(TREE.num_nodes, V)
    for i in range(TREE.num_nodes):
        logits[i, targets.get(i, 0)] = 5.0
    return logits


@pytest.mark.parametrize("targets, path, bonus", [
    ({0: 11, 1: 13, 3: 16, 6: 3}, [0, 1, 3, 6], 3),   # every depth accepted, bonus after the leaf
    ({0: 12, 1: 13, 2: 15, 5: 7}, [0, 2, 5], 7),      # second branch; node 1's match does not count
    ({0: 11, 1: 14, 4: 9}, [0, 1, 4], 9),             # sibling rank 1 at depth 2
    ({0: 19}, [0], 19),                               # nothing accepted: bonus = root's argmax
])
def test_greedy_accepts_the_longest_matching_path(targets, path, bonus):
    """Guards against accepting a child whose parent was rejected, or the wrong bonus token."""
    v = verify_greedy(TREE.buffers(), TOKENS, peaked(targets))
    assert v.path == path and v.bonus == bonus
    # the path's tokens come with the path in the one host read (no second read of the accepted tokens)
    assert v.tokens == TOKENS[path].tolist() and v.accepted_tokens(None) == TOKENS[path[1:]].tolist()


def _dist(pairs: dict[int, float]) -> torch.Tensor:
    """Logits of a distribution with the given token probabilities, the rest spread evenly."""
    p = torch.full((V,), (1 - sum(pairs.values())) / (V - len(pairs)))
    for t, q in pairs.items():
        p[t] = q
    return p.log()


def test_typical_acceptance_follows_medusas_threshold():
    """Guards against a typical rule other than p(x) > min(eps, delta*exp(-H)) or wrong tie-breaking."""
    logits = torch.stack([_dist({12: 0.5, 11: 0.2})] + [_dist({7: 0.999})] * 6)
    p0 = torch.softmax(logits[0], -1)
    entropy = float(-(p0 * p0.log()).sum())
    g = torch.Generator().manual_seed(0)
    # both root children pass; equal lengths -> the likelier [1] (token 12) wins; bonus = node 2's mode
    cfg = SamplingConfig(mode="typical", temperature=1.0, typical_epsilon=0.09, typical_delta=0.3)
    v = verify_typical(TREE.buffers(), TOKENS, logits, cfg, g)
    assert v.path == [0, 2]
    # threshold between 0.2 and 0.5 through delta*exp(-H): only token 12 passes
    cfg = SamplingConfig(mode="typical", temperature=1.0, typical_epsilon=1.0,
                         typical_delta=0.35 / math.exp(-entropy))
    assert verify_typical(TREE.buffers(), TOKENS, logits, cfg, g).path == [0, 2]
    # threshold above both: nothing accepted
    cfg = SamplingConfig(mode="typical", temperature=1.0, typical_epsilon=1.0,
                         typical_delta=0.55 / math.exp(-entropy))
    assert verify_typical(TREE.buffers(), TOKENS, logits, cfg, g).path == [0]
    # through epsilon: min(0.3, large) = 0.3 keeps only token 12 again
    cfg = SamplingConfig(mode="typical", temperature=1.0, typical_epsilon=0.3, typical_delta=100.0)
    assert verify_typical(TREE.buffers(), TOKENS, logits, cfg, g).path == [0, 2]


def test_filter_probs_temperature_top_k_top_p():
    """Guards against a target distribution that drifts from the documented filtering order."""
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    logits = p.log()
    assert torch.allclose(filter_probs(logits, 1.0), p)
    assert torch.allclose(filter_probs(logits, 1.0, top_k=2), torch.tensor([5 / 7, 2 / 7, 0, 0, 0]))
    assert torch.allclose(filter_probs(logits, 1.0, top_p=0.8), torch.tensor([0.5, 0.2, 0.15, 0, 0]) / 0.85)
    assert torch.allclose(filter_probs(logits, 1.0, top_p=0.5), torch.tensor([1.0, 0, 0, 0, 0]))
    hot = p.sqrt() / p.sqrt().sum()
    assert torch.allclose(filter_probs(logits, 2.0), hot)
    both = filter_probs(logits, 2.0, top_k=3, top_p=0.6)
    h3 = hot[:3] / hot[:3].sum()
    keep = (h3.cumsum(0) - h3) < 0.6
    assert torch.allclose(both[:3], torch.where(keep, h3, 0) / torch.where(keep, h3, 0).sum())


def test_propose_gathers_ranked_and_truncated_guesses():
    """Guards against tree tokens taken from the wrong head/rank or not mapped through token_map."""
    buf = TREE.buffers()
    head_logits = [torch.tensor([0.0, 3.0, 2.0, 1.0]), torch.tensor([3.0, 0.0, 1.0, 2.0]),
                   torch.tensor([0.0, 0.0, 5.0, 0.0])]
    token_map = torch.tensor([40, 41, 42, 43])
    tokens, q = propose(buf, head_logits, lambda ids: token_map[ids], SamplingConfig(), None, 50)
    # ranks: head0 -> [1, 2], head1 -> [0, 3], head2 -> [2]
    assert tokens.tolist() == [41, 42, 40, 43, 40, 42] and q is None


def test_sampled_drafts_are_distinct_and_q_is_mapped():
    """Guards against draws with replacement among siblings or q placed on the wrong vocabulary ids."""
    buf = MedusaTree([[0], [1], [2]]).buffers()
    token_map = torch.tensor([7, 3, 5, 9])
    logits = [torch.tensor([[1.0, 0.5, 0.0, -1.0]]).expand(500, -1)]
    cfg = SamplingConfig(mode="sample", temperature=1.0, draft="sampled")
    tokens, q = propose(buf, logits, lambda ids: token_map[ids], cfg, torch.Generator().manual_seed(0), 12)
    assert tokens.shape == (500, 3)
    assert all(len(set(row)) == 3 for row in tokens.tolist())
    assert torch.allclose(q[0, 0, [7, 3, 5, 9]], torch.softmax(logits[0][0], -1))
    assert q[0, 0].sum().item() == pytest.approx(1.0)
    # the first draw follows q itself
    freq = torch.bincount(tokens[:, 0], minlength=12)[[7, 3, 5, 9]].float() / 500
    assert torch.allclose(freq, torch.softmax(logits[0][0], -1), atol=0.07)


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(mode="beam"), "decoding mode"),
    (dict(mode="sample", temperature=0), "temperature > 0"),
    (dict(temperature=-1), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(draft="nope"), "draft"),
])
def test_bad_sampling_settings_are_user_errors(kwargs, fragment):
    """Guards against nonsense settings reaching the sampler (NaNs, silent greedy)."""
    with pytest.raises(UserError, match=fragment):
        SamplingConfig(**kwargs)


# -- per-row trees of different shapes, verified together (RowTrees) -------------------------------------
ROW_TREES = [MedusaTree([[0], [0, 0]]), TREE, MedusaTree([[0], [1], [2]]), MedusaTree([[0]])]


def _row_batch(trees, seed: int, vocab: int = 4):
    """Each tree's tokens and logits drawn from a small vocabulary (so draws match often, ties between equally long
    paths included), stacked as a batched drafter hands them over: -1 tokens on a narrower row's padding."""
    g = torch.Generator().manual_seed(seed)
    bufs = [t.buffers() for t in trees]
    n = max(b.num_nodes for b in bufs)
    tokens = torch.full((len(bufs), n), -1, dtype=torch.long)
    logits = torch.randn(len(bufs), n, vocab, generator=g) * 3
    for i, b in enumerate(bufs):
        tokens[i, :b.num_nodes] = torch.randint(vocab, (b.num_nodes,), generator=g)
    return bufs, RowTrees.stack(bufs), tokens, logits


@pytest.mark.parametrize("seed", range(40))
def test_row_trees_verified_together_give_each_row_its_own_trees_verdict(seed):
    """Guards against stacking per-row trees of different shapes into one verification going wrong: a padding node
    or padding leaf path accepted, another row's structure read, or the first-longest tie rule picking a padding
    path. Greedy: every row's path, bonus and tokens equal ``verify`` on its tree alone. Typical acceptance (its
    bonus is drawn): every row's accepted path equals its own tree's."""
    bufs, rows, tokens, logits = _row_batch(ROW_TREES, seed)
    v = verify_rows(rows, tokens, logits, SamplingConfig(), None, None)
    for i, b in enumerate(bufs):
        alone = verify(b, tokens[i, :b.num_nodes], logits[i, :b.num_nodes], SamplingConfig(), None, None)
        assert (v.paths[i], v.bonus[i], v.tokens[i]) == (alone.path, alone.bonus, alone.tokens)
    cfg = SamplingConfig(mode="typical", temperature=1.0, typical_epsilon=0.3, typical_delta=0.09)
    g = torch.Generator().manual_seed(seed)
    v = verify_rows(rows, tokens, logits, cfg, None, g)
    for i, b in enumerate(bufs):
        assert v.paths[i] == verify(b, tokens[i, :b.num_nodes], logits[i, :b.num_nodes], cfg, None, g).path


def test_row_trees_sample_each_rows_own_distribution():
    """Guards against exact sampling over stacked per-row trees walking a padding node or another row's children:
    over 4,000 rows of two trees of different shapes (the narrow one padded), each row's first two emitted tokens
    follow the target's law on its own tree (the first at the root; the second, after an accepted child, at that
    child's node; none after a first token no child carries), and drafts are both accepted and rejected."""
    vocab, trials = 6, 2000
    g = torch.Generator().manual_seed(0)
    trees = [default_tree("chain3", 2), TREE]
    bufs = [t.buffers() for t in trees] * trials
    rows = RowTrees.stack(bufs)
    n = rows.num_nodes
    logits = torch.randn(n, vocab, generator=g).expand(len(bufs), n, vocab)
    tokens = torch.full((len(bufs), n), -1, dtype=torch.long)
    for i, b in enumerate(bufs):
        tokens[i, :b.num_nodes] = torch.arange(b.num_nodes) % vocab
    v = verify_rows(rows, tokens, logits, SamplingConfig(mode="sample", temperature=1.0), None, g)
    p = torch.softmax(logits[0], -1)                                       # [n, V]: the target at each node
    for shape, b in enumerate(bufs[:len(trees)]):
        law = torch.zeros(vocab, vocab + 1)                                # (first, second or none)
        for x in range(vocab):
            kids = [c for c in b.children[0].tolist() if c >= 0 and tokens[shape, c] == x]
            after = torch.cat([p[kids[0]], torch.zeros(1)]) if kids else torch.eye(vocab + 1)[vocab]   # none: stop
            law[x] = p[0, x] * after
        counts = torch.zeros(vocab, vocab + 1)
        for path, bonus, toks in list(zip(v.paths, v.bonus, v.tokens))[shape::len(trees)]:
            emitted = toks[1:] + [bonus]
            counts[emitted[0], emitted[1] if len(emitted) > 1 else vocab] += 1
        assert chi_square_pvalue(counts.flatten(), law.flatten()) > 1e-3
        assert 0 < sum(len(p) > 1 for p in v.paths[shape::len(trees)]) < trials


def test_sampled_verification_writes_no_python_scalar_through_an_index():
    """Guards against draft="sampled" verification zeroing a rejected token's draft mass with a Python scalar through
    a tensor index (``q2[rows, x] = 0``): on CUDA that scalar becomes a host tensor which index_put_ copies to the
    device, a blocking sync once per sibling per step. Seen on CPU as an index_put_ whose value was made from a
    Python number (``aten.lift_fresh``); a device-made value (``new_zeros``) is none, and the output is unchanged."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class HostScalarWrites(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.lifted, self.writes = set(), 0
            self.kept = []   # the lifted tensors kept alive: a freed one's id can be a later tensor's

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = str(func)
            if name.startswith("aten.lift_fresh"):
                self.lifted.add(id(out))
                self.kept.append(out)
            elif name.startswith(("aten.index_put", "aten._index_put_impl")):
                vals = args[2] if len(args) > 2 else (kwargs or {}).get("values")
                self.writes += id(vals) in self.lifted
            return out

    buf = TREE.buffers()
    g = torch.Generator().manual_seed(0)
    heads = torch.randn(2, buf.max_depth, V, generator=g)
    cfg = SamplingConfig(mode="sample", temperature=1.0, draft="sampled")
    cand, q = propose(buf, list(heads.unbind(1)), lambda ids: ids, cfg, g, V)
    tokens = torch.cat([torch.tensor([[1], [2]]), cand], 1)
    probs = torch.softmax(torch.randn(2, buf.num_nodes, V, generator=g), -1)
    ref = verify_sample(buf, tokens, probs, q, "sampled", torch.Generator().manual_seed(5))
    with HostScalarWrites() as mode:
        got = verify_sample(buf, tokens, probs, q, "sampled", torch.Generator().manual_seed(5))
    assert mode.writes == 0
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


def test_a_tiny_temperature_gives_the_argmax_distribution():
    """Guards against logits / T overflowing to inf at a tiny temperature (T <= ~1e-38 passes validation): the
    softmax gave NaN and sampling raised torch's raw 'probability tensor contains either inf, nan' error in every
    method. Shifted by their maximum first, the logits give the argmax one-hot; ordinary temperatures are unchanged."""
    logits = torch.tensor([[1.0, 3.5, -2.0, 3.25], [0.0, -1.0, 7.0, 6.5]])
    for t in (1e-39, 1e-44, 1e-4):
        p = filter_probs(logits, t)
        assert torch.isfinite(p).all()
        assert torch.equal(p, torch.nn.functional.one_hot(logits.argmax(-1), 4).float())
    assert torch.allclose(filter_probs(logits, 0.7), torch.softmax(logits / 0.7, -1), atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_typical_acceptance_leaves_the_logits_as_they_were(dtype):
    """Guards against the in-place arithmetic of typical acceptance (one float32 copy, shifted and scaled in place:
    ~1 GiB a full-vocabulary tensor at 32 rows x 65 nodes x 128,256 tokens) writing into float32 logits the caller
    still reads (the bonus sample, the draft's next root), where ``.float()`` returns the same tensor."""
    logits = torch.stack([_dist({12: 0.5, 11: 0.2})] + [_dist({7: 0.999})] * 6).to(dtype)
    before = logits.clone()
    cfg = SamplingConfig(mode="typical", temperature=0.7, typical_epsilon=0.09, typical_delta=0.3)
    assert verify_typical(TREE.buffers(), TOKENS, logits, cfg, torch.Generator().manual_seed(0)).path == [0, 2]
    assert torch.equal(logits, before)


def test_typical_acceptance_keeps_to_top_k_top_p_and_tiny_temperatures():
    """Guards against typical acceptance reading the unfiltered distribution: with top_k=1 (or a top_p nucleus
    of one token) a draft the plain loop could never sample was accepted, so speculation emitted tokens of zero
    probability; and against a tiny temperature (1e-39) turning the log-probabilities into NaN, so no draft was
    ever accepted (tau 1)."""
    logits = torch.stack([_dist({12: 0.5, 11: 0.4})] + [_dist({7: 0.999})] * 6)   # node 1 (11) passes typically
    g = torch.Generator().manual_seed(0)
    loose = SamplingConfig(mode="typical", temperature=1.0, typical_epsilon=0.09, typical_delta=0.3)
    tree = MedusaTree([[0], [0, 0]])     # one chain: root -> 11 -> 13
    tokens = torch.tensor([10, 11, 13])
    chain = torch.stack([logits[0], _dist({13: 0.999}), _dist({7: 0.999})])
    assert verify_typical(tree.buffers(), tokens, chain, loose, g).path == [0, 1, 2]
    for kw in ({"top_k": 1}, {"top_p": 0.4}):
        cfg = SamplingConfig(mode="typical", temperature=1.0, typical_epsilon=0.09, typical_delta=0.3, **kw)
        v = verify_typical(tree.buffers(), tokens, chain, cfg, g)
        assert v.path == [0] and v.bonus == 12, kw
    tiny = SamplingConfig(mode="typical", temperature=1e-39, typical_epsilon=0.09, typical_delta=0.3)
    peaky = torch.stack([_dist({11: 0.6}), _dist({13: 0.6}), _dist({7: 0.999})])
    assert verify_typical(tree.buffers(), tokens, peaky, tiny, g).path == [0, 1, 2]
