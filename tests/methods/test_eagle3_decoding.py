"""Method ``eagle3``: EAGLE-2 dynamic trees drafted by an EAGLE-3 drafter (inference/methods/eagle3.py).

Tiny random Llama backbones with a real ``Eagle3Drafter`` (warm start, weights perturbed so drafts
are arbitrary), or a ``ScriptedDrafter``: the real drafter (its KV entries, states and masks are
computed as usual) whose draft distribution is scripted from the backbone's greedy sequence, so
acceptance can be forced high, partial or nil.
"""

from __future__ import annotations

import pytest
import torch

from inference.errors import UserError
from inference.methods import eagle3_choice as tc
from inference.runtime import race
from inference.heads.eagle3 import DraftKV, Eagle3Drafter, default_aux_layers, draft_layer_config
from inference.heads.registry import init_heads
from inference.heads.spec import HeadsSpec
from inference.methods import check_methods, generate
from inference.methods.eagle3 import Eagle3Decoder, Eagle3Options
from inference.methods.registry import options_from_keys
from inference.loading import attach_heads
from inference.runtime.tree import MedusaTree, select_nodes, tree_buffers
from inference.runtime.verify import SamplingConfig

from runtime_support import one_thread, random_heads, tiny_llama, wrap  # noqa: F401 (autouse fixture)

PROMPTS = ([5, 17, 3, 88, 41, 9], [1, 2, 3, 4], [60, 61, 7, 7, 7, 30, 12, 95, 44])


def runtime_aux_layers(num_layers: int) -> list[int]:
    """The default ids, or on the 2-layer test backbones (too shallow for three distinct servable layers,
    which only the runtime computes: training and export refuse them) the last layer three times."""
    return default_aux_layers(num_layers) if num_layers >= 4 else [num_layers - 1] * 3


def eagle3_spec(model, num_heads: int = 2, aux=None, **layer) -> HeadsSpec:
    """A drafter's spec for ``model``; ``layer``: draft_layer fields to set otherwise than the backbone's."""
    cfg = model.config
    return HeadsSpec(num_heads=num_heads, num_layers=1, hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size,
                     kind="eagle3", aux_layers=aux or runtime_aux_layers(cfg.num_hidden_layers),
                     draft_layer={**draft_layer_config(cfg), **layer}, base_model="random:llama")


def random_drafter(model, cls=Eagle3Drafter, seed: int = 3, scale: float = 0.1, aux=None, num_heads: int = 2):
    spec = eagle3_spec(model, num_heads=num_heads, aux=aux)
    fresh = init_heads(spec, model.lm_head.weight, model.get_input_embeddings().weight)
    d = cls(spec)
    d.load_state_dict(fresh.state_dict())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return attach_heads(model, d)


class ScriptedDrafter(Eagle3Drafter):
    """A row at position p fed x_{p+1} = seq[p+1] ranks seq[p+2] at ``rank(p)`` (None: last); the
    other ranks hold decoys. The real features still flow (KV entries, pre-norm states)."""

    seq: torch.Tensor = torch.zeros(1, dtype=torch.long)
    rank = staticmethod(lambda p: 0)

    def forward_step(self, tokens, hidden, positions, past=None, mask=None):
        normed, pre, kv = super().forward_step(tokens, hidden, positions, past, mask)
        n = len(self.seq)
        on = (tokens == self.seq[(positions + 1).clamp(max=n - 1)]) & (positions + 2 < n)
        code = normed.clone()
        code[..., 0] = torch.where(on, self.seq[(positions + 2).clamp(max=n - 1)], -1).float()
        code[..., 1] = positions.float()
        return code, pre, kv

    def project(self, x, k=0):
        v = self.spec.vocab_size
        flat = x.reshape(-1, x.shape[-1])
        logits = torch.zeros(flat.shape[0], v)
        for i, (t, p) in enumerate(flat[:, :2].round().long().tolist()):
            base = t if t >= 0 else 0
            for j in range(4):                                   # decoys at 8, 7, 6, 5
                logits[i, (base + 1 + j) % v] = 8.0 - j
            if t >= 0:
                r = self.rank(p)
                logits[i, t] = -100.0 if r is None else 10.0 if r == 0 else 8.5 - r
        return logits.reshape(*x.shape[:-1], v)


