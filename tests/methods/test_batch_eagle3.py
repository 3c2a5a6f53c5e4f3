"""Batched ``eagle3`` (inference/methods/eagle3_batch.py): every row of a batch grows its own dynamic
tree and must decode exactly as that prompt alone through batch-1 ``Eagle3Decoder``.

Tiny random fp32 Llamas with a real ``Eagle3Drafter`` (weights perturbed: arbitrary drafts) or a
``TableDrafter``: the real drafter (KV entries, states and masks computed as usual) whose draft
distribution is scripted from every row's greedy sequence at once, so acceptance is high, partial
or nil by position and differs between rows.
"""

from __future__ import annotations

import random

import pytest
import torch

from inference.errors import UserError
from inference.heads.eagle3 import Eagle3Drafter
from inference.methods import generate, generate_batch
from inference.methods.eagle3 import Eagle3Options
from inference.methods.eagle3_batch import Eagle3BatchDrafter
from inference.methods.registry import batched_names
from inference.runtime.batch_cache import RAGGED_MODES
from inference.runtime.batch_decode import BatchTreeDecoder, run_batch
from inference.runtime.speculation import SpeculationSchedule
from inference.runtime.tree import RowTrees, default_tree
from inference.runtime.verify import SamplingConfig

from runtime_support import one_thread, random_heads, tiny_llama, wrap  # noqa: F401 (autouse fixture)
from test_eagle3_decoding import ScriptedDrafter, random_drafter, small  # noqa: F401 (fixture)
from test_runtime_sampling import chi_square_pvalue

N = 30                                   # new tokens per row
LENGTHS = (1, 7, 300, 3, 60)             # the batch's prompt lengths
SWAP = 150                               # the length of the prompt that replaces one (leakage test)
# "floor": eagle_min_prob drops a different number of nodes per row and step (rows of different sizes)
SETTINGS = {"tree": dict(nodes=8, depth=4, topk=3), "chain": dict(nodes=3, depth=3, topk=1),
            "floor": dict(nodes=8, depth=4, topk=3, min_prob=0.1)}


class TableDrafter(ScriptedDrafter):
    """``ScriptedDrafter`` for many sequences at once: a node at position p fed token x ranks
    ``table[(p, x)]`` (what follows x at p+1 in a row's greedy sequence) at ``rank(p)``; keys whose
    rows disagree are left out (decoys only there). Rows at other positions get other ranks."""

    table: dict = {}

    def forward_step(self, tokens, hidden, positions, past=None, mask=None):
        normed, pre, kv = Eagle3Drafter.forward_step(self, tokens, hidden, positions, past, mask)
        right = [self.table.get(key, -1) for key in zip(positions.reshape(-1).tolist(), tokens.reshape(-1).tolist())]
        code = normed.clone()
        code[..., 0] = torch.tensor(right, dtype=code.dtype).reshape(tokens.shape)
        code[..., 1] = positions.float()
        return code, pre, kv


def table_of(sequences) -> dict:
    seen: dict = {}
    for seq in sequences:
        for p in range(len(seq) - 2):
            seen.setdefault((p, seq[p + 1]), set()).add(seq[p + 2])
    return {key: next(iter(v)) for key, v in seen.items() if len(v) == 1}


def rank_rule(p: int):
    """Right at rank 0 mostly, at rank 1 every third position (found by trees, missed by chains),
    never every eleventh."""
    return None if p % 11 == 5 else 1 if p % 3 == 0 else 0


@pytest.fixture(scope="module")
def backbone():
    return tiny_llama(vocab=96, hidden=64, layers=4, seed=0)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(0)
    return [[rng.randrange(96) for _ in range(n)] for n in LENGTHS + (SWAP,)]


@pytest.fixture(scope="module")
def greedy(backbone, prompts):
    plain = wrap(backbone, None)
    return [generate(plain, p, "autoregressive", max_new_tokens=N + 10, eos_token_ids=()).tokens for p in prompts]


@pytest.fixture(scope="module")
def models(backbone, prompts, greedy):
    scripted = random_drafter(backbone, TableDrafter)
    scripted.heads.table = table_of([p + g for p, g in zip(prompts, greedy)])
    scripted.heads.rank = rank_rule
    return {"scripted": scripted, "random": random_drafter(backbone, scale=0.02)}


