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
    (None, "input_ids must be a list of token ids or a tensor, got NoneType"),
    (torch.tensor([5.0, 6.0]), "got a tensor of torch.float32"),
    (b"hello", "input_ids must be token ids; encode text first"),              # decoded as ids 104, 101, ...
    ({5, 17, 3}, "input_ids must be a list of token ids or a tensor, got set"),   # in its hash order
    ({"ids": [P]}, r"a mapping of prompts needs 'input_ids' \(a tokenizer's output\)"),   # read by its keys
    ({"input_ids": [P, P]}, "batch size 2 is not supported: decode one sequence at a time"),
    (np.array([P, P]), "batch size 2 is not supported: decode one sequence at a time"),
    (np.array([[P]]), r"got an array of shape \(1, 1, 6\)"),
    ([np.arange(100)], r"got array\(\[.*\.\.\.$"),                           # one line, cut short
])
def test_prompt_ids_must_be_integers(m, prompt, fragment):
    """Guards against: non-integral prompt ids decoded after ``int()`` truncated them, a nested list or None
    failing with a TypeError from inside the conversion, bytes and a set read as token ids, a tokenizer's output
    refused as "got 'input_ids'", and a numpy prompt's whole array in a message of several lines."""
    with pytest.raises(UserError, match=fragment) as e:
        generate(m, prompt, "medusa", max_new_tokens=4)
    assert "\n" not in str(e.value)


def test_a_numpy_prompt_of_one_row_decodes_as_its_list(m):
    """Guards against: ``np.array([ids])`` refused while ``torch.tensor([ids])`` and numpy batches were taken."""
    want = generate(m, P, "medusa", max_new_tokens=6, eos_token_ids=()).tokens
    assert generate(m, np.array([P]), "medusa", max_new_tokens=6, eos_token_ids=()).tokens == want
    assert generate(m, np.array(P, dtype=np.int32), "medusa", max_new_tokens=6, eos_token_ids=()).tokens == want


@pytest.mark.parametrize("eos", [10 ** 6, -1, [0, "V"]], ids=["huge", "negative", "vocab_size"])
def test_an_eos_id_outside_the_vocabulary_is_refused(m, eos):
    """Guards against: an EOS id the backbone cannot emit (a typo, -1 for "none") accepted, the reply then running
    to max_new_tokens as if the model never ended."""
    eos = [m.vocab_size if e == "V" else e for e in eos] if isinstance(eos, list) else eos
    with pytest.raises(UserError, match=r"eos_token_ids must lie in 0\.\.\d+ \(the backbone's vocabulary\)"):
        generate(m, P, "medusa", max_new_tokens=4, eos_token_ids=eos)
    with pytest.raises(UserError, match="eos_token_ids must lie in"):
        generate_batch(m, [P, P[:3]], "medusa", max_new_tokens=4, eos_token_ids=eos)


@pytest.mark.parametrize("mode", ["sample", "typical"])
@pytest.mark.parametrize("method", ["medusa", "autoregressive"])
@pytest.mark.parametrize("fields", [dict(temperature=1e-46), dict(temperature=0.7, top_p=1e-46)],
                         ids=["temperature", "top_p"])
def test_values_below_float32s_range_sample_the_argmax(m, mode, method, fields):
    """Guards against: a temperature or top_p that passes ``> 0`` but is 0 in float32 (1e-46): 0 / 0 at the
    maximum, every token of the nucleus dropped, then torch's "probability tensor contains either inf, nan"."""
    want = generate(m, P, method, max_new_tokens=6, eos_token_ids=()).tokens
    cfg = SamplingConfig(mode=mode, **fields)
    assert generate(m, P, method, max_new_tokens=6, eos_token_ids=(), sampling=cfg, seed=1).tokens == want


def test_a_padded_prompt_is_refused_where_the_pad_token_is_no_text_marker():
    """Guards against: ``generate_batch(m, tokenizer(texts, padding=True).input_ids)`` decoding the pad tokens as part
    of each shorter prompt (the runtime takes no attention mask): its rows differ from the unpadded rows' answers.
    A pad token that is also the end of text (SmolLM2's) is no sign of padding and stays accepted."""
    from types import SimpleNamespace

    base = tiny_llama(vocab=96, init=0.2)
    padded = wrap(base, random_heads(base, seed=1))
    padded.tokenizer = SimpleNamespace(pad_token_id=90, bos_token_id=91)
    with pytest.raises(UserError, match=r"prompt 1 ends with the tokenizer's pad token \(id 90\): padding would"):
        generate_batch(padded, [P, P[:3] + [90, 90, 90]], "medusa", max_new_tokens=4)
    with pytest.raises(UserError, match="the prompt starts with the tokenizer's pad token"):
        generate(padded, [90] + P, "medusa", max_new_tokens=4)
    assert len(generate_batch(padded, [P, P[:3]], "medusa", max_new_tokens=4).rows) == 2
    padded.eos_token_ids = [90]
    assert generate(padded, P + [90], "medusa", max_new_tokens=4).tokens


