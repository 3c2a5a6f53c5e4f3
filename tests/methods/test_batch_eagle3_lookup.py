"""Batched ``eagle3_lookup`` (inference/methods/eagle3_lookup.py, ``Eagle3LookupBatchDrafter``): every
row grows eagle3's tree as batched eagle3 does and grafts its own looked-up branch on, and must decode
exactly as that prompt alone through batch-1 ``eagle3_lookup``.

The tiny random Llama and drafters of tests/methods/test_batch_eagle3.py (a scripted ``TableDrafter``, right
at most positions, and an arbitrary random one), plus a prompt that repeats itself; one-token
suffixes (``min_ngram=1``) make lookups fire in most steps, with chains of different lengths per row.
"""

from __future__ import annotations

import pytest

from inference.errors import UserError
from inference.methods import generate, generate_batch
from inference.methods.eagle3 import Eagle3Options
import inference.methods.eagle3_lookup as hybrid
from inference.methods.eagle3_lookup import Eagle3LookupBatchDrafter, Eagle3LookupOptions
from inference.methods.prompt_lookup import NGramIndex
from inference.methods.registry import batched_names
from inference.runtime.batch_cache import RAGGED_MODES
from inference.runtime.batch_decode import BatchTreeDecoder, run_batch
from inference.runtime.speculation import SpeculationSchedule
from inference.runtime.verify import SamplingConfig

from runtime_support import one_thread  # noqa: F401 (autouse fixture)
from test_batch_eagle3 import LENGTHS, N, SETTINGS, backbone, check_drafter_cache, greedy, models, prompts  # noqa: F401
from test_eagle3_decoding import small  # noqa: F401 (fixture)
from test_eagle3_lookup import REPEATING

LOOKUP = dict(num_tokens=6, min_ngram=1, max_ngram=3)


def batch_of(prompts):  # noqa: F811
    return [prompts[i] for i in range(len(LENGTHS))] + [REPEATING]


class Spy(Eagle3LookupBatchDrafter):
    """Records every step's per-row tree sizes (root included) after grafting, and the nodes grafted."""

    def amend(self, dec, rows):
        out = super().amend(dec, rows)
        self.sizes.append([t.numel() for t, _, _ in out])
        self.grafted.append([t.numel() - r.numel() for (t, _, _), (r, _, _) in zip(out, rows)])
        return out


@pytest.mark.parametrize("ragged", RAGGED_MODES)
@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("kind", ["scripted", "random"])
def test_every_row_decodes_as_batch_one_eagle3_lookup_and_plain_greedy(models, prompts, kind, setting, ragged):
    """Guards against a row's graft, padding or catch-up depending on its batch (another row's
    lookup index or history, a grafted chain hung under another row's node, padding nodes of a
    shorter graft accepted or committed): every row emits batch-1 eagle3_lookup's tokens (= plain
    greedy), accepts the same lengths step by step and reports the same proposals, while rows
    graft chains of different lengths in the same step."""
    batch = batch_of(prompts)
    m = models[kind]
    out = generate_batch(m, batch, "eagle3_lookup", max_new_tokens=N, eos_token_ids=(), ragged=ragged,
                         **SETTINGS[setting], **LOOKUP)
    for i, (p, row) in enumerate(zip(batch, out.rows)):
        single = generate(m, p, "eagle3_lookup", max_new_tokens=N, eos_token_ids=(), **SETTINGS[setting], **LOOKUP)
        plain = generate(m, p, "autoregressive", max_new_tokens=N, eos_token_ids=()).tokens
        assert row.tokens == single.tokens == plain, i
        assert row.accept_lengths == single.accept_lengths, i
        assert row.proposed == single.proposed, i
    o = Eagle3LookupOptions(**SETTINGS[setting], **LOOKUP)
    spy = Spy(m, o, o.lookup)
    spy.sizes, spy.grafted = [], []
    dec = BatchTreeDecoder(m, spy, ragged=ragged)
    dec.prefill(batch, N)
    for _ in range(6):
        dec.step()
    assert any(len(set(s)) > 1 for s in spy.sizes)            # trees of different sizes in one step
    assert any(len(set(g)) > 1 for g in spy.grafted)          # from grafts of different lengths