def scripted(model, seq, rank):
    m = random_drafter(model, ScriptedDrafter)
    m.heads.seq = torch.tensor(seq)
    m.heads.rank = rank
    return m


@pytest.fixture(scope="module")
def backbone():
    return tiny_llama(vocab=96, hidden=64, layers=4, seed=0)


@pytest.fixture(scope="module")
def m(backbone):
    return random_drafter(backbone)


@pytest.fixture(scope="module")
def greedy(m):
    return {tuple(p): generate(m, p, "autoregressive", max_new_tokens=40, eos_token_ids=()).tokens for p in PROMPTS}


def test_tree_buffers_from_parents_equal_medusa_trees():
    """Guards against the vectorised per-step buffers (dynamic trees) disagreeing with MedusaTree's:
    masks, positions, leaf paths and children in rank order."""
    tree = MedusaTree([[0], [1], [2], [0, 0], [0, 1], [2, 0], [0, 0, 0], [0, 1, 0], [0, 1, 1]])
    ref = tree.buffers()
    got = tree_buffers(torch.tensor(tree.parent), torch.tensor(tree.depth), tree.max_depth)
    for name in ("tree_mask", "position_offsets", "parents", "retrieve_indices", "children", "node_rank"):
        assert torch.equal(getattr(got, name), getattr(ref, name)), name
    assert got.topk_per_depth == ref.topk_per_depth and got.num_nodes == ref.num_nodes


@pytest.mark.parametrize("opts", [dict(), dict(nodes=3, depth=3, topk=1), dict(nodes=20, depth=5, topk=3),
                                  dict(nodes=1, depth=1, topk=2), dict(nodes=20, depth=5, topk=3, min_prob=0.02),
                                  dict(min_prob=0.999)],
                         ids=["default", "chain", "deep", "depth1", "floor", "floor-drops-all"])
def test_greedy_is_token_identical_to_plain_greedy(m, greedy, opts):
    """Guards against any drafting, masking, verification or compaction bug changing greedy output
    (k=1 chains, depths beyond the drafter's trained num_heads=2, a one-level tree, trees pruned by
    eagle_min_prob, down to the root alone)."""
    for p in PROMPTS:
        out = generate(m, p, "eagle3", max_new_tokens=40, eos_token_ids=(), **opts)
        assert out.tokens == greedy[tuple(p)], (p, opts)


def test_folded_drafter_attention_decodes_the_same(m, greedy, monkeypatch):
    """Guards against the CUDA path of the drafter's masked grouped-query attention (its groups folded into
    query rows, as SDPA with a mask and enable_gqa falls back to its unfused math kernel there) reading other
    key/value heads or returning another layout: forced on CPU, greedy output and every attention output agree."""
    from inference.attention_backends import folded_attention
    from inference.heads import eagle3

    attn = m.heads.midlayer.self_attn
    assert attn.heads != attn.kv_heads   # grouped: the path is taken
    q, k, v = torch.randn(2, attn.heads, 3, 8), torch.randn(2, attn.kv_heads, 7, 8), torch.randn(2, attn.kv_heads, 7, 8)
    mask = torch.where(torch.rand(2, 1, 3, 7) > 0.3, 0.0, float("-inf"))
    mask[..., 0] = 0.0
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(folded_attention(q, k, v, mask).transpose(1, 2), ref)
    folded = []
    monkeypatch.setattr(eagle3, "fold_groups", lambda q, mask, grouped: folded.append(mask is not None) or (
        grouped and mask is not None))
    for p in PROMPTS:
        assert generate(m, p, "eagle3", max_new_tokens=40, eos_token_ids=()).tokens == greedy[tuple(p)]
    assert any(folded)


