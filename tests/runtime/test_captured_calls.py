"""The drafters' own forwards as captured calls (``runtime.captured_calls``), on CPU.

``replaying`` (tests/runtime/test_static_steps.py) stands in for CUDA's capture: the outputs stay the tensors
the capture returned and each replay refills them, so the fixed-input plumbing, the batch padding, the counts
and the checks run here; the CUDA capture itself is in the gpu tier (tests/runtime/test_static_steps_gpu.py).
``host_read_refused`` stands in for ``graph_capture.HostReadGuard``, which fails a CUDA capture's warm-up on a
host read."""

from __future__ import annotations

import inspect
from contextlib import contextmanager

import pytest
import torch

from inference.methods import generate, generate_batch
from inference.runtime.static_steps import StaticSteps
from inference.runtime.verify import SamplingConfig
from runtime_support import one_thread  # noqa: F401 (autouse fixture)
from test_static_steps import (DISTINCT, REPEATING, dependent, frozen, medusa, model,  # noqa: F401 (fixtures)
                               replaying, with_steps)

HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")


@contextmanager
def no_host_reads():
    """Tensor -> host conversions raise inside (what ``HostReadGuard`` does to a CUDA capture's warm-up)."""
    saved = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def refuse(*args, **kwargs):
        raise RuntimeError("host read inside a captured call")
    try:
        for name in HOST_READS:
            setattr(torch.Tensor, name, refuse)
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


def host_read_refused(fn, pool):
    """``replaying``, with every run of the captured function refusing host reads, as a CUDA capture would."""
    with no_host_reads():
        outs = fn()

    def replay():
        with no_host_reads():
            new = fn()
        for o, n in zip(outs, new):
            o.copy_(n)
    return replay, outs


def static(m, capture=replaying, lines=None):
    m.static = StaticSteps(m, capture=capture, log=(lines.append if lines is not None else lambda line: None))
    return m


SCALARS = (bool, int, float, str, type(None))


def frozen_scalars(fn, depth: int = 0) -> tuple:
    """The Python values (numbers, strings, None, tuples of them) a captured function closes over, through the
    functions it closes over: what a capture freezes into its graph (tensors and modules it closes over are read at
    each replay, not frozen)."""
    out = []
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            v = cell.cell_contents
        except ValueError:            # an empty cell (a name bound later)
            continue
        if isinstance(v, SCALARS) or (isinstance(v, tuple) and all(isinstance(x, SCALARS) for x in v)):
            out.append(v)
        elif inspect.isfunction(v) and depth < 8:
            out.append(frozen_scalars(v, depth + 1))
    return tuple(out)


class KeyAudit:
    """Wraps ``m.static.calls.run``: for every call key (name, batched, input shapes), the Python values its
    function freezes (``frozen_scalars``); ``conflicts``: the keys that stood for two sets of them, where a replay
    would run the first set's graph for the second (a value left out of the call's name)."""

    def __init__(self, m):
        self.seen: dict = {}
        self.conflicts: list = []
        calls = m.static.calls
        run = calls.run

        def audited(name, fn, inputs, rows=None, keep=None):
            key = (name, rows is not None, tuple(tuple(x.shape[1:] if rows is not None else x.shape) for x in inputs))
            frozen = frozen_scalars(fn)
            first = self.seen.setdefault(key, frozen)
            if first != frozen:
                self.conflicts.append((name, first, frozen))
            return run(name, fn, inputs, rows, keep)
        calls.run = audited


def draft_captures(m) -> dict:
    return {k: v for k, v in m.static.calls.captures.items() if k.startswith("draft")}


@pytest.mark.parametrize("kind, tree", [("medusa", "tree8"), ("hydra", "tree8"), ("mlp_speculator", "tree4")])
def test_heads_drafting_is_captured_once_per_tree_without_host_reads(model, medusa, kind, tree):
    """Guards against a family's drafting staying eager under graphs (a few dozen launches a step on a GPU),
    reading a host value inside the call (a CUDA capture fails, or freezes it), or capturing again each step:
    the draft is one call per tree, captured once, its replays checked, tokens plain greedy's."""
    m = medusa if kind == "medusa" else dependent(model, kind)
    with_steps(m, "off")
    refs = [generate(m, p, "medusa", tree=tree, max_new_tokens=30, eos_token_ids=()).tokens for p in (REPEATING, DISTINCT)]
    static(m, host_read_refused)
    outs = [generate(m, p, "medusa", tree=tree, max_new_tokens=30, eos_token_ids=()).tokens for p in (REPEATING, DISTINCT)]
    assert outs == refs
    calls = m.static.calls
    assert len(draft_captures(m)) == 1 and calls.failed == 0 and calls.disagreed == 0 and calls.checked == 1
    assert m.static.summary()["drafter_calls"]["captures"] == draft_captures(m)
    m.static = None


