"""Medusa + prompt lookup in one forward (inference/methods/medusa_lookup.py): the trie
merge, forced acceptance with a scripted model, the no-match step, greedy identity and exact
caches on tiny random Llamas, exact sampling on the merged trie, and the harness / CLI wiring."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from inference.cli import EvalConfig
from inference.cli_run import eval_methods
from inference.methods.medusa import TreeDecoder
from inference.methods import generate
from inference.errors import UserError
from inference.evaluation.evaluate import evaluate
from inference.prompts import Prompt
from inference.methods import get, names
from inference.methods.registry import kv_bytes_per_token
from inference.heads.registry import init_heads
from inference.heads.spec import HeadsSpec
from inference.methods.medusa_lookup import HybridDecoder, MedusaLookupOptions, graft_tree, match_prefix
from inference.loading import attach_heads
from inference.runtime.model import MedusaModel
from inference.methods.prompt_lookup import PromptLookupSettings
from inference.runtime.tree import MedusaTree, default_tree
from inference.runtime.verify import SamplingConfig, verify_sample

from runtime_support import FixedHeads, one_thread, random_heads, sequential_kv, tiny_llama, wrap  # noqa: F401
from scripted_lm import ScriptedLM, cached_tokens

V = 96
REPEATING = [5, 17, 3, 88, 41, 9]              # the tiny model's greedy text repeats: lookups fire
DISTINCT = [61, 7, 29, 90, 44, 13, 70, 2]      # no repeated token: with trigrams, no early lookup
TRIGRAMS = PromptLookupSettings(num_tokens=4, max_ngram=3, min_ngram=3)
# nodes: 0 root, 1 [0], 2 [1], 3 [0,0], 4 [0,1], 5 [1,0], 6 [0,0,0]
TREE = MedusaTree([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])


@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab=V, seed=0)


@pytest.fixture(scope="module")
def m(model):
    return wrap(model, random_heads(model, num_heads=3, seed=1))


@pytest.fixture(scope="module")
def greedy(m):
    """Plain greedy continuations (48 tokens) of both prompts."""
    return {name: generate(m, p, "autoregressive", max_new_tokens=48).tokens
            for name, p in (("repeating", REPEATING), ("distinct", DISTINCT))}


# -- the trie ---------------------------------------------------------------------------------
def _token_paths(tree: MedusaTree, tokens) -> set[tuple]:
    return {tuple(tokens[u] for u in tree.ancestors(i)[1:]) for i in range(1, tree.num_nodes)}


def test_lookup_merges_into_the_tree_sharing_identical_prefixes():
    """Guards against a lookup branch duplicating tree nodes it shares a prefix with (wasted
    verification, and siblings carrying one token), a trie over the size cap, or trie nodes whose
    root-to-node token paths are not exactly the tree's paths plus the lookup's prefixes."""
    node_tokens = [-1, 11, 40, 12, 41, 42, 13]          # TREE's node tokens (node 0 = the root)
    tree_paths = _token_paths(TREE, node_tokens)
    for proposal, attach, matched, nodes in (([11, 12, 50, 51], 3, 2, 9),   # shares 11 12, grafts 2 under node 3
                                             ([40, 43], 2, 1, 8),           # shares the rank-1 branch
                                             ([60, 61, 62], 0, 0, 10),      # nothing shared: under the root
                                             ([11, 12, 13, 14], 6, 3, 8)):  # past a leaf
        assert match_prefix(TREE, node_tokens, proposal) == (attach, matched)
        trie, source = graft_tree(TREE, attach, len(proposal) - matched)
        assert trie.num_nodes == nodes <= TREE.num_nodes + len(proposal)
        tokens = [(node_tokens + proposal[matched:])[s] for s in source]
        want = tree_paths | {tuple(proposal[:d]) for d in range(1, len(proposal) + 1)}
        assert _token_paths(trie, tokens) == want and len(want) == nodes - 1
        for v in range(trie.num_nodes):                  # siblings carry distinct tokens
            kids = [tokens[c] for c in trie.children[v]]
            assert len(kids) == len(set(kids))
        for i in range(1, TREE.num_nodes):               # the tree's nodes keep their tokens
            assert tokens[trie.paths.index(TREE.paths[i - 1]) + 1] == node_tokens[i]
    assert match_prefix(TREE, node_tokens, [11, 12, 13]) == (6, 3)   # all inside the tree: no graft


# -- forced acceptance with a scripted backbone ------------------------------------------------
class ScriptedWithHeads(ScriptedLM):
    """``ScriptedLM`` (predicts script[t + 1] at position t) with stub heads ranking fixed tokens."""

    def __init__(self, script, vocab, ranked):
        super().__init__(script, vocab)
        self.heads = FixedHeads(vocab, ranked)

    @property
    def num_heads(self):
        return self.heads.spec.num_heads

    def head_logits(self, hidden, count=None):
        return [self.heads.head_logits(hidden, k) for k in range(count or self.num_heads)]

    def draft_tree(self, buf, h_last, root, cfg, gen):
        return self.heads.draft_tree(buf, h_last, root, cfg, gen, self.vocab_size)


T = list(range(10, 30))
WRONG = ([30, 31], [30, 31], [30])
RIGHT = ([11, 30], [12, 30], [13])
R1 = ([31, 11], [30, 31], [30])                   # head 0's rank-1 guess (node 2) is right, the rest wrong


@pytest.mark.parametrize("prompt, ranked, k, accepted, trie_nodes", [
    ([10, 11, 12, 13, 6, 5], WRONG, 3, 3, 10),    # lookup [11 12 13] right, heads wrong
    ([10, 11, 12, 13, 6, 5], R1, 3, 3, 9),        # lookup shares node 2 (token 11), grafts 12 13 under it
    ([10, 11, 12, 20, 5], RIGHT, 3, 3, 8),        # heads right, lookup [11 12 20] grafts 20 under node 3
    ([10, 20, 21, 6, 5], WRONG, 3, 0, 10),        # both wrong
    ([10, 11, 6, 5], RIGHT, 1, 3, 7),             # lookup [11] is node 1 already: the plain tree
    ([1, 2, 3, 4, 5], R1, 3, 1, 7),               # no lookup match: the plain tree
], ids=["lookup-right", "lookup-merged", "heads-right", "both-wrong", "lookup-inside-tree", "no-match"])
def test_forced_acceptance_through_the_merged_trie_and_compacted_cache(prompt, ranked, k, accepted, trie_nodes):
    """Guards against wrong acceptance lengths through the merged trie (lookup branch, shared
    nodes, graft below a tree node), a trie forward that is not ONE call over root + trie, and a
    compacted cache holding rejected branches instead of exactly prompt + root + accepted tokens."""
    lm = ScriptedWithHeads(prompt + T, 32, [list(r) for r in ranked])
    dec = HybridDecoder(lm, TREE, PromptLookupSettings(num_tokens=k))
    assert dec.prefill(torch.tensor([prompt]), max_new_tokens=16) == T[0]
    new, proposed = dec.step()
    assert new == T[1:accepted + 2] and trie_nodes - 1 == dec.last_trie.num_nodes - 1
    assert proposed == dec.last_trie.max_depth  # the most one step can accept, as the harness counts
    assert lm.calls == [len(prompt), trie_nodes]
    assert dec.cache.length == dec.past == len(prompt) + 1 + accepted
    assert cached_tokens(dec.cache) == prompt + T[:accepted + 1]
    assert dec.step()[0][0] == T[accepted + 2]           # decoding goes on from the compacted cache


# -- no lookup match = a Medusa step ---------------------------------------------------------
@pytest.mark.parametrize("cfg", [SamplingConfig(), SamplingConfig(mode="sample", temperature=0.9)],
                         ids=["greedy", "sample"])
def test_without_a_lookup_match_the_step_is_tree_decoders_step(m, cfg):
    """Guards against the hybrid changing Medusa's step when the lookup finds nothing: same
    tokens, same accepted path, same cache and state as ``TreeDecoder`` (proposed = the tree's depth)."""
    hyb = HybridDecoder(m, "tree8", TRIGRAMS, cfg, seed=3)
    ref = TreeDecoder(m, "tree8", cfg, seed=3)
    prompt = torch.tensor([DISTINCT])
    assert hyb.prefill(prompt, 16) == ref.prefill(prompt, 16)
    steps = 0
    while steps < 6 and hyb.index.propose(TRIGRAMS.num_tokens) == []:
        (new, proposed), (ref_new, _) = hyb.step(), ref.step()
        assert new == ref_new and proposed == ref.buf.max_depth
        assert hyb.last_path == ref.last_path and hyb.last_trie is hyb.buf and hyb.root == ref.root
        torch.testing.assert_close(hyb.h_last, ref.h_last, atol=0, rtol=0)
        for a, b in zip(hyb.cache.layers, ref.cache.layers):
            torch.testing.assert_close(a.keys, b.keys, atol=0, rtol=0)
            torch.testing.assert_close(a.values, b.values, atol=0, rtol=0)
        steps += 1
    assert steps >= 1


# -- greedy identity and caches on tiny models -------------------------------------------------
@pytest.mark.parametrize("tree", ["chain3", "tree4", "tree8"])
@pytest.mark.parametrize("case", ["repeating", "distinct"])
def test_greedy_medusa_lookup_is_token_identical(m, greedy, tree, case):
    """Guards against the merged trie (mask, positions, graft, compaction, bonus) changing the
    greedy output, on text where lookups fire (repeating) and where they mostly do not."""
    prompt, settings = (REPEATING, PromptLookupSettings(num_tokens=5)) if case == "repeating" else (DISTINCT, TRIGRAMS)
    out = generate(m, prompt, "medusa_lookup", tree=tree, options=settings, max_new_tokens=48)
    assert out.tokens == greedy[case] and out.finish_reason == "length"
    base = default_tree(tree, 3).max_depth
    assert all(base <= p <= base + settings.num_tokens for p in out.proposed)
    if case == "repeating":
        assert max(out.proposed) > base and out.tau > 1.5      # the lookup branch fired and got accepted


def test_caches_equal_sequential_caches_after_each_step(m):
    """Guards against rejected tree or lookup rows surviving compaction in a real model's cache."""
    dec = HybridDecoder(m, "tree8", PromptLookupSettings(num_tokens=5))
    dec.prefill(torch.tensor([REPEATING]), max_new_tokens=40)
    seq, grafted = REPEATING + [dec.root], 0
    for _ in range(10):
        seq += dec.step()[0]
        grafted += dec.last_trie is not dec.buf
        for layer, (k_ref, v_ref) in zip(dec.cache.layers, sequential_kv(m, seq[:-1])):
            torch.testing.assert_close(layer.keys, k_ref, atol=1e-5, rtol=0)
            torch.testing.assert_close(layer.values, v_ref, atol=1e-5, rtol=0)
    assert grafted > 0


@pytest.mark.parametrize("kind", ["hydra", "mlp_speculator"])
def test_dependent_heads_keep_greedy_identity(model, greedy, kind):
    """Guards against dependent heads (drafted level by level) breaking the merged trie."""
    spec = HeadsSpec(num_heads=3, num_layers=1, hidden_size=64, vocab_size=V, kind=kind, base_model="random:llama")
    heads = init_heads(spec, model.lm_head.weight, model.get_input_embeddings().weight)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    out = generate(attach_heads(model, heads), REPEATING, "medusa_lookup", tree="tree8", max_new_tokens=48,
                          options=PromptLookupSettings(num_tokens=5))
    assert out.tokens == greedy["repeating"] and max(out.proposed) > default_tree("tree8", 3).max_depth


# -- sampling --------------------------------------------------------------------------------
def test_sampling_on_the_merged_trie_is_exact():
    """Guards against inexact sampling through a trie that mixes head guesses and a grafted lookup
    branch: with the fixed-candidate rule the first token must follow p(root), and the token after
    an accepted lookup node must follow p at that node (200k vectorised trials, V = 5)."""
    tree = MedusaTree([[0], [1], [0, 0]])
    trie, source = graft_tree(tree, 0, 2)                 # lookup [3, 4] under the root: 6 nodes
    tokens = torch.tensor([([-1, 0, 1, 2] + [3, 4])[s] for s in source])
    tokens[0] = 0
    g = torch.Generator().manual_seed(0)
    # Dirichlet(1) vectors from the seeded generator (normalised exponentials): the test's draws must not
    # depend on the global RNG, i.e. on which tests ran before it
    e = -torch.rand(trie.num_nodes, 5, generator=g).log()
    probs = e / e.sum(-1, keepdim=True)
    B = 200_000
    buf = trie.buffers()
    paths, accepted, bonus = verify_sample(buf, tokens.expand(B, -1), probs.expand(B, -1, -1), None, "topk", g)
    first = torch.where(accepted >= 1, tokens[paths[:, 1].clamp(min=0)], bonus)
    freq = torch.bincount(first, minlength=5).double() / B
    assert (freq - probs[0].double()).abs().max() < 0.006
    lookup_node = int((tokens == 3).nonzero()[0, 0])
    took = paths[:, 1] == lookup_node
    second = torch.where(accepted[took] >= 2, tokens[paths[took, 2].clamp(min=0)], bonus[took])
    freq2 = torch.bincount(second, minlength=5).double() / int(took.sum())
    # 5 binomial standard deviations of a frequency over the trials that took the lookup node
    assert (freq2 - probs[lookup_node].double()).abs().max() < 5 * (0.25 / int(took.sum())) ** 0.5


def test_sampling_is_reproducible_and_uses_the_fixed_candidate_rule(m):
    """Guards against seeds being ignored, and against sampled drafts (whose acceptance needs a
    draft distribution q that looked-up tokens do not have) being used on the merged trie."""
    for cfg in (SamplingConfig(mode="sample", temperature=0.9, draft="sampled"),
                SamplingConfig(mode="typical", temperature=0.9)):
        a = generate(m, REPEATING, "medusa_lookup", tree="tree8", max_new_tokens=24, sampling=cfg, seed=4)
        b = generate(m, REPEATING, "medusa_lookup", tree="tree8", max_new_tokens=24, sampling=cfg, seed=4)
        assert a.tokens == b.tokens and len(a.tokens) == 24
    assert HybridDecoder(m, "tree4", sampling=SamplingConfig(mode="sample", draft="sampled")).cfg.draft == "topk"


def test_eos_inside_an_accepted_branch_stops(m, greedy):
    """Guards against emitting past an EOS that sits inside an accepted lookup / tree path."""
    ref = greedy["repeating"]
    eos = ref[20]
    out = generate(m, REPEATING, "medusa_lookup", tree="tree8", max_new_tokens=48, eos_token_ids=[eos])
    assert out.tokens == ref[:ref.index(eos) + 1] and out.finish_reason == "eos"


def test_no_heads_or_a_too_deep_tree_is_a_one_line_error(model, m):
    """Guards against medusa_lookup starting without heads or with a tree deeper than the heads."""
    with pytest.raises(UserError, match="needs Medusa heads"):
        HybridDecoder(MedusaModel(model=model, tokenizer=None, heads=None), "tree8")
    with pytest.raises(UserError, match="depth"):
        HybridDecoder(m, MedusaTree([[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]]))


# -- harness and CLI -------------------------------------------------------------------------
TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 320, "max_position_embeddings": 512}