@pytest.fixture(scope="module")
def alone(models, prompts):
    """Batch-1 eagle3 decoding of every prompt, per model and setting (computed on first use)."""
    cache = {}

    def get(kind: str, setting: str, i: int, **kw):
        key = (kind, setting, i, tuple(sorted(kw.items())))
        if key not in cache:
            cache[key] = generate(models[kind], prompts[i], "eagle3", max_new_tokens=N,
                                  **{"eos_token_ids": (), **kw}, **SETTINGS[setting])
        return cache[key]
    return get


def check_drafter_cache(m, dec: BatchTreeDecoder, drafter: Eagle3BatchDrafter) -> None:
    """Every row's committed drafter entries, and the state its next root's children are drafted
    from, equal a fresh catch-up over its accepted sequence with true features (batch 1, one call).
    Entries that plain steps (or the prefill) left pending are committed first, as the next drafting
    step would."""
    drafter.catch_up_pending()
    tap = m.aux_tap(m.heads.spec.settings.aux_layers)
    for b, seq in enumerate(dec.history):
        n = len(seq) - 1                                   # the root is not committed yet
        with torch.inference_mode():
            _, aux = m.hidden_aux(torch.tensor([seq[:n]]), torch.arange(n)[None], m.new_cache(n), tap)
            _, pre, (k, v) = m.heads.forward_step(torch.tensor([seq[1:n + 1]]), m.heads.combine(aux),
                                                  torch.arange(n)[None])
        ck, cv = drafter.dkv.row_entries(b)
        assert int(drafter.dkv.committed[b]) == n
        assert torch.allclose(ck, k[0], atol=1e-5) and torch.allclose(cv, v[0], atol=1e-5), (b, n)
        assert torch.allclose(drafter.root_state[b], pre[0, -1], atol=1e-5)


# -- identity with batch 1 --------------------------------------------------------------------------
@pytest.mark.parametrize("ragged", RAGGED_MODES)
@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("kind", ["scripted", "random"])
def test_every_row_decodes_as_batch_one_eagle3_and_plain_greedy(models, prompts, greedy, alone, kind, setting,
                                                                ragged):
    """Guards against a row's tree, acceptance or output depending on its batch (another row's
    committed or draft entries visible, a shared position offset, the wrong rows of the verification
    tap fed to the catch-up, padding of a shorter catch-up committed): each row of prompts of 1 to
    300 tokens must emit batch-1 eagle3's tokens (= plain greedy), accept the same lengths step by
    step and report the same proposals."""
    batch = list(range(len(LENGTHS)))
    out = generate_batch(models[kind], [prompts[i] for i in batch], "eagle3", max_new_tokens=N, eos_token_ids=(),
                         ragged=ragged, **SETTINGS[setting])
    for i, row in zip(batch, out.rows):
        single = alone(kind, setting, i)
        assert row.tokens == single.tokens == greedy[i][:N], i
        assert row.accept_lengths == single.accept_lengths, i
        assert row.proposed == single.proposed, i
    if kind == "scripted":
        assert out.tau > 1.8            # drafts are accepted, so the acceptance check above has teeth
        steps = min(r.steps for r in out.rows)
        assert any(len({r.accept_lengths[s] for r in out.rows}) > 1 for s in range(steps))   # and ragged


def test_changing_one_prompt_never_changes_another_row(models, prompts):
    """Guards against leakage between rows: replacing prompt 3 (3 tokens) by a 150-token one must
    leave every other row's tokens and per-step acceptance unchanged."""
    m = models["scripted"]
    batch = [prompts[i] for i in range(len(LENGTHS))]
    swapped = list(batch)
    swapped[3] = prompts[len(LENGTHS)]
    a, b = (generate_batch(m, x, "eagle3", max_new_tokens=N, eos_token_ids=(), **SETTINGS["tree"])
            for x in (batch, swapped))
    assert a.rows[3].tokens != b.rows[3].tokens
    for i in (0, 1, 2, 4):
        assert (a.rows[i].tokens, a.rows[i].accept_lengths) == (b.rows[i].tokens, b.rows[i].accept_lengths)


