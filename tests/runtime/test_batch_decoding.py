"""Batched speculative decoding (runtime/batch_cache.py, batch_decode.py, verify.verify_rows,
``generate_batch``) on tiny random Llamas.

The reference for every greedy row is its own batch-1 decoding: a batch must be nothing but
several independent generations run together. Stub heads (``RowOracleHeads``) know each row's
greedy continuation and guess right or wrong by a per-row rule, so acceptance lengths differ
between rows and steps (what makes the ragged cache ragged) and can be forced exactly.
"""

from __future__ import annotations

import types

import pytest
import torch

import inference.runtime.batch_decode as batch_decode
from inference.errors import UserError
from inference.heads.drafting import IndependentDrafting
from inference.heads.medusa import MedusaHeads
from inference.heads.registry import init_heads
from inference.heads.spec import HeadsSpec
from inference.methods import generate
from inference.methods.medusa import HeadsDrafter
from inference.methods.registry import generate_batch
from inference.runtime.batch_cache import RAGGED_MODES
from inference.runtime.batch_decode import BatchTreeDecoder, PlainDrafter, check_batch_size, run_batch
from inference.runtime.speculation import SpeculationSchedule
from inference.runtime.tree import MedusaTree, default_tree
from inference.runtime.verify import SamplingConfig, filter_probs

from runtime_support import one_thread, random_heads, tiny_llama, wrap  # noqa: F401 (autouse fixture)
from test_runtime_sampling import chi_square_pvalue as sampling_chi_square

V = 96
N = 24                     # new tokens per row
NUM_HEADS = 3
# Prompt lengths, from 1 to 1000 tokens. Prompt 0 is the "all-accept" and prompt 1 the "all-reject"
# sequence of ``mixed_rule``; the base batch is prompts 0-5; prompts 6 and 7 only replace one of
# them (the leakage test).
LENGTHS = (555, 1, 1000, 2, 17, 130, 700, 3)
BASE = list(range(6))
TREES = ["tree8", "chain3"]


# -- stub heads ----------------------------------------------------------------------------------
class RowOracleHeads(IndependentDrafting, torch.nn.Module):
    """Stub heads that know every sequence's greedy continuation and guess it right or wrong by rule.

    ``sequences[s]`` is prompt + greedy continuation of sequence s; the hidden state a head is
    given is matched (nearest neighbour) to a position t of one sequence among the hidden states
    of all of them, so the same heads serve every row of a batch and batch-1 runs alike. Head k
    then ranks the token at t + k + 2 first, or (when ``wrong(s, t, k)``) ranks it last, so that
    none of its top-k guesses is right.
    """

    def __init__(self, model, sequences: list[list[int]], wrong):
        super().__init__()
        self.spec = types.SimpleNamespace(num_heads=NUM_HEADS, output_size=V)
        self.seqs, self.wrong = sequences, wrong
        with torch.no_grad():
            states = [model.model(input_ids=torch.tensor([s])).last_hidden_state[0] for s in sequences]
        self.reference = torch.cat(states)
        self.where = [(s, t) for s, seq in enumerate(sequences) for t in range(len(seq))]

    def head_logits(self, hidden, k):
        flat = hidden.reshape(-1, hidden.shape[-1])
        out = torch.zeros(flat.shape[0], V)
        for i, j in enumerate(torch.cdist(flat, self.reference).argmin(-1).tolist()):
            s, t = self.where[j]
            if t + k + 2 < len(self.seqs[s]):
                tok = self.seqs[s][t + k + 2]
                out[i, tok] = -10.0 if self.wrong(s, t, k) else 10.0
        return out.reshape(*hidden.shape[:-1], V)

    def to_vocab_ids(self, ids):
        return ids


def mixed_rule(s: int, t: int, k: int) -> bool:
    """Sequence 0 is always guessed right, sequence 1 always wrong, the others wrong at a rate
    that differs between sequences (20%, 40% or 60% by s % 3) in a position-dependent pattern."""
    if s in (0, 1):
        return s == 1
    return (t * 31 + k * 7 + s * 13) % 5 <= s % 3


# -- fixtures --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab=V, seed=0, max_positions=2048)


@pytest.fixture(scope="module")
def plain(model):
    return wrap(model, None)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, V, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def refs(plain, prompts):
    """Each prompt's batch-1 greedy continuation, long enough for the oracle beyond N tokens."""
    return [generate(plain, p, "autoregressive", max_new_tokens=N + 8, eos_token_ids=()).tokens for p in prompts]


