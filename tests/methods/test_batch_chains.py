"""Chain lengths sized per batch size for the batched chain methods (draft model, prompt lookup).

The sizing rule (``chain_choice.choose_chain_schedule``): tau per length from one batch-1 calibration
run with the longest chain, step times of the method's own drafter at each batch size, the best
expected tokens/s per batch size, or plain. The schedule then drives the batched drafters step by step
(by active rows), and a row must stay token-identical to plain greedy however the length moves."""

from __future__ import annotations

import random

import pytest
import torch

from inference.errors import UserError
from inference.methods import chain_choice as batch_sizing
from inference.runtime import sizing as runtime_sizing
from inference.evaluation.batch_eval import evaluate_batched
from inference.prompts import Prompt
from inference.runtime.race import PLAIN
from inference.methods import generate, generate_batch
from inference.runtime.speculation import SpeculationSchedule
from inference.runtime.tree import chain_tree, resolve_tree
from inference.runtime.verify import SamplingConfig

from runtime_support import one_thread  # noqa: F401 (autouse fixture)
from test_batch_methods import m  # noqa: F401 (fixture: the tiny backbone the batched chain tests use)

METHODS = {"draft": {"draft": "self:2", "k": 4}, "prompt_lookup": {"num_tokens": 4}}


@pytest.fixture(scope="module")
def prompts():
    """Prompts of very different lengths; a small alphabet makes n-grams repeat so lookup proposes."""
    rng = random.Random(1)
    return [[rng.randrange(6) for _ in range(n)] for n in (2, 30, 7, 120)]


def test_expected_tau_per_length_is_the_capped_acceptance():
    """Guards against: a chain's expected tau not being 1 + mean(min(A, k)) over the calibration steps
    (a longer chain credited with tokens the longest chain never accepted, or a shorter one with more
    than k), lengths above the method's most offered, or the method's own most length missing."""
    accepted = [0, 1, 3, 5, 5, 2]
    cands = batch_sizing.chain_candidates(accepted, most=5, lengths=(1, 2, 3, 4, 6, 8))
    assert list(cands) == ["chain2", "chain3", "chain4", "chain5", "chain6"]   # k = 1, 2, 3, 4 and most 5
    for name, (tree, tau) in cands.items():
        k = tree.num_nodes - 1
        assert tree.max_depth == k and tau == pytest.approx(1 + sum(min(a, k) for a in accepted) / len(accepted))
    taus = [tau for _, tau in cands.values()]
    assert taus == sorted(taus)
    with pytest.raises(UserError, match="calibration step"):
        batch_sizing.chain_candidates([], most=3)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_calibration_runs_the_longest_chain_at_batch_one(m, prompts, method):
    """Guards against: a calibration measuring acceptance with another chain than the longest (the draft
    model's adaptive k moving it, a default length instead of the set one), which would make every
    shorter chain's expected tau wrong: the counts are those of batch-1 decoding with the most length."""
    opts = {**METHODS[method], **({"adaptive": True} if method == "draft" else {})}
    from inference.methods.registry import make_options

    options = make_options(method, None, **opts)
    accepted = batch_sizing.measure_chain_acceptance(m, method, options, prompts[:2], max_new_tokens=20)
    expected = []
    for p in prompts[:2]:
        fixed = {k: v for k, v in opts.items() if k != "adaptive"}
        out = generate(m, p, method, max_new_tokens=20, eos_token_ids=(), **fixed)
        expected += [n - 1 for n in out.accepted]
        assert all(x <= 4 for x in out.proposed)
    assert accepted == expected and max(accepted) <= 4 and sum(accepted) > 0


