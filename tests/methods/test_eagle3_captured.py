"""EAGLE-3's drafter forwards as captured calls (``methods/eagle3_static.py``), on CPU.

With static steps (graphs=) the drafter drafts and catches up through ``MedusaModel.static.calls`` over a
fixed-shape cache. ``replaying`` (tests/runtime/test_static_steps.py) stands in for CUDA's capture, and
``host_read_refused`` (tests/runtime/test_captured_calls.py) for ``graph_capture.HostReadGuard``, which fails a
CUDA capture's warm-up on a host read; the CUDA capture itself is checked on a GPU."""

from __future__ import annotations

import pytest
import torch

from inference.heads.eagle3 import Eagle3Drafter, StaticDraftKV
from inference.heads.registry import init_heads
from inference.loading import attach_heads
from inference.methods import generate, generate_batch
from inference.methods.eagle3 import Eagle3Decoder, Eagle3Options
from inference.methods.eagle3_static import KEPT, tree_step
from inference.runtime.static_steps import StaticSteps
from inference.runtime.tree import RowTrees
from inference.runtime.verify import SamplingConfig
from runtime_support import one_thread, tiny_llama  # noqa: F401 (autouse fixture)
from test_captured_calls import KeyAudit, host_read_refused
from test_eagle3_decoding import eagle3_spec, random_drafter
from test_static_steps import REPEATING, with_steps

LONG = [(7 * i + 3) % 96 for i in range(300)]
PROMPTS = ([5], REPEATING, LONG)
SETTINGS = {"n4-d1-k4": dict(nodes=4, depth=1, topk=4), "n8-d3-k2": dict(nodes=8, depth=3, topk=2),
            "n8-d3-k2-p0.02": dict(nodes=8, depth=3, topk=2, min_prob=0.02)}    # some nodes below the floor
METHODS = ("eagle3", "eagle3_lookup")


class RightDrafter(Eagle3Drafter):
    """A drafter whose first choice is always the backbone's greedy token (``seq``), decoys after it, computed
    without a host read (so it can be captured): steps accept deep paths, every catch-up length and depth runs."""

    seq: torch.Tensor = torch.zeros(1, dtype=torch.long)

    def _scripted(self, normed, tokens, positions):
        n = len(self.seq)
        on = (tokens == self.seq[(positions + 1).clamp(max=n - 1)]) & (positions + 2 < n)
        code = normed.clone()
        code[..., 0] = torch.where(on, self.seq[(positions + 2).clamp(max=n - 1)], -1).float()
        return code

    def forward_step(self, tokens, hidden, positions, past=None, mask=None):
        normed, pre, kv = super().forward_step(tokens, hidden, positions, past, mask)
        return self._scripted(normed, tokens, positions), pre, kv

    def forward_static(self, tokens, hidden, positions, cache, slots, mask, rows=None):
        normed, pre = super().forward_static(tokens, hidden, positions, cache, slots, mask, rows)
        return self._scripted(normed, tokens, positions), pre

    def project(self, x, k=0):
        v = self.spec.vocab_size
        t = x[..., 0].round().long()
        base = t.clamp(min=0)
        logits = torch.zeros(*x.shape[:-1], v)
        for j in range(4):                                   # decoys at 8, 7, 6, 5
            logits.scatter_(-1, ((base + 1 + j) % v)[..., None], 8.0 - j)
        right = torch.where(t >= 0, 10.0, logits.gather(-1, base[..., None])[..., 0])
        return logits.scatter_(-1, base[..., None], right[..., None])


@pytest.fixture(scope="module")
def backbone():
    return tiny_llama(vocab=96, hidden=64, layers=4, seed=0, max_positions=1024)


@pytest.fixture(scope="module")
def m(backbone):
    return random_drafter(backbone)