@pytest.mark.parametrize("ragged", RAGGED_MODES)
def test_rows_stop_at_eos_or_length_at_different_steps(models, prompts, greedy, alone, ragged):
    """Guards against rows leaving the batch disturbing the others (drafter cache rows, root
    states or logits selected for the wrong rows) and rows overrunning or stopping early: with an
    EOS that ends some rows mid-run, every row equals its batch-1 run under that EOS."""
    batch = list(range(len(LENGTHS)))
    eos = None
    for t in greedy[2][4:N]:          # an EOS ending the long row mid-run, others elsewhere or never
        runs = [alone("scripted", "tree", i, eos_token_ids=(t,)) for i in batch]
        if len({r.steps for r in runs}) >= 3 and {r.finish_reason for r in runs} == {"eos", "length"}:
            eos = t
            break
    assert eos is not None, "no EOS token makes the rows finish at different steps"
    out = generate_batch(models["scripted"], [prompts[i] for i in batch], "eagle3", max_new_tokens=N,
                         eos_token_ids=(eos,), ragged=ragged, **SETTINGS["tree"])
    for i, row, single in zip(batch, out.rows, runs):
        assert (row.tokens, row.finish_reason, row.accept_lengths) == (single.tokens, single.finish_reason,
                                                                        single.accept_lengths), i
    assert out.active == [sum(r.steps > s for r in runs) for s in range(max(r.steps for r in runs))]


# -- the drafter's cache and the schedule ------------------------------------------------------------
@pytest.mark.parametrize("ragged", RAGGED_MODES)
def test_drafter_cache_equals_a_fresh_catch_up_after_every_step(models, prompts, ragged):
    """Guards against wrong compaction of the drafter's ragged cache: after the prefill and every
    step, each row's committed entries must be a fresh catch-up over its accepted tokens (stale
    draft entries, features of rejected nodes, another row's entries or shifted positions differ),
    also after rows leave the batch in another order."""
    m = models["scripted"]
    rows = [2, 0, 4, 1, 3]
    drafter = Eagle3BatchDrafter(m, Eagle3Options(**SETTINGS["tree"]))
    dec = BatchTreeDecoder(m, drafter, ragged=ragged)
    dec.prefill([prompts[i] for i in rows], N)
    check_drafter_cache(m, dec, drafter)
    lengths = []
    for step in range(5):
        lengths += [len(new) for new, _ in dec.step()]
        check_drafter_cache(m, dec, drafter)
        if step == 1:
            dec.keep_rows([3, 0, 4])
            check_drafter_cache(m, dec, drafter)
    assert max(lengths) > 2                               # multi-token paths were committed


def test_each_rows_drafts_equal_batch_one_drafting(backbone, prompts):
    """Guards against a wrong per-row drafting mask or position (a node seeing another node's draft
    entries, its row's stale slots past its committed entries, or another row's offset), which
    scripted drafts cannot show: with arbitrary drafts whose attention matters, every row's drafted
    tokens, parents, depths and scores equal batch-1 ``Eagle3Decoder._draft`` at the same point."""
    from inference.methods.eagle3 import Eagle3Decoder

    m = random_drafter(backbone, scale=0.1)
    o = Eagle3Options(**SETTINGS["tree"])
    drafter = Eagle3BatchDrafter(m, o)
    dec = BatchTreeDecoder(m, drafter)
    dec.prefill([prompts[i] for i in range(len(LENGTHS))], N)
    for step in range(3):
        with torch.inference_mode():
            drafter.catch_up_pending()   # as draft() does before growing (the prefill's entries wait)
            tok, score, parent, depth = drafter._grow(o)
        for b, seq in enumerate(dec.history):
            single = Eagle3Decoder(m, o)
            with torch.inference_mode():
                assert single.prefill(torch.tensor([seq[:-1]]), N) == seq[-1]
                t1, s1, p1, d1 = single._draft()
            assert torch.equal(tok[b], t1) and torch.equal(parent[b], p1) and torch.equal(depth[b], d1), (step, b)
            assert torch.allclose(score[b], s1, atol=1e-4), (step, b)
        dec.step()


