"""Static-shape steps (``runtime.static_steps``, ``graphs=``) on CPU: what a captured GPU step computes.

``graphs=uncaptured`` runs the exact arithmetic ``graphs=on`` captures (full-capacity buffer, bucketed rows,
padding rows, the write index); ``replaying`` below stands in for CUDA's capture on CPU: it runs the step
once at capture and re-runs it into the same output tensors at every replay, so the fixed-tensor plumbing
(inputs filled in place, outputs read back from the captured tensors, one capture per bucket) is exercised
without a GPU. The CUDA capture itself is in the gpu tier (tests/runtime/test_static_steps_gpu.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from inference.errors import UserError
from inference.heads.registry import init_heads
from inference.heads.spec import HeadsSpec
from inference.loading import attach_heads
from inference.methods import generate
from inference.methods.prompt_lookup import PromptLookupSettings
from inference.runtime.cache import TreeKVCache
from inference.runtime.graph_capture import HostReadGuard
from inference.runtime.static_steps import StaticKV, StaticSteps, apply_graphs, check_graphs
from inference.runtime.verify import SamplingConfig
from runtime_support import one_thread, random_heads, tiny_llama, wrap  # noqa: F401 (autouse fixture)
from test_eagle3_decoding import random_drafter

REPEATING = [5, 17, 3, 88, 41, 9, 5, 17, 3, 88, 41, 9, 5, 17]
DISTINCT = [7, 1, 60, 33, 2]


def replaying(fn, pool):
    """A CPU stand-in for ``cuda_capture``: the outputs stay the same tensors, each replay refills them. Its first
    run is under the guard ``cuda_capture`` warms up under: a step that reads the host fails here as on a GPU."""
    with HostReadGuard():
        outs = fn()

    def replay():
        for o, new in zip(outs, fn()):
            o.copy_(new)
    return replay, outs


def with_steps(m, how: str, **kw):
    """``m`` with graphs off, static uncaptured, or static with the replaying stand-in for capture."""
    if how == "replayed":
        m.static = StaticSteps(m, capture=replaying, log=lambda line: None, **kw)
    else:
        apply_graphs(m, how, **kw)
    return m


@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab=96, seed=0)


@pytest.fixture(scope="module")
def medusa(model):
    return wrap(model, random_heads(model, num_heads=3, seed=1))


def dependent(model, kind):
    spec = HeadsSpec(num_heads=3, num_layers=1, hidden_size=64, vocab_size=96, kind=kind, base_model="random:llama")
    heads = init_heads(spec, model.lm_head.weight, model.get_input_embeddings().weight)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return attach_heads(model, heads)


CASES = [
    ("medusa", "autoregressive", {}),
    ("medusa", "medusa", {"tree": "tree8"}),
    ("medusa", "medusa", {"tree": "tree64"}),                 # the largest default bucket, exactly
    ("medusa", "medusa_lookup", {"tree": "tree8", "options": PromptLookupSettings(num_tokens=5)}),
    ("medusa", "prompt_lookup", {}),
    ("medusa", "lookahead", {}),
    ("medusa", "draft", {"draft": "self:1"}),
    ("hydra", "medusa", {"tree": "tree8"}),
    ("mlp_speculator", "medusa", {"tree": "tree4"}),
    ("eagle3", "eagle3", {}),
    ("eagle3", "eagle3_lookup", {}),
]


def backbone_for(kind, model, medusa_m):
    if kind == "medusa":
        return medusa_m
    if kind == "eagle3":
        return random_drafter(tiny_llama(vocab=96, hidden=64, layers=4, seed=0))
    return dependent(model, kind)


@pytest.mark.parametrize("how", ["uncaptured", "replayed"])
@pytest.mark.parametrize("kind, method, kw", CASES, ids=[f"{k}-{m}-{i}" for i, (k, m, _) in enumerate(CASES)])
def test_static_steps_are_token_identical_for_every_method(model, medusa, how, kind, method, kw):
    """Guards against the static-shape step changing a single token (padding rows accepted or attended, the
    write index or the full-capacity mask off by one, compaction of the shared buffer, the aux-feature tap
    under a captured step) for any family or method that verifies drafts: fp32, greedy, against graphs=off."""
    m = backbone_for(kind, model, medusa)
    for prompt in (REPEATING, DISTINCT):
        with_steps(m, "off")
        ref = generate(m, prompt, method, max_new_tokens=40, eos_token_ids=(), **kw)
        with_steps(m, how)
        out = generate(m, prompt, method, max_new_tokens=40, eos_token_ids=(), **kw)
        assert out.tokens == ref.tokens
        if method != "lookahead":   # its Jacobi guesses are argmaxes of unverified rows: near-ties of this
            assert out.accept_lengths == ref.accept_lengths   # random model may round apart (tokens may not)
    m.static = None


def test_a_bucket_is_captured_once_and_replayed(medusa):
    """Guards against silent recapture: after many steps of a tree and a plain loop, each bucket the steps
    used was captured exactly once, and capturing an already-captured step again raises."""
    m = with_steps(medusa, "replayed")
    for _ in range(3):
        generate(m, REPEATING, "medusa", tree="tree8", max_new_tokens=30, eos_token_ids=())
        generate(m, DISTINCT, "autoregressive", max_new_tokens=30, eos_token_ids=())
    assert m.static.captures == {"8": 1, "1": 1}          # tree8: 8 nodes; plain: 1 row; prompts run uncaptured
    assert m.static.summary()["captures"] == {"8": 1, "1": 1}
    step = m.static._step_fn(m.static._bucket(1, 8), None)
    with pytest.raises(RuntimeError, match="captured a second time"):
        m.static._capture("8", step)
    m.static = None


@pytest.mark.parametrize("length, capacity", [(1, 256), (400, 448), (1000, 1152)])
def test_prompts_of_one_to_a_thousand_tokens(length, capacity):
    """Guards against prompts from 1 to ~1k tokens (beyond the largest bucket) failing or being captured: they
    prefill uncaptured on the static buffer, the capacity grows to hold them, decoding stays token-identical."""
    model = tiny_llama(vocab=96, seed=0, max_positions=2048)
    medusa = wrap(model, random_heads(model, num_heads=3, seed=1))
    prompt = [(7 * i + 3) % 96 for i in range(length)]
    ref = generate(medusa, prompt, "medusa", tree="tree8", max_new_tokens=24, eos_token_ids=()).tokens
    m = with_steps(medusa, "replayed")
    assert generate(m, prompt, "medusa", tree="tree8", max_new_tokens=24, eos_token_ids=()).tokens == ref
    assert set(m.static.captures) == {"8"} and m.static.summary()["kv_capacity"] == capacity


def test_capacity_is_rounded_by_an_eighth_and_grows_geometrically():
    """Guards against a static buffer sized to the next power of two (up to twice the KV a request needs, all of
    it attended every step: 4,096 slots for 2,370 at Llama-3.1-8B's shape), and against a regrow per slightly
    longer request (every graph dropped and recaptured each time)."""
    from inference.runtime.static_steps import rounded_capacity

    for slots in [1, 255, 256, 257, 300, 511, 513, 1000, 2370, 4097, 70000]:
        got = rounded_capacity(slots, 256)
        assert max(slots, 256) <= got <= max(256, slots * 1.125), (slots, got)
    assert rounded_capacity(2370, 256) == 2560 and rounded_capacity(257, 256) == 288
    assert rounded_capacity(300, 256, grown_from=1024) == 1280   # a regrow: at least 1.25x the old buffer


def test_capacity_growth_recaptures_and_says_so(medusa):
    """Guards against graphs kept over a reallocated buffer (they would read freed memory): a longer request
    grows the capacity, drops the captured steps, captures again and logs one line."""
    lines = []
    m = medusa
    m.static = StaticSteps(m, capture=replaying, log=lines.append)
    generate(m, DISTINCT, "autoregressive", max_new_tokens=8, eos_token_ids=())
    assert m.static.captures == {"1": 1} and m.static.kv.shape[4] == 256
    generate(m, [3] * 300, "autoregressive", max_new_tokens=8, eos_token_ids=())
    assert m.static.kv.shape[4] == 320 and m.static.regrown == 1 and m.static.captures == {"1": 1}
    assert len(lines) == 1 and "1 x 256 -> 1 x 320" in lines[0]
    m.static = None


def test_request_beyond_a_fixed_capacity_decodes_uncaptured_with_a_warning(medusa):
    """Guards against a request longer than a fixed static capacity overflowing the buffer or decoding wrong:
    it falls back to the dynamic cache with one warning and the same tokens."""
    with_steps(medusa, "off")
    ref = generate(medusa, REPEATING * 10, "medusa", tree="tree4", max_new_tokens=20, eos_token_ids=()).tokens
    m = with_steps(medusa, "replayed", capacity=64)
    with pytest.warns(UserWarning, match="beyond the fixed capacity 64"):
        out = generate(m, REPEATING * 10, "medusa", tree="tree4", max_new_tokens=20, eos_token_ids=())
    assert out.tokens == ref and m.static.fallbacks == 1
    assert isinstance(m.new_cache(10), StaticKV)
    with pytest.warns(UserWarning):
        assert isinstance(m.new_cache(100), TreeKVCache)
    m.static = None


def test_a_draft_request_beyond_a_fixed_capacity_names_whose_steps_fall_back(medusa):
    """Guards against the two identical-looking warnings a draft-model request beyond a fixed capacity gave (the
    target's and the draft's, one slot apart), as if one request had been refused twice: the draft model's line
    now says it is the draft's, and the tokens are graphs off's."""
    import warnings

    with_steps(medusa, "off")
    ref = generate(medusa, REPEATING * 10, "draft", draft="self:1", k=3, max_new_tokens=20, eos_token_ids=()).tokens
    m = with_steps(medusa, "replayed", capacity=64)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = generate(m, REPEATING * 10, "draft", draft="self:1", k=3, max_new_tokens=20, eos_token_ids=())
    lines = sorted(str(w.message) for w in seen if "beyond the fixed capacity" in str(w.message))
    assert out.tokens == ref and len(lines) == 2
    assert lines[0].startswith("graphs: the draft model needs") and lines[1].startswith("graphs: this request needs")
    m.static = None


def test_padding_rows_never_reach_the_output(medusa):
    """Guards against padded nodes being visible: a 3-row step in the 4-row bucket returns 3 rows equal to the
    dynamic path's, and the padding rows wrote only to the reserved last slot."""
    m = with_steps(medusa, "uncaptured")
    view = m.new_cache(32)
    ids, pos = torch.tensor([[5, 17, 3]]), torch.arange(3)[None]
    with torch.inference_mode():
        h = m.hidden(ids, pos, view)
        ref = m.body_hidden(ids, pos, TreeKVCache(m.config.num_hidden_layers, 8))
    assert h.shape == (1, 3, 64)
    torch.testing.assert_close(h, ref, atol=1e-5, rtol=0)
    assert view.length == 3 and m.static.kv[:, :, :, :, 3:-1].abs().sum() == 0   # slot 3.. untouched but the last
    m.static = None


def test_an_open_stream_keeps_the_buffer_and_the_next_generation_decodes_beside_it(medusa):
    """Guards against: two streams read in turn by one thread (an asyncio server's pattern) on static steps: the
    second took the buffer over and the first died mid-answer ("two generations are decoding ..."). The second now
    decodes on the dynamic cache with a warning, both token-identical to graphs=off; once the first is read to its
    end the buffer is free again; a step through a stale view is still refused."""
    from inference.methods import stream

    with_steps(medusa, "off")
    want_a = generate(medusa, DISTINCT, "medusa", tree="tree8", max_new_tokens=20, eos_token_ids=()).tokens
    want_b = generate(medusa, REPEATING, "medusa", tree="tree8", max_new_tokens=20, eos_token_ids=()).tokens
    m = with_steps(medusa, "uncaptured")
    a = iter(stream(m, DISTINCT, "medusa", tree="tree8", max_new_tokens=20, eos_token_ids=()))
    got_a = list(next(a))
    with pytest.warns(UserWarning, match="an unfinished stream is decoding on this model's static KV buffer"):
        got_b = generate(m, REPEATING, "medusa", tree="tree8", max_new_tokens=20, eos_token_ids=()).tokens
    for chunk in a:
        got_a += chunk
    assert (got_a, got_b) == (want_a, want_b)
    fallbacks = m.static.fallbacks
    assert generate(m, REPEATING, "medusa", tree="tree8", max_new_tokens=20, eos_token_ids=()).tokens == want_b
    assert m.static.fallbacks == fallbacks   # the finished stream let go of the buffer
    view = m.new_cache(16)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="two generations"):
        m.static.check_current(view.generation - 1)
    m.static = None