def test_a_tokenizers_output_decodes_its_rows_without_the_padding_its_mask_marks(m):
    """Guards against: ``generate_batch(m, tokenizer(texts, padding=True, return_tensors="pt"))`` (transformers'
    way of giving prompts) refused, or its padding decoded as part of the shorter prompts; a mask with a hole
    inside a prompt taken as padding at its ends."""
    want = [r.tokens for r in generate_batch(m, [P, P[:3]], "medusa", max_new_tokens=5, eos_token_ids=()).rows]
    for ids, mask in (([P, P[:3] + [0, 0, 0]], [[1] * 6, [1, 1, 1, 0, 0, 0]]),     # right padding
                      ([P, [0, 0, 0] + P[:3]], [[1] * 6, [0, 0, 0, 1, 1, 1]])):    # left padding
        enc = {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask)}
        assert [r.tokens for r in generate_batch(m, enc, "medusa", max_new_tokens=5, eos_token_ids=()).rows] == want
    listed = {"input_ids": [torch.tensor(P), torch.tensor(P[:3] + [0, 0, 0])],   # a list of row tensors
              "attention_mask": [torch.ones(6), torch.tensor([1, 1, 1, 0, 0, 0])]}
    assert [r.tokens for r in generate_batch(m, listed, "medusa", max_new_tokens=5, eos_token_ids=()).rows] == want
    with pytest.raises(UserError, match="the prompt is empty"):   # was "batch size 0 is not supported"
        generate(m, {"input_ids": []}, "medusa", max_new_tokens=4)
    one = {"input_ids": torch.tensor([[0, 0] + P]), "attention_mask": torch.tensor([[0, 0] + [1] * 6])}
    assert generate(m, one, "medusa", max_new_tokens=5, eos_token_ids=()).tokens == want[0]
    holed = {"input_ids": [P, P], "attention_mask": [[1] * 6, [1, 1, 0, 1, 1, 1]]}
    with pytest.raises(UserError, match="row 1's attention_mask has a hole inside the prompt"):
        generate_batch(m, holed, "medusa", max_new_tokens=4)
    with pytest.raises(UserError, match="attention_mask must have input_ids' shape"):
        generate_batch(m, {"input_ids": [P, P], "attention_mask": [[1] * 6]}, "medusa", max_new_tokens=4)


def test_a_padded_batch_is_refused_where_the_pad_token_is_also_the_end_of_text():
    """Guards against: ``generate_batch(m, tokenizer(texts, padding=True).input_ids)`` with a pad token that is also
    the end of text (``tokenizer.pad_token = tokenizer.eos_token``, the usual setting) decoding the shorter rows'
    padding as part of their prompts without a word; rows of one length ending alike (no padding) are taken."""
    from types import SimpleNamespace

    base = tiny_llama(vocab=96, init=0.2)
    padded = wrap(base, random_heads(base, seed=1))
    padded.tokenizer = SimpleNamespace(pad_token_id=90, bos_token_id=91)
    padded.eos_token_ids = [90]
    with pytest.raises(UserError, match=r"prompt 1 ends with the pad token \(id 90\) and others do not"):
        generate_batch(padded, [P, P[:3] + [90, 90, 90]], "medusa", max_new_tokens=4)
    with pytest.raises(UserError, match="prompts 0, 2 start with the pad token"):
        generate_batch(padded, torch.tensor([[90] + P[:5], P, [90, 90] + P[:4]]), "medusa", max_new_tokens=4)
    assert len(generate_batch(padded, [P[:5] + [90], P[1:] + [90]], "medusa", max_new_tokens=4).rows) == 2
    assert len(generate_batch(padded, [P, P[:3]], "medusa", max_new_tokens=4).rows) == 2


def test_small_api_mistakes_are_one_line_before_decoding(m, tmp_path):
    """Guards against: a callback that is no function failing after the prompt's prefill, a token list given to
    ``stream_text`` failing with "'int' object is not iterable", numpy ranks in a tree refused as not integers."""
    from inference.runtime.decode import stream_text

    with pytest.raises(UserError, match="on_tokens must be a function"):
        generate(m, P, "medusa", max_new_tokens=4, on_tokens="print")
    with pytest.raises(UserError, match="use answer_text"):
        list(stream_text(m.tokenizer, [5, 6, 7]))
    tree = [[np.int64(0)], [np.int64(0), np.int64(0)]]
    assert (generate(m, P, "medusa", max_new_tokens=6, tree=tree).tokens
            == generate(m, P, "medusa", max_new_tokens=6, tree=[[0], [0, 0]]).tokens)


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
    (dict(typical_epsilon=1e300), r"typical_epsilon caps a probability: it must be in \(0, 1\]"),   # torch overflow
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