def test_batched_drafting_pads_the_batch_to_its_bucket(medusa):
    """Guards against a batch's draft capturing once per batch size (every row that finishes would capture
    anew) or padding rows leaking into real rows' drafts: a batch of 5 replays the 8-row capture, and as rows
    stop at an EOS, smaller buckets' captures; the tokens stay the uncaptured batch's."""
    prompts = [REPEATING, DISTINCT, REPEATING[:5], DISTINCT[:2], [4]]
    with_steps(medusa, "off")
    free = generate_batch(medusa, prompts, "medusa", tree="tree4", max_new_tokens=24, eos_token_ids=())
    starts = {t for r in free.rows for t in r.tokens[:2]}
    eos = (next(t for r in free.rows for t in r.tokens[4:12] if t not in starts),)   # rows stop mid-generation
    ref = generate_batch(medusa, prompts, "medusa", tree="tree4", max_new_tokens=24, eos_token_ids=eos)
    static(medusa)
    out = generate_batch(medusa, prompts, "medusa", tree="tree4", max_new_tokens=24, eos_token_ids=eos)
    assert [r.tokens for r in out.rows] == [r.tokens for r in ref.rows] and ref.active[-1] < 5
    sizes = sorted(int(k.rsplit("@", 1)[1]) for k in draft_captures(medusa))
    assert sizes[-1] == 8 and len(sizes) >= 2 and medusa.static.calls.disagreed == 0
    medusa.static = None


def test_a_frozen_drafting_replay_is_dropped_and_the_tokens_stay_right(medusa):
    """Guards against a captured draft that replays stale tokens (a host value frozen into the graph): its first
    replay on new inputs is checked against the draft run eagerly, then it runs uncaptured, said in a line."""
    with_steps(medusa, "off")
    ref = generate(medusa, REPEATING, "medusa", tree="tree8", max_new_tokens=30, eos_token_ids=()).tokens
    lines = []
    static(medusa, frozen, lines)
    assert generate(medusa, REPEATING, "medusa", tree="tree8", max_new_tokens=30, eos_token_ids=()).tokens == ref
    assert medusa.static.calls.disagreed == 1 and any("call disagreed" in line for line in lines)
    medusa.static = None


def test_a_call_that_cannot_be_captured_stays_eager_and_the_steps_stay_captured(medusa):
    """Guards against one drafter call that cannot be captured (a host read inside it) failing the generation
    or turning the backbone's graphs off with it: that call runs eagerly (one line), the steps stay captured."""
    def fails_for_drafts(fn, pool):
        if fn.__code__.co_filename.endswith("captured_calls.py"):    # a drafter call's step, not the backbone's
            raise RuntimeError("operation not permitted when stream is capturing")
        return replaying(fn, pool)

    with_steps(medusa, "off")
    ref = generate(medusa, REPEATING, "medusa", tree="tree8", max_new_tokens=20, eos_token_ids=()).tokens
    lines = []
    static(medusa, fails_for_drafts, lines)
    assert generate(medusa, REPEATING, "medusa", tree="tree8", max_new_tokens=20, eos_token_ids=()).tokens == ref
    assert medusa.static.calls.failed == 1 and medusa.static.capture is not None and medusa.static.captures == {"8": 1}
    assert len(lines) == 1 and "runs uncaptured" in lines[0]
    medusa.static = None


