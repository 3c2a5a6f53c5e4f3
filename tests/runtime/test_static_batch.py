"""Batched decoding on static-shape steps (``runtime.static_batch``): each row as the dynamic batched cache
decodes it, token for token, with the batch padded up to a bucket, rows leaving mid-generation and the
bucket shrinking after them; ``replaying`` (tests/runtime/test_static_steps.py) stands in for CUDA's capture."""

from __future__ import annotations

import random

import pytest

from inference.methods import generate_batch
from inference.runtime.batch_cache import RaggedKVCache
from inference.runtime.static_batch import StaticRaggedKV
from runtime_support import one_thread, random_heads, tiny_llama, wrap  # noqa: F401 (autouse fixture)
from test_eagle3_decoding import random_drafter
from test_static_steps import with_steps

METHODS = {"autoregressive": {}, "medusa": {"tree": "tree8"}, "prompt_lookup": {"num_tokens": 4},
           "draft": {"draft": "self:1", "k": 3}, "eagle3": {"nodes": 8, "depth": 3, "topk": 2},
           "eagle3_lookup": {"nodes": 4, "depth": 1, "topk": 4}}


@pytest.fixture(scope="module")
def medusa():
    model = tiny_llama(vocab=96, seed=0)
    return wrap(model, random_heads(model, num_heads=3, seed=1))


@pytest.fixture(scope="module")
def eagle():
    return random_drafter(tiny_llama(vocab=96, hidden=64, layers=4, seed=0))


@pytest.fixture(scope="module")
def prompts():
    """Five prompts of very different lengths (a batch of 5 runs in the 8-row bucket); a small alphabet makes
    n-grams repeat so lookup proposes."""
    rng = random.Random(0)
    return [[rng.randrange(6) for _ in range(n)] for n in (1, 9, 40, 3, 150)]


@pytest.mark.parametrize("how", ["uncaptured", "replayed"])
@pytest.mark.parametrize("method", sorted(METHODS))
def test_batched_rows_are_token_identical_on_static_steps(medusa, eagle, prompts, method, how):
    """Guards against a padded batch row or node being attended or accepted, a row's entries written at
    another row's slots, or rows leaving the batch (EOS inside the bucket: 5 rows in the 8-row bucket, then
    fewer in smaller ones) moving the wrong buffer rows: every row's tokens and accepted lengths equal the
    dynamic batched cache's, with an EOS that stops the rows at different steps."""
    m = eagle if method.startswith("eagle3") else medusa
    kw = METHODS[method]
    with_steps(m, "off")
    free = generate_batch(m, prompts, method, max_new_tokens=24, eos_token_ids=(), **kw)
    starts = {t for r in free.rows for t in r.tokens[:2]}
    eos = (next(t for r in free.rows for t in r.tokens[4:12] if t not in starts),)   # rows stop mid-generation
    ref = generate_batch(m, prompts, method, max_new_tokens=24, eos_token_ids=eos, **kw)
    with_steps(m, how)
    out = generate_batch(m, prompts, method, max_new_tokens=24, eos_token_ids=eos, **kw)
    for a, b in zip(out.rows, ref.rows):
        assert a.tokens == b.tokens and a.accept_lengths == b.accept_lengths
    assert ref.active[0] == 5 and ref.active[-1] < 5     # rows did leave at different steps
    if how == "replayed":
        assert m.static.captures and m.static.failed == 0
        sizes = {label.split("x")[0] for label in m.static.captures if "x" in label}
        assert "8" in sizes and len(sizes) > 1           # the bucket shrank as rows left
    m.static = None


def test_gaps_mode_and_oversized_batches_keep_the_dynamic_cache(medusa):
    """Guards against the static buffer taking a layout it does not implement (gaps) or a batch above the largest
    bucket (it would index past the buffer): both decode on their own RaggedKVCache, the latter with a warning."""
    m = with_steps(medusa, "replayed", buckets=[1, 2, 4])
    assert isinstance(m.new_batch_cache(3, 64, "compact"), StaticRaggedKV)
    assert type(m.new_batch_cache(3, 64, "gaps")) is RaggedKVCache
    with pytest.warns(UserWarning, match="beyond the largest graph bucket 4"):
        assert type(m.new_batch_cache(5, 64, "compact")) is RaggedKVCache
    m.static = None


def test_batched_exact_sampling_is_unchanged_by_static_steps(medusa, prompts):
    """Guards against static batched steps changing what exact sampling draws from: with the same seed every row
    samples the same tokens as on the dynamic cache (so the per-row chi-square tests of the dynamic path,
    tests/methods/test_batch_methods.py, hold for these steps too)."""
    from inference.runtime.verify import SamplingConfig

    cfg = SamplingConfig(mode="sample", temperature=0.8, top_p=0.9)
    with_steps(medusa, "off")
    ref = generate_batch(medusa, prompts, "medusa", tree="tree8", max_new_tokens=20, sampling=cfg, seed=4,
                         eos_token_ids=())
    with_steps(medusa, "replayed")
    out = generate_batch(medusa, prompts, "medusa", tree="tree8", max_new_tokens=20, sampling=cfg, seed=4,
                         eos_token_ids=())
    assert [r.tokens for r in out.rows] == [r.tokens for r in ref.rows]
    medusa.static = None


def test_the_memory_check_counts_the_static_buffer(medusa):
    """Guards against the batch memory check (refusing a batch over free memory before allocating) counting the
    dynamic cache's bytes while the static buffer rounds the batch and the capacity up (up to 2x each)."""
    from inference.runtime.batch_decode import batch_cache_bytes
    from inference.runtime.model import kv_bytes_per_token

    lens, new = [10, 20, 30, 5, 7], 40
    dynamic = batch_cache_bytes(medusa, lens, new, 8)
    m = with_steps(medusa, "replayed")
    static = batch_cache_bytes(m, lens, new, 8)
    item = 4   # float32
    mask = 5 * 30 * (30 + 40 + 8 - 30) * item   # the prompts' mask over every slot, not over the prompts alone
    assert static - dynamic == (8 * 256 - 5 * (30 + 40 + 8)) * kv_bytes_per_token(m) + mask   # 8 rows x 256 slots
    m.new_batch_cache(5, 30 + 40 + 8)
    assert batch_cache_bytes(m, lens, new, 8) == static - 8 * 256 * kv_bytes_per_token(m)   # already allocated
    m.static = None