def test_exact_sampling_is_unchanged_by_static_steps(medusa):
    """Guards against the static step changing what sampling sees: same seed, same tokens as graphs=off (the
    logits agree to fp32 rounding, far below what would move a sampled token here)."""
    cfg = SamplingConfig(mode="sample", temperature=0.8)
    with_steps(medusa, "off")
    ref = generate(medusa, DISTINCT, "medusa", tree="tree8", max_new_tokens=30, sampling=cfg, seed=5).tokens
    m = with_steps(medusa, "replayed")
    assert generate(m, DISTINCT, "medusa", tree="tree8", max_new_tokens=30, sampling=cfg, seed=5).tokens == ref
    m.static = None


@pytest.mark.parametrize("mode, buckets, device, match", [
    ("sometimes", [1, 2], None, "graphs must be one of"),
    ("auto", [1, 4, 2], None, "strictly increasing"),
    ("auto", [], None, "strictly increasing"),
    ("auto", [0, 1], None, "strictly increasing"),
    ("on", [1, 2], "cpu", "needs device=cuda"),
])
def test_bad_graph_settings_are_refused_in_one_line(mode, buckets, device, match):
    """Guards against a mistyped mode, a bucket list that is not increasing, or graphs=on on a CPU run
    reaching the model load (or a crash later)."""
    with pytest.raises(UserError, match=match) as err:
        check_graphs(mode, buckets, device)
    assert "\n" not in str(err.value)


