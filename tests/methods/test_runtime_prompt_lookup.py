"""Prompt lookup decoding (inference/prompt_lookup.py): the n-gram lookup, forced acceptance with a
scripted model, greedy identity on a tiny random Llama, and bad settings."""

import pytest
import torch

from inference.errors import UserError
from inference.methods.prompt_lookup import NGramIndex, PromptLookupDecoder, PromptLookupSettings
from inference.methods import generate
from inference.runtime.verify import SamplingConfig

from runtime_support import one_thread, sequential_kv  # noqa: F401 (autouse fixture)
from runtime_support import PLAIN_PROMPT, plain_greedy, plain_model  # noqa: F401  (fixtures m, greedy)
from scripted_lm import ScriptedLM, cached_tokens

PROMPT = PLAIN_PROMPT
V = 96


def test_lookup_takes_the_latest_earlier_occurrence_of_the_longest_suffix():
    """Guards against proposing from the oldest match, preferring a short n-gram over a longer one,
    or matching the current suffix with itself."""
    idx = NGramIndex(1, 3)
    idx.extend([1, 2, 3, 9, 2, 3, 7, 8, 4, 2, 3])
    assert idx.propose(3) == [7, 8, 4]          # "2 3": latest earlier occurrence is at 4..5, not 1..2
    idx.extend([7])
    assert idx.propose(2) == [8, 4]             # "2 3 7" (trigram) wins
    idx.extend([5])
    assert idx.propose(4) == []                 # "7 5", "5": never seen before
    run = NGramIndex(1, 2)
    run.extend([6, 6, 6])
    assert run.propose(5) == [6]                # overlapping match: what exists so far, not past the end


P_FULL, P_ZERO, P_PART, P_NONE = [10, 11, 12, 13, 6, 5], [10, 20, 21, 6, 5], [10, 11, 12, 20, 5], [1, 2, 3, 4, 5]
T = list(range(10, 30))


@pytest.mark.parametrize("prompt, proposed, accepted", [(P_FULL, 3, 3), (P_ZERO, 3, 0), (P_PART, 3, 2),
                                                        (P_NONE, 0, 0)], ids=["full", "zero", "partial", "no-match"])
def test_forced_acceptance_counts_and_cache_rollback(prompt, proposed, accepted):
    """Guards against wrong acceptance counts and caches that keep rejected guesses: the root (10)
    occurs earlier in the prompt, followed by a continuation that is right for 3, 0 or 2 tokens."""
    lm = ScriptedLM(prompt + T, 32)
    dec = PromptLookupDecoder(lm, PromptLookupSettings(num_tokens=3))
    assert dec.prefill(torch.tensor([prompt]), max_new_tokens=16) == T[0]
    new, n = dec.step()
    assert n == proposed and new == T[1:accepted + 2]
    assert lm.calls == [len(prompt), 1 + proposed]
    assert dec.cache.length == len(prompt) + 1 + accepted
    assert cached_tokens(dec.cache) == prompt + T[:accepted + 1]




@pytest.mark.parametrize("settings", [PromptLookupSettings(), PromptLookupSettings(num_tokens=1, max_ngram=1),
                                      PromptLookupSettings(num_tokens=20, max_ngram=5, min_ngram=2)],
                         ids=["default", "one-token", "long"])
def test_greedy_prompt_lookup_is_token_identical(m, greedy, settings):
    """Guards against prompt lookup changing the greedy output."""
    out = generate(m, PROMPT, "prompt_lookup", options=settings, max_new_tokens=48)
    assert out.tokens == greedy and out.finish_reason == "length"
    assert all(0 <= p <= settings.num_tokens for p in out.proposed)


def test_repeating_text_is_accepted_and_caches_stay_exact(m, greedy):
    """Guards against lookups that never fire on repeating text, and against stale cache rows."""
    out = generate(m, PROMPT, "prompt_lookup", max_new_tokens=48)
    assert out.tau > 1.5 and 0 < out.acceptance_rate <= 1
    dec = PromptLookupDecoder(m)
    dec.prefill(torch.tensor([PROMPT]), max_new_tokens=40)
    seq = PROMPT + [dec.root]
    for _ in range(8):
        seq += dec.step()[0]
        for layer, (k_ref, v_ref) in zip(dec.cache.layers, sequential_kv(m, seq[:-1])):
            torch.testing.assert_close(layer.keys, k_ref, atol=1e-5, rtol=0)
            torch.testing.assert_close(layer.values, v_ref, atol=1e-5, rtol=0)


def test_sampling_is_reproducible_and_eos_stops(m, greedy):
    """Guards against seeds being ignored, and emitting past an EOS inside an accepted proposal."""
    cfg = SamplingConfig(mode="sample", temperature=0.9)
    a = generate(m, PROMPT, "prompt_lookup", max_new_tokens=24, sampling=cfg, seed=5)
    b = generate(m, PROMPT, "prompt_lookup", max_new_tokens=24, sampling=cfg, seed=5)
    assert a.tokens == b.tokens and len(a.tokens) == 24
    eos = greedy[20]
    out = generate(m, PROMPT, "prompt_lookup", max_new_tokens=48, eos_token_ids=[eos])
    assert out.tokens == greedy[:greedy.index(eos) + 1] and out.finish_reason == "eos"


@pytest.mark.parametrize("kw, words", [({"num_tokens": 0}, "num_tokens"), ({"max_ngram": 0}, "max_ngram"),
                                       ({"min_ngram": 3, "max_ngram": 2}, "exceeds")])
def test_bad_settings_are_one_line_errors(kw, words):
    """Guards against impossible lookup settings reaching the decoder."""
    with pytest.raises(UserError, match=words):
        PromptLookupSettings(**kw)
