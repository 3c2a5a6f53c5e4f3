"""The decoding loop on tiny random Llamas (inference/decode.py, cache.py, model.py)."""

import pytest
import torch

from inference.methods.medusa import TreeDecoder
from inference.methods import generate, stream
from inference.methods.medusa_choice import calibrated_tree, measure_head_accuracy, measure_step_latency
from inference.errors import UserError
from inference.runtime.tree import MedusaTree, default_tree
from inference.runtime.verify import SamplingConfig

from runtime_support import (FixedHeads, OracleHeads, one_thread, random_heads, sequential_kv,  # noqa: F401
                             tiny_llama, wrap)

V = 96
PROMPT = [5, 17, 3, 88, 41, 9]
# nodes: 0 root, 1 [0], 2 [1], 3 [0,0], 4 [0,1], 5 [1,0], 6 [0,0,0]
TREE = MedusaTree([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])


@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab=V, seed=0)


@pytest.fixture(scope="module")
def m(model):
    return wrap(model, random_heads(model, num_heads=4, seed=1))


@pytest.fixture(scope="module")
def greedy(m):
    """The backbone's own greedy continuation of PROMPT (48 tokens)."""
    return generate(m, PROMPT, "autoregressive", max_new_tokens=48).tokens


@pytest.mark.parametrize("tree", [TREE, default_tree("mc_sim_7b_63", 4)], ids=["7-nodes", "mc_sim_7b_63"])
def test_tree_node_logits_equal_sequential_decoding(m, tree):
    """Guards against wrong tree masks / positions / cache use: every node's logits must equal
    those of running the prefix + its root-to-node path as an ordinary sequence."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, V, (tree.num_nodes,), generator=g)
    buf = tree.buffers()
    cache = m.new_cache(64 + tree.num_nodes)
    with torch.inference_mode():
        m.hidden(torch.tensor([PROMPT]), torch.arange(len(PROMPT))[None], cache)
        past = len(PROMPT)
        h = m.hidden(tokens[None], (buf.position_offsets + past)[None], cache, buf.additive_mask(past, torch.float32))
        got = m.logits(h[0])
        assert cache.length == past + tree.num_nodes
        for i in range(tree.num_nodes):
            seq = PROMPT + tokens[tree.ancestors(i)].tolist()
            ref = m.model(input_ids=torch.tensor([seq])).logits[0, -1]
            torch.testing.assert_close(got[i], ref, atol=1e-5, rtol=0)


def _wrong(t, k=1):
    return (t + k) % V


@pytest.mark.parametrize("case", ["all", "none", "rank1-branch", "stop-at-depth-2"])
def test_forced_acceptance_lengths_and_compacted_cache(model, greedy, case):
    """Guards against wrong acceptance lengths and against a compacted KV cache that differs from
    the cache of feeding prompt + accepted tokens one by one (stale or misordered tree rows)."""
    g = greedy  # g[0] is the root (chosen at prefill); head k guesses g[k+1] for depth k+1
    ranked = {
        "all": ([g[1], _wrong(g[1])], [g[2], _wrong(g[2])], [g[3]]),
        "none": ([_wrong(g[1]), _wrong(g[1], 2)], [g[2], _wrong(g[2])], [g[3]]),
        "rank1-branch": ([_wrong(g[1]), g[1]], [g[2], _wrong(g[2])], [g[3]]),
        "stop-at-depth-2": ([g[1], _wrong(g[1])], [_wrong(g[2]), _wrong(g[2], 2)], [g[3]]),
    }[case]
    expected_path = {"all": [0, 1, 3, 6], "none": [0], "rank1-branch": [0, 2, 5], "stop-at-depth-2": [0, 1]}[case]
    m = wrap(model, FixedHeads(V, [list(r) for r in ranked]))
    dec = TreeDecoder(m, TREE)
    assert dec.prefill(torch.tensor([PROMPT]), max_new_tokens=16) == g[0]
    new, _ = dec.step()
    n = len(expected_path)
    assert dec.last_path == expected_path
    assert new == g[1:1 + n]                      # accepted tokens + the bonus token
    assert dec.past == len(PROMPT) + n and dec.cache.length == dec.past
    reference = sequential_kv(m, PROMPT + g[:n])  # prompt, root, accepted nodes (not the bonus)
    for layer, (k_ref, v_ref) in zip(dec.cache.layers, reference):
        torch.testing.assert_close(layer.keys, k_ref, atol=1e-5, rtol=0)
        torch.testing.assert_close(layer.values, v_ref, atol=1e-5, rtol=0)
    assert dec.root == g[n] and dec.step()[0][0] == g[n + 1]   # decoding continues from the compacted cache


@pytest.mark.parametrize("tree", ["chain2", "chain4", "tree4", "tree8", "tree16", "tree64", "mc_sim_7b_63"])
def test_greedy_medusa_is_token_identical_with_random_heads(m, greedy, tree):
    """Guards against greedy Medusa changing the output when guesses are (mostly) wrong."""
    out = generate(m, PROMPT, tree=tree, max_new_tokens=48)
    assert out.tokens == greedy
    assert len(out.tokens) == 48 and out.finish_reason == "length"


@pytest.mark.parametrize("projection", ["truncated", "shared"])
def test_greedy_identity_with_truncated_and_shared_heads(model, greedy, projection):
    """Guards against token_map / shared lm_head mistakes corrupting candidates or outputs."""
    heads = random_heads(model, num_heads=3, projection=projection, truncated=40 if projection == "truncated" else None)
    out = generate(wrap(model, heads), PROMPT, tree="tree16", max_new_tokens=48)
    assert out.tokens == greedy


@pytest.mark.parametrize("tree", ["chain4", "tree8", "tree16", "tree32"])
def test_greedy_identity_and_full_acceptance_with_perfect_heads(m, model, greedy, tree):
    """Guards against accepted paths being cut short (or wrong) when every guess is right."""
    oracle = OracleHeads(m, PROMPT + generate(m, PROMPT, "autoregressive", max_new_tokens=64).tokens, num_heads=3)
    mm = wrap(model, oracle)
    out = generate(mm, PROMPT, tree=tree, max_new_tokens=48)
    depth = default_tree(tree, 3).max_depth
    assert out.tokens == greedy
    assert all(a == depth + 1 for a in out.accept_lengths[:-1])
    assert out.steps == -(-47 // (depth + 1)) and sum(out.accept_lengths) == 47   # the last step cut at the budget


@pytest.mark.parametrize("batched", [False, True], ids=["batch-1", "batched"])
def test_accept_lengths_count_only_emitted_tokens(m, model, greedy, batched):
    """Guards against tau, accept lengths and the acceptance rate counting a last step's accepted tokens that
    were never output (past max_new_tokens or past an EOS): with perfect heads a 3-deep chain accepts 4 tokens
    a step, and a budget of 7 emits 1 + 4 + 2. tau must add up to the tokens emitted; the acceptance rate stays
    what verification accepted (a cut is no rejection)."""
    from inference.methods import generate_batch

    oracle = OracleHeads(m, PROMPT + generate(m, PROMPT, "autoregressive", max_new_tokens=64).tokens, num_heads=4)
    mm = wrap(model, oracle)

    def run(**kw):
        if batched:
            return generate_batch(mm, [PROMPT], tree="chain4", **kw).rows[0]
        return generate(mm, PROMPT, tree="chain4", **kw)

    depth = default_tree("chain4", 4).max_depth   # 3: a step accepts 4 tokens
    out = run(max_new_tokens=7)
    assert out.tokens == greedy[:7] and out.accept_lengths == [depth + 1, 6 - (depth + 1)]
    assert out.tau == 3.0
    # what verification accepted stays whole: the drafter's acceptance is not a cut's
    assert out.accepted == [depth + 1, depth + 1] and out.acceptance_rate == 1.0
    eos = greedy[3]
    first = greedy.index(eos)
    out = run(max_new_tokens=48, eos_token_ids=[eos])
    assert out.tokens == greedy[:first + 1] and out.finish_reason == "eos"
    assert 1 + sum(out.accept_lengths) == len(out.tokens)


def test_medusa_counts_the_tree_depth_as_proposed_at_batch_1_as_batched(m, model):
    """Guards against batch-1 Medusa counting every tree node as proposed (the batched decoder and every other
    method count the depth, the most a step can accept): the same decoding then gave two acceptance rates."""
    from inference.methods import generate_batch

    oracle = OracleHeads(m, PROMPT + generate(m, PROMPT, "autoregressive", max_new_tokens=40).tokens, num_heads=3)
    mm = wrap(model, oracle)
    one = generate(mm, PROMPT, tree="tree8", max_new_tokens=20)
    row = generate_batch(mm, [PROMPT], tree="tree8", max_new_tokens=20).rows[0]
    assert one.tokens == row.tokens and one.accept_lengths == row.accept_lengths
    assert one.proposed == row.proposed == [default_tree("tree8", 3).max_depth] * one.steps
    assert one.acceptance_rate == row.acceptance_rate


def test_plain_loop_matches_transformers_generate(model, m):
    """Guards against the autoregressive baseline (and its cache) diverging from HF greedy generate."""
    ref = model.generate(torch.tensor([PROMPT]), max_new_tokens=32, do_sample=False, pad_token_id=0)[0, len(PROMPT):]
    out = generate(m, PROMPT, "autoregressive", max_new_tokens=32)
    assert out.tokens == ref.tolist()
    assert out.steps == 31 and out.tau == 1.0


def test_streaming_eos_and_length_limits(m, greedy):
    """Guards against streams that lose/duplicate tokens and stops that overrun EOS or max_new_tokens."""
    streamed = stream(m, PROMPT, tree="tree8", max_new_tokens=48)
    chunks = list(streamed)
    assert [t for c in chunks for t in c] == greedy == streamed.result.tokens
    eos = greedy[10]
    first = greedy.index(eos)
    for out in (generate(m, PROMPT, tree="tree8", max_new_tokens=48, eos_token_ids=[eos]),
                generate(m, PROMPT, "autoregressive", max_new_tokens=48, eos_token_ids=[eos])):
        assert out.tokens == greedy[:first + 1] and out.finish_reason == "eos"
    seen = []
    out = generate(m, PROMPT, tree="chain4", max_new_tokens=7, on_tokens=seen.append)
    assert out.tokens == greedy[:7] and [t for c in seen for t in c] == greedy[:7]
    ar = stream(m, PROMPT, "autoregressive", max_new_tokens=5)
    assert [t for c in ar for t in c] == greedy[:5] and ar.result.finish_reason == "length"
    assert generate(m, PROMPT, tree="tree8", max_new_tokens=48, max_steps=3).steps == 3


def test_sampling_modes_are_reproducible_and_typical_accepts(m):
    """Guards against seeds being ignored and typical acceptance never accepting anything."""
    for cfg in (SamplingConfig(mode="sample", temperature=0.9, top_p=0.95),
                SamplingConfig(mode="sample", temperature=0.9, draft="sampled"),
                SamplingConfig(mode="typical", temperature=0.9)):
        a = generate(m, PROMPT, tree="tree16", max_new_tokens=24, sampling=cfg, seed=7)
        b = generate(m, PROMPT, tree="tree16", max_new_tokens=24, sampling=cfg, seed=7)
        assert a.tokens == b.tokens and len(a.tokens) == 24
    # a random tiny model is near-uniform: typical's threshold is tiny, so guesses get accepted
    lax = SamplingConfig(mode="typical", temperature=1.0, typical_epsilon=1e-6, typical_delta=1e-6)
    lengths = generate(m, PROMPT, tree="chain4", max_new_tokens=24, sampling=lax, seed=1).accept_lengths
    assert lengths[:-1] == [4] * (len(lengths) - 1) and sum(lengths) == 23   # the last step cut at the budget
    strict = SamplingConfig(mode="typical", temperature=1.0, typical_epsilon=1.0, typical_delta=1e6)
    assert generate(m, PROMPT, tree="chain4", max_new_tokens=24, sampling=strict, seed=1).tau == 1.0


@pytest.mark.parametrize("method, kw", [("medusa", {"tree": "tree16"}), ("draft", {"draft": "self:1"})])
def test_typical_mode_with_top_k_1_is_greedy(m, greedy, method, kw):
    """Guards against typical acceptance ignoring top_k / top_p: with top_k=1 the plain loop can only take the argmax,
    but a lax typical threshold accepted drafts off it, so speculation emitted tokens of zero probability."""
    lax = SamplingConfig(mode="typical", temperature=1.0, typical_epsilon=1e-6, typical_delta=1e-6, top_k=1)
    out = generate(m, PROMPT, method, max_new_tokens=24, sampling=lax, seed=3, eos_token_ids=(), **kw)
    assert out.tokens == generate(m, PROMPT, "autoregressive", max_new_tokens=24, eos_token_ids=()).tokens


def test_calibration_counts_and_perfect_heads(m, model):
    """Guards against head/offset mix-ups in calibration (head k must be scored at t+k+2)."""
    seq = PROMPT + generate(m, PROMPT, "autoregressive", max_new_tokens=40).tokens
    oracle = wrap(model, OracleHeads(m, seq, num_heads=3))
    acc = measure_head_accuracy(oracle, [PROMPT], max_new_tokens=20, topk=4)
    assert acc.totals.tolist() == [19, 18, 17]          # positions whose target is generated
    assert acc.per_rank[:, 0].tolist() == [1.0, 1.0, 1.0]
    assert torch.all(acc.topk[:, -1] == 1.0)
    rnd = measure_head_accuracy(m, [PROMPT, PROMPT[:3]], max_new_tokens=12, topk=5)
    assert rnd.per_rank.shape == (4, 5) and rnd.totals.tolist() == [22, 20, 18, 16]
    assert torch.all(rnd.topk <= 1.0) and torch.all(rnd.per_rank >= 0)


def test_calibrated_tree_follows_the_measured_heads(m, model):
    """Guards against calibration and growth not being wired together (perfect heads -> a chain)."""
    seq = PROMPT + generate(m, PROMPT, "autoregressive", max_new_tokens=40).tokens
    oracle = wrap(model, OracleHeads(m, seq, num_heads=3))
    tree, tau, acc = calibrated_tree(oracle, [PROMPT], num_nodes=8, max_new_tokens=20, topk=3)
    assert tree.paths == ((0,), (0, 0), (0, 0, 0)) and tau == 4.0   # rank 0 is always right, others never
    out = generate(oracle, PROMPT, tree=tree, max_new_tokens=20)
    assert out.tokens == seq[len(PROMPT):len(PROMPT) + 20] and out.accept_lengths[0] == 4


def test_step_latency_measurement_runs(m):
    """Guards against the latency helper failing on root-only or large trees."""
    lat = measure_step_latency(m, PROMPT, ["tree1", "tree8", "tree64"], steps=2, warmup=1)
    assert list(lat) == ["tree1", "tree8", "tree64"] and all(v > 0 for v in lat.values())


def test_bfloat16_decoding_runs(model):
    """Guards against dtype mismatches (mask, heads, cache) when the backbone runs in bf16."""
    bf = tiny_llama(vocab=V, seed=0).to(torch.bfloat16)
    mm = wrap(bf, random_heads(bf, num_heads=3))
    out = generate(mm, PROMPT, tree="tree16", max_new_tokens=12)
    ar = generate(mm, PROMPT, "autoregressive", max_new_tokens=12)
    assert len(out.tokens) == 12 and all(0 <= t < V for t in out.tokens)
    assert out.tokens[:3] == ar.tokens[:3]


@pytest.mark.parametrize("call, fragment", [
    (lambda m: generate(m, torch.tensor([PROMPT, PROMPT])), "batch size 2"),
    (lambda m: generate(m, []), "empty"),
    (lambda m: generate(m, [V + 3]), "must lie in"),
    (lambda m: generate(m, "hello"), "token ids"),
    (lambda m: generate(m, PROMPT, max_new_tokens=0), "max_new_tokens"),
    (lambda m: generate(m, PROMPT, max_new_tokens=600), "positions"),
    (lambda m: generate(m, PROMPT, tree=[[0], [0, 0], [0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0, 0]]), "depth 5"),
    (lambda m: generate(m, PROMPT, tree="tree7x"), "unknown tree"),
])
def test_user_mistakes_are_one_line_errors(m, call, fragment):
    """Guards against bad requests surfacing as tracebacks from deep inside torch."""
    with pytest.raises(UserError, match=fragment):
        call(m)