def test_library_defaults_fit_the_drafter(backbone, m, greedy):
    """Guards against the Python API (generate / generate_batch / Eagle3Decoder without eagle_* options)
    drafting deeper than the drafter was trained to (the library's fixed n8-d4-k4 decoded the recipe's
    one-step drafter at 0.99x the loop, benchmarks/history.md) and against unset options reaching a decoder, its
    costs or a report as None."""
    from inference.methods import generate_batch
    from inference.methods.eagle3 import eagle3_costs
    from inference.methods.registry import fitted_options, make_options, options_report

    one_step = random_drafter(backbone, num_heads=1)
    assert make_options("eagle3").label == "fitted to the drafter"
    assert fitted_options(one_step, "eagle3", make_options("eagle3")).label == "n4-d1-k4"
    assert fitted_options(one_step, "eagle3_lookup", make_options("eagle3_lookup")).label == "n4-d1-k4+t6-m2"
    assert fitted_options(m, "eagle3", make_options("eagle3")).label == "n8-d2-k4"          # trained 2 steps
    given = make_options("eagle3", nodes=2, depth=3, topk=1)
    assert fitted_options(one_step, "eagle3", given) is given                             # given keys are kept
    assert fitted_options(one_step, "eagle3", make_options("eagle3", depth=2)).label == "n8-d2-k4"
    assert Eagle3Decoder(one_step, Eagle3Options()).o.label == "n4-d1-k4"
    from inference.methods.eagle3_batch import Eagle3BatchDrafter

    drafter = Eagle3BatchDrafter(one_step, Eagle3Options())
    assert (drafter.max_depth, drafter.max_nodes) == (1, 5)
    report = options_report(fitted_options(one_step, "eagle3", make_options("eagle3")))
    assert (report["eagle_nodes"], report["eagle_depth"]) == (4, 1)
    assert eagle3_costs(one_step, fitted_options(one_step, "eagle3", Eagle3Options()), 10).extra_kv_cache_bytes > 0
    for p in PROMPTS:
        out = generate(one_step, p, "eagle3", max_new_tokens=40, eos_token_ids=())
        assert out.tokens == greedy[tuple(p)]
        assert max(out.proposed) == 1 and max(out.accept_lengths) <= 2      # depth 1: one draft token deep
    rows = generate_batch(one_step, [list(p) for p in PROMPTS], "eagle3_lookup", max_new_tokens=40, eos_token_ids=())
    assert [r.tokens for r in rows.rows] == [greedy[tuple(p)] for p in PROMPTS]


@pytest.mark.parametrize("rank,least_tau", [(lambda p: 0, 4.0), (lambda p: 1 if p % 3 == 0 else 0, 2.0),
                                            (lambda p: None, 1.0)], ids=["right", "rank1-often", "wrong"])
def test_acceptance_follows_the_drafts_and_output_stays_greedy(backbone, greedy, rank, least_tau):
    """Guards against a decoder that never accepts (drafts that are always right must give several
    tokens per step, also through second-ranked branches) or that accepts wrong drafts."""
    p = PROMPTS[0]
    sm = scripted(backbone, p + greedy[tuple(p)], rank)
    out = generate(sm, p, "eagle3", max_new_tokens=40, eos_token_ids=(), nodes=8, depth=4, topk=3)
    assert out.tokens == greedy[tuple(p)]
    assert out.tau >= least_tau, out.accept_lengths
    if least_tau == 1.0:
        assert out.tau == 1.0