@pytest.mark.parametrize("method", sorted(METHODS))
def test_the_rule_shortens_and_switches_off_as_the_batch_grows(m, prompts, method, monkeypatch):
    """Guards against: one chain length at every batch size (the length that pays at batch 1 kept at 16
    rows where each draft token costs a whole row of compute), a winner that is not the best expected
    tokens/s, or no plain decoding where no length pays. Step times are controlled: a chain of k tokens
    costs (1 + k x slope) plain steps, the slope growing with the batch."""
    slope = {1: 0.0, 4: 0.2, 16: 2.0}

    def fake_race(taus, timer, *, what, **kw):
        b = int(what.rsplit(" ", 1)[1])
        step = {PLAIN: 0.01, **{n: 0.01 * (1 + slope[b] * (int(n[5:]) - 1)) for n in taus}}
        return step, {n: {"step_ms": s * 1e3} for n, s in step.items()}, {"rounds": 1}

    monkeypatch.setattr(runtime_sizing, "race", fake_race)
    from inference.methods.registry import make_options

    options = make_options(method, None, **METHODS[method])
    sizing, record = batch_sizing.choose_chain_schedule(m, method, options, prompts[:2], prompts, [16, 1, 4],
                                                        calibration_tokens=20, log=lambda s: None)
    sched = sizing.schedule
    taus = record["expected_tau"]
    assert sched.choices[1].name == max(taus, key=taus.get)   # free drafts: the longest useful chain
    assert sched.choices[16] is None                          # each token costs two steps: plain wins
    four = sizing.table[4]
    best = max(four["candidates"], key=lambda c: c["expected_tokens_per_s"])
    assert four["winner"] == (best["name"] if best["expected_tokens_per_s"] > four["plain_tokens_per_s"] else "plain")
    assert record["most"] == 4 and record["calibration_steps"] > 0


@pytest.mark.parametrize("method", sorted(METHODS))
def test_a_schedule_moves_the_chain_by_active_rows_and_rows_stay_greedy(m, prompts, method):
    """Guards against: the batched chain drafters ignoring the schedule (a fixed length at every batch
    size), or a length change altering any row's tokens. Rows accept different numbers of tokens, so
    they finish at different steps and the active count crosses the schedule's buckets."""
    sched = SpeculationSchedule({1: chain_tree(5), 2: chain_tree(2), 4: chain_tree(3)}, switch_gain=0.0)
    out = generate_batch(m, prompts, method, max_new_tokens=40, eos_token_ids=(), schedule=sched, **METHODS[method])
    for p, row in zip(prompts, out.rows):
        assert row.tokens == generate(m, p, "autoregressive", max_new_tokens=40, eos_token_ids=()).tokens
    most = {1: 5, 2: 2, 3: 3, 4: 3}   # nodes per row (root included) the schedule allows by active rows
    seen = set()
    for a, n in zip(out.active, out.speculation):
        seen.add(a)
        assert n <= most[a] if method == "prompt_lookup" else n == most[a]
    assert 4 in seen and len(seen) >= 3   # the active count crossed buckets


class _Flip:
    """A schedule that says plain for the first ``plain`` steps, then a chain of 4 tokens."""

    def __init__(self, plain: int):
        self.left = plain

    def choose(self, active, current, started):
        self.left -= 1
        return None if self.left >= 0 else chain_tree(5)


def test_draft_model_catches_up_after_plain_steps(m, prompts):
    """Guards against: the batched draft model drafting from a stale cache after steps where the
    schedule turned it off (plain steps do not run it): the first drafts after a plain stretch must be
    the draft model's greedy continuation of each row's whole history, as if it had seen every token."""
    from inference.methods.draft import load_draft
    from inference.methods.registry import make_options
    from inference.runtime.speculation import ScheduleCursor
    from inference.methods.draft import batch_draft_decoder

    rows = prompts[:3]
    dec = batch_draft_decoder(m, make_options("draft", None, draft="self:2", k=4), None, None, "compact")
    dec.drafter.cursor = ScheduleCursor(_Flip(plain=6))
    with torch.inference_mode():
        dec.prefill(rows, 40)
        dec.step()
        dec.drafter.cursor = ScheduleCursor(_Flip(plain=0))   # drafts once (cache started), then plain
        dec.step()
        dec.drafter.cursor = ScheduleCursor(_Flip(plain=5))
        for _ in range(5):
            dec.step()
        _, cand, _ = dec.drafter.draft(dec)
    small = load_draft("self:2", m)
    for b, hist in enumerate(dec.history):
        expect = generate(small, hist, "autoregressive", max_new_tokens=4, eos_token_ids=()).tokens
        assert cand[b].tolist() == expect


