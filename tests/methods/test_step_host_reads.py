"""One host read a greedy step on static steps (``graphs=``): the step's verdict, nothing else.

On a GPU every read of a device value into Python waits for all the kernels queued before it, and while the
host then decides what to do nothing is queued: a step that reads the host four times idles the device four
times. ``HostReads`` (benchmarks/host_reads.py) counts those reads (and the ops whose output shape depends on the
values, which wait the same way) on CPU, with the replaying stand-in for capture."""

from __future__ import annotations

import pytest

from benchmarks.host_reads import HostReads
from inference.methods import generate, generate_batch, stream
from inference.runtime.verify import SamplingConfig
from runtime_support import one_thread  # noqa: F401 (autouse fixture)
from test_static_steps import REPEATING, backbone_for, medusa, model, with_steps  # noqa: F401 (fixtures)

CASES = [
    ("medusa", "autoregressive", {}),
    ("medusa", "medusa", {"tree": "tree8"}),
    ("hydra", "medusa", {"tree": "tree8"}),
    ("mlp_speculator", "medusa", {"tree": "tree4"}),
    ("medusa", "prompt_lookup", {}),
    ("medusa", "lookahead", {}),                                                  # its guesses read with the verdict
    ("medusa", "draft", {"draft": "self:1"}),                                     # drafts fed on without a read
    ("medusa", "medusa_lookup", {"tree": "tree8"}),                              # a looked-up chain grafted
    ("hydra", "medusa_lookup", {"tree": "tree8", "num_tokens": 4}),
    ("eagle3", "eagle3", {"nodes": 8, "depth": 3, "topk": 2}),
    ("eagle3", "eagle3", {"nodes": 4, "depth": 1, "topk": 4}),
    ("eagle3", "eagle3", {"nodes": 8, "depth": 3, "topk": 2, "min_prob": 0.02}),   # nodes below the floor masked
    ("eagle3", "eagle3_lookup", {"nodes": 8, "depth": 3, "topk": 2}),              # a looked-up chain grafted
    ("eagle3", "eagle3_lookup", {"nodes": 4, "depth": 2, "topk": 2, "min_prob": 0.02, "switch": 2}),
]


def reads_per_step(m, method: str, kw: dict) -> list[int]:
    """Host reads of each step of a generation, after two identical ones: every call it makes is captured and
    its replay checked by then (a check reads the host, once per call)."""
    for _ in range(2):
        generate(m, REPEATING, method, max_new_tokens=40, eos_token_ids=(), **kw)
    steps = iter(stream(m, REPEATING, method, max_new_tokens=40, eos_token_ids=(), **kw))
    next(steps)       # the prompt's forward
    with HostReads() as reads:
        return [reads.take() for _ in steps]


@pytest.mark.parametrize("kind, method, kw", CASES, ids=[f"{k}-{m}-{i}" for i, (k, m, _) in enumerate(CASES)])
def test_a_greedy_step_reads_the_host_once(model, medusa, kind, method, kw):
    """Guards against a greedy step on static steps reading the host more than once (its verdict: the accepted
    path and tokens, read together): a tree sized on the host (how many nodes passed EAGLE's floor, how deep
    the kept tree is, which nodes are leaves), a second read for the tokens, a key hashed from device values;
    each idles the GPU between captured graphs. EAGLE-3's tree is built on the device for this."""
    m = with_steps(backbone_for(kind, model, medusa), "replayed")
    counts = reads_per_step(m, method, kw)
    assert len(counts) > 10 and counts == [1] * len(counts), counts
    m.static = None


NOT_BATCHED = ("medusa_lookup", "lookahead")     # they decode batch 1 only
BATCH_CASES = [c for c in CASES if c[1] not in NOT_BATCHED]


def batch_reads(m, method: str, kw: dict, tokens: int) -> tuple[int, int]:
    """(host reads, steps) of a batched generation of three prompts of different lengths."""
    prompts = [REPEATING, REPEATING[:5], [7]]
    with HostReads() as reads:
        out = generate_batch(m, prompts, method, max_new_tokens=tokens, eos_token_ids=(), **kw)
    return reads.count, len(out.step_s)


@pytest.mark.parametrize("kind, method, kw", BATCH_CASES,
                         ids=[f"{k}-{m}-{i}" for i, (k, m, _) in enumerate(BATCH_CASES)])
def test_a_greedy_batch_step_reads_the_host_once(model, medusa, kind, method, kw):
    """Guards against a batched greedy step reading the host once per row or per question (the longest row's
    length, whether all rows are equally long, each row's verdict, its tokens, its tree's size): on a GPU each
    read idles the device between captured graphs, and the batch's graphs are what make large batches pay.
    The reads of a generation of 45 tokens less those of one of 15 (the prompts' cancel) are one per step."""
    m = with_steps(backbone_for(kind, model, medusa), "replayed")
    for _ in range(2):      # both lengths: a batch that shrinks earlier in one may capture a call the other does not
        batch_reads(m, method, kw, 45)
        batch_reads(m, method, kw, 15)
    (long, steps_long), (short, steps_short) = batch_reads(m, method, kw, 45), batch_reads(m, method, kw, 15)
    assert steps_long - steps_short > 5
    assert long - short == steps_long - steps_short, (long, short, steps_long, steps_short)
    m.static = None


