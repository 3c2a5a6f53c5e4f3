"""Method ``eagle3_lookup``: EAGLE-3's dynamic tree plus a prompt-lookup branch in one forward
(inference/methods/eagle3_lookup.py).

Tiny random Llama backbones with a real ``Eagle3Drafter`` (random drafts) or the scripted drafter of
test_eagle3_decoding (drafts forced right or wrong), and an oracle n-gram index whose proposals are
the backbone's true greedy continuation (cut to a set number of right tokens), so acceptance through
the looked-up branch can be forced.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import inference.methods.eagle3_lookup as hybrid
from inference.errors import UserError
from inference.methods import eagle3_choice as tc
from inference.runtime import race
from inference.methods import check_methods, generate
from inference.methods.eagle3_lookup import Eagle3LookupDecoder, Eagle3LookupOptions, eagle3_lookup_costs, graft
from inference.methods.prompt_lookup import NGramIndex
from inference.methods.registry import kv_bytes_per_token, methods_for_heads, options_from_keys
from inference.runtime.verify import SamplingConfig

from runtime_support import one_thread, random_heads, tiny_llama, wrap  # noqa: F401 (autouse fixture)
from test_eagle3_decoding import (PROMPTS, assert_draft_kv_is_a_fresh_catch_up, backbone, fake_clock, greedy, m, random_drafter,  # noqa: F401 (fixtures)
                                  scripted, small)

REPEATING = [5, 17, 3, 88, 41, 9, 5, 17, 3, 88, 41]   # the context repeats itself: real lookups fire


def oracle(seq: list[int], right: int, wrong: int = 0):
    """An NGramIndex whose proposal is the next ``right`` tokens of ``seq`` (the true continuation),
    then ``wrong`` tokens that are not."""
    class Oracle(NGramIndex):
        def propose(self, count):
            n = len(self.seq)
            good = seq[n:n + min(right, count)]
            bad = [(t + 1) % 96 for t in seq[n + len(good):n + len(good) + wrong]]
            return (good + bad)[:count]
    return Oracle


def test_graft_walks_shared_prefixes_and_stops_at_the_first_new_token():
    """Guards against a looked-up chain duplicating nodes the tree already has (wasted rows, two
    nodes with one path) or attaching under the wrong node."""
    # 0 root; 1, 2 children of the root (tokens 7, 8); 3 child of 1 (9); 4 child of 2 (7)
    tokens, parents = [50, 7, 8, 9, 7], [-1, 0, 0, 1, 2]
    assert graft(tokens, parents, [7, 9, 4]) == (3, 2)
    assert graft(tokens, parents, [8, 7]) == (4, 2)
    assert graft(tokens, parents, [9, 7]) == (0, 0)      # 9 is no child of the root
    assert graft(tokens, parents, [8, 1]) == (2, 1)


@pytest.mark.parametrize("opts", [dict(nodes=1, depth=1, topk=1), dict(nodes=4, depth=1, topk=4),
                                  dict(nodes=8, depth=4, topk=3, num_tokens=3, min_ngram=2),
                                  dict(nodes=0)], ids=["n1", "n4-wide", "deep-bigram", "lookup-alone"])
def test_greedy_is_token_identical_to_plain_greedy(m, opts):
    """Guards against any graft, mask, position or catch-up bug changing greedy output, on prompts
    whose text repeats (the real n-gram index grafts chains) and ones that do not."""
    for p in PROMPTS + (REPEATING,):
        ref = generate(m, p, "autoregressive", max_new_tokens=40, eos_token_ids=()).tokens
        out = generate(m, p, "eagle3_lookup", max_new_tokens=40, eos_token_ids=(), **opts)
        assert out.tokens == ref, (p, opts)


def test_real_lookups_are_grafted_on_a_repeating_context(m):
    """Guards against a hybrid that never grafts (a lookup that misses its own context): a prompt
    that repeats itself (and the tiny model's looping reply) must get looked-up chains, with the
    default two-token suffixes and more often with one-token ones."""
    grafted = []
    for min_ngram in (2, 1):
        dec = Eagle3LookupDecoder(m, Eagle3LookupOptions(nodes=1, depth=1, topk=1, min_ngram=min_ngram))
        dec.prefill(torch.tensor([REPEATING]), 20)
        for _ in range(8):
            dec.step()
        grafted.append(dec.grafted)
    assert 3 <= grafted[0] <= grafted[1]


@pytest.mark.parametrize("right,least_tau", [(4, 4.0), (2, 2.5)])
def test_right_lookups_are_accepted_where_the_drafter_is_always_wrong(backbone, greedy, monkeypatch, right,
                                                                       least_tau):
    """Guards against a looked-up branch that is verified but never accepted (wrong positions or
    mask for grafted nodes), or accepted beyond what is right: with drafts always wrong, tokens
    per step come from the lookup alone, and output stays greedy."""
    p = PROMPTS[0]
    seq = p + greedy[tuple(p)]
    sm = scripted(backbone, seq, lambda q: None)
    monkeypatch.setattr(hybrid, "NGramIndex", oracle(seq, right, wrong=2))
    out = generate(sm, p, "eagle3_lookup", max_new_tokens=40, eos_token_ids=(), nodes=2, depth=2, topk=1,
                   num_tokens=right + 2)
    assert out.tokens == greedy[tuple(p)]
    assert out.tau >= least_tau, out.accept_lengths
    assert max(out.accept_lengths) == right + 1


def test_drafter_kv_equals_a_fresh_catch_up_after_accepted_lookups(backbone, greedy, monkeypatch):
    """Guards against a catch-up that reads the wrong tap rows for grafted nodes: after steps that
    accept looked-up tokens (and drafted ones: the lookup agrees with the drafts' first token and
    then continues under it), the drafter's committed entries must equal a fresh catch-up over the
    accepted sequence with true features."""
    p = PROMPTS[0]
    seq = p + greedy[tuple(p)]
    sm = scripted(backbone, seq, lambda q: 1 if q % 2 else 0)
    monkeypatch.setattr(hybrid, "NGramIndex", oracle(seq, 3, wrong=1))
    dec = Eagle3LookupDecoder(sm, Eagle3LookupOptions(nodes=4, depth=2, topk=2, num_tokens=4))
    emitted = [dec.prefill(torch.tensor([p]), 40)]
    tap = sm.aux_tap(sm.heads.spec.settings.aux_layers)
    for _ in range(6):
        new, depth = dec.step()
        emitted += new
        n = dec.past
        assert emitted == seq[len(p):n + 1] and dec.root == seq[n] and len(new) == 4 and depth >= 4
        assert_draft_kv_is_a_fresh_catch_up(sm, dec, seq, tap)
    assert dec.grafted == 6


def test_a_lookup_already_in_the_tree_leaves_the_eagle3_step_unchanged(backbone, greedy, monkeypatch):
    """Guards against grafting duplicates: a proposal whose every token is on the drafted tree's path
    must give exactly eagle3's step (same tokens per step, nothing grafted)."""
    p = PROMPTS[0]
    seq = p + greedy[tuple(p)]
    sm = scripted(backbone, seq, lambda q: 0)
    monkeypatch.setattr(hybrid, "NGramIndex", oracle(seq, 2))
    opts = dict(nodes=3, depth=3, topk=1)
    ref = generate(sm, p, "eagle3", max_new_tokens=30, eos_token_ids=(), **opts)
    dec = Eagle3LookupDecoder(sm, Eagle3LookupOptions(num_tokens=2, **opts))
    dec.prefill(torch.tensor([p]), 30)
    lengths = [len(dec.step()[0]) for _ in range(4)]
    assert lengths == ref.accept_lengths[:4] and dec.grafted == 0


def test_exact_sampling_with_a_looked_up_branch_matches_the_backbone_distribution(small, monkeypatch):
    """Guards against bias from the looked-up branch in sample mode (a fixed chain grafted beside the
    drafted candidates): the 2nd and 3rd tokens must follow the backbone's own law (chi-square)."""
    from test_eagle3_decoding import TRIALS
    from test_runtime_sampling import chi_square_pvalue

    class Fixed(NGramIndex):
        def propose(self, count):
            return [4, 9][:count]

    sm, prompt, law = small
    monkeypatch.setattr(hybrid, "NGramIndex", Fixed)
    cfg = SamplingConfig(mode="sample", temperature=1.0)
    counts = torch.zeros(144, dtype=torch.long)
    for seed in range(TRIALS):
        out = generate(sm, prompt, "eagle3_lookup", max_new_tokens=3, sampling=cfg, seed=seed, eos_token_ids=(),
                       nodes=2, depth=2, topk=1, num_tokens=2)
        counts[out.tokens[1] * 12 + out.tokens[2]] += 1
    assert chi_square_pvalue(counts, law) > 1e-3


def test_mistakes_are_one_line_refusals(m, backbone):
    """Guards against eagle3_lookup decoding Medusa heads, bad lookup settings or draft=sampled
    surfacing as tracebacks instead of one line."""
    medusa = wrap(backbone, random_heads(backbone, num_heads=2))
    for call in (lambda: generate(medusa, PROMPTS[0], "eagle3_lookup"),
                 lambda: check_methods(["eagle3_lookup"], medusa)):
        with pytest.raises(UserError, match="method eagle3_lookup needs EAGLE-3 heads") as e:
            call()
        assert "\n" not in str(e.value)
    for bad, match in ((dict(min_ngram=0), "eagle_lookup_min_ngram must be"),
                       (dict(min_ngram=4, max_ngram=2), "exceeds eagle_lookup_max_ngram"),
                       (dict(num_tokens=-1), "eagle_lookup_tokens must be"), (dict(num_tokens=True), "eagle_lookup_tokens"),
                       (dict(switch=4), "eagle_lookup_switch must be"), (dict(switch=1), "eagle_lookup_switch must be"),
                       (dict(nodes=40, depth=2, topk=4), "more than")):
        with pytest.raises(UserError, match=match):
            generate(m, PROMPTS[0], "eagle3_lookup", max_new_tokens=4, **bad)
    with pytest.raises(UserError, match="draft=sampled"):
        generate(m, PROMPTS[0], "eagle3_lookup", sampling=SamplingConfig(mode="sample", draft="sampled"))


def test_keys_costs_and_the_methods_for_eagle3_heads(m):
    """Guards against the hybrid missing from compare=true for EAGLE-3 heads, reading other keys than
    the prompt-lookup ones, or a trade-off matrix without its looked-up slots."""
    import inference.cli as cli
    from inference.methods.eagle3 import Eagle3Options, eagle3_costs

    assert methods_for_heads(m.heads.spec)[:2] == ["eagle3_lookup", "eagle3"]   # the default first
    o = options_from_keys("eagle3_lookup", cli.EvalConfig(eagle_nodes=1, eagle_depth=1, eagle_topk=1,
                                                          eagle_lookup_tokens=3, eagle_lookup_min_ngram=2))
    assert (o.nodes, o.num_tokens, o.min_ngram, o.max_ngram) == (1, 3, 2, 3)
    base = eagle3_costs(m, Eagle3Options(nodes=1, depth=1, topk=1), 100)
    assert eagle3_lookup_costs(m, o, 100).extra_kv_cache_bytes == base.extra_kv_cache_bytes + 3 * kv_bytes_per_token(m)
    assert eagle3_lookup_costs(m, Eagle3LookupOptions(nodes=0, num_tokens=3), 100).extra_parameters == 0


def test_auto_races_the_hybrid_with_its_branch_and_the_report_shows_it(monkeypatch):
    """Guards against choice=auto for eagle3_lookup being chosen on eagle3's decoding (without
    the looked-up branch), or a choice the report does not show."""
    from medusa_train.backbone import random_backbone
    from inference.evaluation.evaluate import evaluate
    from inference.prompts import Prompt
    from inference.evaluation.reports import markdown

    bb = random_backbone({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
                          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 320,
                          "max_position_embeddings": 512}, seed=0)
    em = random_drafter(bb.model.eval())
    em.tokenizer = bb.tokenizer
    seen = []
    parts = Eagle3LookupOptions(num_tokens=3).part_shapes()
    clock = fake_clock({"plain": 100, **{tc.eagle3_name(s): 400 for s in tc.EAGLE3_GRID + parts}})

    def timed(m, prompt_ids, shape, *, steps=8, warmup=2, method="eagle3", options=None, reply_tokens=None):
        seen.append((method, type(options).__name__))
        return clock(m, prompt_ids, shape, steps=steps, warmup=warmup)

    monkeypatch.setattr(race, "machine_load", lambda: (0.1, 2))
    monkeypatch.setattr(tc, "eagle3_step_times", timed)
    prompts = [Prompt(str(i), [f"question {i}? question {i}?"]) for i in range(2)]
    report = evaluate(em, prompts, methods=["eagle3_lookup", "autoregressive"], max_new_tokens=6,
                      calibration_prompts=1, calibration_tokens=6, progress=False, log=lambda s: None,
                      options={"eagle3_lookup": Eagle3LookupOptions(num_tokens=3)}, choice="auto")
    assert ("eagle3_lookup", "Eagle3LookupOptions") in seen and "eagle3_tree" not in report
    assert report["eagle3_lookup_tree"]["name"] == "none (plain decoding)"
    # plain decoding is nothing drafted and nothing looked up (eagle_nodes=0 alone is the lookup alone)
    assert report["method_options"]["eagle3_lookup"]["eagle_nodes"] == 0
    assert report["method_options"]["eagle3_lookup"]["eagle_lookup_tokens"] == 0
    assert report["per_method"]["eagle3_lookup"]["greedy_identical_fraction"] == 1.0
    assert "- eagle3_lookup tree: none (plain decoding)" in markdown(report)


@pytest.mark.parametrize("grafts", [True, False])
def test_auto_costs_a_varying_setting_over_a_whole_reply(monkeypatch, grafts):
    """Guards against choice=auto for eagle3_lookup costing a setting whose steps differ (a looked-up chain
    verified, or a switch made, where the text repeats itself) by a few steps of one prompt: its first
    steps are not its mix (a switching setting costed 73 ms on the prompt's copied code decoded at 95 ms a
    step and lost to the lookup alone). Such a setting is timed over a whole calibration reply and costed
    by its mean step; eagle3 (no branch) keeps its median over the race's few steps."""
    from types import SimpleNamespace

    calibration = SimpleNamespace(accept_lengths=[2, 2, 2, 2], accepted=[2, 2, 2, 2], steps=4)   # tau 2
    monkeypatch.setattr(tc, "generate", lambda *a, **k: calibration)
    monkeypatch.setattr(race, "machine_load", lambda: (0.1, 2))
    replies = []

    def clock(m, p, shape, *, reply_tokens=None, **k):   # plain 10 ms; a tree 15 ms, a whole reply's mean 21.25
        if reply_tokens is not None:
            replies.append(reply_tokens)
            return [0.015, 0.015, 0.015, 0.040]
        return [0.010 if shape is None else 0.015] * 6

    monkeypatch.setattr(tc, "eagle3_step_times", clock)
    options = Eagle3LookupOptions(nodes=1, depth=1, topk=1, num_tokens=3) if grafts else None
    choice = tc.choose_eagle3(None, [[1, 2, 3]], [1, 2, 3], grid=[(1, 1, 1)], log=lambda s: None,
                              calibration_tokens=24, method="eagle3_lookup" if grafts else "eagle3", options=options)
    cand = next(c for c in choice.candidates if c["name"] == "n1-d1-k1")
    if grafts:   # 2 / 21.25 ms = 94 tokens/s < plain 100
        assert cand["timed_on"] == "a 24-token reply" and set(replies) == {24}
        assert cand["expected_tokens_per_s"] == pytest.approx(2 / 0.02125, abs=0.01)
        # the drafter alone (a part raced too) has steps alike: its median over a few steps, 133 tokens/s wins
        alone = next(c for c in choice.candidates if c["name"] == "n2-d1-k2-t0")
        assert alone["timed_on"] == "6 steps" and alone["expected_tokens_per_s"] == pytest.approx(2 / 0.015, abs=0.01)
        assert tc.eagle3_fields(choice.shape)["num_tokens"] == 0 and choice.shape[0] > 0
    else:        # 2 / 15 ms = 133 tokens/s: the tree
        assert cand["timed_on"] == "6 steps" and not replies
        assert choice.shape == (1, 1, 1)


def test_race_costs_by_mean_only_the_names_asked():
    """Guards against a race costing every candidate by its mean step (or none): a run of a whole reply
    is costed by its mean step, stalls dropped, while a few alike steps keep their median."""
    runs = {race.PLAIN: [0.010] * 3, "reply": [0.010, 0.010, 0.040, 0.5], "steps": [0.010, 0.010, 0.040]}
    step, spreads, _ = race.race({race.PLAIN: 1.0, "reply": 1.0, "steps": 1.0}, lambda name: runs[name],
                                 latency_steps=3, min_rounds=1, max_rounds=2, log=lambda s: None, progress=False,
                                 by_mean={"reply"})
    assert step["reply"] == pytest.approx(0.020) and step["steps"] == pytest.approx(0.010)   # 0.5: a stall
    assert spreads["reply"]["stalled_steps_dropped"] > 0


# -- the parts of the combination (issue 43 item 12): the lookup alone, the drafter alone, switching ----
def copying_oracle(seq: list[int], right: int, matched: int):
    """``oracle`` whose every proposal reports a suffix match of ``matched`` tokens (text being copied)."""
    base = oracle(seq, right)

    class Copying(base):
        def propose(self, count):
            out = super().propose(count)
            self.last_match = matched if out else 0
            return out
    return Copying


@pytest.mark.parametrize("opts", [dict(nodes=4, depth=1, topk=4, num_tokens=4, switch=2),
                                  dict(nodes=8, depth=2, topk=4, num_tokens=6, switch=3),
                                  dict(nodes=4, depth=2, topk=2, num_tokens=0),
                                  dict(nodes=0, num_tokens=0)], ids=["switch-any", "switch-full", "drafter-alone",
                                                                     "plain"])
def test_the_parts_and_switching_stay_token_identical(m, opts):
    """Guards against a switched step (the chain alone, no drafted rows), the drafter alone or plain decoding
    expressed in eagle3_lookup's keys changing greedy output, on repeating and non-repeating prompts."""
    for p in PROMPTS + (REPEATING,):
        ref = generate(m, p, "autoregressive", max_new_tokens=40, eos_token_ids=()).tokens
        assert generate(m, p, "eagle3_lookup", max_new_tokens=40, eos_token_ids=(), **opts).tokens == ref, (p, opts)


def test_a_switched_step_verifies_the_looked_up_chain_alone(backbone, greedy, monkeypatch):
    """Guards against the switch still verifying the drafter's nodes (the rows it exists to save) or
    losing the drafter's state: where the lookup matched a long suffix, a step's tree is the root and the
    chain only, the chain is accepted, and the drafter's committed entries still equal a fresh catch-up
    over the accepted tokens, so the steps after it draft as usual."""
    p = PROMPTS[0]
    seq = p + greedy[tuple(p)]
    sm = scripted(backbone, seq, lambda q: None)                # the drafter is always wrong
    monkeypatch.setattr(hybrid, "NGramIndex", copying_oracle(seq, 3, matched=3))
    dec = Eagle3LookupDecoder(sm, Eagle3LookupOptions(nodes=4, depth=1, topk=4, num_tokens=3, switch=3))
    emitted = [dec.prefill(torch.tensor([p]), 40)]
    tokens, parents, depths = dec.tree()
    assert tokens.numel() == 4 and parents.tolist() == [-1, 0, 1, 2] and depths.tolist() == [0, 1, 2, 3]
    dec.dkv.truncate(dec.past)
    tap = sm.aux_tap(sm.heads.spec.settings.aux_layers)
    for _ in range(5):
        new, depth = dec.step()
        emitted += new
        assert len(new) == 4 and depth == 3 and emitted == seq[len(p):dec.past + 1]
        assert_draft_kv_is_a_fresh_catch_up(sm, dec, seq, tap)
    assert dec.switched == 6 and dec.grafted == 6          # 6 trees built: the one above and 5 steps


def test_a_short_match_below_the_switch_keeps_the_drafted_tree(backbone, greedy, monkeypatch):
    """Guards against switching on every proposal: a match shorter than eagle_lookup_switch keeps the
    drafter's nodes and grafts the chain beside them, as without a switch."""
    p = PROMPTS[0]
    seq = p + greedy[tuple(p)]
    sm = scripted(backbone, seq, lambda q: None)
    monkeypatch.setattr(hybrid, "NGramIndex", copying_oracle(seq, 3, matched=2))
    dec = Eagle3LookupDecoder(sm, Eagle3LookupOptions(nodes=4, depth=1, topk=4, num_tokens=3, switch=3))
    dec.prefill(torch.tensor([p]), 40)
    tokens, _, _ = dec.tree()
    assert tokens.numel() == 1 + 4 + 3 and dec.switched == 0


def test_the_drafter_alone_is_an_eagle3_step_and_neither_part_is_plain_decoding(m):
    """Guards against eagle_lookup_tokens=0 still grafting or costing a lookup, and against eagle3_lookup
    with nothing drafted and nothing looked up decoding anything but plain decoding (a choice=auto
    choice of plain decoding must decode plainly, not with the lookup alone)."""
    from inference.methods.autoregressive import AutoregressiveDecoder
    from inference.methods.eagle3 import Eagle3Decoder
    from inference.methods.registry import get

    opts = dict(nodes=4, depth=2, topk=2)
    for p in PROMPTS + (REPEATING,):
        ref = generate(m, p, "eagle3", max_new_tokens=30, eos_token_ids=(), **opts)
        alone = generate(m, p, "eagle3_lookup", max_new_tokens=30, eos_token_ids=(), num_tokens=0, **opts)
        assert (alone.tokens, alone.accept_lengths, alone.proposed) == (ref.tokens, ref.accept_lengths, ref.proposed)
    decoder = get("eagle3_lookup").decoder
    assert type(decoder(m, Eagle3LookupOptions(num_tokens=0, **opts), None, 0)) is Eagle3Decoder
    assert type(decoder(m, Eagle3LookupOptions(nodes=0, num_tokens=0), None, 0)) is AutoregressiveDecoder
    assert Eagle3LookupOptions(nodes=0, num_tokens=0).fixed_choice() is None
    assert Eagle3LookupOptions(nodes=0, num_tokens=3).fixed_choice() is not None     # the lookup alone
    assert eagle3_lookup_costs(m, Eagle3LookupOptions(nodes=0, num_tokens=0), 100).extra_kv_cache_bytes == 0


@pytest.mark.parametrize("winner", ["lookup-only", "n4-d1-k4-t0", "n4-d1-k4-s3", "n4-d1-k4"])
def test_auto_races_the_lookup_alone_the_drafter_alone_and_switching(backbone, greedy, monkeypatch, winner):
    """Guards against choice=auto for eagle3_lookup choosing among combined shapes only, so that on
    prompts where one part alone is faster (code: the lookup alone) the combination decodes below it:
    the lookup alone, the drafter alone and the switching shapes are raced too, whichever is fastest is
    chosen, and its options decode token-identically."""
    p = PROMPTS[0]
    sm = scripted(backbone, p + greedy[tuple(p)], lambda q: 0)
    options = Eagle3LookupOptions(num_tokens=3)
    names = {tc.eagle3_name(s) for s in ((4, 1, 4), *options.part_shapes())}
    assert {"lookup-only", "n2-d1-k2-t0", "n4-d1-k4-t0", "n8-d2-k4-t0", "n4-d1-k4-s3", "n4-d1-k4-s2"} <= names
    ms = {name: 400.0 for name in names}
    ms[winner] = 1.0
    monkeypatch.setattr(race, "machine_load", lambda: (0.1, 2))
    monkeypatch.setattr(tc, "eagle3_step_times", fake_clock({"plain": 100, **ms}))
    choice = tc.choose_eagle3(sm, [p], p, grid=[(4, 1, 4)], calibration_tokens=12, log=lambda s: None,
                              method="eagle3_lookup", options=options)
    assert choice.to_dict()["name"] == winner
    assert {c["name"] for c in choice.candidates} == names
    chosen = dataclasses.replace(options, **choice.options())
    out = generate(sm, p, "eagle3_lookup", options=chosen, max_new_tokens=12, eos_token_ids=())
    assert out.tokens == greedy[tuple(p)][:12]
