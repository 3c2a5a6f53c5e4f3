"""Speculation sized per batch size (``runtime.sizing``, for the Medusa tree shape ``methods.medusa_choice``): the
rule, on controlled step times, and that its schedule is what the batched decoder then verifies with."""

from __future__ import annotations

import pytest

from inference.methods import generate_batch
from inference.methods import medusa_choice as batch_sizing
from inference.methods.medusa import HeadsDrafter
from inference.runtime import sizing as runtime_sizing
from inference.runtime.race import PLAIN

from runtime_support import one_thread, random_heads, tiny_llama, wrap  # noqa: F401 (autouse fixture)

PER_RANK = [[0.6, 0.1], [0.5, 0.1], [0.4, 0.1]]


@pytest.fixture(scope="module")
def m():
    model = tiny_llama(vocab=96, seed=0)
    return wrap(model, random_heads(model, num_heads=3))


def test_candidates_are_distinct_small_trees_and_chains():
    """Guards against: the same tree timed twice under two names (wasted timing, a tie broken by noise),
    no top-1 chain among the candidates (chains keep paying at batch sizes where trees stop), or a
    candidate deeper than the heads."""
    cands = batch_sizing.candidate_trees(PER_RANK, num_heads=3)
    keys = [tuple(map(tuple, t.choices)) for t, _ in cands]
    assert len(keys) == len(set(keys)) and all(t.num_nodes > 1 for t, _ in cands)
    assert any(all(set(c) == {0} for c in t.choices) and t.num_nodes == 3 for t, _ in cands)   # chain3
    assert all(t.max_depth <= 3 for t, _ in cands)
    assert all(tau > 1 for _, tau in cands)


def test_the_rule_picks_per_batch_size_and_falls_back_to_plain(m, monkeypatch):
    """Guards against: one tree for every batch size (a tree that pays at batch 1 kept at 16 rows where it
    costs more than it accepts), a winner that is not the best expected tokens/s, or no plain decoding
    where nothing pays. Step times are controlled: each candidate costs (1 + nodes x slope) plain steps,
    the slope growing with the batch, as a compute-bound verification does."""
    slope = {1: 0.0, 16: 1.0}
    seen = []

    def fake_race(taus, timer, *, what, **kw):
        b = int(what.rsplit(" ", 1)[1])
        seen.append(b)
        nodes = {t.name: t.num_nodes for t, _ in batch_sizing.candidate_trees(PER_RANK, 3)}
        step = {PLAIN: 0.01, **{n: 0.01 * (1 + slope[b] * (k - 1)) for n, k in nodes.items()}}
        return step, {n: {"step_ms": s * 1e3} for n, s in step.items()}, {"rounds": 1}

    monkeypatch.setattr(runtime_sizing, "race", fake_race)
    monkeypatch.setattr(runtime_sizing, "_BatchTimer", lambda *a, **k: None)
    sizing = batch_sizing.choose_schedule(m, PER_RANK, [[1, 2, 3]], [16, 1], drafter=HeadsDrafter, log=lambda s: None)
    assert seen == [1, 16]
    sched = sizing.schedule
    best1 = max(batch_sizing.candidate_trees(PER_RANK, 3), key=lambda x: x[1])[0]
    assert sched.choices[1].name == best1.name          # free nodes: the highest expected tau wins
    assert sched.choices[16] is None                    # every node costs a whole step: plain wins
    table = sizing.to_dict()["per_batch_size"]
    assert table["16"]["winner"] == "plain" and table["1"]["winner"] == best1.name
    for entry in table.values():
        best = max(entry["candidates"], key=lambda c: c["expected_tokens_per_s"])
        assert (entry["winner"] == best["name"]) == (best["expected_tokens_per_s"] > entry["plain_tokens_per_s"])


def test_measured_schedule_drives_the_batched_decoder(m):
    """Guards against: a schedule measured but not used (the decoder keeping one tree), or the real timer
    failing on a batch (prefill once, steps with each candidate): the measured winners must be what each
    step verified, by number of active rows."""
    sizing = batch_sizing.choose_schedule(m, PER_RANK, [[5, 6, 7], [9, 1]], [1, 4], drafter=HeadsDrafter, latency_steps=2, warmup=1,
                                          min_rounds=1, max_rounds=1, log=lambda s: None)
    sched = sizing.schedule
    assert set(sched.choices) == {1, 4}
    out = generate_batch(m, [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]], "medusa", tree=sched, max_new_tokens=6,
                         eos_token_ids=())
    expected = sched.choices[4]
    assert out.speculation[0] == (expected.num_nodes if expected is not None else 1)


def test_per_batch_timing_steps_on_the_static_buffer_at_every_batch_size(m):
    """Guards against: the sizing's timer of one batch size still alive (its decoder prefilled) when the next batch
    size's timer prefills, and the newer one then decoding on the dynamic cache: on a GPU every size after the first
    would time uncaptured steps and pick trees for steps no generation takes. Only a stream suspended between its
    steps keeps the buffer from a generation of the same thread."""
    from inference.runtime.static_steps import apply_graphs

    apply_graphs(m, "uncaptured", log=lambda line: None)
    try:
        batch_sizing.choose_schedule(m, PER_RANK, [[5, 6, 7], [9, 1]], [1, 2, 4], drafter=HeadsDrafter,
                                     latency_steps=2, warmup=1, min_rounds=1, max_rounds=1, log=lambda s: None)
        assert m.static.fallbacks == 0
    finally:
        m.static = None