def oracle_for(sequences, right: int, wrong: int):
    """An NGramIndex whose proposal, in whichever row's sequence its context starts, is the next
    ``right`` tokens of it (the true continuation), then ``wrong`` tokens that are not."""
    class Oracle(NGramIndex):
        def propose(self, count):
            n = len(self.seq)
            seq = next(s for s in sequences if s[:n] == self.seq)
            good = seq[n:n + min(right, count)]
            bad = [(t + 1) % 96 for t in seq[n + len(good):n + len(good) + wrong]]
            return (good + bad)[:count]
    return Oracle


@pytest.mark.parametrize("ragged", RAGGED_MODES)
def test_drafter_cache_equals_a_fresh_catch_up_after_grafted_steps(models, prompts, greedy, ragged, monkeypatch):
    """Guards against a catch-up that reads the wrong tap rows for a row's grafted nodes or a padding
    node: with looked-up chains that are right for 3 tokens, after every step (also after rows leave
    the batch) each row's committed drafter entries equal a fresh catch-up over its accepted tokens
    with true features, and the rows stay plain greedy."""
    m = models["random"]
    rows = list(range(len(LENGTHS)))
    seqs = [prompts[i] + greedy[i] for i in rows]
    monkeypatch.setattr(hybrid, "NGramIndex", oracle_for(seqs, 3, wrong=1))
    o = Eagle3LookupOptions(**SETTINGS["chain"], num_tokens=4)
    drafter = Eagle3LookupBatchDrafter(m, o, o.lookup)
    assert (drafter.max_nodes, drafter.max_depth) == (o.nodes + 1 + o.num_tokens, o.num_tokens)
    dec = BatchTreeDecoder(m, drafter, ragged=ragged)
    dec.prefill([prompts[i] for i in rows], N)
    lengths = []
    for step in range(6):
        lengths += [len(new) for new, _ in dec.step()]
        check_drafter_cache(m, dec, drafter)
        if step == 2:
            dec.keep_rows([4, 0, 3])
            assert len(drafter.indexes) == 3
            check_drafter_cache(m, dec, drafter)
    for row, hist in zip(dec.rows, dec.history):
        assert hist == seqs[row][:len(hist)], row
    assert lengths.count(4) >= len(lengths) // 2           # the right 3 looked-up tokens + the bonus


def test_lookup_alone_plain_schedules_and_refusals(models, prompts):
    """Guards against eagle_nodes=0 batches doing something else than batch 1 (prompt lookup alone
    with this method's keys), a schedule plain at every size not being the plain loop, and batches
    accepting what batch 1 refuses, in one line."""
    m = models["random"]
    batch = batch_of(prompts)
    assert "eagle3_lookup" in batched_names()
    alone = generate_batch(m, batch, "eagle3_lookup", max_new_tokens=N, eos_token_ids=(), nodes=0, **LOOKUP)
    lookup = generate_batch(m, batch, "prompt_lookup", max_new_tokens=N, eos_token_ids=(), **LOOKUP)
    assert [(r.tokens, r.accept_lengths) for r in alone.rows] == [(r.tokens, r.accept_lengths) for r in lookup.rows]
    assert max(n for r in alone.rows for n in r.accept_lengths) > 1
    plain = generate_batch(m, batch[:3], "eagle3_lookup", max_new_tokens=6, eos_token_ids=(),
                           schedule=SpeculationSchedule({1: None, 4: None}))
    assert set(plain.speculation) == {1} and all(set(r.accept_lengths) == {1} for r in plain.rows)
    for call, match in (
            (lambda: generate_batch(m, batch[:2], "eagle3_lookup", tree="auto"), "method eagle3_lookup has no option 'tree'"),
            (lambda: generate_batch(m, batch[:2], "eagle3_lookup",
                                    sampling=SamplingConfig(mode="sample", draft="sampled")), "draft=sampled"),
            (lambda: generate_batch(m, batch[:2], "eagle3_lookup", min_ngram=3, max_ngram=2), "exceeds")):
        with pytest.raises(UserError, match=match) as err:
            call()
        assert "\n" not in str(err.value)