def expansion(method: str, opts: dict, key: str) -> bool:
    """Whether ``key`` names the captured call that drafts a step's tree: greedy eagle3 drafts and reranks in one
    call (its tree built on the device); eagle3_lookup's grafts its looked-up chain in that call too (``.graft6``,
    where the lookup found one; where it found none, eagle3's own call)."""
    name = tree_step(None, StaticDraftKV(1, 1, 1, 1, torch.float32, torch.device("cpu")), Eagle3Options(**opts))[0]
    head, name = key.split(":")[0], name.split(":")[0]
    return head == name or (method == "eagle3_lookup" and head == name + ".graft6")


def drafter_calls(m) -> dict:
    return {k: v for k, v in m.static.calls.captures.items() if k.startswith("eagle3.")}


def assert_clean(m) -> None:
    calls = m.static.calls
    assert calls.failed == 0 and calls.disagreed == 0 and calls.checked >= 1


@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("method", METHODS)
def test_greedy_is_token_identical_off_uncaptured_and_replayed(m, method, setting):
    """Guards against the static drafter cache or its captured calls changing a token or an acceptance (a
    draft entry at the wrong slot, a mask that shows a stale or another node's entry, a catch-up at the wrong
    start, NaN from an uninitialised slot, a replay reading the capture's inputs): fp32 greedy, graphs=off vs
    uncaptured vs replayed, eagle3 and eagle3_lookup (its grafted nodes), prompts of 1, 14 and 300 tokens."""
    opts = SETTINGS[setting]
    for prompt in PROMPTS:
        with_steps(m, "off")
        ref = generate(m, prompt, method, max_new_tokens=40, eos_token_ids=(), **opts)
        for how in ("uncaptured", "replayed"):
            with_steps(m, how)
            out = generate(m, prompt, method, max_new_tokens=40, eos_token_ids=(), **opts)
            assert out.tokens == ref.tokens and out.accept_lengths == ref.accept_lengths, (prompt[:3], how)
        assert any(expansion(method, opts, k) for k in drafter_calls(m))
        assert_clean(m)
    m.static = None


def token_paths(tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor) -> list[tuple]:
    """A tree's nodes as the tokens from the root to each (masked nodes, token -1, left out), in a canonical order:
    two layouts of the same tree give the same list."""
    out = []
    for i in range(tokens.numel()):
        if tokens[i] < 0:
            continue
        path, j = [], i
        while j >= 0:
            path.insert(0, int(tokens[j]))
            j = int(parents[j])
        assert len(path) == int(depths[i]) + 1
        out.append(tuple(path))
    return sorted(out)


def recording(dec, log: list):
    """``dec`` with every tree it verifies (tokens, parents, depths) appended to ``log``: the host-built tree
    (``tree``) or the one built on the device (``_static_tree``, greedy eagle3 on static steps)."""
    tree, static = dec.tree, dec._static_tree

    def on_device():
        buf, extra = static()
        log.append((buf.tokens, buf.parents, buf.position_offsets))
        return buf, extra
    dec.tree = lambda: (lambda out: log.append(out) or out)(tree())
    dec._static_tree = on_device
    return dec