@pytest.mark.parametrize("ragged", RAGGED_MODES)
def test_a_schedule_switching_between_settings_and_plain_steps_stays_identical(models, prompts, greedy, ragged):
    """Guards against a schedule ignored as rows leave, and against plain steps leaving the drafter
    behind (a plain step's root must be committed before the next draft, or it reads a stale cache): every
    step verifies the schedule's choice for its active rows, every row stays plain greedy, and the
    drafter's cache stays a fresh catch-up through tree -> plain -> chain steps."""
    m = models["scripted"]
    tree, chain = Eagle3Options(**SETTINGS["tree"]), Eagle3Options(**SETTINGS["chain"])
    drafter = Eagle3BatchDrafter(m, SpeculationSchedule({1: chain, 2: None, 8: tree}))
    assert (drafter.max_nodes, drafter.max_depth) == (tree.nodes + 1, tree.depth)
    rows = [0, 2, 4, 1]
    dec = BatchTreeDecoder(m, drafter, ragged=ragged)
    dec.prefill([prompts[i] for i in rows], N)
    accepted = {}
    for keep, choice in (([0, 1, 2, 3], tree), ([1, 3], None), ([0], chain)):
        dec.keep_rows(keep)
        for _ in range(2):
            steps = dec.step()
            assert dec.last_nodes == (choice.nodes + 1 if choice else 1)
            proposed = [p for _, p in steps]
            assert proposed == [0] * dec.batch if choice is None else min(proposed) > 0
            accepted.setdefault(choice and choice.label, []).extend(len(new) for new, _ in steps)
            for row, hist in zip(dec.rows, dec.history):
                i = rows[row]
                assert hist[len(prompts[i]):] == greedy[i][:len(hist) - len(prompts[i])], i
            check_drafter_cache(m, dec, drafter)
    assert set(accepted[None]) == {1} and max(accepted[chain.label]) > 1   # drafting resumed after plain


# -- sampling ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg", [SamplingConfig(mode="sample", temperature=1.0),
                                 SamplingConfig(mode="typical", temperature=0.8)], ids=["sample", "typical"])
def test_a_one_row_batch_samples_as_batch_one(small, cfg):  # noqa: F811
    """Guards against the batched verification of per-row trees taking another rule than batch 1
    (a vectorised verdict, another random stream, another bonus draw): a batch of one row with the
    same seed emits batch-1 eagle3's tokens, step for step."""
    sm, prompt, _ = small
    for seed in range(12):
        kw = dict(max_new_tokens=8, sampling=cfg, seed=seed, eos_token_ids=(), nodes=4, depth=2, topk=2)
        one = generate_batch(sm, [prompt], "eagle3", **kw).rows[0]
        single = generate(sm, prompt, "eagle3", **kw)
        assert (one.tokens, one.accept_lengths) == (single.tokens, single.accept_lengths), seed


def test_each_row_samples_exactly_the_backbone_distribution(small):  # noqa: F811
    """Guards against a biased batched sampler (a row verified against another row's tree or logits,
    a bonus drawn at the wrong node): the 2nd and 3rd tokens of 30 rows of the same prompt, beside
    rows of other prompts, must follow the backbone's own law (chi-square)."""
    sm, prompt, law = small
    cfg = SamplingConfig(mode="sample", temperature=1.0)
    batch = [prompt] * 30 + [[1, 2], [4, 4, 4, 4, 4, 4, 9, 3, 2]]
    counts = torch.zeros(144, dtype=torch.long)
    first_accepts = 0
    for seed in range(40):
        out = generate_batch(sm, batch, "eagle3", max_new_tokens=3, sampling=cfg, seed=seed, eos_token_ids=(),
                             nodes=4, depth=2, topk=2)
        for row in out.rows[:30]:
            counts[row.tokens[1] * 12 + row.tokens[2]] += 1
            first_accepts += row.accept_lengths[0] > 1
    assert 1200 // 4 < first_accepts < 1200 * 3 // 4    # accepted and rejected drafts both common
    assert chi_square_pvalue(counts, law) > 1e-3


# -- per-row trees of different sizes ------------------------------------------------------------------
class OracleTreesDrafter:
    """Row i verifies its own static tree ``trees[i]`` whose all-rank-0 path carries the row's greedy
    continuation (other ranks: decoys), so a narrower row's tree is padded in every step."""

    def __init__(self, m, trees, sequences):
        self.m, self.trees, self.seqs = m, trees, sequences
        self.max_nodes = max(t.num_nodes for t in trees)
        self.max_depth = max(t.max_depth for t in trees)

    def draft(self, dec):
        bufs, cand = [], []
        for b, hist in enumerate(dec.history):
            tree, seq = self.trees[dec.rows[b]], self.seqs[dec.rows[b]]
            at = len(hist) - 1
            toks = [seq[at + len(p)] if not any(p) else (seq[at + len(p)] + 1 + p[-1]) % 96 for p in tree.paths]
            bufs.append(tree.buffers(self.m.device))
            cand.append(toks)
        trees = RowTrees.stack(bufs)
        return trees, torch.tensor([c + [-1] * (trees.num_nodes - 1 - len(c)) for c in cand]), None

    def rows_kept(self, index):
        pass