def test_a_schedule_switching_settings_and_plain_steps_stays_greedy(models, prompts, greedy):  # noqa: F811
    """Guards against a plain step of the schedule grafting (it must verify the root alone) and a
    lookup index left behind by plain steps (the next graft would look up a stale context): rows stay
    plain greedy through tree -> plain -> chain steps, and drafting with grafts resumes after them."""
    m = models["scripted"]
    tree, chain = Eagle3Options(**SETTINGS["tree"]), Eagle3Options(**SETTINGS["chain"])
    o = Eagle3LookupOptions(**LOOKUP)
    drafter = Eagle3LookupBatchDrafter(m, SpeculationSchedule({1: chain, 2: None, 8: tree}), o.lookup)
    rows = [0, 2, 4, 1]
    dec = BatchTreeDecoder(m, drafter)
    dec.prefill([prompts[i] for i in rows], N)
    for keep, choice in (([0, 1, 2, 3], tree), ([1, 3], None), ([0], chain)):
        dec.keep_rows(keep)
        for _ in range(2):
            steps = dec.step()
            if choice is None:
                assert dec.last_nodes == 1 and [len(new) for new, _ in steps] == [1] * dec.batch
            else:
                assert dec.last_nodes >= choice.nodes + 1
            for row, hist in zip(dec.rows, dec.history):
                i = rows[row]
                assert hist[len(prompts[i]):] == greedy[i][:len(hist) - len(prompts[i])], i
            check_drafter_cache(m, dec, drafter)


@pytest.mark.parametrize("cfg", [SamplingConfig(mode="sample", temperature=1.0),
                                 SamplingConfig(mode="typical", temperature=0.8)], ids=["sample", "typical"])
def test_a_one_row_batch_samples_as_batch_one(small, cfg):  # noqa: F811
    """Guards against the batched path verifying a grafted tree by another rule than batch 1 (another
    candidate order, random stream or bonus draw): a one-row batch with the same seed emits batch-1
    eagle3_lookup's tokens, step for step."""
    sm, prompt, _ = small
    for seed in range(12):
        kw = dict(max_new_tokens=8, sampling=cfg, seed=seed, eos_token_ids=(), nodes=2, depth=2, topk=1,
                  num_tokens=3, min_ngram=1)
        one = generate_batch(sm, [prompt + prompt], "eagle3_lookup", **kw).rows[0]
        single = generate(sm, prompt + prompt, "eagle3_lookup", **kw)
        assert (one.tokens, one.accept_lengths) == (single.tokens, single.accept_lengths), seed


def test_caches_are_sized_for_the_grafted_branch(models, prompts, greedy, monkeypatch):  # noqa: F811
    """Guards against caches sized for eagle3's tree alone: with a looked-up chain of the full
    ``eagle_lookup_tokens`` grafted on the widest tree in every step, up to every row's last token,
    the run must fit and stay greedy, and the memory check's estimate of the drafter cache is what
    it allocates."""
    m = models["random"]
    rows = list(range(len(LENGTHS)))
    seqs = [prompts[i] + greedy[i] for i in rows]
    monkeypatch.setattr(hybrid, "NGramIndex", oracle_for(seqs, 1, wrong=5))
    o = Eagle3LookupOptions(**SETTINGS["tree"], **LOOKUP)
    drafter = Eagle3LookupBatchDrafter(m, o, o.lookup)
    batch = [prompts[i] for i in rows]
    out = run_batch(BatchTreeDecoder(m, drafter), m, batch, N, eos_token_ids=())
    assert [r.tokens for r in out.rows] == [g[:N] for g in greedy[:len(rows)]]
    assert max(out.speculation) == o.nodes + 1 + o.num_tokens   # full grafts were verified
    kv = drafter.dkv                                        # every row has left: its shape per row remains
    per_row = kv.capacity * 2 * kv.k.shape[1] * kv.k.shape[3] * kv.k.element_size()
    assert drafter.cache_bytes([len(p) for p in batch], N) == len(batch) * per_row


