"""Static-shape steps captured as CUDA graphs (``graphs=on``) on the GPU tier's device (skipped without CUDA; the
GPU check's CPU dry run runs it with GPU_TIER_DEVICE=cpu, where the CPU stand-in for capture replaces CUDA's)."""

import gc

import pytest
import torch

from conftest import GPU_TIER_DEVICE as DEV
from inference.methods import generate
from inference.runtime.cache import TreeKVCache
from inference.runtime.static_steps import StaticSteps, apply_graphs
from inference.runtime.tree import default_tree
from inference.runtime.verify import SamplingConfig
from runtime_support import one_thread, random_heads, tiny_llama, wrap  # noqa: F401 (autouse fixture)
from test_eagle3_decoding import random_drafter
from test_static_steps import replaying

pytestmark = pytest.mark.gpu
PROMPT = [5, 17, 3, 88, 41, 9, 5, 17, 3, 88]


def captured(m):
    """``m`` with graphs on (CUDA), or with the CPU stand-in for capture (the dry run)."""
    if torch.device(DEV).type == "cuda":
        return apply_graphs(m, "on", log=lambda line: None)
    m.static = StaticSteps(m, capture=replaying, log=lambda line: None)
    return m


@pytest.mark.parametrize("method, kw", [("autoregressive", {}), ("medusa", {"tree": "tree8"}),
                                        ("medusa", {"tree": "tree64"}), ("prompt_lookup", {}),
                                        ("medusa_lookup", {"tree": "tree4"})])
def test_captured_steps_are_token_identical_in_fp32(method, kw):
    """Guards against a captured graph replaying stale inputs (positions, mask, write index filled outside the
    captured tensors), reading a reallocated buffer, or padding rows leaking into the output, on CUDA."""
    model = tiny_llama(vocab=96, seed=0).to(DEV)
    m = wrap(model, random_heads(model, num_heads=3))
    ref = generate(m, PROMPT, method, max_new_tokens=40, eos_token_ids=(), **kw).tokens
    captured(m)
    for _ in range(3):     # later generations replay what the first captured, its decoder collected
        gc.collect()       # (a tensor a graph reads must outlive it: medusa_lookup's fixed tree fields)
        assert generate(m, PROMPT, method, max_new_tokens=40, eos_token_ids=(), **kw).tokens == ref
    assert m.static.failed == 0 and m.static.disagreed == 0 and all(v == 1 for v in m.static.captures.values())
    assert m.static.summary()["capture_s"] >= 0
    calls_were_captured(m, drafts=method.startswith("medusa"))


def calls_were_captured(m, drafts: bool):
    """The drafter calls (``captured_calls``) captured without a failure (a host read inside) or a stale replay."""
    calls = m.static.calls
    assert calls.failed == 0 and calls.disagreed == 0
    assert any(k.startswith("draft") for k in calls.captures) == drafts


@pytest.mark.parametrize("kind", ["hydra", "mlp_speculator"])
def test_captured_path_drafting_is_token_identical_in_fp32(kind):
    """Guards against level-by-level drafting (a Hydra / MLP-speculator head per depth, fed its parent's token)
    failing capture on CUDA (a host read) or replaying a previous step's parent tokens."""
    from inference.loading import attach_heads
    from test_static_steps import dependent

    model = tiny_llama(vocab=96, seed=0)
    m = attach_heads(model.to(DEV), dependent(model, kind).heads)    # heads made on CPU, moved with the model
    ref = generate(m, PROMPT, "medusa", tree="tree8", max_new_tokens=40, eos_token_ids=()).tokens
    captured(m)
    for _ in range(2):
        assert generate(m, PROMPT, "medusa", tree="tree8", max_new_tokens=40, eos_token_ids=()).tokens == ref
    calls_were_captured(m, drafts=True)


def test_captured_eagle3_verification_with_aux_features():
    """Guards against EAGLE-3's aux-layer tap (forward hooks) returning stale features under a replayed graph:
    the drafter would then draft from the previous step's features."""
    m = random_drafter(tiny_llama(vocab=96, hidden=64, layers=4, seed=0).to(DEV))
    opts = dict(nodes=8, depth=3, topk=2)
    ref = generate(m, PROMPT, "eagle3", max_new_tokens=40, eos_token_ids=(), **opts).tokens
    captured(m)
    for _ in range(2):
        out = generate(m, PROMPT, "eagle3", max_new_tokens=40, eos_token_ids=(), **opts)
        assert out.tokens == ref
    assert any("+aux" in k for k in m.static.captures) and m.static.failed == 0 and m.static.disagreed == 0
    calls_were_captured(m, drafts=False)
    assert any(k.startswith("eagle3.tree") for k in m.static.calls.captures)      # its draft and rerank: one call
    assert any(k.startswith("eagle3.catchup") for k in m.static.calls.captures)