@pytest.mark.parametrize("ragged", RAGGED_MODES)
def test_narrower_rows_pad_with_nodes_never_accepted(backbone, prompts, greedy, ragged):
    """Guards against the padding of per-row trees leaking: a row whose tree is narrower than the
    widest row's gets padding nodes (token -1) that must never be accepted, kept in the cache or
    seen by its real nodes; every row then accepts its own tree's full rank-0 path each step and
    stays plain greedy."""
    m = wrap(backbone, None)
    trees = [default_tree(t, 4) for t in ("chain3", "tree8", "chain2")]
    rows = [0, 2, 1]
    seqs = [prompts[i] + greedy[i] for i in rows]
    dec = BatchTreeDecoder(m, OracleTreesDrafter(m, trees, seqs), ragged=ragged)
    out = run_batch(dec, m, [prompts[i] for i in rows], 20, eos_token_ids=())
    assert out.speculation[0] == trees[1].num_nodes > trees[0].num_nodes
    for row, tree, i in zip(out.rows, trees, rows):
        assert row.tokens == greedy[i][:20]
        assert row.accept_lengths[:-1] == [tree.max_depth + 1] * (len(row.accept_lengths) - 1)


# -- the method --------------------------------------------------------------------------------------
def test_generate_batch_runs_eagle3_and_refuses_what_batch_one_refuses(models, backbone, prompts, greedy):
    """Guards against eagle3 missing from the batched methods, eagle_nodes=0 (or a schedule that is
    plain at every batch size) not being the plain loop, and batches accepting what batch 1 refuses
    (the old eagle_tree option, now the choice key's; draft=sampled, Medusa heads, impossible schedules), each in
    one line."""
    m = models["random"]
    assert "eagle3" in batched_names()
    out = generate_batch(m, prompts[:3], "eagle3", max_new_tokens=6, eos_token_ids=(), nodes=0)
    assert [r.tokens for r in out.rows] == [g[:6] for g in greedy[:3]] and set(out.speculation) == {1}
    out = generate_batch(m, prompts[:3], "eagle3", max_new_tokens=6, eos_token_ids=(),
                         schedule=SpeculationSchedule({1: None, 4: None}))
    assert [r.tokens for r in out.rows] == [g[:6] for g in greedy[:3]] and set(out.speculation) == {1}
    medusa = wrap(backbone, random_heads(backbone, num_heads=2))
    for call, match in (
            (lambda: generate_batch(m, prompts[:2], "eagle3", tree="auto"), "method eagle3 has no option 'tree'"),
            (lambda: generate_batch(m, prompts[:2], "eagle3", sampling=SamplingConfig(mode="sample", draft="sampled")),
             "draft=sampled"),
            (lambda: generate_batch(m, prompts[:2], "eagle3", topk=200), "eagle_topk must be an integer in 1..64"),
            (lambda: generate_batch(medusa, prompts[:2], "eagle3"), "needs EAGLE-3 heads"),
            (lambda: Eagle3BatchDrafter(m, SpeculationSchedule({1: None, 4: None})), "at least one eagle3 setting"),
            (lambda: Eagle3BatchDrafter(m, SpeculationSchedule({1: Eagle3Options(nodes=0), 4: Eagle3Options()})),
             "a schedule says so with None"),
            (lambda: Eagle3BatchDrafter(m, SpeculationSchedule({1: default_tree("tree8", 2)})),
             "holds eagle3 options or None")):
        with pytest.raises(UserError, match=match) as err:
            call()
        assert "\n" not in str(err.value)


# -- its setting per batch size ----------------------------------------------------------------------
GRID = ((2, 2, 1), (4, 3, 2))