def test_batch_sizing_races_the_shapes_with_the_branch_and_the_eval_decodes_them(models, prompts, greedy,  # noqa: F811
                                                                                tmp_path):
    """Guards against eagle3_lookup sized as eagle3 (tau measured without the branch, step times of
    eagle3's drafter, which never grafts), a schedule whose settings lose the lookup keys, and a
    batched medusa-eval that refuses choice=auto for it or records another schedule than the
    one its batches decode with, or a choice file that does not give that schedule back."""
    from inference.evaluation import batch_eval
    from inference.prompts import Prompt
    from inference.methods import eagle3_choice as batch_sizing
    from inference.methods.eagle3_choice import measure_eagle3_tau
    from inference.runtime.speculation import tree_label

    m = models["scripted"]
    o = Eagle3LookupOptions(**LOOKUP)
    grid = ((2, 2, 1), (4, 3, 2))
    calib = [REPEATING, prompts[1]]
    timing = dict(latency_steps=2, warmup=1, min_rounds=1, max_rounds=1, log=lambda s: None)
    sizing, record = batch_sizing.choose_eagle3_schedule(m, calib, batch_of(prompts)[:4], [1, 4], grid=grid,
                                                         calibration_tokens=12, method="eagle3_lookup", options=o,
                                                         **timing)
    with_branch = measure_eagle3_tau(m, calib, (2, 2, 1), max_new_tokens=12, method="eagle3_lookup", options=o)
    without = measure_eagle3_tau(m, calib, (2, 2, 1), max_new_tokens=12)
    assert record["measured_tau"]["n2-d2-k1"] == pytest.approx(with_branch, abs=1e-4) and with_branch > without
    for choice in sizing.schedule.choices.values():
        assert choice is None or (isinstance(choice, Eagle3LookupOptions) and choice.lookup == o.lookup)
    # the hysteresis finds every choice's expected rate under the label it looks up (not the shape's name)
    for b, choice in sizing.schedule.choices.items():
        assert tree_label(choice) in sizing.schedule.rates[b]
        assert all(k == "plain" or k.endswith(f"+t{o.num_tokens}-m{o.min_ngram}") for k in sizing.schedule.rates[b])

    items = [Prompt(id=str(i), turns=[str(i)]) for i in range(5)]
    texts = [REPEATING] + [prompts[i] for i in range(4)]
    orig = type(m).encode_chat
    type(m).encode_chat = lambda self, text: texts[int(text)]
    chosen, fixed_chosen = {}, {}
    try:
        r = batch_eval.evaluate_batched(m, items, methods=["eagle3_lookup"], batch_sizes=[2], max_new_tokens=8,
                                        calibration_prompts=1, progress=False, log=lambda s: None, choice="auto",
                                        options={"eagle3_lookup": Eagle3LookupOptions(**LOOKUP)}, chosen=chosen)
        fixed = batch_eval.evaluate_batched(m, items, methods=["eagle3_lookup"], batch_sizes=[2], max_new_tokens=8,
                                            progress=False, log=lambda s: None, choice="fixed", chosen=fixed_chosen,
                                            options={"eagle3_lookup": Eagle3LookupOptions(nodes=0, **LOOKUP)})
    finally:
        type(m).encode_chat = orig
    b = r["batched"]
    assert b["speculation"]["eagle3_lookup"]["tree"] == "auto" and b["num_prompts"] == 4
    assert b["per_batch_size"]["2"]["per_method"]["eagle3_lookup"]["greedy_identical"] is True
    assert set(b["speculation"]["eagle3_lookup"]["calibration"]["measured_tau"]) == {
        "n1-d1-k1", "n2-d1-k2", "n4-d1-k4", "n2-d2-k1", "n3-d2-k2", "n4-d4-k1", "n4-d3-k2", "n8-d4-k4"}
    # what the evaluation chose, through its choice file, is the schedule medusa-generate decodes batches with
    from inference.methods.choice_file import read_choice, write_choice

    made = chosen["eagle3_lookup"]
    path = write_choice(tmp_path, "eagle3_lookup", made, made.options)
    assert path.name == "eagle3_lookup_choice.json"
    saved = read_choice(str(path), m.heads.spec, ["eagle3", "eagle3_lookup"], lambda x: Eagle3LookupOptions(**LOOKUP))
    assert saved.method == "eagle3_lookup"
    assert saved.schedule.to_dict() == b["speculation"]["eagle3_lookup"]["schedule"]
    assert all(c is None or c.lookup == o.lookup for c in saved.schedule.choices.values())
    f = fixed["batched"]
    assert f["speculation"]["eagle3_lookup"]["schedule"] == {"2": "prompt lookup t6-m1"}
    assert not fixed_chosen["eagle3_lookup"].measured                                      # nothing was chosen
    assert f["per_batch_size"]["2"]["per_method"]["eagle3_lookup"]["greedy_identical"] is True


