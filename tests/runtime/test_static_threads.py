"""Two threads decoding on one model's static KV buffer (``graphs=`` uncaptured here; ``auto`` on a GPU).

A generation takes the model's one static buffer; a step checked that its generation was still the buffer's and
then wrote, two operations, so a second thread taking the buffer over between them handed each generation the
other's entries: a review saw 1 of 5 runs of 2 x 6 sampled generations return other tokens without an error, and
most others end in shape-mismatch tracebacks. Another thread's request now decodes on the dynamic cache while a
generation holds the buffer (one warning), and each drafter call is atomic.
"""

from __future__ import annotations

import threading
import warnings

import pytest

from inference.methods import generate, generate_batch
from inference.runtime.static_steps import apply_graphs
from inference.runtime.verify import SamplingConfig
from runtime_support import one_thread, random_heads, tiny_llama, wrap  # noqa: F401 (autouse fixture)
from test_eagle3_decoding import random_drafter

SAMPLE = SamplingConfig(mode="sample", temperature=1.0)
PROMPTS = [[5, 17, 3, 88, 41, 9, 5, 17, 3], [60, 61, 7, 7, 30, 12, 44, 13]]
N = 24


def models():
    """(method, model, options): a plain loop, Medusa heads (stateless drafter calls), an EAGLE-3 drafter (its own
    static cache beside the backbone's)."""
    base = tiny_llama(vocab=96, layers=4, init=0.2)
    return [("autoregressive", wrap(base, None), {}), ("medusa", wrap(base, random_heads(base, seed=1)),
                                                       dict(tree="tree8")), ("eagle3", random_drafter(base), {})]


def decode(m, method, kw, prompt, seed, batched):
    if batched:
        out = generate_batch(m, [prompt, PROMPTS[1]], method, max_new_tokens=N, eos_token_ids=(), sampling=SAMPLE,
                             seed=seed, **kw)
        return [r.tokens for r in out.rows]
    return generate(m, prompt, method, max_new_tokens=N, eos_token_ids=(), sampling=SAMPLE, seed=seed, **kw).tokens


@pytest.mark.parametrize("batched", [False, True], ids=["batch1", "batched"])
def test_two_threads_never_mix_their_generations(batched):
    """Guards against: two threads generating on one model with static steps getting each other's tokens (or a
    traceback): every generation of both threads, run side by side, equals the same generation run alone."""
    for method, m, kw in models():
        apply_graphs(m, "uncaptured", log=lambda line: None)
        jobs = [(PROMPTS[t % 2], 7 + t) for t in range(2)]
        alone = [decode(m, method, kw, p, s, batched) for p, s in jobs]
        results, errors = [[] for _ in jobs], []

        def worker(t):
            try:
                for _ in range(4):
                    results[t].append(decode(m, method, kw, *jobs[t], batched))
            except Exception as e:   # noqa: BLE001 (reported below)
                errors.append(repr(e))

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # "another thread is decoding": the fallback, said per request
            threads = [threading.Thread(target=worker, args=(t,)) for t in range(2)]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
        assert not errors, (method, errors)
        assert all(r == [alone[t]] * 4 for t, r in enumerate(results)), method
        # the buffer is free again once both finished: a later request takes it without a fallback
        before = m.static.fallbacks
        assert decode(m, method, kw, *jobs[0], batched) == alone[0]
        assert m.static.fallbacks == before, method


def test_another_threads_request_falls_back_while_a_generation_holds_the_buffer():
    """Guards against: a request from a second thread while a first thread's generation (a stream paused between
    steps) holds the buffer taking it over; it decodes on the dynamic cache, saying so, and the first stream goes
    on to its own tokens (the same thread's second stream does the same: test_static_steps)."""
    from inference.methods import stream

    base = tiny_llama(vocab=96, layers=2, init=0.2)
    m = wrap(base, random_heads(base, seed=1))
    apply_graphs(m, "uncaptured", log=lambda line: None)
    want = generate(m, PROMPTS[0], "medusa", tree="tree8", max_new_tokens=N, eos_token_ids=(), sampling=SAMPLE,
                    seed=3).tokens
    other = generate(m, PROMPTS[1], "medusa", tree="tree8", max_new_tokens=N, eos_token_ids=(), sampling=SAMPLE,
                     seed=4).tokens
    s = stream(m, PROMPTS[0], "medusa", tree="tree8", max_new_tokens=N, eos_token_ids=(), sampling=SAMPLE, seed=3)
    it = iter(s)
    first = next(it)
    seen, got = [], []

    def second():
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            got.append(generate(m, PROMPTS[1], "medusa", tree="tree8", max_new_tokens=N, eos_token_ids=(),
                                sampling=SAMPLE, seed=4).tokens)
        seen.extend(str(x.message) for x in w)

    th = threading.Thread(target=second)
    th.start()
    th.join()
    assert got == [other]
    assert any("another thread is decoding on this model's static KV buffer" in x for x in seen), seen
    assert list(first) + [t for chunk in it for t in chunk] == want