def test_graph_buckets_are_bounded_by_the_largest_step_any_method_takes():
    """Guards against graph_buckets=[1,2,100000000] passing the checks, then a 100 GB allocation traceback once
    the model had loaded (a step's rows and a batch are padded up to their bucket): the bound holds the largest step
    the methods' own bounds allow (lookahead's), no more than the power of two above it, and --help names it."""
    from inference.cli_keys import CommandKeys
    from inference.methods.eagle3 import EAGLE_BOUNDS
    from inference.methods.lookahead import LookaheadSettings
    from inference.methods.prompt_lookup import MAX_LOOKUP_TOKENS
    from inference.runtime.static_steps import MAX_BUCKET, MAX_STEP_ROWS
    from inference.runtime.tree import MAX_TREE_NODES

    bounds = LookaheadSettings.BOUNDS   # a step verifies 1 + (N-1)(W+G) rows
    assert MAX_STEP_ROWS == 1 + (bounds["ngram"][1] - 1) * (bounds["window"][1] + bounds["guesses"][1])
    assert MAX_STEP_ROWS >= max(MAX_TREE_NODES, EAGLE_BOUNDS["nodes"][1] + 1) + MAX_LOOKUP_TOKENS
    assert MAX_STEP_ROWS <= MAX_BUCKET < 2 * MAX_STEP_ROWS
    check_graphs("uncaptured", [1, 2, MAX_BUCKET])
    for buckets in ([1, 2, 100_000_000], [MAX_BUCKET + 1]):
        with pytest.raises(UserError, match=f"graph_buckets must be at most {MAX_BUCKET} ") as err:
            check_graphs("uncaptured", buckets)
        assert "\n" not in str(err.value)
    help_text = [f for f in dataclasses.fields(CommandKeys) if f.name == "graph_buckets"][0].metadata["help"]
    assert f"at most {MAX_BUCKET}" in help_text


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_graphs_on_without_cuda_is_refused():
    """Guards against graphs=on silently running uncaptured (or crashing in capture) on a machine without CUDA."""
    with pytest.raises(UserError, match="no CUDA device"):
        check_graphs("on", [1, 2])