def test_harness_runs_medusa_lookup_on_the_calibrated_tree():
    """Guards against medusa_lookup ignoring the chosen tree (tree=calibrated:N), losing greedy
    identity in the harness, or costs that are not the heads' parameters and tree + lookup KV."""
    from medusa_train.backbone import random_backbone

    bb = random_backbone(TINY, seed=0)
    mm = MedusaModel(model=bb.model.eval(), tokenizer=bb.tokenizer, heads=random_heads(bb.model, num_heads=2))
    prompts = [Prompt(str(i), [f"repeat after me: abc abc abc {i}"]) for i in range(3)]
    opts = {"medusa_lookup": MedusaLookupOptions(num_tokens=4)}
    r = evaluate(mm, prompts, methods=["medusa_lookup", "autoregressive"], tree="calibrated:3", max_new_tokens=8,
                 calibration_prompts=1, calibration_tokens=6, progress=False, log=lambda s: None, options=opts)
    assert r["tree"]["nodes"] == 3 and r["per_method"]["medusa_lookup"]["greedy_identical_fraction"] == 1.0
    cost = r["costs"]["medusa_lookup"]
    assert cost["training"] == "heads" and cost["extra_parameters"] > 0
    assert cost["extra_kv_cache_bytes"] == (3 + 4) * kv_bytes_per_token(mm)
    no_tree = MedusaLookupOptions(num_tokens=4, tree=None)
    assert get("medusa_lookup").costs(mm, no_tree, 20).extra_kv_cache_bytes == 5 * kv_bytes_per_token(mm)
    with pytest.raises(UserError, match="medusa_lookup needs Medusa heads"):
        evaluate(MedusaModel(model=bb.model, tokenizer=bb.tokenizer, heads=None), prompts,
                 methods=["medusa_lookup"], progress=False, log=lambda s: None)