def test_the_rule_picks_a_setting_per_batch_size_and_falls_back_to_plain(models, prompts, monkeypatch):
    """Guards against: eagle3 sized with one setting at every batch size (the tree that pays at batch 1
    kept where every node is a row of compute), expected tau not measured by decoding each setting,
    or no plain decoding where nothing pays. Step times are controlled: a setting of n nodes costs
    (1 + n x slope) plain steps, the slope growing with the batch."""
    from inference.methods import eagle3_choice as batch_sizing
    from inference.methods.eagle3_choice import measure_eagle3_tau
    from inference.runtime import sizing as runtime_sizing
    from inference.runtime.race import PLAIN

    slope = {1: 0.0, 8: 1.0}

    def fake_race(taus, timer, *, what, **kw):
        b = int(what.rsplit(" ", 1)[1])
        step = {PLAIN: 0.01, **{n: 0.01 * (1 + slope[b] * int(n.split("-")[0][1:])) for n in taus}}
        return step, {n: {"step_ms": s * 1e3} for n, s in step.items()}, {"rounds": 1}

    monkeypatch.setattr(runtime_sizing, "race", fake_race)
    m = models["scripted"]
    sizing, record = batch_sizing.choose_eagle3_schedule(m, prompts[:2], prompts[:3], [8, 1], grid=GRID,
                                                         calibration_tokens=12, log=lambda s: None)
    taus = record["measured_tau"]
    assert taus["n4-d3-k2"] == pytest.approx(measure_eagle3_tau(m, prompts[:2], (4, 3, 2), max_new_tokens=12), abs=1e-4)
    best = max(taus, key=taus.get)
    assert taus[best] > 1.0 and sizing.schedule.choices[1].label == best
    assert sizing.schedule.choices[8] is None and sizing.table[8]["winner"] == "plain"


def test_measured_eagle3_schedule_drives_the_batched_decoder(models, prompts, greedy):
    """Guards against: the real timer failing with eagle3 (a drafter whose cache must see every step,
    shared by the candidates, prefilled with the batch's features), or the decoder then not verifying
    with the winners by number of active rows; rows stay identical to greedy."""
    from inference.methods import eagle3_choice as batch_sizing

    m = models["scripted"]
    sizing, _ = batch_sizing.choose_eagle3_schedule(m, prompts[:1], prompts[:3], [1, 4], grid=GRID,
                                                    calibration_tokens=8, latency_steps=2, warmup=1, min_rounds=1,
                                                    max_rounds=1, log=lambda s: None)
    sched = sizing.schedule
    assert set(sched.choices) == {1, 4}
    out = generate_batch(m, prompts[:4], "eagle3", max_new_tokens=N, eos_token_ids=(), schedule=sched)
    assert [r.tokens for r in out.rows] == [g[:N] for g in greedy[:4]]
    first = sched.choices[4]
    assert out.speculation[0] == (first.nodes + 1 if first is not None else 1)


def test_batched_eval_sizes_eagle3_when_its_tree_is_auto(models, prompts, greedy, monkeypatch):
    """Guards against: medusa-eval with batch sizes refusing or ignoring choice=auto (one setting
    everywhere), the calibration prompts not held out, or the sized schedule not being the one the
    batches decode with and the report records."""
    from inference.evaluation import batch_eval
    from inference.prompts import Prompt
    from inference.methods import eagle3_choice
    from inference.runtime.sizing import BatchSizing

    calls = []

    def fake(m, *, method, calibration, latency_prompts, batch_sizes, **kw):
        assert method == "eagle3"
        calls.append((len(calibration), len(latency_prompts), list(batch_sizes)))
        sched = SpeculationSchedule({1: Eagle3Options(**SETTINGS["chain"]), 2: None})
        return BatchSizing(sched, {1: {"winner": "n3-d3-k1"}, 2: {"winner": "plain"}}), {"measured_tau": {}}

    monkeypatch.setattr(eagle3_choice, "choose_eagle3_schedule", fake)
    m = models["scripted"]
    monkeypatch.setattr(type(m), "encode_chat", lambda self, text: prompts[int(text)])
    items = [Prompt(id=str(i), turns=[str(i)]) for i in range(5)]
    r = batch_eval.evaluate_batched(m, items, methods=["eagle3"], batch_sizes=[2], max_new_tokens=8,
                                    calibration_prompts=2, progress=False, log=lambda s: None,
                                    options={"eagle3": Eagle3Options()}, choice="auto")
    b = r["batched"]
    assert calls == [(2, 2, [1, 2])]   # steps timed on the 2 calibration prompts, not the 3 evaluated
    assert b["speculation"]["eagle3"]["schedule"] == {"1": "n3-d3-k1", "2": "plain"}
    assert b["per_batch_size"]["2"]["speculation"]["eagle3"] == "plain"
    row = b["per_batch_size"]["2"]["per_method"]["eagle3"]
    assert row["greedy_identical"] is True and row["tau"] > 1.0   # the last row alone drafts (batch 1)
    calls.clear()
    r = batch_eval.evaluate_batched(m, items, methods=["eagle3"], batch_sizes=[2], max_new_tokens=8,
                                    progress=False, log=lambda s: None, choice="fixed",
                                    options={"eagle3": Eagle3Options(**SETTINGS["chain"])})
    b = r["batched"]
    assert not calls and b["num_prompts"] == 5                    # fixed: nothing sized, nothing held out
    assert b["speculation"]["eagle3"] == {"tree": "fixed", "schedule": {"2": "n3-d3-k1"}, "sizing": None}
    assert b["per_batch_size"]["2"]["speculation"]["eagle3"] == "n3-d3-k1"
    assert b["per_batch_size"]["2"]["per_method"]["eagle3"]["greedy_identical"] is True


