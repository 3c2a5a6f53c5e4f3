"""Lookahead decoding (inference/lookahead.py): the one-forward mask and positions, forced
acceptance through the candidate trie with scripted models, the window / n-gram pool update,
greedy identity on tiny random Llamas, and bad settings."""

import pytest
import torch

from inference.errors import UserError
from inference.methods.lookahead import LookaheadDecoder, LookaheadSettings, NGramPool, build_trie
from inference.methods import generate
from inference.runtime.verify import SamplingConfig

from runtime_support import one_thread, sequential_kv  # noqa: F401 (autouse fixture)
from runtime_support import PLAIN_PROMPT, plain_greedy, plain_model  # noqa: F401  (fixtures m, greedy)
from scripted_lm import ScriptedLM, cached_tokens

PROMPT = PLAIN_PROMPT
V = 96




def test_every_window_and_trie_node_sees_exactly_its_context(m):
    """Guards against a wrong lookahead mask or wrong position ids: each window token's logits must
    equal running its Jacobi column (level 0 up to its column, then its own column upwards) as an
    ordinary sequence, and each trie node's those of prefix + root + its ancestors."""
    s = LookaheadSettings(window=3, ngram=3, guesses=3)
    dec = LookaheadDecoder(m, s)
    dec.prefill(torch.tensor([PROMPT]), max_new_tokens=8)
    dec.levels = [[11, 12, 13], [21, 22, 23]]
    for gram in ([dec.root, 40, 41], [dec.root, 40, 42], [dec.root, 50, 51]):
        dec.pool.add(gram)
    x = dec.inputs()
    assert x.trie.num_nodes == 6                              # 40 and 50, then 41 | 42 under 40, 51
    with torch.inference_mode():
        got = m.logits(m.hidden(torch.tensor([x.tokens]), x.positions[None], dec.cache, x.mask)[0])

        def ref(seq):
            return m.model(input_ids=torch.tensor([seq])).logits[0, -1]

        base = PROMPT + [dec.root]
        torch.testing.assert_close(got[0], ref(base), atol=1e-5, rtol=0)
        for j in range(2):
            for i in range(3):
                column = dec.levels[0][:i + 1] + [dec.levels[k][i] for k in range(1, j + 1)]
                torch.testing.assert_close(got[1 + j * 3 + i], ref(base + column), atol=1e-5, rtol=0)
        tree_tokens = x.trie_tokens
        for v in range(1, x.trie.num_nodes):
            ancestors = [u for u in range(1, x.trie.num_nodes) if x.trie.tree_mask[v, u]]
            torch.testing.assert_close(got[6 + v], ref(base + [tree_tokens[u] for u in ancestors]), atol=1e-5, rtol=0)


P = [1, 2, 3, 4, 5]
T = list(range(10, 30))


@pytest.mark.parametrize("case, grams, accepted", [
    ("full", [[31, 30, 29], [11, 12, 13]], 3),
    ("zero", [[31, 30, 29], [30, 11, 12]], 0),
    ("partial", [[11, 12, 31], [11, 30, 29]], 2),
    ("second-branch", [[11, 12, 13], [11, 30, 29]], 3),
], ids=["full", "zero", "partial", "older-branch"])
def test_forced_acceptance_through_the_trie_and_compacted_cache(case, grams, accepted):
    """Guards against wrong acceptance lengths through the candidate trie and against a cache that
    keeps window tokens or rejected branches (compaction must gather the accepted trie rows)."""
    lm = ScriptedLM(P + T, 32)
    dec = LookaheadDecoder(lm, LookaheadSettings(window=3, ngram=4, guesses=3))
    assert dec.prefill(torch.tensor([P]), max_new_tokens=16) == T[0]
    for g in grams:
        dec.pool.add([T[0]] + g)
    new, proposed = dec.step()
    assert proposed == 3 and new == T[1:accepted + 2]
    n_trie = len({tuple(g[:d]) for g in grams for d in range(1, 4)})
    assert lm.calls == [len(P), 1 + 3 * 3 + n_trie]            # root + window + trie in ONE forward
    assert dec.cache.length == len(P) + 1 + accepted and cached_tokens(dec.cache) == P + T[:accepted + 1]