@pytest.mark.parametrize("word, mode", [(True, "on"), ("True", "on"), (False, "off"), ("False", "off"),
                                        ("uncaptured", "uncaptured")])
def test_yaml_booleans_read_as_graph_modes(word, mode):
    """Guards against ``graphs=on`` on a command line being refused: OmegaConf reads on/off as booleans, which
    reach a string key as 'True' / 'False'."""
    from inference.runtime.static_steps import graphs_mode

    assert graphs_mode(word) == mode


def frozen(fn, pool):
    """A capture that froze its inputs (what a host value baked into a CUDA graph does): replays keep the
    capture's outputs whatever the step's inputs are now."""
    outs = fn()
    return (lambda: None), outs


def test_a_replay_that_disagrees_with_the_eager_step_is_dropped(medusa):
    """Guards against a captured step that replays stale values (a host number frozen at capture) decoding wrong
    tokens: its first replay on new inputs is checked against the same step run eagerly; the disagreeing step
    then runs uncaptured, the tokens stay plain greedy's and the report counts it."""
    with_steps(medusa, "off")
    ref = generate(medusa, REPEATING, "medusa", tree="tree8", max_new_tokens=30, eos_token_ids=()).tokens
    lines = []
    medusa.static = StaticSteps(medusa, capture=frozen, log=lines.append)
    assert generate(medusa, REPEATING, "medusa", tree="tree8", max_new_tokens=30, eos_token_ids=()).tokens == ref
    summary = medusa.static.summary()
    assert summary["disagreeing_replays"] >= 1 and summary["checked_replays"] >= 1
    assert any("disagreed" in line for line in lines)
    medusa.static = None