@pytest.mark.parametrize("how", ["uncaptured", "replayed"])
@pytest.mark.parametrize("method", METHODS)
def test_drafter_state_equals_the_dynamic_drafters_step_by_step(backbone, method, how):
    """Guards against a drafter bug that greedy tokens cannot show (drafts only change acceptance): a stale or
    missing entry in the static cache's mask, a catch-up at the wrong start or positions, a draft entry at the
    wrong slot, a rerank on the device keeping other nodes. Decoding in lockstep with graphs=off, every step's
    verified tree (tokens, parents, depths: eagle3's built on the device) is equal, and the next root's draft
    distribution and state agree to fp32 rounding."""
    from inference.methods.eagle3_lookup import Eagle3LookupDecoder, Eagle3LookupOptions

    cls, opts = ((Eagle3Decoder, Eagle3Options) if method == "eagle3"
                 else (Eagle3LookupDecoder, Eagle3LookupOptions))
    off, static = random_drafter(backbone), with_steps(random_drafter(backbone), how)   # the same weights
    for prompt in ([5], REPEATING):
        logs = ([], [])
        decs = [recording(cls(mm, opts(**SETTINGS["n8-d3-k2"])), log) for mm, log in zip((off, static), logs)]
        for dec in decs:
            dec.prefill(torch.tensor([prompt]), 40)
        lengths = []
        for _ in range(12):
            for a, b in (decs[0].root_logits, decs[1].root_logits), (decs[0].root_state, decs[1].root_state):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
            steps = [dec.step() for dec in decs]
            assert steps[0] == steps[1]
            lengths.append(len(steps[0][0]))
            (ta, pa, da), (tb, pb, db) = logs[0][-1], logs[1][-1]
            if method == "eagle3":
                assert torch.equal(ta, tb) and torch.equal(pa, pb) and torch.equal(da, db)
            else:   # a chain grafted on the device sits at fixed slots, the host's right after the tree: same nodes
                assert token_paths(ta, pa, da) == token_paths(tb, pb, db)
        if method == "eagle3_lookup":     # the device graft's count (read with the verdict) is the host's
            assert (decs[1].grafted, decs[1].grafted_nodes) == (decs[0].grafted, decs[0].grafted_nodes)
        if method == "eagle3_lookup" and prompt == REPEATING:
            assert max(lengths) > 2 and decs[1].grafted > 0   # grafted paths accepted: multi-row catch-ups ran
    if how == "replayed":
        assert_clean(static)


@pytest.mark.parametrize("method", METHODS)
def test_deep_accepted_paths_stay_greedy_and_capture_each_catch_up_once(backbone, method):
    """Guards against the captured catch-up of a long accepted path (rows 2..D+1, start a device input) or a
    deep tree's expansion calls diverging from the eager drafter, and against recapturing them per step or
    per generation: with drafts that are always right every catch-up length runs, each captured once
    (``catchup{n}``), the draft once per setting, replays checked, tokens plain greedy's."""
    sm = random_drafter(backbone, RightDrafter)
    plain = generate(sm, REPEATING, "autoregressive", max_new_tokens=40, eos_token_ids=()).tokens
    sm.heads.seq = torch.tensor(REPEATING + plain)
    with_steps(sm, "replayed")
    outs = [generate(sm, REPEATING, method, max_new_tokens=40, eos_token_ids=(), nodes=8, depth=4, topk=2)
            for _ in range(3)]
    assert all(o.tokens == plain for o in outs) and max(outs[0].accept_lengths) >= 5
    names = drafter_calls(sm)
    assert all(v == 1 for v in names.values())
    # one cache, 3 runs: eagle3's tree call; eagle3_lookup's with and without a grafted chain
    assert sum(expansion(method, dict(nodes=8, depth=4, topk=2), k) for k in names) == (1 if method == "eagle3" else 2)
    assert "catchup5" in {k.split(":")[0].split(".")[1] for k in names}
    assert_clean(sm)
    sm.static = None


def test_calls_are_captured_once_per_key_across_generations(m):
    """Guards against the drafter cache (and so every call captured over it) being made anew per generation
    (a capture and a graph's memory per request on a GPU) or a call captured twice: many generations of two
    settings add no capture after the first round; a longer request regrows the cache once, said by a new name."""
    with_steps(m, "replayed")
    for opts in SETTINGS.values():
        generate(m, REPEATING, "eagle3", max_new_tokens=30, eos_token_ids=(), **opts)
        generate(m, [5], "eagle3_lookup", max_new_tokens=30, eos_token_ids=(), **opts)
    first = dict(drafter_calls(m))
    for _ in range(2):
        for opts in SETTINGS.values():
            generate(m, REPEATING, "eagle3", max_new_tokens=30, eos_token_ids=(), **opts)
            generate(m, [5], "eagle3_lookup", max_new_tokens=30, eos_token_ids=(), **opts)
    grown = set(drafter_calls(m)) - set(first)
    assert all("catchup" in k for k in grown)      # only longer accepted paths, never a recapture
    assert {k.split(":")[0] for k in first} >= {"eagle3.tree-n4-d1-k4", "eagle3.tree-n8-d3-k2", "eagle3.catchup1",
                                                "eagle3.tree-n8-d3-k2-p0.02", "eagle3.tree-n4-d1-k4.graft6",
                                                "eagle3.tree-n8-d3-k2.graft6", "eagle3.tree-n8-d3-k2-p0.02.graft6"}
    tags = {k.split(":")[1] for k in drafter_calls(m)}
    assert len(tags) == 1
    generate(m, LONG + LONG, "eagle3", max_new_tokens=10, eos_token_ids=(), **SETTINGS["n4-d1-k4"])
    assert len({k.split(":")[1] for k in drafter_calls(m)}) == 2
    assert_clean(m)
    m.static = None