def assert_draft_kv_is_a_fresh_catch_up(sm, dec, seq, tap) -> None:
    """The decoder's committed drafter entries (and backbone cache length) after a step equal one
    catch-up pass over the accepted sequence seq[:past] with true aux features."""
    n = dec.past
    with torch.inference_mode():
        _, aux = sm.hidden_aux(torch.tensor([seq[:n]]), torch.arange(n)[None], sm.new_cache(n), tap)
        _, _, (k, v) = sm.heads.forward_step(torch.tensor([seq[1:n + 1]]), sm.heads.combine(aux),
                                             torch.arange(n)[None])
    ck, cv = dec.dkv.view()
    assert dec.dkv.length == n and dec.cache.length == n
    assert torch.allclose(ck, k, atol=1e-5) and torch.allclose(cv, v, atol=1e-5)


def test_select_nodes_keeps_the_best_above_the_floor_with_their_ancestors():
    """Guards against the rerank keeping a node without its parent (a tree verify cannot walk), ranking
    ties to the later node, or letting the probability floor drop a parent but keep its child."""
    #            0     1     2     3 (of 0) 4 (of 0) 5 (of 1) 6 (of 3)
    score = torch.tensor([-0.2, -1.0, -3.0, -0.5, -1.0, -1.5, -0.6])
    parent = torch.tensor([-1, -1, -1, 0, 0, 1, 3])
    keep, parents = select_nodes(score, parent, 4)
    assert keep.tolist() == [0, 1, 3, 6] and parents.tolist() == [-1, 0, 0, 1, 3]   # 1 before 4: ties to the earlier
    keep, parents = select_nodes(score, parent, 7, min_score=-0.55)
    assert keep.tolist() == [0, 3] and parents.tolist() == [-1, 0, 1]
    keep, parents = select_nodes(score, parent, 7, min_score=0.0)
    assert keep.numel() == 0 and parents.tolist() == [-1]


def test_min_prob_drops_the_guesses_the_drafter_rates_unlikely(backbone, greedy):
    """Guards against eagle_min_prob doing nothing, or dropping the drafts that get accepted: with the
    right token ranked first at ~0.8 and decoys at <= 0.11, a floor of 0.3 must verify the chain of
    right tokens alone (4 nodes of 8) and accept as much as the full tree; 0.9 drops every draft (plain
    steps through the tree path) and output stays greedy throughout."""
    p = PROMPTS[0]
    sm = scripted(backbone, p + greedy[tuple(p)], lambda q: 0)
    sizes = {}
    for floor in (0.0, 0.3, 0.9):
        dec = Eagle3Decoder(sm, Eagle3Options(nodes=8, depth=4, topk=3, min_prob=floor))
        grown, rows = dec.tree, []
        dec.tree = lambda: (lambda t: rows.append(t[0].numel()) or t)(grown())
        emitted = [dec.prefill(torch.tensor([p]), 40)]
        taus = []
        while len(emitted) < 30:
            new, _ = dec.step()
            emitted += new
            taus.append(len(new))
        assert emitted[:30] == greedy[tuple(p)][:30], floor
        sizes[floor] = (rows, taus)
    assert set(sizes[0.0][0]) == {9} and set(sizes[0.3][0]) == {5} and set(sizes[0.9][0]) == {1}
    assert sizes[0.3][1] == sizes[0.0][1] and min(sizes[0.0][1]) == 5 and set(sizes[0.9][1]) == {1}
    opts = Eagle3Options(nodes=2, depth=1, topk=2, min_prob=0.1)
    assert opts.label == "n2-d1-k2-p0.1" and opts.steps_vary and not Eagle3Options().steps_vary


def test_draft_kv_equals_a_fresh_catch_up_after_every_step(backbone, greedy):
    """Guards against wrong compaction: after each step the drafter's committed entries must be
    those of a fresh catch-up over the whole accepted sequence with true features (stale tree
    entries, wrong rows of the verification tap or wrong positions would differ)."""
    p = PROMPTS[0]
    seq = p + greedy[tuple(p)]
    sm = scripted(backbone, seq, lambda q: 1 if q % 3 == 0 else 0)
    dec = Eagle3Decoder(sm, Eagle3Options(nodes=8, depth=4, topk=3))
    emitted = [dec.prefill(torch.tensor([p]), 40)]
    tap = sm.aux_tap(sm.heads.spec.settings.aux_layers)
    lengths = []
    for _ in range(6):
        new, _ = dec.step()
        emitted += new
        lengths.append(len(new))
        n = dec.past
        assert emitted == seq[len(p):n + 1] and dec.root == seq[n]
        assert_draft_kv_is_a_fresh_catch_up(sm, dec, seq, tap)
    assert max(lengths) > 2  # multi-token steps were compacted