def test_chain_schedule_bad_input(m):
    """Guards against: a schedule whose chain is longer than the method's set length (it would overflow
    the caches sized for that length) or that holds a tree that is not a chain, reaching the decoder
    instead of one clear line."""
    with pytest.raises(UserError, match="more than draft_k=2"):
        generate_batch(m, [[1, 2, 3]], "draft", draft="self:2", k=2, schedule=SpeculationSchedule({1: chain_tree(4)}))
    with pytest.raises(UserError, match="not a chain"):
        generate_batch(m, [[1, 2, 3]], "prompt_lookup", num_tokens=4,
                       schedule=SpeculationSchedule({1: resolve_tree([[0], [1]], 2)}))
    with pytest.raises(UserError, match="choice must be auto, fixed or a choice file"):
        evaluate_batched(m, [Prompt(id="a", turns=["x"])], methods=["prompt_lookup"], batch_sizes=[2], choice="both")


def test_sampled_plain_steps_of_the_draft_model(m, prompts):
    """Guards against: a plain step of the draft model in sample mode (k = 0: no draft probabilities)
    crashing the sampled verification rule or emitting more than one token per row."""
    sched = SpeculationSchedule({1: chain_tree(3), 4: None}, switch_gain=0.0)
    out = generate_batch(m, prompts, "draft", max_new_tokens=12, eos_token_ids=(), schedule=sched, draft="self:2",
                         k=3, sampling=SamplingConfig(mode="sample", temperature=1.0), seed=3)
    assert all(len(r.tokens) == 12 for r in out.rows)
    assert all(n == 1 for a, n in zip(out.active, out.speculation) if a > 1)


def test_batched_eval_sizes_chain_methods_per_batch_size(m, prompts, monkeypatch):
    """Guards against: medusa-eval with batch sizes running the chain methods at their set length
    everywhere when sizing is asked (auto), not holding calibration prompts out, not recording the
    schedule and its measurement per method, or decoding with another schedule than the one recorded;
    and choice=fixed still sizing."""
    calls = []

    def fake_sizing(mm, *, method, options, calibration, latency_prompts, batch_sizes, **kw):
        calls.append((method, len(calibration), len(latency_prompts), list(batch_sizes)))
        sched = SpeculationSchedule({1: chain_tree(3), 2: None})
        return runtime_sizing.BatchSizing(sched, {1: {"winner": "chain3"}, 2: {"winner": "plain"}}), {"most": 4}

    from inference.methods.registry import make_options

    monkeypatch.setattr(batch_sizing, "choose_chain_schedule", fake_sizing)
    encode = type(m).encode_chat
    monkeypatch.setattr(type(m), "encode_chat", lambda self, text: [int(c) for c in text])
    try:
        items = [Prompt(id=str(i), turns=["".join(str(t) for t in p[:40])]) for i, p in enumerate(prompts * 2)]
        r = evaluate_batched(m, items, methods=["draft", "prompt_lookup"], batch_sizes=[2], max_new_tokens=8,
                             calibration_prompts=2, progress=False, log=lambda s: None,
                             options={x: make_options(x, None, **METHODS[x]) for x in METHODS})
        b = r["batched"]
        assert [c[0] for c in calls] == ["draft", "prompt_lookup"]
        assert all(c[1] == 2 and c[2] == 2 and c[3] == [1, 2] for c in calls)   # timed on the calibration prompts
        for x in METHODS:
            assert b["speculation"][x]["chain"] == "auto"
            assert b["speculation"][x]["schedule"] == {"1": "chain3", "2": "plain"}
            assert r["method_options"][x]["schedule"] == {"1": "chain3", "2": "plain"}
            row = b["per_batch_size"]["2"]["per_method"][x]
            assert b["per_batch_size"]["2"]["speculation"][x] == "plain"
            assert row["greedy_identical"] is True
        calls.clear()
        r = evaluate_batched(m, items, methods=["prompt_lookup"], batch_sizes=[2], max_new_tokens=8,
                             calibration_prompts=2, progress=False, log=lambda s: None, choice="fixed")
        assert not calls and r["batched"]["num_prompts"] == 8
        assert r["batched"]["speculation"]["prompt_lookup"]["chain"] == "fixed"
        assert r["batched"]["per_batch_size"]["2"]["speculation"]["prompt_lookup"] == "chain11"
    finally:
        monkeypatch.setattr(type(m), "encode_chat", encode)