def test_a_replaced_drafter_cache_releases_its_calls(m):
    """Guards against a regrown drafter cache living as long as the model through the calls captured over it
    (their graphs, fixed inputs and ``keep``: ~0.5 GiB a cache at 32 lanes x 4,096 slots of Llama-3.1-8B's
    drafter), and against a call still made for the released cache (a generation begun on it) being captured a
    second time under its old name: it runs eagerly."""
    import gc
    import weakref

    with_steps(m, "replayed")
    generate(m, REPEATING, "eagle3", max_new_tokens=30, eos_token_ids=(), **SETTINGS["n4-d1-k4"])
    (old,) = [cache for _, cache in m.static.kept[KEPT].values()]
    assert any(call.keep is old for call in m.static.calls._calls.values())
    generate(m, LONG + LONG, "eagle3", max_new_tokens=10, eos_token_ids=(), **SETTINGS["n4-d1-k4"])
    assert not any(call.keep is old for call in m.static.calls._calls.values())
    x = torch.arange(4.0)
    for _ in range(3):   # captured, it would raise "captured a second time" at the second name's capture
        (y,) = m.static.calls.run("probe", lambda t: (t * 2,), (x,), keep=old)
    assert torch.equal(y, x * 2) and "probe" not in m.static.calls.captures
    gone = weakref.ref(old)
    del old
    gc.collect()
    assert gone() is None
    assert_clean(m)
    m.static = None


@pytest.mark.parametrize("method", METHODS)
def test_no_host_read_inside_the_captured_calls(m, method):
    """Guards against a host read (``.item()``, ``.tolist()``, ``int()`` / ``bool()`` of a tensor, a branch on
    a tensor) inside the drafter's captured functions, which fails a CUDA capture (the call then runs eagerly,
    slow) or freezes a value into the graph: every run of a captured function refuses them here, and no
    capture fails."""
    with_steps(m, "off")
    refs = [generate(m, p, method, max_new_tokens=30, eos_token_ids=(), **SETTINGS["n8-d3-k2"]).tokens
            for p in PROMPTS[:2]]
    m.static = StaticSteps(m, capture=host_read_refused, log=lambda line: None)
    outs = [generate(m, p, method, max_new_tokens=30, eos_token_ids=(), **SETTINGS["n8-d3-k2"]).tokens
            for p in PROMPTS[:2]]
    assert outs == refs and drafter_calls(m)
    assert_clean(m)
    m.static = None


def test_the_host_read_stand_in_does_refuse_a_host_read(m):
    """Guards against the no-host-read check above passing vacuously: a call that reads a tensor on the host
    fails its capture under the same stand-in (and stays eager, right)."""
    m.static = StaticSteps(m, capture=host_read_refused, log=lambda line: None)
    x = torch.arange(4.0)
    for _ in range(3):
        (y,) = m.static.calls.run("probe", lambda t: (t * int(t.sum()),), (x,))
    assert torch.equal(y, x * 6) and m.static.calls.failed == 1
    m.static = None