@pytest.fixture(scope="module")
def m(model, prompts, refs):
    """The backbone with RowOracleHeads over every prompt (mixed_rule)."""
    return wrap(model, RowOracleHeads(model, [p + r for p, r in zip(prompts, refs)], mixed_rule))


def _batch1(m, prompt, tree, **kw):
    """Batch-1 Medusa decoding of one prompt (no EOS unless given): the reference of a batch row."""
    return generate(m, prompt, "medusa", tree=tree, eos_token_ids=kw.pop("eos_token_ids", ()), **kw)


# -- 1. identity with batch 1 ------------------------------------------------------------------
def test_the_oracle_heads_make_acceptance_ragged(m, prompts):
    """Guards against an identity test without power: if every row accepted the same number of
    tokens each step, the ragged cache (per-row offsets, gaps) would never be exercised."""
    out = generate_batch(m, [prompts[i] for i in BASE], "medusa", tree="tree8", max_new_tokens=N, eos_token_ids=())
    steps = min(r.steps for r in out.rows) - 1   # the last step of a row may be cut at the budget
    per_step = list(zip(*[r.accept_lengths[:steps] for r in out.rows]))
    assert all(step[0] == 3 and step[1] == 1 for step in per_step), per_step   # the forced rows
    assert all(len(set(r.accept_lengths)) >= 2 for r in out.rows[2:]), per_step
    assert sum(len(set(step[2:])) >= 2 for step in per_step) >= steps // 2, per_step
    assert out.tau > 1.4


@pytest.mark.parametrize("ragged", RAGGED_MODES)
@pytest.mark.parametrize("tree", TREES)
def test_every_row_is_token_identical_to_batch_one(m, prompts, refs, tree, ragged):
    """Guards against any cross-row or padding error of the batch (masks, position ids, per-row
    cache offsets, per-row verification): with prompts from 1 to 1000 tokens in one batch, each
    row must equal batch-1 greedy decoding, the plain batched loop and batch-1 Medusa's steps."""
    batch = [prompts[i] for i in BASE]
    out = generate_batch(m, batch, "medusa", tree=tree, max_new_tokens=N, eos_token_ids=(), ragged=ragged)
    loop = generate_batch(m, batch, "autoregressive", max_new_tokens=N, eos_token_ids=(), ragged=ragged)
    for i, row, plain_row in zip(BASE, out.rows, loop.rows):
        assert row.tokens == refs[i][:N] == plain_row.tokens, f"row {i} (prompt of {LENGTHS[i]} tokens)"
        assert row.finish_reason == plain_row.finish_reason == "length"
        assert row.prompt_tokens == LENGTHS[i]
        assert row.accept_lengths == _batch1(m, prompts[i], tree, max_new_tokens=N).accept_lengths, f"row {i}"
    assert plain_row.accept_lengths == [1] * (N - 1) and loop.speculation == [1] * (N - 1)
    assert out.speculation == [default_tree(tree, NUM_HEADS).num_nodes] * len(out.active)


@pytest.mark.parametrize("projection", ["own", "truncated", "shared"])
def test_real_medusa_heads_batch_identically(model, prompts, refs, projection):
    """Guards against batching only working with stub heads: random MedusaHeads (real blocks and
    projections, a truncated vocabulary's token map, run on [B, H] hidden states) must give every
    row its batch-1 output."""
    mm = wrap(model, random_heads(model, num_heads=NUM_HEADS, seed=3, projection=projection,
                                  truncated=40 if projection == "truncated" else None))
    batch = [prompts[i] for i in (1, 3, 4, 5)]
    out = generate_batch(mm, batch, "medusa", tree="tree16", max_new_tokens=N, eos_token_ids=(), ragged="gaps")
    for i, row in zip((1, 3, 4, 5), out.rows):
        assert row.tokens == refs[i][:N]
        assert row.accept_lengths == _batch1(mm, prompts[i], "tree16", max_new_tokens=N).accept_lengths