@pytest.mark.parametrize("ragged", ["compact", "gaps"])
def test_memory_estimate_of_the_drafter_cache_is_what_it_allocates(models, prompts, ragged):
    """Guards against: the batch memory check (estimate first, refuse in one line) under-counting the
    EAGLE-3 drafter's own cache: the estimate must be the bytes its keys and values take once allocated,
    also with ragged=gaps, whose backbone cache (up to depth + 1 slots per token) once sized the drafter's."""
    m = models["random"]
    dec = registry_decoder(m, ragged)
    lengths = [len(p) for p in prompts[:3]]
    with torch.inference_mode():
        dec.prefill([list(p) for p in prompts[:3]], 20)
        dec.drafter.catch_up_pending()
    kv = dec.drafter.dkv
    allocated = (kv.k.numel() + kv.v.numel()) * kv.k.element_size()
    assert dec.drafter.cache_bytes(lengths, 20) == allocated > 0


def test_the_memory_check_counts_the_prompts_catch_up(models, prompts, monkeypatch):
    """Guards against a batch passing the memory check and then running out of memory in the drafter's first
    call over the prompts (their tapped features, the padded copy it reads and its mask over the drafter cache:
    ~3.5 GiB at 32 prompts of 2,000 tokens, Llama-3.1-8B's shape), which the check left out."""
    from inference.runtime import batch_decode

    m = models["random"]
    dec = registry_decoder(m)
    rows = [list(p) for p in prompts[:3]]
    lengths = [len(r) for r in rows]
    counted = (batch_decode.batch_cache_bytes(m, lengths, 20, dec.drafter.max_nodes, dec.ragged,
                                              dec.drafter.max_depth) + dec.drafter.cache_bytes(lengths, 20))
    extra = dec.drafter.prompt_bytes(lengths, 20)
    assert extra > 0
    monkeypatch.setattr(batch_decode, "free_memory_bytes", lambda device: int((counted + extra / 2) / 0.9))
    with pytest.raises(UserError, match="lower batch_size"):
        run_batch(dec, m, rows, 20)


def registry_decoder(m, ragged="compact"):
    from inference.methods.registry import get, make_options

    return get("eagle3").batch_decoder(m, make_options("eagle3", None, **SETTINGS["tree"]), None, None, ragged)


def test_plain_steps_run_no_drafter_call(models, prompts, greedy):
    """Guards against: a schedule that says plain (large batches) still paying the drafter's layer and
    projection every step, which makes "speculation off" slower than the plain batched loop; the
    roots of those steps are committed in one call when drafting resumes, and the rows stay greedy."""
    m = models["scripted"]
    o = Eagle3Options(**SETTINGS["tree"])
    drafter = Eagle3BatchDrafter(m, SpeculationSchedule({1: o, 2: None}, switch_gain=0.0))
    dec = BatchTreeDecoder(m, drafter)
    calls = []
    real = type(m.heads).forward_step

    def counted(self, *a, **k):
        calls.append(a[0].shape)
        return real(self, *a, **k)

    with torch.inference_mode():
        dec.prefill([prompts[0], prompts[2]], N)
        type(m.heads).forward_step = counted
        try:
            for _ in range(4):
                dec.step()
            assert calls == []                                 # prefill and 4 plain steps: nothing drafted
            dec.keep_rows([1])
            dec.step()
        finally:
            type(m.heads).forward_step = real
    assert len(calls) == 1 + (o.depth - 1) + 1                 # pending commit, expansions, the step's catch-up
    assert calls[0][1] == len(prompts[2]) + 4                  # the prompt and the 4 plain steps' roots at once
    assert dec.history[0][len(prompts[2]):] == greedy[2][:len(dec.history[0]) - len(prompts[2])]