def test_real_chain_sizing_drives_the_batched_decoder(m, prompts):
    """Guards against: the real timer failing with a chain drafter (the draft model's own cache started
    inside a batch prefilled by another drafter, lookups over the timer's rows), or its winners not being
    what each step then verifies."""
    from inference.methods.registry import make_options

    for method in sorted(METHODS):
        options = make_options(method, None, **METHODS[method])
        sizing, _ = batch_sizing.choose_chain_schedule(m, method, options, prompts[:1], prompts, [1, 4],
                                                       calibration_tokens=12, latency_steps=2, warmup=1,
                                                       min_rounds=1, max_rounds=1, log=lambda s: None)
        sched = sizing.schedule
        out = generate_batch(m, prompts, method, max_new_tokens=6, eos_token_ids=(), schedule=sched,
                             **METHODS[method])
        first = sched.choices[4]
        if first is None:
            assert out.speculation[0] == 1
        else:
            assert out.speculation[0] <= first.num_nodes
        for p, row in zip(prompts, out.rows):
            assert row.tokens == generate(m, p, "autoregressive", max_new_tokens=6, eos_token_ids=()).tokens


def test_memory_check_counts_the_draft_models_own_cache(m, monkeypatch):
    """Guards against: the batch memory check (estimate first, refuse in one line) leaving out the draft
    model's own KV cache, so a batch whose target cache fits but whose draft cache does not starts and
    runs out of memory midway instead of being refused up front."""
    from inference.methods.draft import batch_draft_decoder
    from inference.methods.registry import make_options
    from inference.runtime import batch_decode

    rows, new = [[1, 2, 3]] * 8, 64
    dec = batch_draft_decoder(m, make_options("draft", None, draft="self:2", k=4), None, None, "compact")
    target = batch_decode.batch_cache_bytes(m, [3] * 8, new, dec.drafter.max_nodes)
    draft = dec.drafter.cache_bytes([3] * 8, new)
    assert draft > 0
    monkeypatch.setattr(batch_decode, "free_memory_bytes", lambda device: int((target + draft / 2) / 0.9))
    with pytest.raises(UserError, match="lower batch_size or max_new_tokens"):
        generate_batch(m, rows, "draft", max_new_tokens=new, draft="self:2", k=4)
    generate_batch(m, rows, "autoregressive", max_new_tokens=2)   # the target's cache alone fits


def test_lookup_timing_noise_is_not_reported_as_a_loaded_machine():
    """Guards against: sizing prompt lookup telling the user the machine looks loaded because lookup
    steps vary (its proposals follow the text), while a real load, seen in plain decoding's own
    spread, must still be reported."""
    from inference.runtime.race import race

    def run(plain_spread: float, varying: bool) -> list[str]:
        calls = {PLAIN: 0, "chain3": 0}

        def timer(name):   # each name's cost alternates from one round to the next (plain: 2 runs a round)
            calls[name] += 1
            swing = plain_spread if name == PLAIN else 2.0       # the candidate's cost swings 3x
            this_round = (calls[name] - 1) // 2 if name == PLAIN else calls[name]
            return [0.01 * (1 + swing * (this_round % 2))] * 3

        _, _, timing = race({"chain3": 1.2}, timer, latency_steps=3, min_rounds=3, max_rounds=3,
                            log=lambda s: None, progress=False, varying=varying)
        return [w for w in timing["warnings"] if "varied between timing rounds" in w]

    assert run(0.0, varying=False) and "chain3" in run(0.0, varying=False)[0]
    assert run(0.0, varying=True) == []
    assert run(3.0, varying=True) and PLAIN in run(3.0, varying=True)[0]


def test_varying_candidates_are_costed_by_their_mean_step():
    """Guards against a method whose steps differ by themselves (a looked-up chain verified on one step
    in four, at 2x the cost) costed by its median step, a step without the chain: the race would count
    the chain's tokens and not its cost, and choose it where it is slower than plain decoding."""
    from inference.runtime.race import race

    def timer(name):
        return [0.01] * 4 if name == PLAIN else [0.01, 0.01, 0.01, 0.02]

    for varying, cost in ((False, 0.01), (True, 0.0125)):
        step, _, _ = race({"chain3": 1.2}, timer, latency_steps=4, min_rounds=2, max_rounds=2,
                          log=lambda s: None, progress=False, varying=varying)
        assert step["chain3"] == pytest.approx(cost) and step[PLAIN] == pytest.approx(0.01)