# -- 2. forced acceptance per row ----------------------------------------------------------------
@pytest.mark.parametrize("ragged", RAGGED_MODES)
@pytest.mark.parametrize("tree", TREES)
def test_all_accept_and_all_reject_rows_in_one_batch(m, prompts, refs, tree, ragged):
    """Guards against a row's acceptance leaking into another's (one shared path, the batch's
    longest or shortest acceptance applied to every row) and against full paths being cut."""
    depth = default_tree(tree, NUM_HEADS).max_depth
    batch = [prompts[0], prompts[1], prompts[4]]          # all accept, all reject, mixed
    out = generate_batch(m, batch, "medusa", tree=tree, max_new_tokens=N, eos_token_ids=(), ragged=ragged)
    accept, reject, mixed = out.rows
    assert accept.accept_lengths[:-1] == [depth + 1] * ((N - 2) // (depth + 1))   # the last step: cut at N
    assert sum(accept.accept_lengths) == N - 1
    assert reject.accept_lengths == [1] * (N - 1)
    assert mixed.accept_lengths == _batch1(m, prompts[4], tree, max_new_tokens=N).accept_lengths
    assert len(set(mixed.accept_lengths)) > 1
    for i, row in zip((0, 1, 4), out.rows):
        assert row.tokens == refs[i][:N] and len(row.tokens) == N
    steps = [r.steps for r in out.rows]
    assert out.active == [sum(s > t for s in steps) for t in range(N - 1)] and out.active[0] == 3


# -- 3. no leakage ---------------------------------------------------------------------------------
@pytest.mark.parametrize("ragged", RAGGED_MODES)
def test_changing_one_prompt_never_changes_another_row(m, prompts, refs, ragged):
    """Guards against leakage between rows: replacing prompt j (different length and content,
    longer and shorter than the others) must leave every other row's tokens and steps as they were."""
    j = 2
    runs = []
    for replacement in (j, 6, 7):                          # 1000, 700 and 3 tokens at row j
        batch = [prompts[i] for i in BASE]
        batch[j] = prompts[replacement]
        out = generate_batch(m, batch, "medusa", tree="tree8", max_new_tokens=N, eos_token_ids=(), ragged=ragged)
        assert out.rows[j].tokens == refs[replacement][:N]
        runs.append([(r.tokens, r.accept_lengths) for i, r in enumerate(out.rows) if i != j])
    assert runs[0] == runs[1] == runs[2]


# -- 4. the ragged cache after every step ----------------------------------------------------------
def _fresh(m, tokens):
    """Keys/values of every layer and the last hidden state of one batch-1 forward over ``tokens``."""
    cache = m.new_cache(len(tokens))
    with torch.inference_mode():
        h = m.hidden(torch.tensor([tokens]), torch.arange(len(tokens))[None], cache)[0, -1]
    return [(layer.keys[0], layer.values[0]) for layer in cache.layers], h


def _check_rows(dec: BatchTreeDecoder, m, prompts, refs, caller: list[int]):
    """Every active row b against a fresh forward; ``caller[dec.rows[b]]`` is its index in ``prompts``."""
    cache = dec.cache
    assert cache.batch == dec.batch == len(dec.rows)
    for b in range(dec.batch):
        row = caller[dec.rows[b]]
        hist = dec.history[b]
        assert hist == prompts[row] + refs[row][:len(hist) - len(prompts[row])], f"row {row}"
        kept = hist[:-1]                                      # everything but the current root
        assert int(cache.positions[b]) == len(kept) == int(cache.valid[b].sum())
        if cache.mode == "compact":                           # rows packed: slot = position
            assert int(cache.lengths[b]) == len(kept)
        else:                                                 # every row writes at one offset
            assert int(cache.lengths[b]) == int(cache.lengths.max()) >= len(kept)
        layers, h = _fresh(m, kept)
        for layer, (k_ref, v_ref) in enumerate(layers):
            k, v = cache.row_entries(b, layer)
            torch.testing.assert_close(k, k_ref, atol=1e-5, rtol=0, msg=f"row {row} layer {layer} keys")
            torch.testing.assert_close(v, v_ref, atol=1e-5, rtol=0, msg=f"row {row} layer {layer} values")
        torch.testing.assert_close(dec.h_last[b], h, atol=1e-5, rtol=0)
        torch.testing.assert_close(m.logits(dec.h_last[b]), m.logits(h), atol=1e-5, rtol=0)
        assert int(dec.root[b]) == hist[-1] == int(m.logits(h).argmax())


@pytest.mark.parametrize("ragged", RAGGED_MODES)
def test_cache_rows_equal_a_fresh_prefill_after_every_step(m, prompts, refs, ragged):
    """Guards against stale, misplaced or missing cache entries per row (a path kept at another
    row's offset, a gap left visible, pads attended to, rows mixed up when rows leave the batch):
    after each step every row's attended entries must be a fresh prefill of its accepted tokens."""
    rows = [1, 0, 3, 5, 4]                                  # 1, 555, 2, 130, 17 tokens
    dec = BatchTreeDecoder(m, HeadsDrafter(m, "tree8"), ragged=ragged)
    dec.prefill([prompts[i] for i in rows], max_new_tokens=N)
    _check_rows(dec, m, prompts, refs, rows)
    for step in range(5):
        dec.step()
        _check_rows(dec, m, prompts, refs, rows)
        if step == 1:
            dec.keep_rows([3, 0, 4])                        # rows leave, the rest change order
            assert dec.rows == [3, 0, 4]
            _check_rows(dec, m, prompts, refs, rows)


# -- 5. EOS and lengths ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def eos_case(m, prompts, refs):
    """A batch and an EOS set where one row stops at its first token, the all-accept row stops on
    an EOS in the middle of an accepted chunk (tokens after it must be cut), and some row runs to
    max_new_tokens; with each row's batch-1 result under that EOS set."""
    depth = default_tree("chain3", NUM_HEADS).max_depth
    batch = [0, 1, 2, 3, 5]
    first = refs[1][0]                                      # row 1 (1-token prompt) stops at prefill
    mid = next(refs[0][i] for i in range(2, N) if (i - 1) % (depth + 1) != depth and refs[0][i] not in refs[0][:i]
               and refs[0][i] != first)
    eos = [first, mid]
    single = {i: _batch1(m, prompts[i], "chain3", max_new_tokens=N, eos_token_ids=eos) for i in batch}
    reasons = [single[i].finish_reason for i in batch]
    assert single[1].tokens == [first] and single[1].steps == 0
    assert single[0].tokens[-1] == mid and single[0].finish_reason == "eos"
    assert "length" in reasons and len({single[i].steps for i in batch}) >= 3
    return batch, eos, single


@pytest.mark.parametrize("ragged", RAGGED_MODES)
def test_rows_stop_at_eos_or_length_and_leave_the_batch(m, prompts, refs, eos_case, ragged):
    """Guards against rows overrunning EOS (tokens of the same accepted chunk after it), stopping
    late or early, wrong finish reasons, finished rows kept in the batch, and the remaining rows
    being disturbed when others leave."""
    batch, eos, single = eos_case
    out = generate_batch(m, [prompts[i] for i in batch], "medusa", tree="chain3", max_new_tokens=N,
                         eos_token_ids=eos, ragged=ragged)
    for i, row in zip(batch, out.rows):
        s = single[i]
        assert (row.tokens, row.finish_reason, row.accept_lengths) == (s.tokens, s.finish_reason, s.accept_lengths)
        if s.finish_reason == "eos":
            assert row.tokens[-1] in eos and not set(row.tokens[:-1]) & set(eos)
        else:
            assert len(row.tokens) == N and row.tokens == refs[i][:N]
    steps = [single[i].steps for i in batch]
    assert out.active == [sum(s > t for s in steps) for t in range(max(steps))]
    assert out.active[0] == len(batch) - 1                  # the row done at prefill never steps
    limited = generate_batch(m, [prompts[i] for i in batch], "medusa", tree="chain3", max_new_tokens=N,
                             eos_token_ids=eos, ragged=ragged, max_steps=2)
    for i, row in zip(batch, limited.rows):
        done_early = single[i].steps <= 2
        assert row.finish_reason == (single[i].finish_reason if done_early else "steps")
        assert row.tokens == single[i].tokens[:len(row.tokens)] and row.steps == min(2, single[i].steps)


@pytest.mark.parametrize("ragged", RAGGED_MODES)
def test_a_batch_done_at_prefill_and_a_tensor_batch(m, prompts, refs, ragged):
    """Guards against a batch whose rows all stop on their first token stepping anyway (or failing
    on an empty batch), and against a [B, L] tensor of prompts decoding differently from lists."""
    batch = [prompts[i] for i in (3, 5, 0)]
    out = generate_batch(m, batch, "medusa", tree="tree8", max_new_tokens=N, ragged=ragged,
                         eos_token_ids=[refs[i][0] for i in (3, 5, 0)])
    assert out.active == [] and [(r.tokens, r.finish_reason) for r in out.rows] == [
        ([refs[i][0]], "eos") for i in (3, 5, 0)]
    same = torch.tensor([prompts[5][:40], prompts[5][40:80], prompts[0][:40]])
    out = generate_batch(m, same, "medusa", tree="tree8", max_new_tokens=8, eos_token_ids=(), ragged=ragged)
    for ids, row in zip(same.tolist(), out.rows):
        assert row.tokens == generate(m, ids, "autoregressive", max_new_tokens=8, eos_token_ids=()).tokens


# -- 6. exact sampling per row ---------------------------------------------------------------------
SV = 12
SAMPLE_PROMPTS = [[3, 7, 1, 5], [4], [9, 4, 4, 0, 11, 6, 8, 1, 10]]
SAMPLE_TREE = MedusaTree([[0], [1], [2], [0, 0], [0, 1], [1, 0]])


@pytest.fixture(scope="module")
def sampling_setup():
    """A peaky 12-token Llama with fresh Medusa heads (whose guesses are often right), and the exact
    law of the first two generated tokens of each sample prompt (filtered by each config)."""
    model = tiny_llama(vocab=SV, hidden=32, init=0.35, seed=5)
    spec = HeadsSpec(num_heads=2, num_layers=1, hidden_size=32, vocab_size=SV)
    mm = wrap(model, MedusaHeads.from_lm_head(spec, model.lm_head.weight))
    logits = {}
    with torch.inference_mode():
        for b, p in enumerate(SAMPLE_PROMPTS):
            ids = torch.tensor([p + [y] for y in range(SV)])
            out = model(input_ids=ids).logits
            logits[b] = (out[0, len(p) - 1], out[:, len(p)])           # [V], [V(y1), V]
    return mm, logits


def _law(logits, cfg, b):
    first, second = logits[b]
    f = lambda x: filter_probs(x, cfg.temperature, cfg.top_k, cfg.top_p)
    return (f(first)[:, None] * f(second)).reshape(-1)                  # p(y1) p(y2 | y1)


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """test_runtime_sampling's chi-square, with a draw of zero probability under ``probs`` as p = 0
    (comparing against a neighbouring prompt's law must fail, not stop the test)."""
    try:
        return sampling_chi_square(counts, probs)
    except AssertionError:
        return 0.0


@pytest.mark.parametrize("cfg, ragged", [
    (SamplingConfig(mode="sample", temperature=1.0, draft="topk"), "compact"),
    (SamplingConfig(mode="sample", temperature=0.9, top_k=8, top_p=0.95, draft="sampled"), "gaps"),
], ids=["topk-compact", "sampled-filtered-gaps"])
def test_each_row_samples_exactly_its_own_distribution(sampling_setup, cfg, ragged):
    """Guards against per-row sampling bias in the batch (a row verified against another row's
    target, draws or draft probs shared across rows, a biased batched acceptance rule): the first
    two tokens of each row (prefill token, then the first verification step) must follow that row's
    own backbone law. Rows cycle through three prompts of different lengths, so a mix-up of rows
    is a change of law; comparing with a neighbour's law must fail (the test has power)."""
    mm, logits = sampling_setup
    copies, seeds = 100, 10
    batch = SAMPLE_PROMPTS * copies                         # row r decodes prompt r % 3
    counts = torch.zeros(len(SAMPLE_PROMPTS), SV * SV, dtype=torch.long)
    first_step = []
    for seed in range(seeds):
        # 4 tokens: the first step may emit 3 (what it accepted shows); the law is checked on the first two
        out = generate_batch(mm, batch, "medusa", tree=SAMPLE_TREE, max_new_tokens=4, sampling=cfg, seed=seed,
                             eos_token_ids=(), ragged=ragged)
        for r, row in enumerate(out.rows):
            counts[r % 3, row.tokens[0] * SV + row.tokens[1]] += 1
            first_step.append(row.accept_lengths[0])
    share = torch.bincount(torch.tensor(first_step), minlength=4)[1:].float() / len(first_step)
    assert (share[:2] > 0.05).all(), share                  # 0 and >= 1 accepted drafts both common
    for b in range(len(SAMPLE_PROMPTS)):
        assert chi_square_pvalue(counts[b], _law(logits, cfg, b)) > 1e-3, f"prompt {b}"
        assert chi_square_pvalue(counts[b], _law(logits, cfg, (b + 1) % 3)) < 1e-6, f"prompt {b} vs its neighbour"


# -- 7. dependent heads ------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["hydra", "mlp_speculator"])
def test_dependent_heads_batch_identically(model, prompts, refs, kind):
    """Guards against dependent drafting mixing rows (a row's path fed another row's tokens or
    state when ``draft_dependent`` runs with a batch dimension): rows equal batch 1, steps included.
    Heads fresh from the backbone (as each family initialises them) get some drafts accepted, so a
    row drafted from another row's path shows in its acceptance lengths."""
    spec = HeadsSpec(num_heads=NUM_HEADS, num_layers=1, hidden_size=model.config.hidden_size, vocab_size=V,
                     kind=kind, base_model="random:llama")
    mm = wrap(model, init_heads(spec, model.lm_head.weight, model.get_input_embeddings().weight))
    rows = [1, 3, 4, 5, 0]
    for tree, ragged in (("tree8", "compact"), ("chain3", "gaps")):
        out = generate_batch(mm, [prompts[i] for i in rows], "medusa", tree=tree, max_new_tokens=N,
                             eos_token_ids=(), ragged=ragged)
        for i, row in zip(rows, out.rows):
            assert row.tokens == refs[i][:N], f"{kind} {tree} row {i}"
            assert row.accept_lengths == _batch1(mm, prompts[i], tree, max_new_tokens=N).accept_lengths
        assert out.tau > 1.05                               # drafts do get accepted


def test_plain_batches_ignore_what_the_heads_cannot_draft(model, prompts):
    """Guards against the plain batched loop refusing a sampling setting because of heads it never
    uses (batch-1 autoregressive decodes it), while a method that drafts with them still refuses."""
    spec = HeadsSpec(num_heads=NUM_HEADS, num_layers=1, hidden_size=model.config.hidden_size, vocab_size=V,
                     kind="hydra", base_model="random:llama")
    mm = wrap(model, init_heads(spec, model.lm_head.weight, model.get_input_embeddings().weight))
    sampled = SamplingConfig(mode="sample", draft="sampled")
    batch = [prompts[i] for i in (1, 3, 4)]
    for method, opts in (("autoregressive", {}), ("medusa", {"tree": None})):
        out = generate_batch(mm, batch, method, max_new_tokens=5, sampling=sampled, seed=0, eos_token_ids=(), **opts)
        assert [len(r.tokens) for r in out.rows] == [5, 5, 5] and out.speculation == [1] * 4
    with pytest.raises(UserError, match="draft=sampled is not available for dependent"):
        generate_batch(mm, batch, "medusa", tree="tree8", max_new_tokens=5, sampling=sampled, seed=0)


# -- 8. speculation schedule ---------------------------------------------------------------------------
def test_schedule_bucket_is_the_next_larger_measured_size():
    """Guards against a count between measured sizes using the smaller size's choice (whose step
    times underestimate the larger batch) and against counts past the largest size failing."""
    a, b, c = (MedusaTree([[0]], name="a"), MedusaTree([[0], [1]], name="b"), MedusaTree([[0], [0, 0]], name="c"))
    s = SpeculationSchedule({1: a, 4: b, 16: c})
    assert [s.bucket(n) for n in (1, 2, 3, 4, 5, 16, 17, 64)] == [1, 4, 4, 4, 16, 16, 16, 16]
    assert [s.choose(n, None, False) for n in (1, 3, 9, 40)] == [a, b, c, c]


def test_schedule_hysteresis_needs_switch_gain():
    """Guards against timing noise flipping the tree every step: the current tree stays unless the
    new count's winner is expected to be ``switch_gain`` faster there; a first choice is never held."""
    big, small = MedusaTree([[0], [1], [0, 0]], name="big"), MedusaTree([[0]], name="small")
    choices = {2: small, 8: big}
    close = SpeculationSchedule(choices, rates={2: {"big": 100.0, "small": 104.0}}, switch_gain=0.05)
    far = SpeculationSchedule(choices, rates={2: {"big": 100.0, "small": 106.0}}, switch_gain=0.05)
    unmeasured = SpeculationSchedule(choices, rates={2: {"small": 104.0}})
    assert close.choose(2, big, started=True) is big          # 4% better: keep the current tree
    assert far.choose(2, big, started=True) is small          # 6% better: switch
    assert unmeasured.choose(2, big, started=True) is small   # no rate for the current tree: switch
    assert close.choose(2, big, started=False) is small       # nothing to hold on to before the first step
    assert close.choose(5, small, started=True) is big        # bucket 8 has no rates: its winner
    to_plain = SpeculationSchedule({2: None, 8: big}, rates={2: {"big": 100.0, "plain": 104.0}})
    assert to_plain.choose(2, big, started=True) is big
    assert SpeculationSchedule({2: None, 8: big}).choose(2, big, started=True) is None


@pytest.mark.parametrize("plain_rate, switches", [(120.0, True), (101.0, False), (None, True)],
                         ids=["plain-much-faster", "plain-within-gain", "unmeasured"])
def test_speculation_moves_to_plain_as_rows_finish(m, prompts, refs, eos_case, plain_rate, switches):
    """Guards against a schedule ignored as rows leave (or applied against its hysteresis), and
    against plain steps in the middle of a batch breaking identity: each step verifies the tree the
    schedule picks for its active rows, and every row still equals batch 1."""
    batch, eos, single = eos_case
    tree = default_tree("tree8", NUM_HEADS)
    rates = {} if plain_rate is None else {2: {"tree8": 100.0, "plain": plain_rate}}
    schedule = SpeculationSchedule({2: None, 8: tree}, rates=rates)
    out = generate_batch(m, [prompts[i] for i in batch], "medusa", tree=schedule, max_new_tokens=N,
                         eos_token_ids=eos)
    assert out.active[0] > 2 and out.active[-1] <= 2        # the run crosses the bucket boundary
    expected = [tree.num_nodes if a > 2 or not switches else 1 for a in out.active]
    assert out.speculation == expected
    for i, row in zip(batch, out.rows):
        assert (row.tokens, row.finish_reason) == (single[i].tokens, single[i].finish_reason)
        assert row.proposed == [0 if n == 1 else tree.max_depth for n in expected[:row.steps]]


# -- 9. bad input ------------------------------------------------------------------------------------
@pytest.mark.parametrize("call, fragment", [
    (lambda m, p: check_batch_size(0), "batch_size must be an integer >= 1"),
    (lambda m, p: check_batch_size(-3), "batch_size must be an integer >= 1"),
    (lambda m, p: check_batch_size(True), "batch_size must be an integer >= 1"),
    (lambda m, p: check_batch_size(2.0), "batch_size must be an integer >= 1"),
    (lambda m, p: generate_batch(m, [], tree="tree8"), "non-empty list of prompts"),
    (lambda m, p: generate_batch(m, "hello", tree="tree8"), "non-empty list of prompts"),
    (lambda m, p: generate_batch(m, torch.tensor(p[3]), tree="tree8"), r"\[B, L\] tensor"),
    (lambda m, p: generate_batch(m, p[5], tree="tree8"), r"prompt 0 \(int\) is not a list of token ids: a batch is a "
     r"list of prompts \(one prompt: \[ids\]\)"),
    (lambda m, p: generate_batch(m, [p[3], [[1, 2]]], tree="tree8"), "prompt 1 must be a list of integer token ids"),
    (lambda m, p: generate_batch(m, [p[3], []], tree="tree8"), "prompt 1 is empty"),
    (lambda m, p: generate_batch(m, [p[3], "hello"], tree="tree8"), "prompt 1 is text"),
    (lambda m, p: generate_batch(m, [p[3], [1, V]], tree="tree8"), r"prompt 1: token ids must lie in 0\.\.95"),
    (lambda m, p: generate_batch(m, [[-1], p[3]], tree="tree8"), r"prompt 0: token ids must lie in 0\.\.95"),
    (lambda m, p: generate_batch(m, [p[3], p[2]], tree="tree8", max_new_tokens=1049),
     r"prompt 1: prompt \(1000 tokens\) \+ max_new_tokens \(1049\) exceeds the backbone's 2048 positions"),
    (lambda m, p: generate_batch(m, [p[3]], tree="tree8", max_new_tokens=0), "max_new_tokens must be an integer >= 1"),
    (lambda m, p: generate_batch(m, [p[3]], tree="tree8", ragged="padded"), "ragged must be one of compact, gaps"),
    (lambda m, p: generate_batch(m, [p[3]], "lookahead"),
     "method lookahead decodes one prompt at a time; batched methods: medusa, draft, prompt_lookup, eagle3, "
     "eagle3_lookup, autoregressive"),
    (lambda m, p: generate_batch(wrap(m.model, None), [p[3]], "medusa"), "no Medusa heads"),
], ids=["size-0", "size-negative", "size-bool", "size-float", "no-prompts", "text-batch", "1d-tensor", "flat-ids",
        "nested-ids", "empty-prompt", "text-prompt", "id-over-vocab", "negative-id", "over-context", "no-new-tokens",
        "bad-ragged", "unbatched-method", "no-heads"])
def test_bad_batches_are_one_line_errors(m, prompts, call, fragment):
    """Guards against bad batch requests surfacing as tracebacks from deep inside torch (or being
    half-run), and against refusals that do not say which prompt or what to do."""
    with pytest.raises(UserError, match=fragment) as err:
        call(m, prompts)
    assert "\n" not in str(err.value)


def test_a_batch_over_free_memory_is_refused_before_allocating(m, prompts, monkeypatch):
    """Guards against a batch too large for the device being discovered by an out-of-memory crash
    halfway through: the estimate is checked against free memory before the cache exists."""
    monkeypatch.setattr(batch_decode, "free_memory_bytes", lambda device: 4 << 20)
    dec = BatchTreeDecoder(m, HeadsDrafter(m, "tree8"))
    with pytest.raises(UserError, match=r"a batch of 2 prompts \(longest 1000 tokens, max_new_tokens=24\) needs about "
                                        r"[0-9.]+ GiB .* lower batch_size or max_new_tokens") as err:
        run_batch(dec, m, [prompts[3], prompts[2]], N)
    assert "\n" not in str(err.value) and dec.cache is None
    small = BatchTreeDecoder(m, PlainDrafter())
    assert run_batch(small, m, [prompts[3]], 2, eos_token_ids=()).rows[0].tokens == generate(
        m, prompts[3], "autoregressive", max_new_tokens=2, eos_token_ids=()).tokens   # a small batch still fits


# -- 10. typical acceptance ------------------------------------------------------------------------------
@pytest.mark.parametrize("ragged", RAGGED_MODES)
def test_typical_mode_batches(m, prompts, refs, ragged):
    """Guards against typical acceptance being broken in batches: at temperature 0 every row equals
    its own batch-1 typical output; near temperature 0 the typical rule (per-row thresholds, per-row
    bonus) must still give each row its greedy output; a lax threshold accepts every row's whole
    chain and a strict one nothing."""
    batch = [prompts[i] for i in (1, 3, 4, 0)]
    greedy_typical = SamplingConfig(mode="typical", temperature=0.0)
    out = generate_batch(m, batch, "medusa", tree="tree8", max_new_tokens=N, sampling=greedy_typical,
                         eos_token_ids=(), ragged=ragged)
    for p, row in zip(batch, out.rows):
        single = _batch1(m, p, "tree8", max_new_tokens=N, sampling=greedy_typical)
        assert (row.tokens, row.accept_lengths) == (single.tokens, single.accept_lengths)
    # T -> 0 through the typical rule itself (not the greedy shortcut): p is one-hot at the argmax, so a
    # node is typical iff it is the argmax at its parent and the bonus is the argmax: greedy output
    cold = generate_batch(m, batch, "medusa", tree="tree8", max_new_tokens=N, sampling=SamplingConfig(
        mode="typical", temperature=1e-5), seed=0, eos_token_ids=(), ragged=ragged)
    for i, row, single in zip((1, 3, 4, 0), cold.rows, out.rows):
        assert (row.tokens, row.accept_lengths) == (refs[i][:N], single.accept_lengths)
    lax = SamplingConfig(mode="typical", temperature=1.0, typical_epsilon=1e-6, typical_delta=1e-6)
    strict = SamplingConfig(mode="typical", temperature=1.0, typical_epsilon=1.0, typical_delta=1e6)
    a = generate_batch(m, batch, "medusa", tree="chain4", max_new_tokens=13, sampling=lax, seed=1,
                       eos_token_ids=(), ragged=ragged)
    assert all(r.accept_lengths == [4, 4, 4] and len(r.tokens) == 13 for r in a.rows)
    b = generate_batch(m, batch, "medusa", tree="chain4", max_new_tokens=13, sampling=lax, seed=1,
                       eos_token_ids=(), ragged=ragged)
    assert [r.tokens for r in a.rows] == [r.tokens for r in b.rows]       # seeded: reproducible
    c = generate_batch(m, batch, "medusa", tree="chain4", max_new_tokens=13, sampling=strict, seed=1,
                       eos_token_ids=(), ragged=ragged)
    assert all(r.accept_lengths == [1] * 12 for r in c.rows)