def test_tree_drafts_equal_sequential_chains(m):
    """Guards against a wrong expansion mask or state routing: every drafted node's score must be
    its parent's plus the log-probability a plain one-row-at-a-time chain along its ancestors gives."""
    d = m.heads
    dec = Eagle3Decoder(m, Eagle3Options(nodes=8, depth=3, topk=3))
    with torch.inference_mode():
        dec.prefill(torch.tensor([PROMPTS[2]]), 16)
        committed = dec.dkv.length
        tok, score, parent, depth = dec._draft()
        base_k, base_v = (t.clone() for t in dec.dkv.view())
        base_k, base_v = base_k[:, :, :committed], base_v[:, :, :committed]
        for i in range(len(tok)):
            chain = [i]
            while parent[chain[0]] >= 0:
                chain.insert(0, int(parent[chain[0]]))
            logq = torch.log_softmax(dec.root_logits.float(), -1)
            h, ks, vs = dec.root_state, base_k, base_v
            for j, node in enumerate(chain[:-1]):
                normed, h, (k, v) = d.forward_step(tok[node].reshape(1, 1), h.reshape(1, 1, -1),
                                                   torch.tensor([[committed + j]]), (ks, vs))
                ks, vs = torch.cat([ks, k], 2), torch.cat([vs, v], 2)
                h = h[0, 0]
                logq = torch.log_softmax(d.project(normed[0, 0]).float(), -1)
            up = score[parent[i]] if parent[i] >= 0 else 0.0
            assert float(score[i] - up) == pytest.approx(float(logq[tok[i]]), abs=1e-4), (i, chain)
    assert int(depth.max()) == 3


TRIALS = 1200  # ~8 ms each on a tiny model; enough for a chi-square over 144 cells to see a bias


@pytest.fixture(scope="module")
def small():
    """A 12-token backbone peaked enough that drafts are often accepted, and its exact law of the
    2nd and 3rd generated tokens (1st marginalised) from one batched forward."""
    model = tiny_llama(vocab=12, hidden=32, layers=2, init=0.35, seed=5)
    sm = random_drafter(model, scale=0.02, aux=[1, 1, 0])  # warm start on the embeddings: drafts often right
    prompt = [3, 7, 1, 5]
    seqs = torch.cartesian_prod(torch.arange(12), torch.arange(12))
    ids = torch.cat([torch.tensor(prompt).expand(len(seqs), -1), seqs], 1)
    with torch.inference_mode():
        p = torch.softmax(model(ids).logits, -1)
    n0 = len(prompt) - 1
    p1, p2 = p[0, n0], p[::12, n0 + 1]                                   # [V], [V(y1), V]
    p3 = p[:, n0 + 2].reshape(12, 12, 12)                                # [y1, y2, V]
    law = (p1[:, None, None] * p2[:, :, None] * p3).sum(0).reshape(-1)   # (y2, y3)
    return sm, prompt, law