def test_captured_batched_eagle3_drafting_is_token_identical_in_fp32():
    """Guards against the batched EAGLE-3 drafter's captured calls (a batch padded to its bucket, per-row draft
    slots, lanes moved as rows leave) mixing rows or failing capture on CUDA (a host read inside)."""
    from inference.methods import generate_batch

    m = random_drafter(tiny_llama(vocab=96, hidden=64, layers=4, seed=0).to(DEV))
    prompts = [PROMPT[:n] for n in (1, 4, 10)]
    opts = dict(nodes=8, depth=3, topk=2)
    ref = generate_batch(m, prompts, "eagle3", max_new_tokens=24, eos_token_ids=(), **opts)
    captured(m)
    for _ in range(2):
        out = generate_batch(m, prompts, "eagle3", max_new_tokens=24, eos_token_ids=(), **opts)
        assert [r.tokens for r in out.rows] == [r.tokens for r in ref.rows]
    calls_were_captured(m, drafts=False)
    assert any(k.startswith("eagle3.tree") and k.endswith("@4") for k in m.static.calls.captures)   # draft + rerank


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_captured_tree_step_within_the_dtypes_rounding(dtype):
    """Guards against the full-capacity masked attention (or the padding rows) moving half-precision hidden
    states beyond rounding: a 16-node tree step, captured vs the dynamic cache, after the same prefix; the
    replay itself compared (the checked second use returns the eager run's output) and its check passed."""
    model = tiny_llama(vocab=96, seed=0).to(DEV, dtype)
    m = wrap(model, random_heads(model, num_heads=3).to(DEV, dtype))
    buf = default_tree("tree16", 3).buffers(torch.device(DEV))
    prefix = torch.tensor([PROMPT], device=DEV)
    ids = torch.randint(0, 96, (1, buf.num_nodes), generator=torch.Generator().manual_seed(0)).to(DEV)
    past = prefix.shape[1]
    pos = (buf.position_offsets + past)[None]
    outs = []
    for static in (False, True):
        m.static = None
        if static:
            captured(m)
        with torch.inference_mode():
            cache = m.new_cache(64)
            m.hidden(prefix, torch.arange(past, device=DEV)[None], cache)
            # captured and replayed at the first; the second replays and is checked against an eager run,
            # whose output it returns: the first's is the replay compared here
            hs = []
            for _ in range(2):
                hs.append(m.hidden(ids, pos, cache, buf.additive_mask(past, dtype)).float())
                cache.truncate(past)
        outs.append(hs)
        assert isinstance(cache, TreeKVCache) != static
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    for h in outs[1]:
        torch.testing.assert_close(h, outs[0][0], atol=tol, rtol=tol)
    assert m.static.disagreed == 0 and m.static.checked >= 1   # the replay agreed with the same step uncaptured
    m.static = None


@pytest.mark.parametrize("method, kw", [("autoregressive", {}), ("medusa", {"tree": "tree8"}),
                                        ("prompt_lookup", {"num_tokens": 4})])
def test_captured_batched_steps_are_token_identical_in_fp32(method, kw):
    """Guards against a captured batched step reading another bucket's rows, or rows leaving the batch (the buffer
    rows moved to the front) breaking what the smaller bucket's graph reads, on CUDA."""
    from inference.methods import generate_batch

    model = tiny_llama(vocab=96, seed=0).to(DEV)
    m = wrap(model, random_heads(model, num_heads=3))
    prompts = [PROMPT[:n] for n in (1, 4, 10, 7, 3)]
    ref = generate_batch(m, prompts, method, max_new_tokens=24, eos_token_ids=(), **kw)
    captured(m)
    for _ in range(2):
        out = generate_batch(m, prompts, method, max_new_tokens=24, eos_token_ids=(), **kw)
        assert [r.tokens for r in out.rows] == [r.tokens for r in ref.rows]
    assert m.static.failed == 0 and m.static.disagreed == 0 and any("x" in k for k in m.static.captures)
    calls_were_captured(m, drafts=method == "medusa")


@pytest.mark.parametrize("method, kw", [("autoregressive", {}), ("medusa", {"tree": "tree8"}),
                                        ("eagle3", {"nodes": 8, "depth": 3, "topk": 2, "min_prob": 0.02}),
                                        ("eagle3_lookup", {"nodes": 8, "depth": 3, "topk": 2, "switch": 2}),
                                        ("medusa_lookup", {"tree": "tree8"}),
                                        ("medusa", {"tree": "tree8", "seed": 0,
                                                    "sampling": SamplingConfig(mode="sample", temperature=0.8)}),
                                        ("eagle3", {"nodes": 8, "depth": 3, "topk": 2, "seed": 0,
                                                    "sampling": SamplingConfig(mode="typical", temperature=0.8)})])
def test_a_captured_step_reads_the_host_once(method, kw):
    """Guards against a captured step waiting on the device more than once (each read of a device value idles the
    GPU between graphs), on CUDA: batch 1 and a batch of three, one read a step, greedy and sampling."""
    from test_step_host_reads import batch_reads, reads_per_step

    eagle = method.startswith("eagle3")
    model = tiny_llama(vocab=96, hidden=64, layers=4 if eagle else 2, seed=0).to(DEV)
    m = random_drafter(model) if eagle else wrap(model, random_heads(model, num_heads=3))
    captured(m)
    counts = reads_per_step(m, method, kw)
    assert counts == [1] * len(counts)
    if method == "medusa_lookup":   # batch 1 only
        return
    for _ in range(2):       # the batch's calls captured and checked, at both lengths
        batch_reads(m, method, kw, 45)
        batch_reads(m, method, kw, 15)
    (long, steps_long), (short, steps_short) = batch_reads(m, method, kw, 45), batch_reads(m, method, kw, 15)
    assert long - short == steps_long - steps_short
    assert m.static.failed == 0 and m.static.calls.failed == 0 and m.static.disagreed == 0
