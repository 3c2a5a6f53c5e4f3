"""Exact sampling end to end for the batch-1 methods the other sampling tests leave out.

tests/runtime/test_runtime_sampling.py checks the tree sampler itself (and Medusa's decoding loop with
draft=topk), test_runtime_speculative.py the draft model, test_batch_methods.py / test_batch_decoding.py
the batched loops, test_eagle3_decoding.py / test_eagle3_lookup.py EAGLE-3 and its lookup hybrid. Here
the real ``generate`` loop of lookahead, medusa_lookup, batch-1 prompt_lookup and Medusa with
draft=sampled must emit tokens that follow the backbone's own law, with top-k and top-p filters too.

The backbone is test_runtime_sampling's peaky 12-token Llama, so the exact law of the first generated
tokens comes from one batched forward over every continuation of the prompt (enumeration). The prompt
holds every token, so a lookup always finds a match, and was picked so that drafts are accepted in a
good share of steps and rejected in the rest under every config (each test checks that share: a test
whose drafts are always or never accepted would not see a biased acceptance rule). Each test draws a
few hundred generations at fixed seeds (deterministic on the CPU) and compares the joint law of two
generated tokens with the exact one by chi-square (test_runtime_sampling's ``chi_square_pvalue``,
which also fails on any token of zero target probability).
"""

import dataclasses

import pytest
import torch

from inference.heads.medusa import MedusaHeads
from inference.heads.spec import HeadsSpec
from inference.methods import generate
from inference.runtime.verify import SamplingConfig

from runtime_support import one_thread, tiny_llama, wrap  # noqa: F401 (autouse fixture)
from test_runtime_sampling import TREE, V, _exact_law, chi_square_pvalue

# every token once, then a tail: 1-gram lookups always match, and their proposals are often (not always) right
PROMPT = [11, 5, 4, 1, 7, 0, 9, 8, 6, 10, 3, 2, 0, 9, 5, 11]
LOOKAHEAD_PROMPT = list(range(V)) * 2   # a window of V columns starts as all V tokens: step 2 always has a guess
LOOKUP = dict(num_tokens=2, min_ngram=1, max_ngram=1)

T1 = SamplingConfig(mode="sample", temperature=1.0)
TOP_K = SamplingConfig(mode="sample", temperature=1.0, top_k=3)
TOP_P = SamplingConfig(mode="sample", temperature=1.0, top_p=0.5)
COLD = SamplingConfig(mode="sample", temperature=0.8)


@pytest.fixture(scope="module")
def mm():
    """test_runtime_sampling's backbone with fresh Medusa heads (identity blocks + the base lm_head)."""
    model = tiny_llama(vocab=V, hidden=32, init=0.35, seed=5)
    spec = HeadsSpec(num_heads=2, num_layers=1, hidden_size=32, vocab_size=V)
    return wrap(model, MedusaHeads.from_lm_head(spec, model.lm_head.weight))


def exact_law(mm, prompt, cfg) -> torch.Tensor:
    """[V, V, V]: the backbone's law of the first three generated tokens after ``prompt`` (filtered by cfg)."""
    seqs = torch.cartesian_prod(*[torch.arange(V)] * 2)                      # [V^2, 2], y2 fastest
    ids = torch.cat([torch.tensor(prompt).expand(len(seqs), -1), seqs], 1)
    with torch.inference_mode():
        logits = mm.model(input_ids=ids).logits
    n0 = len(prompt) - 1
    # test_runtime_sampling's tables: contexts with j generated tokens, in base-V order
    tables = {0: (logits[:1, n0], None), 1: (logits[::V, n0 + 1], None), 2: (logits[:, n0 + 2], None)}
    return _exact_law(tables, cfg)


def check_law(mm, prompt, method, cfg, first: int, n: int = 400, **options) -> None:
    """n generations: the generated tokens ``first``, ``first + 1`` must follow their exact joint law
    (chi-square p > 1e-3), and the step emitting token ``first + 1`` (the one after the step emitting
    token ``first``, which emits one token for every method here) must have accepted a draft in a
    good share of the runs, but not in all: both branches of the acceptance rule were used."""
    counts = torch.zeros(V * V, dtype=torch.long)
    accepted = 0
    for seed in range(n):
        out = generate(mm, prompt, method, max_new_tokens=first + 2, sampling=cfg, seed=seed, eos_token_ids=(),
                       **options)
        assert out.accepted[:first] == [1] * first
        counts[out.tokens[first] * V + out.tokens[first + 1]] += 1
        accepted += out.accepted[first] > 1        # tokens the step produced (uncut): > 1 = a draft accepted
    law = exact_law(mm, prompt, cfg)
    law = law.sum(2) if first == 0 else law.sum(0)
    assert chi_square_pvalue(counts, law.reshape(-1)) > 1e-3
    assert 0.1 < accepted / n < 0.95, accepted / n


@pytest.mark.parametrize("cfg", [TOP_K, TOP_P], ids=["top_k3", "top_p0.5"])
def test_lookahead_samples_exactly(mm, cfg):
    """Guards against lookahead biasing sampled output: a pool guess accepted without the point-mass
    test, the bonus after a rejected guess drawn afresh from p instead of from the residual, or the
    top-k / top-p filters left out of verification. Its pool is empty at the first step, so the first
    step with guesses is the second: (y2, y3) must follow the backbone's law."""
    check_law(mm, LOOKAHEAD_PROMPT, "lookahead", cfg, first=1, n=600, window=V, ngram=2, guesses=2)


def test_medusa_lookup_samples_exactly(mm):
    """Guards against medusa_lookup biasing sampled output: a node of its trie (the heads' tree with
    the looked-up branch grafted on) accepted without the test, the bonus after a rejection drawn
    afresh from p instead of from the residual, or the temperature (0.8) left out of verification:
    (y1, y2) must follow the backbone's law."""
    check_law(mm, PROMPT, "medusa_lookup", COLD, first=0, tree=TREE, **LOOKUP)


def test_prompt_lookup_samples_exactly_at_batch_one(mm):
    """Guards against batch-1 prompt lookup (its own decoder and ``verify_chain``, not the batched
    loop test_batch_methods checks) biasing sampled output: a looked-up token accepted without the
    test, or a rejected one's residual not taken: (y1, y2) must follow the backbone's law."""
    check_law(mm, PROMPT, "prompt_lookup", T1, first=0, **LOOKUP)


@pytest.mark.parametrize("cfg", [T1, TOP_K, TOP_P], ids=["T1", "top_k3", "top_p0.5"])
def test_medusa_sampled_drafts_sample_exactly(mm, cfg):
    """Guards against the batch-1 Medusa loop with draft=sampled biasing output (test_runtime_sampling
    runs this rule in simulation, and its loop with draft=topk): drafts accepted without the
    min(1, p/q) test, p not replaced by the residual max(0, p - q) after a rejection, or the ratio
    taken with another q than the drafts were drawn from (the heads' softmax unfiltered while the
    draws were top-k / top-p filtered): (y1, y2) must follow the backbone's law."""
    cfg = dataclasses.replace(cfg, draft="sampled")
    check_law(mm, PROMPT, "medusa", cfg, first=0, tree=TREE)