def test_exact_sampling_matches_the_backbone_distribution(small):
    """Guards against any bias of sampling through dynamic trees (candidates that depend on the
    context, verification with deterministic candidates, bonus after a compacted path): the 2nd
    and 3rd tokens must follow the backbone's own law (chi-square)."""
    from test_runtime_sampling import chi_square_pvalue

    sm, prompt, law = small
    cfg = SamplingConfig(mode="sample", temperature=1.0)
    counts = torch.zeros(144, dtype=torch.long)
    accepted = 0
    for seed in range(TRIALS):
        out = generate(sm, prompt, "eagle3", max_new_tokens=3, sampling=cfg, seed=seed, eos_token_ids=(),
                       nodes=4, depth=2, topk=2)
        counts[out.tokens[1] * 12 + out.tokens[2]] += 1
        accepted += out.accept_lengths[0] > 1
    assert TRIALS // 4 < accepted < TRIALS * 3 // 4  # both branches of the first step are common
    assert chi_square_pvalue(counts, law) > 1e-3


def test_mistakes_are_one_line_refusals(m, backbone):
    """Guards against: medusa silently failing on EAGLE-3 heads at the first step (it must refuse at
    construction, and in check_methods, pointing at methods=[eagle3]); eagle3 on Medusa heads;
    impossible option values; draft=sampled (not exact with deterministic candidates); auto outside
    an evaluation."""
    for call in (lambda: generate(m, PROMPTS[0], "medusa", tree="tree4"),
                 lambda: check_methods(["medusa"], m),
                 lambda: check_methods(["medusa_lookup"], m)):
        with pytest.raises(UserError, match=r"use methods=\[eagle3\]") as e:
            call()
        assert "\n" not in str(e.value)
    medusa = wrap(backbone, random_heads(backbone, num_heads=2))
    with pytest.raises(UserError, match="needs EAGLE-3 heads"):
        generate(medusa, PROMPTS[0], "eagle3")
    with pytest.raises(UserError, match="needs EAGLE-3 heads"):
        check_methods(["eagle3"], medusa)
    for bad, match in ((dict(nodes=40, depth=2, topk=4), "more than depth 2 x top-4"),
                       (dict(depth=0), "eagle_depth must be"), (dict(tree="maybe"), "has no option 'tree'"),
                       (dict(topk=200), "eagle_topk must be an integer in 1..64"),
                       (dict(min_prob=1.0), "eagle_min_prob must be a probability"),
                       (dict(min_prob=-0.1), "eagle_min_prob must be a probability"),
                       (dict(min_prob="high"), "eagle_min_prob must be a probability")):
        with pytest.raises(UserError, match=match):
            generate(m, PROMPTS[0], "eagle3", max_new_tokens=4, **bad)
    with pytest.raises(UserError, match="draft=sampled"):
        generate(m, PROMPTS[0], "eagle3", sampling=SamplingConfig(mode="sample", draft="sampled"))


def test_eval_keys_pick_eagle3_for_eagle3_heads(m, monkeypatch):
    """Guards against medusa-eval running (or comparing) medusa on EAGLE-3 heads: the default must be the
    faster eagle3_lookup, compare=true must pick eagle3, and methods=[medusa] must be refused before the
    backbone loads."""
    import inference.cli as cli
    import inference.cli_run as cli_run
    import inference.cli_checks as cli_checks

    monkeypatch.setattr(cli_checks, "heads_spec", lambda cfg, strict=False: m.heads.spec)   # eval_methods reads it
    assert cli_run.eval_methods(cli.EvalConfig(heads="h"))[0] == "eagle3_lookup"
    chosen = cli_run.eval_methods(cli.EvalConfig(heads="h", compare=True))
    assert "eagle3" in chosen and "medusa" not in chosen and "medusa_lookup" not in chosen
    with pytest.raises(UserError, match=r"use methods=\[eagle3\]"):
        cli_run.eval_methods(cli.EvalConfig(heads="h", methods=["medusa"]))
    opts = options_from_keys("eagle3", cli.EvalConfig(eagle_nodes=5, eagle_depth=2, eagle_topk=3, choice="auto",
                                                      eagle_min_prob=0.2))
    assert (opts.nodes, opts.depth, opts.topk, opts.min_prob) == (5, 2, 3, 0.2)
    with pytest.raises(UserError, match="eagle_min_prob must be a probability in"):
        options_from_keys("eagle3", cli.EvalConfig(eagle_min_prob=1.5))