SAMPLE_CASES = [c for c in CASES if c[1] != "autoregressive"]


@pytest.mark.parametrize("mode", ["sample", "typical"])
@pytest.mark.parametrize("kind, method, kw", SAMPLE_CASES,
                         ids=[f"{k}-{m}-{i}" for i, (k, m, _) in enumerate(SAMPLE_CASES)])
def test_a_sampling_step_reads_the_host_once(model, medusa, kind, method, kw, mode):
    """Guards against sampling reading the host per depth of the tree (whether any row descended, whether a bonus is
    still to draw), apart from its path and tokens, typical acceptance picking its path on the host, or sizing
    EAGLE-3's tree on the host: chat users sample, and on a GPU each read idles the device. Exact sampling and
    typical acceptance, batch 1 and (where batched) a batch of three: one read a step."""
    m = with_steps(backbone_for(kind, model, medusa), "replayed")
    kw = dict(kw, sampling=SamplingConfig(mode=mode, temperature=0.8), seed=0)
    counts = reads_per_step(m, method, kw)
    assert len(counts) > 5 and counts == [1] * len(counts), counts
    if method not in NOT_BATCHED:
        for _ in range(2):
            batch_reads(m, method, kw, 45)
            batch_reads(m, method, kw, 15)
        (long, steps_long), (short, steps_short) = batch_reads(m, method, kw, 45), batch_reads(m, method, kw, 15)
        assert long - short == steps_long - steps_short, (long, short, steps_long, steps_short)
    m.static = None


def test_the_count_sees_a_host_built_tree(model, medusa):
    """Guards against a read counter that cannot fail: without static steps (graphs=off) EAGLE-3 builds its tree on
    the host (how many nodes pass the floor, how deep the tree is), so its steps read several times."""
    m = with_steps(backbone_for("eagle3", model, medusa), "off")
    counts = reads_per_step(m, "eagle3", {"nodes": 8, "depth": 3, "topk": 2, "min_prob": 0.02})
    assert max(counts) > 1


def test_a_medusa_step_sends_no_host_values_before_its_verification(model, medusa):
    """Guards against ``torch.tensor([root], device=...)`` between the heads' draft and the verification forward:
    torch copies host memory to a GPU with a stream synchronisation, so the host waited for the captured draft and
    the GPU then idled while the host built the verification step (a wait ``HostReads`` does not count: no value
    is read). The root is filled on the device; no tensor is made from Python values before the forward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    m = with_steps(backbone_for("medusa", model, medusa), "replayed")
    for _ in range(2):
        generate(m, REPEATING, "medusa", max_new_tokens=20, eos_token_ids=(), tree="tree8")
    ops, forward = Ops(), m.hidden
    m.hidden = lambda *a, **k: (ops.seen.append("FORWARD"), forward(*a, **k))[1]
    try:
        steps = iter(stream(m, REPEATING, "medusa", max_new_tokens=20, eos_token_ids=(), tree="tree8"))
        next(steps)
        with ops:
            for _ in steps:
                ops.seen.append("STEP")
    finally:
        del m.hidden
        m.static = None
    per_step = " ".join(ops.seen).split("STEP")[:-1]
    assert len(per_step) > 3 and all("FORWARD" in s for s in per_step)
    assert [s.split("FORWARD")[0].split().count("lift_fresh") for s in per_step] == [0] * len(per_step)


def test_host_values_go_to_a_device_without_waiting():
    """Guards against the index lists a step sends (accepted paths, row lengths, proposals) copied with torch's
    default blocking copy, which synchronises the stream on a GPU: ``to_device`` asks for a non-blocking copy off
    the host, keeps ``torch.tensor``'s dtypes, and passes a tensor through."""
    import torch

    from inference.runtime.graph_capture import to_device

    asked = []
    real = torch.Tensor.to

    def to(self, *args, **kwargs):
        asked.append(kwargs.get("non_blocking"))
        return real(self, *args, **kwargs)

    torch.Tensor.to = to
    try:
        out = to_device([3, 4], torch.device("meta"))
        assert out.device.type == "meta" and out.dtype == torch.long and asked == [True]
        assert to_device([1.5], "cpu").dtype == torch.float32
        assert to_device([1], "cpu", torch.int32).dtype == torch.int32
        t = torch.arange(3)
        assert to_device(t, "cpu") is t
    finally:
        torch.Tensor.to = real