@pytest.mark.parametrize("setting", ["n8-d3-k2", "n8-d3-k2-p0.02"])
@pytest.mark.parametrize("mode", ["sample", "typical"])
def test_sampling_is_unchanged_by_trees_built_on_the_device(m, mode, setting):
    """Guards against the tree built on the device (static steps: fixed size, masked nodes below the floor, chains
    grafted at fixed slots, one path per node) sampling otherwise than the host-built tree (graphs=off): a masked
    node walked into, a draw that depends on the tree's padded depth, another path preferred. The same seed gives
    the same tokens off, uncaptured and replayed, exact sampling and typical acceptance, eagle3 and eagle3_lookup."""
    cfg = SamplingConfig(mode=mode, temperature=0.8)
    tokens = {}
    for how in ("off", "uncaptured", "replayed"):
        with_steps(m, how)
        tokens[how] = [generate(m, REPEATING, method, max_new_tokens=30, sampling=cfg, seed=7,
                                **SETTINGS[setting]).tokens for method in METHODS]
    assert tokens["uncaptured"] == tokens["replayed"] == tokens["off"]
    assert_clean(m)
    m.static = None


def test_two_interleaved_generations_are_refused(m):
    """Guards against two decoders drafting on the one static drafter cache at once (each would read the
    other's entries): the older one's next step raises instead of decoding wrong."""
    with_steps(m, "uncaptured")
    a = Eagle3Decoder(m, Eagle3Options(**SETTINGS["n4-d1-k4"]))
    b = Eagle3Decoder(m, Eagle3Options(**SETTINGS["n4-d1-k4"]))
    a.prefill(torch.tensor([REPEATING]), 8)
    b.prefill(torch.tensor([REPEATING]), 8)
    assert isinstance(a.dkv, StaticDraftKV) and a.dkv is b.dkv
    with pytest.raises(RuntimeError, match="two generations"):
        a.step()
    m.static = None


# -- batches (``Eagle3BatchDrafter``) -----------------------------------------------------------------------
BATCH = [[5], REPEATING, [60, 61, 7, 7, 7, 30, 12, 95, 44], LONG[:150]]


@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("method", METHODS)
def test_batched_drafting_is_token_identical_and_captured_per_bucket(m, method, setting):
    """Guards against a batch's captured draft or catch-up mixing rows (a padded lane writing a real row's
    cache, per-row draft slots or masks off by one, rows leaving the batch moving the wrong cache lanes) or
    reading the host: 3 rows (padded to the 4-row bucket), then fewer as rows stop at an EOS, every row's
    tokens and acceptances equal graphs=off's; each call captured once per bucket, no failure, no disagreement."""
    opts = SETTINGS[setting]
    prompts = BATCH[:3] + BATCH[3:] * (method == "eagle3")     # 4 rows for eagle3, 3 (padded) for lookup
    with_steps(m, "off")
    free = generate_batch(m, prompts, method, max_new_tokens=24, eos_token_ids=(), **opts)
    starts = {t for r in free.rows for t in r.tokens[:2]}
    eos = (next(t for r in free.rows for t in r.tokens[4:12] if t not in starts),)
    ref = generate_batch(m, prompts, method, max_new_tokens=24, eos_token_ids=eos, **opts)
    m.static = StaticSteps(m, capture=host_read_refused, log=lambda line: None)
    out = generate_batch(m, prompts, method, max_new_tokens=24, eos_token_ids=eos, **opts)
    for a, b in zip(out.rows, ref.rows):
        assert a.tokens == b.tokens and a.accept_lengths == b.accept_lengths
    names = drafter_calls(m)
    sizes = {int(k.rsplit("@", 1)[1]) for k in names if expansion(method, opts, k)}
    assert 4 in sizes and all(v == 1 for v in names.values())
    assert m.static.calls.failed == 0 and m.static.calls.disagreed == 0
    m.static = None


def verified(trees, cand, _q) -> tuple:
    """Each row's verified tree (parents, depths) and the candidates, as a batched drafter's ``draft`` returns
    them: per-row trees built on the host (``RowTrees``) or on the device (``StaticTree`` with a row axis)."""
    if isinstance(trees, RowTrees):
        return [t.parents for t in trees.rows], [t.position_offsets for t in trees.rows], cand
    return list(trees.parents), list(trees.position_offsets), cand