def fake_clock(ms: dict):
    def clock(m, prompt_ids, shape, *, steps=8, warmup=2, **kw):
        return [ms[tc.eagle3_name(shape) if shape else "plain"] / 1e3] * steps
    return clock


def test_auto_picks_plain_decoding_when_drafts_are_useless(backbone, greedy, monkeypatch):
    """Guards against choice=auto making EAGLE-3 decoding slower: with drafts that are never right no
    setting beats plain decoding, which it must then pick; its options must still decode."""
    monkeypatch.setattr(race, "machine_load", lambda: (0.1, 2))
    monkeypatch.setattr(tc, "eagle3_step_times", fake_clock({"plain": 100, "n2-d2-k1": 120, "n4-d3-k2": 150}))
    p = PROMPTS[0]
    sm = scripted(backbone, p + greedy[tuple(p)], lambda q: None)
    choice = tc.choose_eagle3(sm, [p], p, grid=[(2, 2, 1), (4, 3, 2)], calibration_tokens=12, log=lambda s: None)
    assert choice.shape is None and choice.to_dict()["name"] == "none (plain decoding)"
    assert {c["measured_tau"] for c in choice.candidates} == {1.0}
    out = generate(sm, p, "eagle3", max_new_tokens=12, eos_token_ids=(), **choice.options())
    assert out.tokens == greedy[tuple(p)][:12]

    sm.heads.rank = lambda q: 0                              # now always right: a tree pays for itself
    choice = tc.choose_eagle3(sm, [p], p, grid=[(2, 2, 1), (4, 3, 2)], calibration_tokens=12, log=lambda s: None)
    assert choice.shape == (4, 3, 2) and choice.to_dict()["timing"]["rounds"] >= 3
    out = generate(sm, p, "eagle3", max_new_tokens=12, eos_token_ids=(), **choice.options())
    assert out.tokens == greedy[tuple(p)][:12] and out.tau > 2


def test_auto_can_choose_a_probability_floor(backbone, greedy, monkeypatch):
    """Guards against a grid shape's floor (its fourth element, eagle_min_prob) being lost on the way: in
    the calibration decodes (tau), in the race (names), in the chosen options or in the report, and
    against a floor shape being costed by its median step where its steps differ by themselves."""
    monkeypatch.setattr(race, "machine_load", lambda: (0.1, 2))
    clock = fake_clock({"plain": 80, "n4-d1-k4": 130, "n4-d1-k4-p0.3": 90})
    whole = []   # the shapes timed over a whole reply (their steps differ) and that reply's length
    monkeypatch.setattr(tc, "eagle3_step_times", lambda m, p, shape, reply_tokens=None, **k: (
        whole.append((tc.eagle3_name(shape), reply_tokens)) if reply_tokens else None, clock(m, p, shape, **k))[1])
    p = PROMPTS[0]
    # rank 1 every third position: steps of 2 tokens meet it at every phase (every 4th, they could all miss it)
    sm = scripted(backbone, p + greedy[tuple(p)], lambda q: 1 if q % 3 == 1 else 0)
    choice = tc.choose_eagle3(sm, [p], p, grid=[(4, 1, 4), (4, 1, 4, 0.3)], calibration_tokens=24,
                              log=lambda s: None)
    assert set(whole) == {("n4-d1-k4-p0.3", 24)}     # the floor shape only, over a calibration-long reply
    assert choice.shape == (4, 1, 4, 0.3) and choice.options()["min_prob"] == 0.3
    info = choice.to_dict()
    assert info["name"] == "n4-d1-k4-p0.3" and info["min_prob"] == 0.3
    by_name = {c["name"]: c for c in info["candidates"]}
    # rank-1 drafts (every 3rd position) sit at ~0.28 < 0.3: the floor drops them, and their acceptances
    assert by_name["n4-d1-k4-p0.3"]["measured_tau"] < by_name["n4-d1-k4"]["measured_tau"]
    assert by_name["n4-d1-k4"]["timed_on"] == "6 steps" and "min_prob" not in by_name["n4-d1-k4"]
    assert by_name["n4-d1-k4-p0.3"]["timed_on"] == "a 24-token reply"
    out = generate(sm, p, "eagle3", max_new_tokens=24, eos_token_ids=(), **choice.options())
    assert out.tokens == greedy[tuple(p)][:24]
    assert tc.eagle3_name((4, 1, 4, 0.1)) == Eagle3Options(nodes=4, depth=1, topk=4, min_prob=0.1).label