def test_window_shift_and_ngram_pool_follow_the_jacobi_trajectory():
    """Guards against n-grams collected from the wrong cells or a window that does not advance:
    after a step, column i must give (level0[i], .., level_{N-2}[i], guess[i]) and the guesses
    become the last level."""
    lm = ScriptedLM(P + T, 32)
    dec = LookaheadDecoder(lm, LookaheadSettings(window=3, ngram=3, guesses=2))
    dec.prefill(torch.tensor([P]), max_new_tokens=16)
    dec.levels = [[1, 2, 3], [4, 5, 6]]
    past = dec.past
    dec.step()
    guesses = [(P + T)[past + i + 3] for i in range(3)]      # last level sits at past+2+i, predicts +1
    assert dec.levels == [[4, 5, 6], guesses]
    for i, first in enumerate([1, 2, 3]):
        assert dec.pool.candidates(first) == [([4, 5, 6][i], guesses[i])]


def test_pool_keeps_the_newest_distinct_continuations_and_the_trie_merges_prefixes():
    """Guards against duplicate candidates (wasted verification) and an unbounded pool."""
    pool = NGramPool(2)
    for g in ([7, 1, 2], [7, 1, 3], [7, 1, 2], [7, 4, 5]):
        pool.add(g)
    assert pool.candidates(7) == [(4, 5), (1, 2)] and pool.candidates(8) == []
    tree, tokens = build_trie([(1, 2), (1, 3), (4, 5)])
    assert tree.num_nodes == 6 and sorted(tokens[1:]) == [1, 2, 3, 4, 5]
    assert build_trie([]) == (None, [-1])


@pytest.mark.parametrize("settings", [LookaheadSettings(), LookaheadSettings(window=2, ngram=2, guesses=1),
                                      LookaheadSettings(window=7, ngram=5, guesses=10)],
                         ids=["default", "smallest", "large"])
def test_greedy_lookahead_is_token_identical(m, greedy, settings):
    """Guards against lookahead changing the greedy output (masks, positions, compaction, bonus)."""
    out = generate(m, PROMPT, "lookahead", options=settings, max_new_tokens=48)
    assert out.tokens == greedy and out.finish_reason == "length"
    assert out.steps == len(out.proposed) and all(p in (0, settings.ngram - 1) for p in out.proposed)


def test_lookahead_accepts_guesses_on_a_repetitive_continuation(m, greedy):
    """Guards against a pool that never yields accepted guesses (the method would be a slow
    plain decoder): the tiny model's greedy text repeats, so some steps must accept tokens."""
    out = generate(m, PROMPT, "lookahead", max_new_tokens=48)
    assert out.tau > 1.2 and 0 < out.acceptance_rate <= 1


def test_caches_equal_sequential_caches_after_each_step(m):
    """Guards against window rows or rejected trie rows surviving in the KV cache."""
    dec = LookaheadDecoder(m, LookaheadSettings(window=3, ngram=3, guesses=4))
    dec.prefill(torch.tensor([PROMPT]), max_new_tokens=40)
    seq = PROMPT + [dec.root]
    for _ in range(10):
        seq += dec.step()[0]
        ref = sequential_kv(m, seq[:-1])
        for layer, (k_ref, v_ref) in zip(dec.cache.layers, ref):
            torch.testing.assert_close(layer.keys, k_ref, atol=1e-5, rtol=0)
            torch.testing.assert_close(layer.values, v_ref, atol=1e-5, rtol=0)


def test_sampling_is_reproducible(m):
    """Guards against seeds being ignored by lookahead in sample and typical modes."""
    for cfg in (SamplingConfig(mode="sample", temperature=0.9, draft="sampled"),
                SamplingConfig(mode="typical", temperature=0.9)):
        a = generate(m, PROMPT, "lookahead", max_new_tokens=24, sampling=cfg, seed=3)
        b = generate(m, PROMPT, "lookahead", max_new_tokens=24, sampling=cfg, seed=3)
        assert a.tokens == b.tokens and len(a.tokens) == 24


@pytest.mark.parametrize("kw, words", [({"window": 1}, "window"), ({"ngram": 1}, "ngram"), ({"guesses": 0}, "guesses"),
                                       ({"window": 2.5}, "window")])
def test_bad_settings_are_one_line_errors(kw, words):
    """Guards against W or N < 2 (no Jacobi window / no n-gram) or G < 1 reaching the decoder."""
    with pytest.raises(UserError, match=words):
        LookaheadSettings(**kw)