@pytest.mark.parametrize("method", METHODS)
def test_batched_drafter_state_equals_the_dynamic_drafters_step_by_step(backbone, method):
    """Guards against the batch's static drafter holding what tokens cannot show: a row's committed entries at
    the wrong lane or slots (a padded lane writing a real row, per-row starts off by one, lanes not compacted
    when rows leave), a draft mask hiding a node's own or its ancestors' entries, a wrong next-root state. In
    lockstep with graphs=off, every captured step drafts the same nodes (scores to fp32 rounding), and after the
    prefill and every step each row's entries and state equal a fresh catch-up over its accepted tokens, also
    after rows leave in another order (3 rows in the 4-lane bucket, then 2). Greedy trees are built on the device:
    every step's verified trees (parents, depths, tokens) equal graphs=off's (eagle3_lookup's as token paths)."""
    from inference.methods.eagle3_lookup import Eagle3LookupOptions
    from inference.runtime.batch_decode import BatchTreeDecoder
    from test_batch_eagle3 import check_drafter_cache

    off, sm = random_drafter(backbone), with_steps(random_drafter(backbone), "replayed")    # the same weights
    opts = (Eagle3Options if method == "eagle3" else Eagle3LookupOptions)(**SETTINGS["n8-d3-k2"])
    decs, logs = [], ([], [])
    for mm, log in zip((off, sm), logs):
        drafter = opts.batch_drafter(mm, opts)
        draft = drafter.draft
        drafter.draft = lambda dec, draft=draft, log=log: (lambda out: log.append(verified(*out)) or out)(draft(dec))
        decs.append(BatchTreeDecoder(mm, drafter))
        decs[-1].prefill(BATCH[1:], 30)
    dec = decs[1]
    check_drafter_cache(off, dec, dec.drafter)
    lengths = []
    for step in range(8):
        news = [d.step() for d in decs]
        assert news[0] == news[1]
        lengths += [len(new) for new, _ in news[1]]
        (pa, da, ca), (pb, db, cb) = logs[0][-1], logs[1][-1]
        if method == "eagle3":
            assert all(map(torch.equal, pa, pb)) and all(map(torch.equal, da, db)) and torch.equal(ca, cb)
        else:       # grafted chains at fixed slots on the device, right after each row's tree on the host
            for row in range(len(pa)):
                a, b = (torch.cat([c.new_zeros(1), c[row]]) for c in (ca, cb))
                assert token_paths(a, pa[row], da[row]) == token_paths(b, pb[row], db[row])
        check_drafter_cache(off, dec, dec.drafter)
        if step == 2:
            with torch.inference_mode():     # as run_batch calls it (the backbone's static rows move in it)
                for d in decs:
                    d.keep_rows([2, 0])
            check_drafter_cache(off, dec, dec.drafter)
    assert max(lengths) > 2 or method == "eagle3"      # lookup's grafted paths: multi-row catch-ups
    assert {int(k.rsplit("@", 1)[1]) for k in drafter_calls(sm)} >= {2, 4}
    assert_clean(sm)


def test_batched_sampling_is_unchanged_by_captured_drafting(m):
    """Guards against the batch's captured draft changing what its rows sample: same seed, same tokens
    uncaptured and replayed (and as graphs=off)."""
    cfg = SamplingConfig(mode="sample", temperature=0.8)
    rows = {}
    for how in ("off", "uncaptured", "replayed"):
        with_steps(m, how)
        out = generate_batch(m, BATCH[:3], "eagle3", max_new_tokens=20, sampling=cfg, seed=3, **SETTINGS["n8-d3-k2"])
        rows[how] = [r.tokens for r in out.rows]
    assert rows["uncaptured"] == rows["replayed"] == rows["off"]
    m.static = None


def test_static_cache_is_zero_filled():
    """Guards against an uninitialised drafter cache: a NaN in a masked slot still poisons attention (NaN x 0)."""
    kv = StaticDraftKV(2, 2, 16, 4, torch.float32, "cpu")
    assert kv.k.abs().sum() == 0 and kv.v.abs().sum() == 0 and not kv.k.isnan().any()


