"""Batched decoding of the training-free methods that verify drafts: the draft model and prompt lookup.

Each row of a batch must behave exactly as that prompt decoded alone: the same greedy tokens, the
same accepted lengths step by step (so the batched draft cache and n-gram indexes hold each row's
own context, nothing of the other rows), the same proposal sizes; sampled rows must follow the
backbone's distribution (chi-square on a 12-token vocabulary, as tests/runtime/test_runtime_sampling.py)."""

from __future__ import annotations

import random

import pytest
import torch

from inference.methods import generate, generate_batch
from inference.runtime.verify import SamplingConfig

from runtime_support import one_thread, tiny_llama, wrap  # noqa: F401 (autouse fixture)
from test_runtime_sampling import PROMPT, V, _exact_law, chi_square_pvalue, setup  # noqa: F401 (fixture)

METHODS = {"draft": {"draft": "self:2", "k": 3}, "prompt_lookup": {"num_tokens": 4}}


@pytest.fixture(scope="module")
def m():
    return wrap(tiny_llama(vocab=96, layers=4, seed=0), None)


@pytest.fixture(scope="module")
def prompts():
    """Prompts of very different lengths; a small alphabet makes n-grams repeat so lookup proposes."""
    rng = random.Random(0)
    return [[rng.randrange(6) for _ in range(n)] for n in (1, 9, 40, 3, 150)]


@pytest.mark.parametrize("ragged", ["compact", "gaps"])
@pytest.mark.parametrize("method", sorted(METHODS))
def test_rows_decode_as_they_would_alone(m, prompts, method, ragged):
    """Guards against: a row's drafts or acceptance depending on its batch (a shared draft cache
    offset, an n-gram index built from another row, a padding token or gap attended to), which shows
    as other tokens or other per-step accepted lengths than the same prompt decoded alone."""
    out = generate_batch(m, prompts, method, max_new_tokens=30, eos_token_ids=(), ragged=ragged, **METHODS[method])
    for p, row in zip(prompts, out.rows):
        alone = generate(m, p, method, max_new_tokens=30, eos_token_ids=(), **METHODS[method])
        assert row.tokens == alone.tokens
        assert row.accept_lengths == alone.accept_lengths
        assert row.proposed == alone.proposed
    assert out.tau > 1.15   # the drafts are accepted often enough that the check above means something


@pytest.mark.parametrize("method", sorted(METHODS))
def test_batched_sampling_follows_the_backbone(setup, method):  # noqa: F811
    """Guards against: a biased batched sampler (draft probabilities of another row, a rejection that
    keeps a draft token, the residual not renormalised): the (2nd, 3rd) generated tokens of every row
    must follow the backbone's law, with rows of other prompts beside them in the batch."""
    mm, tables = setup
    cfg = SamplingConfig(mode="sample", temperature=1.0)
    options = {"draft": {"draft": "self:1", "k": 2}, "prompt_lookup": {"num_tokens": 2, "min_ngram": 1}}[method]
    others = [[1, 2], [4, 4, 4, 4, 4, 4, 9, 3, 2]]
    batch = [PROMPT] * 30 + others
    counts = torch.zeros(V * V, dtype=torch.long)
    for seed in range(80):
        out = generate_batch(mm, batch, method, max_new_tokens=3, sampling=cfg, seed=seed, eos_token_ids=(),
                             **options)
        for row in out.rows[:30]:
            counts[row.tokens[1] * V + row.tokens[2]] += 1
    law = _exact_law(tables, cfg).sum(0).reshape(-1)
    assert chi_square_pvalue(counts, law) > 1e-3


def test_lookup_pads_short_rows_without_counting_or_accepting_the_padding(m):
    """Guards against: rows without a match being charged for the longest row's chain (acceptance rates
    deflated), or their padding nodes being accepted or changing the output."""
    rng = random.Random(1)

    def find(alphabet: int, proposes: bool):
        """A prompt whose first lookup step proposes (or does not), with its batch-1 decoding."""
        for _ in range(200):
            p = [rng.randrange(alphabet) for _ in range(12)]
            alone = generate(m, p, "prompt_lookup", max_new_tokens=8, eos_token_ids=(), num_tokens=4, max_steps=1)
            if (alone.proposed[0] > 0) == proposes:
                return p, alone
        raise AssertionError("no such prompt")

    (matchy, _), (plain, alone) = find(4, True), find(96, False)
    out = generate_batch(m, [matchy, plain], "prompt_lookup", max_new_tokens=8, eos_token_ids=(), num_tokens=4,
                         max_steps=1)
    assert out.speculation[0] > 1                         # the step verified the longer row's chain
    assert out.rows[1].proposed == [0] and out.rows[1].accept_lengths == [1]
    assert out.rows[1].tokens == alone.tokens