def test_faithful_replays_pass_their_check(medusa):
    """Guards against the check itself dropping good captures (every step would then run uncaptured)."""
    m = with_steps(medusa, "replayed")
    generate(m, REPEATING, "medusa", tree="tree8", max_new_tokens=30, eos_token_ids=())
    generate(m, REPEATING, "autoregressive", max_new_tokens=30, eos_token_ids=())
    assert m.static.checked == 2 and m.static.disagreed == 0     # the tree step's bucket and the plain one's
    m.static = None


def test_a_draft_model_steps_on_its_own_static_buffer(medusa):
    """Guards against a draft model's k forwards a step staying eager (on a GPU they launch the most kernels of
    draft decoding) or sharing the target's buffer (each would overwrite the other's entries): the draft gets its
    own static steps, captured, and the tokens stay the target's greedy ones."""
    from inference.methods.draft import load_draft

    with_steps(medusa, "off")
    ref = generate(medusa, REPEATING, "draft", draft="self:1", k=3, max_new_tokens=30, eos_token_ids=()).tokens
    m = with_steps(medusa, "replayed")
    draft = load_draft("self:1", m)
    assert draft.static is not None and draft.static is not m.static
    assert generate(m, REPEATING, "draft", draft=draft, k=3, max_new_tokens=30, eos_token_ids=()).tokens == ref
    assert draft.static.captures.get("1") == 1 and draft.static.disagreed == 0
    m.static = None


def test_a_failed_capture_turns_capture_off_and_decodes_right(medusa):
    """Guards against a step that cannot be captured (a host read inside it) failing the generation, or being
    attempted again at every bucket: the first failure is logged and counted, every step then runs uncaptured
    on the static buffer, and the tokens stay plain greedy's."""
    def failing(fn, pool):
        raise RuntimeError("operation not permitted when stream is capturing")

    with_steps(medusa, "off")
    ref = generate(medusa, REPEATING, "medusa", tree="tree8", max_new_tokens=20, eos_token_ids=()).tokens
    lines = []
    medusa.static = StaticSteps(medusa, capture=failing, log=lines.append)
    assert generate(medusa, REPEATING, "medusa", tree="tree8", max_new_tokens=20, eos_token_ids=()).tokens == ref
    assert medusa.static.failed == 1 and medusa.static.capture is None and not medusa.static.summary()["captured"]
    assert len([line for line in lines if "every step runs uncaptured" in line]) == 1   # (the draft call's own line)
    medusa.static = None