def test_sampled_drafts_are_not_captured(medusa):
    """Guards against capturing draft=sampled drafting, whose random draws a graph would replay as constants:
    it stays eager (the seed gives the same tokens as graphs=off), and draft=topk's draft is captured."""
    sampled = SamplingConfig(mode="sample", temperature=0.8, draft="sampled")
    with_steps(medusa, "off")
    ref = generate(medusa, REPEATING, "medusa", tree="tree8", max_new_tokens=20, eos_token_ids=(), sampling=sampled,
                   seed=3).tokens
    static(medusa)
    out = generate(medusa, REPEATING, "medusa", tree="tree8", max_new_tokens=20, eos_token_ids=(), sampling=sampled,
                   seed=3).tokens
    assert out == ref and not draft_captures(medusa)
    topk = SamplingConfig(mode="sample", temperature=0.8, draft="topk")
    generate(medusa, REPEATING, "medusa", tree="tree8", max_new_tokens=20, eos_token_ids=(), sampling=topk, seed=3)
    assert len(draft_captures(medusa)) == 1
    medusa.static = None


def test_a_captured_call_is_never_captured_again(medusa):
    """Guards against silent recapture of a drafter call (each costs a capture's time and graph memory)."""
    static(medusa)
    generate(medusa, REPEATING, "medusa", tree="tree8", max_new_tokens=20, eos_token_ids=())
    (label,) = draft_captures(medusa)
    with pytest.raises(RuntimeError, match="captured a second time"):
        medusa.static.calls._capture(label, lambda: (torch.zeros(1),), torch.device("cpu"))
    medusa.static = None


def test_uncaptured_calls_run_the_function_itself(medusa):
    """Guards against graphs=uncaptured keeping fixed copies or counts it has no use for: with no capture
    function a call is the function's own result, nothing recorded."""
    with_steps(medusa, "uncaptured")
    x = torch.randn(3, 4)
    (y,) = medusa.static.calls.run("double", lambda t: (t * 2,), (x,), rows=3)
    assert torch.equal(y, x * 2) and medusa.static.calls.captures == {} and medusa.static.calls._calls == {}
    medusa.static = None


def test_rows_beyond_the_largest_bucket_run_eagerly(medusa):
    """Guards against a batch above the largest bucket failing or capturing a bucket of its own."""
    medusa.static = StaticSteps(medusa, buckets=(1, 2), capture=replaying, log=lambda line: None)
    x = torch.randn(3, 4)
    for _ in range(3):
        (y,) = medusa.static.calls.run("double", lambda t: (t * 2,), (x,), rows=3)
        assert torch.equal(y, x * 2)
    assert medusa.static.calls.captures == {}
    for rows in (2, 2, 1, 2, 1, 1):
        (y,) = medusa.static.calls.run("double", lambda t: (t * 2,), (x[:rows],), rows=rows)
        assert torch.equal(y, x[:rows] * 2)
    assert medusa.static.calls.captures == {"double@2": 1, "double@1": 1}
    medusa.static = None


def test_two_calls_of_one_name_with_other_shapes_are_two_captures(medusa):
    """Guards against a call name reused with other input shapes being taken for a recapture (and raising mid-
    generation): each shape is its own captured call, reported under its own label."""
    medusa.static = StaticSteps(medusa, capture=replaying, log=lambda line: None)
    for shape in ((2, 3), (4,), (2, 3), (4,), (2, 3), (4,)):
        x = torch.randn(*shape)
        (y,) = medusa.static.calls.run("double", lambda t: (t * 2,), (x,))
        assert torch.equal(y, x * 2)
    assert medusa.static.calls.captures == {"double": 1, "double[4]": 1} and medusa.static.calls.checked == 2
    medusa.static = None


def test_the_key_audit_sees_a_value_frozen_under_one_name(medusa):
    """Guards against ``KeyAudit`` (the check that a captured call's name holds every Python value its function
    freezes) passing everything: one name over two functions closing over other floats is a conflict; other
    names, or the same float, are not."""
    static(medusa)
    audit = KeyAudit(medusa)

    def scaled(factor):
        def inner(t):
            return (t * factor,)
        return lambda t: inner(t)
    x = torch.randn(2)
    for name, factor in (("scale", 2.0), ("scale", 2.0), ("scale3", 3.0), ("scale", 0.5)):
        medusa.static.calls.run(name, scaled(factor), (x,))
    assert [c[0] for c in audit.conflicts] == ["scale"]
    medusa.static = None
