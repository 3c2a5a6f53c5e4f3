"""The Python API's decoding arguments (``generate``, ``stream``, ``generate_batch``, ``SamplingConfig``): a wrong
type or value is one ``UserError`` naming the argument, raised before anything decodes; nothing is rounded, read
digit by digit or left to fail deep in torch; a refused call leaves the model decoding as before."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from inference.errors import UserError
from inference.methods import generate, generate_batch, stream
from inference.runtime.verify import SamplingConfig
from runtime_support import one_thread, random_heads, tiny_llama, wrap  # noqa: F401 (autouse fixture)

P = [5, 17, 3, 88, 41, 9]


@pytest.fixture(scope="module")
def m():
    base = tiny_llama(vocab=96, init=0.2)
    return wrap(base, random_heads(base, seed=1))


@pytest.mark.parametrize("method", ["medusa", "autoregressive", "hf_generate"])
@pytest.mark.parametrize("kwargs, fragment", [
    (dict(max_new_tokens=2.5), "max_new_tokens must be an integer >= 1, got 2.5"),   # rounded, or a deep TypeError
    (dict(max_new_tokens=float("nan")), "max_new_tokens must be an integer"),        # hf_generate never stopped
    (dict(max_new_tokens="5"), "max_new_tokens must be an integer"),
    (dict(max_new_tokens=None), "max_new_tokens must be an integer"),
    (dict(max_steps=1.5), "max_steps must be None or an integer >= 1"),                 # ran 7 tokens
    (dict(max_steps=-1), "max_steps must be None or an integer >= 1"),                  # ran 1 token
    (dict(seed=2 ** 70), "seed must be None or an integer"),                            # torch's overflow
    (dict(seed=7.9), "seed must be None or an integer"),                                # silently 7
    (dict(eos_token_ids="198"), "eos_token_ids must be a token id or a list"),          # stopped on 1, 9 and 8
    (dict(eos_token_ids=[None]), "eos_token_ids must be a token id or a list"),
    (dict(eos_token_ids=iter([3])), "eos_token_ids must be a token id or a list"),       # checked = spent
    (dict(sampling={"mode": "sample"}), "sampling must be a SamplingConfig"),           # AttributeError
])
def test_a_bad_call_argument_is_one_line(m, method, kwargs, fragment):
    """Guards against: a decoding call's wrong argument type or value failing deep (a cache allocation's TypeError,
    torch's seed overflow, an AttributeError), being rounded or read otherwise (2.5 tokens as 3, a seed 7.9 as 7,
    EOS "198" as the ids 1, 9 and 8), or never stopping (NaN tokens under transformers' generate)."""
    with pytest.raises(UserError, match=fragment.replace("(", r"\(")) as e:
        generate(m, P, method, **{"max_new_tokens": 4, **kwargs})
    assert "\n" not in str(e.value)
    if method != "hf_generate":   # the methods that decode batches too
        with pytest.raises(UserError, match=fragment.replace("(", r"\(")):
            generate_batch(m, [P, P[:3]], method, **{"max_new_tokens": 4, **kwargs})


@pytest.mark.parametrize("prompt, fragment", [
    ([5.9, 6.2, 7.0], "input_ids must be integer token ids, got 5.9"),   # truncated to 5, 6, 7
    ([True, False, True], "input_ids must be integer token ids, got True"),
    ([P], "input_ids must be integer token ids, got \\["),                # a nested list: int()'s TypeError
    (None, "input_ids must be a list of token ids, got NoneType"),
    (torch.tensor([5.0, 6.0]), "got a torch.float32 tensor"),
])
def test_prompt_ids_must_be_integers(m, prompt, fragment):
    """Guards against: non-integral prompt ids decoded after ``int()`` truncated them, and a nested list or None
    failing with a TypeError from inside the conversion."""
    with pytest.raises(UserError, match=fragment):
        generate(m, prompt, "medusa", max_new_tokens=4)


def test_accepted_forms_still_decode_alike(m):
    """Guards against: the checks refusing what was always accepted: numpy integers, a single EOS id, a [1, L]
    tensor, a seed at the top of torch's range; and a refused call changing what the next call decodes."""
    want = generate(m, P, "medusa", max_new_tokens=6, eos_token_ids=()).tokens
    with pytest.raises(UserError):
        generate(m, P, "medusa", max_new_tokens=2.5)
    assert generate(m, [np.int64(i) for i in P], "medusa", max_new_tokens=np.int64(6), eos_token_ids=()).tokens == want
    assert generate(m, torch.tensor([P]), "medusa", max_new_tokens=6, eos_token_ids=[]).tokens == want
    stop = want[2]
    assert generate(m, P, "medusa", max_new_tokens=6, eos_token_ids=stop).tokens == want[:want.index(stop) + 1]
    sample = SamplingConfig(mode="sample")
    assert generate(m, P, "medusa", max_new_tokens=4, sampling=sample, seed=2 ** 64 - 1).tokens


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(temperature="0.7"), "temperature must be a number"),
    (dict(temperature=None), "temperature must be a number"),
    (dict(top_p="0.5"), "top_p must be a number"),
    (dict(top_k=2.5), "top_k must be an integer"),      # accepted, then topk()'s TypeError at the first step
    (dict(top_k=True), "top_k must be an integer"),
    (dict(top_k=None), "top_k must be an integer"),
    (dict(typical_epsilon=math.inf), "typical_epsilon and typical_delta must be > 0"),
])
def test_sampling_config_types(kwargs, fragment):
    """Guards against: ``SamplingConfig`` checking values but not types: a string temperature's TypeError from its
    own comparison, a float top_k accepted and failing inside the first step."""
    with pytest.raises(UserError, match=fragment):
        SamplingConfig(mode="sample", **kwargs)


def test_a_stream_checks_its_prompt_when_made_and_keeps_its_result(m):
    """Guards against: ``stream(m, [])`` accepted until first iterated, and a stream iterated twice losing its
    ``result`` (the spent generator's None overwrote it)."""
    with pytest.raises(UserError, match="the prompt is empty"):
        stream(m, [], "medusa", max_new_tokens=4)
    s = stream(m, P, "medusa", max_new_tokens=4, eos_token_ids=())
    tokens = [t for chunk in s for t in chunk]
    assert s.result is not None and s.result.tokens == tokens
    assert list(s) == [] and s.result.tokens == tokens


@pytest.mark.parametrize("model", [None, "runs/x/heads"])
def test_a_model_that_is_none_is_one_line(model):
    """Guards against: ``generate(None, ...)`` or a heads path given for the model failing with an AttributeError
    inside the model wrapper."""
    with pytest.raises(UserError, match="the model must be a MedusaModel"):
        generate(model, P, "autoregressive", max_new_tokens=4)


def test_calibrated_tree_names_where_it_is_measured(m):
    """Guards against: ``tree="calibrated:N"``, which the options' help lists, refused as an unknown tree whose list
    of accepted forms leaves it out."""
    with pytest.raises(UserError, match="measured by medusa-eval on its calibration prompts"):
        generate(m, P, "medusa", tree="calibrated:8", max_new_tokens=4)