def test_batch_sizing_costs_the_steps_that_graft(models, prompts, monkeypatch):  # noqa: F811
    """Guards against eagle3_lookup's batched sizing costing each setting by its median step (a step
    with no looked-up chain, the costlier ones passed over), which eagle3, whose steps do not vary,
    keeps."""
    from inference.methods import eagle3_choice as batch_sizing
    from inference.runtime.sizing import BatchSizing
    from inference.runtime.speculation import SpeculationSchedule

    seen = {}

    def fake_size(m, cands, drafter_for, latency_prompts, batch_sizes, *, what, varying=False, **kw):
        seen[what] = varying
        return BatchSizing(SpeculationSchedule({}, {}, 0.05), {})

    monkeypatch.setattr(batch_sizing, "size_speculation", fake_size)
    m = models["scripted"]
    kw = dict(grid=((2, 2, 1),), calibration_tokens=4)
    batch_sizing.choose_eagle3_schedule(m, [REPEATING], batch_of(prompts)[:2], [1], method="eagle3_lookup",
                                        options=Eagle3LookupOptions(**LOOKUP), **kw)
    batch_sizing.choose_eagle3_schedule(m, [REPEATING], batch_of(prompts)[:2], [1], **kw)
    assert seen == {"eagle3_lookup trees": True, "eagle3 trees": False}


@pytest.mark.parametrize("switch", [1, 3])
def test_rows_that_switch_to_the_looked_up_chain_stay_batch_one_and_greedy(models, prompts, switch):
    """Guards against a batched row whose lookup matched a long suffix (its tree replaced by the root and
    the looked-up chain, eagle_lookup_switch) reading another row's nodes, or padding of a switched row
    being accepted: every row emits batch-1 eagle3_lookup's tokens with the same switch (= plain greedy),
    step by step, while other rows in the same step keep their drafted trees."""
    batch = batch_of(prompts)
    m = models["random"]
    opts = dict(nodes=4, depth=2, topk=2, **LOOKUP, switch=switch)
    out = generate_batch(m, batch, "eagle3_lookup", max_new_tokens=N, eos_token_ids=(), **opts)
    for i, (p, row) in enumerate(zip(batch, out.rows)):
        single = generate(m, p, "eagle3_lookup", max_new_tokens=N, eos_token_ids=(), **opts)
        plain = generate(m, p, "autoregressive", max_new_tokens=N, eos_token_ids=()).tokens
        assert row.tokens == single.tokens == plain, i
        assert row.accept_lengths == single.accept_lengths, i