def test_eval_method_selection_includes_medusa_lookup_only_with_heads():
    """Guards against compare=true dropping medusa_lookup when heads are given, or adding it
    (and failing late) when they are not; and method=medusa_lookup without heads loading anything."""
    assert "medusa_lookup" in names()
    with_heads = eval_methods(EvalConfig(heads="runs/x/heads", compare=True))
    assert "medusa_lookup" in with_heads and "medusa" in with_heads
    assert "medusa_lookup" not in eval_methods(EvalConfig(compare=True))
    assert eval_methods(EvalConfig(heads="h", methods=["medusa_lookup"])) == ["medusa_lookup", "autoregressive",
                                                                           "hf_generate"]
    with pytest.raises(UserError, match="medusa_lookup needs heads="):
        eval_methods(EvalConfig(methods=["medusa_lookup"]))


def test_cli_medusa_lookup_without_heads_is_one_line_and_exit_2():
    """Guards against medusa-eval method=medusa_lookup without heads= ending in a traceback, a zero
    exit status, or after loading a model."""
    code = "import sys; from inference.cli import eval_main; eval_main(sys.argv[1:])"
    proc = subprocess.run([sys.executable, "-c", code, "methods=[medusa_lookup]"], capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "medusa_lookup needs heads=" in lines[0] and "Traceback" not in proc.stderr


@pytest.mark.parametrize("how", ["uncaptured", "replayed"])
def test_a_graft_built_on_the_device_verifies_the_host_trie(m, how):
    """Guards against the graft built on the device (static steps, greedy: no read of the heads' tokens) verifying
    another trie than the host's: the chain under another node, a token the tree has repeated, an unused slot seen
    or accepted. Step by step against graphs=off: the same trie (as token paths), the same tokens and proposed
    depth; and the device did graft (tries of more nodes than the tree's, built as ``StaticTree``)."""
    from test_eagle3_captured import token_paths
    from test_static_steps import with_steps

    def run(how):
        with_steps(m, how)
        dec = HybridDecoder(m, "tree8", PromptLookupSettings(num_tokens=5))
        tries, trie_tokens = [], dec.trie_tokens
        dec.trie_tokens = lambda **kw: (lambda out: tries.append(out) or out)(trie_tokens(**kw))
        dec.prefill(torch.tensor([REPEATING]), max_new_tokens=40)
        steps = [dec.step() for _ in range(10)]
        return steps, [(type(trie).__name__, token_paths(t, trie.parents, trie.position_offsets)) for trie, t in tries]
    try:
        (host, host_tries), (dev, dev_tries) = run("off"), run(how)
    finally:
        m.static = None
    assert dev == host and [p for _, p in dev_tries] == [p for _, p in host_tries]
    assert any(kind == "StaticTree" and len(p) > 9 for kind, p in dev_tries)       # the tree8 trie has 9 nodes
    assert all(kind == "TreeBuffers" for kind, _ in host_tries)


@pytest.mark.parametrize("mode", ["sample", "typical"])
def test_sampling_through_a_graft_built_on_the_device_is_the_host_trie_s(m, mode):
    """Guards against the device graft sampling otherwise than the host trie (a masked slot walked into, a draw
    that depends on the trie's fixed depth, another path preferred by typical acceptance): the same seed gives the
    same tokens with graphs=off, uncaptured and replayed, where lookups fire."""
    from test_static_steps import with_steps

    cfg = SamplingConfig(mode=mode, temperature=0.8)
    tokens, settings = {}, PromptLookupSettings(num_tokens=5)
    try:
        for how in ("off", "uncaptured", "replayed"):
            with_steps(m, how)
            tokens[how] = generate(m, REPEATING, "medusa_lookup", tree="tree8", options=settings, max_new_tokens=40,
                                   sampling=cfg, seed=5).tokens
        grafted = [k for k in m.static.calls.captures if k.startswith("medusa_lookup.graft")]
    finally:
        m.static = None
    assert tokens["uncaptured"] == tokens["replayed"] == tokens["off"] and grafted