def test_a_new_buffer_is_sized_to_the_request_not_every_past_one(medusa):
    """Guards against a buffer that only grows in both dimensions (a wide batch, then one long prompt, would
    allocate wide x long): a new buffer keeps the old larger dimensions only where that costs at most twice the
    request's own size."""
    m = with_steps(medusa, "replayed", buckets=[1, 2, 4, 8])
    m.new_batch_cache(8, 100)
    assert tuple(m.static.kv.shape[i] for i in (2, 4)) == (8, 256)
    m.new_cache(1000)
    assert tuple(m.static.kv.shape[i] for i in (2, 4)) == (1, 1024)    # not 8 x 1024
    m.new_batch_cache(2, 100)
    assert tuple(m.static.kv.shape[i] for i in (2, 4)) == (2, 256)     # keeping 1024 would cost 4x the request
    m.new_cache(300)
    assert tuple(m.static.kv.shape[i] for i in (2, 4)) == (2, 320)     # keeping 2 rows costs 2x: kept
    m.static = None


def test_a_self_draft_keeps_its_static_steps_across_generations(medusa):
    """Guards against a self-draft, rebuilt at every generate call, getting a new buffer and new captures each
    time (a capture, a check and a warm-up per call on a GPU)."""
    m = with_steps(medusa, "replayed")
    for _ in range(3):
        generate(m, REPEATING, "draft", draft="self:1", k=3, max_new_tokens=20, eos_token_ids=())
    (steps,) = m.static.siblings.values()
    assert steps.captures.get("1") == 1 and steps.regrown == 0
    m.static = None


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory"), RuntimeError(
    "[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: you tried to allocate 4 bytes")])
def test_no_memory_for_the_static_buffer_decodes_on_the_dynamic_cache(medusa, monkeypatch, error):
    """Guards against a static buffer the device has no memory for ending the request with a traceback: CUDA raises
    OutOfMemoryError, the CPU allocator (graphs=uncaptured) a RuntimeError; both fall back with one warning and
    decode the same tokens, and the next request tries the buffer again."""
    import inference.runtime.static_steps as static_steps

    with_steps(medusa, "off")
    ref = generate(medusa, REPEATING, "medusa", tree="tree4", max_new_tokens=12, eos_token_ids=()).tokens
    m = with_steps(medusa, "uncaptured")
    real = torch.zeros

    def failing(*args, **kw):
        if len(args) == 6:   # the buffer [layers, 2, batch, kv_heads, capacity, head_dim]
            raise error
        return real(*args, **kw)

    monkeypatch.setattr(static_steps.torch, "zeros", failing)
    with pytest.warns(UserWarning, match="no memory for a static KV buffer"):
        out = generate(m, REPEATING, "medusa", tree="tree4", max_new_tokens=12, eos_token_ids=())
    assert out.tokens == ref and m.static.fallbacks == 1
    monkeypatch.setattr(static_steps.torch, "zeros", real)
    assert generate(m, REPEATING, "medusa", tree="tree4", max_new_tokens=12, eos_token_ids=()).tokens == ref
    assert m.static.kv is not None
    m.static = None


def test_steps_beyond_the_largest_bucket_are_counted_and_said_once(medusa):
    """Guards against a step of more rows than the largest graph bucket (a 16-node tree with buckets up to 8)
    running uncaptured on every step without a word or a count: the ~1,300 kernels launched one by one, and
    report.json saying the generation was captured."""
    lines = []
    medusa.static = StaticSteps(medusa, buckets=[1, 2, 4, 8], capture=replaying, log=lines.append)
    plain = generate(medusa, REPEATING, "autoregressive", max_new_tokens=12, eos_token_ids=()).tokens
    out = generate(medusa, REPEATING, "medusa", tree="tree16", max_new_tokens=12, eos_token_ids=())
    assert out.tokens == plain
    said = [l for l in lines if "beyond the largest graph bucket" in l]
    summary = medusa.static.summary()
    assert summary["oversized_steps"] >= 2 and len(said) == 1 and "a 16-row step" in said[0], lines
    medusa.static = None