def test_the_memory_check_counts_the_static_drafter_cache_as_allocated(m):
    """Guards against the batch memory check undercounting the drafter's cache under graphs (it has a row per
    lane of the batch bucket and a capacity rounded up): the estimate equals what is allocated."""
    from inference.methods.eagle3_batch import Eagle3BatchDrafter

    m.static = StaticSteps(m, capture=None, log=lambda line: None)
    prompts = BATCH[:3]
    drafter = Eagle3BatchDrafter(m, Eagle3Options(nodes=8, depth=3, topk=2).fitted(m.heads.spec))
    estimate = drafter.cache_bytes([len(p) for p in prompts], 24)
    generate_batch(m, prompts, "eagle3", max_new_tokens=24, eos_token_ids=(), nodes=8, depth=3, topk=2)
    (cache,) = [c for _, c in m.static.kept["eagle3 draft caches"].values()]
    assert cache.k.shape[0] == 4 and estimate == 2 * cache.k.numel() * cache.k.element_size()
    m.static = None


def test_a_dynamic_rope_drafter_is_captured_and_decodes_as_uncaptured(backbone):
    """Guards against a drafter with dynamic NTK RoPE reading its call's length on the host (``int(positions.max())``)
    to pick its frequencies: that read fails every capture of its calls, so the drafter ran eagerly beside captured
    backbone steps. Its drafter's max_position_embeddings (32) is passed at once, so the rescaled frequencies are
    the ones used: every drafter call captures with no host read, and tokens equal graphs=off's, eagle3 and
    eagle3_lookup, prompts of 1, 14 and 300 tokens."""
    spec = eagle3_spec(backbone, rope_scaling={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=32)
    d = init_heads(spec, backbone.lm_head.weight, backbone.get_input_embeddings().weight)
    assert d.midlayer.self_attn.rotary.length_dependent
    m = attach_heads(backbone, d)
    for method in METHODS:
        with_steps(m, "off")
        refs = [generate(m, p, method, max_new_tokens=24, eos_token_ids=(), **SETTINGS["n8-d3-k2"]).tokens
                for p in PROMPTS]
        m.static = StaticSteps(m, capture=host_read_refused, log=lambda line: None)
        outs = [generate(m, p, method, max_new_tokens=24, eos_token_ids=(), **SETTINGS["n8-d3-k2"]).tokens
                for p in PROMPTS]
        assert outs == refs and drafter_calls(m)
        assert_clean(m)
        m.static = None


# -- call keys: every value a captured call freezes is in its name -----------------------------------------
FLOORS = (0.0, 0.3, 0.30000001, 0.9)   # settings differing in eagle_min_prob alone (0.3 and 0.30000001: alike in :g)


def test_settings_differing_only_in_a_frozen_value_never_share_a_captured_call(m):
    """Guards against a captured call's name leaving out a Python value its function freezes into the graph
    (eagle3_lookup's tree call was named by its label, which has no eagle_min_prob; eagle3's label rounds it with
    :g): a second setting on the same model then replays the first one's floor. Every captured call of eagle3 and
    eagle3_lookup, batch 1 and batched, over settings differing in the floor alone, freezes one set of values per
    key (``KeyAudit``)."""
    with_steps(m, "replayed")
    audit = KeyAudit(m)
    for method in METHODS:
        for p in FLOORS:
            opts = dict(nodes=8, depth=3, topk=2, num_tokens=4) if method == "eagle3_lookup" else {}
            opts.update(nodes=8, depth=3, topk=2, min_prob=p)
            generate(m, REPEATING * 2, method, max_new_tokens=20, eos_token_ids=(), **opts)
            generate_batch(m, [REPEATING * 2, BATCH[2]], method, max_new_tokens=12, eos_token_ids=(), **opts)
    assert not audit.conflicts, [c[0] for c in audit.conflicts]
    trees = {k[0].split(":")[0] for k in audit.seen if k[0].startswith("eagle3.tree")}
    assert len(trees) >= 2 * len(FLOORS)           # a tree call per floor, with and without a grafted chain
    assert_clean(m)
    m.static = None


def test_alternating_floors_on_one_model_decode_as_each_alone(m):
    """Guards against a setting replaying the graph another setting of the same model captured (a frozen floor
    its call's name leaves out): greedy tokens cannot show a floor, the trees' depths (``proposed``) do. eagle3_lookup
    at eagle_min_prob 0, 0.9, 0 on one model, replayed, each generation equals that setting's graphs=uncaptured one."""
    opts = dict(nodes=8, depth=3, topk=2, num_tokens=4)
    ref = {}
    for p in (0.0, 0.9):
        with_steps(m, "uncaptured")
        ref[p] = generate(m, REPEATING * 2, "eagle3_lookup", max_new_tokens=40, eos_token_ids=(), min_prob=p, **opts)
    def seen(out):
        return out.tokens, out.accept_lengths, out.proposed
    assert seen(ref[0.0]) != seen(ref[0.9])                         # the floor shows
    with_steps(m, "replayed")
    for p in (0.0, 0.0, 0.9, 0.0):
        out = generate(m, REPEATING * 2, "eagle3_lookup", max_new_tokens=40, eos_token_ids=(), min_prob=p, **opts)
        assert seen(out) == seen(ref[p]), p
    assert_clean(m)
    m.static = None


def test_a_64_node_tree_is_captured_by_default(m):
    """Guards against the default buckets stopping at 64 rows while an EAGLE-3 tree of 64 nodes verifies 65 (its
    root too): every verification step then ran uncaptured (~1,300 kernel launches a step on a GPU)."""
    with_steps(m, "replayed")
    out = generate(m, REPEATING, "eagle3", max_new_tokens=12, eos_token_ids=(), nodes=64, depth=8, topk=8)
    assert m.static.oversized == 0 and any(k.startswith("128+") for k in m.static.captures), m.static.captures
    m.static = None
    assert out.tokens == generate(m, REPEATING, "eagle3", max_new_tokens=12, eos_token_ids=(), nodes=64, depth=8,
                                  topk=8).tokens


def test_a_cache_made_after_a_released_one_names_new_calls():
    """Guards against drafter caches named by ``id()``: released caches are freed now, a later one may get the same
    id, and its calls the names of calls already captured: the third such capture raised "would be captured a
    second time" mid-generation. Each cache is named by a serial of its own."""
    from inference.methods.eagle3_static import tag

    names = []
    for _ in range(20):
        cache = StaticDraftKV(1, 2, 8, 4, torch.float32, torch.device("cpu"))
        names.append(tag(cache))
        del cache
    assert len(set(names)) == len(names)


def test_the_memory_check_counts_the_drafter_cache_it_would_allocate(m):
    """Guards against the batch memory check counting a new drafter cache where the one held already holds the
    batch (refusing batches that fit), and under-counting a regrown one (at least 1.25x the cache it replaces)."""
    from inference.methods.eagle3_batch import Eagle3BatchDrafter

    m.static = StaticSteps(m, capture=None, log=lambda line: None)
    drafter = Eagle3BatchDrafter(m, Eagle3Options(nodes=8, depth=3, topk=2).fitted(m.heads.spec))
    prompts = BATCH[:3]
    generate_batch(m, prompts, "eagle3", max_new_tokens=24, eos_token_ids=(), nodes=8, depth=3, topk=2)
    assert drafter.cache_bytes([len(p) for p in prompts], 24) == 0        # the one held holds them
    longer = [LONG + LONG] * 3
    estimate = drafter.cache_bytes([len(p) for p in longer], 8)
    generate_batch(m, longer, "eagle3", max_new_tokens=8, eos_token_ids=(), nodes=8, depth=3, topk=2)
    (cache,) = [c for _, c in m.static.kept["eagle3 draft caches"].values()]
    assert estimate == 2 * cache.k.numel() * cache.k.element_size() > 0
    m.static = None