def test_evaluate_records_the_eagle3_choice(monkeypatch, tmp_path):
    """Guards against an EAGLE-3 choice=auto the report does not show (report.json's eagle3_tree,
    report.md's line) or an evaluation that then decodes differently from plain greedy."""
    from medusa_train.backbone import random_backbone
    from inference.evaluation.evaluate import evaluate
    from inference.prompts import Prompt
    from inference.evaluation.reports import markdown

    bb = random_backbone({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
                          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 320,
                          "max_position_embeddings": 512}, seed=0)
    em = random_drafter(bb.model.eval())
    em.tokenizer = bb.tokenizer
    monkeypatch.setattr(race, "machine_load", lambda: (0.1, 2))
    monkeypatch.setattr(tc, "eagle3_step_times", fake_clock({"plain": 100, **{tc.eagle3_name(s): 400
                                                                               for s in tc.EAGLE3_GRID}}))
    prompts = [Prompt(str(i), [f"question {i}?"]) for i in range(2)]
    report = evaluate(em, prompts, methods=["eagle3", "autoregressive"], max_new_tokens=6, calibration_prompts=1,
                      calibration_tokens=6, progress=False, log=lambda s: None,
                      options={"eagle3": Eagle3Options()}, choice="auto")
    assert report["eagle3_tree"]["name"] == "none (plain decoding)"
    assert len(report["eagle3_tree"]["candidates"]) == len(tc.EAGLE3_GRID)
    assert report["method_options"]["eagle3"]["eagle_nodes"] == 0
    assert report["per_method"]["eagle3"]["greedy_identical_fraction"] == 1.0
    assert "- eagle3 tree: none (plain decoding)" in markdown(report)
    assert report["costs"]["eagle3"]["extra_parameters"] > 0


def test_draft_kv_truncate_keeps_committed_entries():
    """Guards against DraftKV.truncate growing the cache or losing committed entries."""
    kv = DraftKV(8)
    kv.append(torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4))
    kv.append(torch.zeros(1, 2, 2, 4), torch.zeros(1, 2, 2, 4))
    kv.truncate(3)
    assert kv.length == 3 and kv.view()[0].sum() == 24
    kv.truncate(5)
    assert kv.length == 3


def test_costs_count_the_drafter_and_its_kv_cache(m):
    """Guards against the trade-off matrix hiding eagle3's memory: the drafter's own parameters (not
    the borrowed embeddings), the tree's backbone KV slots and the drafter's one-layer KV cache."""
    from inference.methods.eagle3 import eagle3_costs
    from inference.methods.registry import kv_bytes_per_token

    layer = m.heads.spec.settings.draft_layer
    per_token = 2 * layer["num_key_value_heads"] * layer["head_dim"] * 4                     # fp32
    costs = eagle3_costs(m, Eagle3Options(nodes=8, depth=4, topk=4), run_length=100)
    assert costs.extra_kv_cache_bytes == 9 * kv_bytes_per_token(m) + (100 + 5 + 3 * 4) * per_token
    assert costs.extra_parameters == sum(p.numel() for p in m.heads.parameters()) and costs.training == "heads"
    assert eagle3_costs(m, Eagle3Options(nodes=0), run_length=100).extra_kv_cache_bytes == 0
