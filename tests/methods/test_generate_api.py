"""The public decoding API as a user calls it: ``generate`` / ``generate_batch`` / ``stream`` and ``medusa-generate``.

What the other decoding tests leave out: the text a stream prints (a character whose bytes span two tokens, or two
steps), the finish reason every method reports, and seeded sampling of one prompt alike through ``generate`` and
``generate_batch`` for every method that decodes batches.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from inference.methods import generate, generate_batch, stream, stream_text
from inference.runtime.decode import GenerationOutput, TokenStream
from inference.runtime.verify import SamplingConfig
from medusa_train.backbone import byte_tokenizer

from runtime_support import one_thread, random_heads, tiny_llama, wrap  # noqa: F401 (autouse fixture)
from test_eagle3_decoding import random_drafter

TEXT = "é€ 日本 ok 🙂!"   # characters of 2, 3 and 4 UTF-8 bytes: one byte-level token per byte
PROMPT = [5, 17, 3, 88, 41, 9]


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def chunked(ids: list[int], size: int) -> list[list[int]]:
    return [ids[i:i + size] for i in range(0, len(ids), size)]


@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_stream_text_keeps_characters_split_across_chunks(tok, size):
    """Guards against streamed text losing a character whose bytes span two chunks (tokens, or steps): decoding each
    chunk alone, or writing what a partial character decodes to (U+FFFD) and then only what came after it, printed
    U+FFFD and never the character. The pieces must join to the whole answer's text."""
    ids = tok.encode(TEXT)
    assert len(ids) > len(TEXT)                      # multi-byte characters do span tokens here
    pieces = list(stream_text(tok, chunked(ids, size)))
    assert "".join(pieces) == TEXT and "\ufffd" not in "".join(pieces)


def test_stream_text_ends_with_what_stayed_incomplete(tok):
    """Guards against a held-back partial character being dropped when the stream ends (a budget cutting a
    character): the pieces still join to the decoded tokens, U+FFFD included, as ``generate``'s tokens decode."""
    ids = tok.encode(TEXT)[:3]                       # "é" (two bytes) and the first byte of "€"
    assert "".join(stream_text(tok, [ids[:1], ids[1:]])) == tok.decode(ids) == "é\ufffd"


class PieceTokenizer:
    """A SentencePiece-style tokenizer ("▁" marks a word's leading space, the first one stripped on decode)
    whose decode applies transformers 4's ``clean_up_tokenization_spaces`` unless told not to, as Llama-3's
    tokenizer config asks; it counts the tokens each decode reads."""

    PIECES = ["▁it", "▁'", "s", "▁fine", "▁.", "▁do", "n", "▁'", "t", "▁go", "▁,",
              "▁ok"]

    def __init__(self):
        self.read = []

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=True):
        self.read.append(len(ids))
        text = "".join(self.PIECES[i] for i in ids).replace("▁", " ").removeprefix(" ")
        if clean_up_tokenization_spaces:
            for a, b in ((" .", "."), (" ,", ","), (" '", "'"), ("n't", "n't")):
                text = text.replace(a, b)
        return text


@pytest.mark.parametrize("size", [1, 2, 3])
def test_stream_text_joins_to_the_answer_whatever_the_tokenizer_rewrites(size):
    """Guards against streamed text that is not the answer's text: a tokenizer cleaning up spaces (transformers 4
    with Llama-3's config) rewrote what a later token follows ("it 's" -> "it's"), so the pieces printed lost or
    garbled letters ("it ' fine"); against a SentencePiece word's leading space lost when only the newest tokens are
    decoded; and against a stream decoding the whole answer every step (its cost growing with the answer)."""
    from inference.runtime.decode import answer_text

    tok = PieceTokenizer()
    ids = list(range(len(PieceTokenizer.PIECES))) * 4
    pieces = list(stream_text(tok, chunked(ids, size)))
    assert "".join(pieces) == answer_text(tok, ids) == " ".join(["it 's fine . don 't go , ok"] * 4)
    tok.read.clear()
    list(stream_text(tok, chunked(ids, size)))
    assert max(tok.read[:-1]) <= 2 * size   # each step reads its window; the end reads the whole answer once


def test_medusa_generate_prints_characters_split_across_tokens(monkeypatch, capsys, tok):
    """Guards against medusa-generate (one prompt, streamed) printing U+FFFD in place of every character whose
    bytes span two tokens: it decoded the answer so far, wrote the text past what it had written, and so skipped
    the finished character once its last byte came. stdout must be the answer's text."""
    import inference.cli as cli
    import inference.cli_run as cli_run
    import inference.methods as methods

    ids = tok.encode(TEXT)

    def fake_stream(m, prompt, method, **kw):
        def steps():
            for chunk in chunked(ids, 2):
                yield chunk
            return GenerationOutput(tokens=list(ids), prompt_tokens=len(prompt), finish_reason="length",
                                    accept_lengths=[2] * (len(ids) // 2))
        return TokenStream(steps())

    model = SimpleNamespace(tokenizer=tok, static=None)
    monkeypatch.setattr(cli_run, "heads_spec", lambda cfg: None)
    monkeypatch.setattr(cli_run, "generate_options", lambda cfg, spec, several, size: ("autoregressive", None, False))
    monkeypatch.setattr(cli_run, "check_prompts_fit", lambda cfg, texts, spec: None)
    monkeypatch.setattr(cli_run, "_load", lambda cfg: model)
    monkeypatch.setattr(cli_run, "encode_prompts", lambda m, texts, cfg: [[1, 2]])
    monkeypatch.setattr(methods, "stream", fake_stream)
    cli_run.run_generate(cli.GenerateConfig(heads="h", prompt="hi"))
    out, err = capsys.readouterr()
    assert out == TEXT, repr(out)
    assert "finish: length" in err


@pytest.fixture(scope="module")
def backbone():
    """A random backbone whose sampled continuations vary (init 0.3: no one token dominates)."""
    return tiny_llama(vocab=96, hidden=64, layers=4, seed=0, init=0.3)


def test_hf_generate_reports_the_runtimes_finish_reasons():
    """Guards against method hf_generate returning finish_reason "hf", none of ``GenerationOutput``'s documented
    reasons ("eos", "length", "steps"): a caller telling an answer cut at max_new_tokens from one that ended at EOS
    read neither."""
    m = wrap(tiny_llama(vocab=96, seed=0), None)
    free = generate(m, PROMPT, "autoregressive", max_new_tokens=12, eos_token_ids=()).tokens
    out = generate(m, PROMPT, "hf_generate", max_new_tokens=12, eos_token_ids=())
    assert out.tokens == free and out.finish_reason == "length"
    eos = free[4]
    out = generate(m, PROMPT, "hf_generate", max_new_tokens=12, eos_token_ids=[eos])
    assert out.tokens == free[:free.index(eos) + 1] and out.finish_reason == "eos"


def batched_methods(backbone):
    plain, drafter = wrap(backbone, None), random_drafter(backbone)
    return {"autoregressive": (plain, {}), "draft": (plain, {"draft": "self:2", "k": 3}),
            "prompt_lookup": (plain, {"num_tokens": 4}), "medusa": (wrap(backbone, random_heads(backbone)), {}),
            "eagle3": (drafter, {}), "eagle3_lookup": (drafter, {})}


@pytest.mark.parametrize("mode", ["sample", "typical"])
def test_a_batch_of_one_samples_as_generate_with_the_same_seed(backbone, mode):
    """Guards against ``generate_batch([p], seed=s)`` and ``generate(p, seed=s)`` drawing different tokens: the
    autoregressive loop sampled each token with ``multinomial`` where the plain batched loop draws by inverse CDF
    from a step's uniforms, and the draft model verified its chain with another rule's draws than its batched
    form. Both are exact, but the generator's draws then fell elsewhere and one seed gave two answers."""
    cfg = SamplingConfig(mode=mode, temperature=1.0 if mode == "sample" else 0.8)
    for name, (m, options) in batched_methods(backbone).items():
        alone = generate(m, PROMPT, name, max_new_tokens=24, sampling=cfg, seed=7, eos_token_ids=(), **options)
        batch = generate_batch(m, [PROMPT], name, max_new_tokens=24, sampling=cfg, seed=7, eos_token_ids=(),
                               **options).rows[0]
        assert batch.tokens == alone.tokens, name
        assert batch.accepted == alone.accepted, name
        streamed = stream(m, PROMPT, name, max_new_tokens=24, sampling=cfg, seed=7, eos_token_ids=(), **options)
        assert [t for chunk in streamed for t in chunk] == alone.tokens, name
        other = generate(m, PROMPT, name, max_new_tokens=24, sampling=cfg, seed=8, eos_token_ids=(), **options)
        assert other.tokens != alone.tokens, name     # the seed matters: the check above compares draws
        if name == "draft" and mode == "sample":      # the rule ran both ways: drafts kept and rejected
            assert any(a > 1 for a in alone.accepted) and any(a < 4 for a in alone.accepted)



def test_hf_generate_keeps_the_apis_budget_and_step_rules():
    """Guards against method hf_generate (transformers' generate behind the same API) ignoring ``max_steps`` (the
    whole budget decoded), skipping the prompt checks every other method makes (a prompt past the backbone's
    positions reached transformers), and running in full when ``stream`` was called rather than when iterated (a
    prompt it refuses is refused by ``stream`` itself, before anything runs)."""
    from inference.errors import UserError

    m = wrap(tiny_llama(vocab=96, seed=0), None)
    plain = generate(m, PROMPT, "autoregressive", max_new_tokens=12, eos_token_ids=(), max_steps=3)
    out = generate(m, PROMPT, "hf_generate", max_new_tokens=12, eos_token_ids=(), max_steps=3)
    assert out.tokens == plain.tokens and len(out.tokens) == 4
    assert out.finish_reason == plain.finish_reason == "steps"
    too_long = [1] * (m.max_positions - 4)
    with pytest.raises(UserError, match="exceeds the backbone's"):
        stream(m, too_long, "hf_generate", max_new_tokens=8)
    s = stream(m, PROMPT, "hf_generate", max_new_tokens=4, eos_token_ids=())
    assert s.result is None                                      # nothing ran yet
    assert [t for chunk in s for t in chunk] == s.result.tokens
    with pytest.raises(UserError, match="prompt is empty"):
        generate(m, [], "hf_generate", max_new_tokens=8)


def test_a_streams_time_is_decodings_not_the_callers():
    """Guards against a stream's decode_s (and every tokens/s) counting the time the caller spent between chunks
    (printing each piece, a slow on_tokens callback): medusa-generate reported the terminal's speed."""
    import time

    m = wrap(tiny_llama(vocab=96, seed=0), None)
    s = stream(m, PROMPT, "autoregressive", max_new_tokens=6, eos_token_ids=())
    for _ in s:
        time.sleep(0.25)
    out = s.result
    # five steps of a tiny model (milliseconds; under a loaded machine still well below a second), not the
    # caller's 1.25 s or more of sleeps between its chunks
    assert len(out.tokens) == 6 and out.decode_s < 1.0
    assert out.decode_s >= sum(out.step_s)


def test_batches_and_options_are_checked_as_one_prompt_is():
    """Guards against generate_batch truncating float or boolean token ids (1.7 -> 1) that generate refuses, a numpy
    batch refused that generate takes, another method's options (a subclass: medusa_lookup's for prompt_lookup)
    decoding with their own settings dropped in silence, and a SamplingConfig changed after its check (top_p = 0
    reached the sampler: a NaN distribution)."""
    import dataclasses

    import numpy as np

    from inference.errors import UserError
    from inference.methods.medusa_lookup import MedusaLookupOptions

    m = wrap(tiny_llama(vocab=96, seed=0), None)
    for bad in ([[1.7, 2.9]], [[True, False]], np.array([[1.0, 2.0]])):
        with pytest.raises(UserError, match="integer token ids"):
            generate_batch(m, bad, "autoregressive", max_new_tokens=2)
    want = generate(m, PROMPT, "autoregressive", max_new_tokens=3).tokens
    assert generate_batch(m, np.array([PROMPT]), "autoregressive", max_new_tokens=3).rows[0].tokens == want
    with pytest.raises(UserError, match="takes PromptLookupSettings options, got MedusaLookupOptions"):
        generate(m, PROMPT, "prompt_lookup", options=MedusaLookupOptions(tree="tree8"), max_new_tokens=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        SamplingConfig(mode="sample").top_p = 0


def test_wrong_kinds_of_arguments_are_one_line():
    """Guards against tracebacks from inside Python or a template for arguments of the wrong kind: a list of methods
    where one goes (unhashable), load_medusa(None) (pathlib's TypeError), a prompt or system message that is not
    text (list() of an int, a template's concatenation)."""
    from inference.errors import UserError
    from inference.loading import load_medusa
    from inference.runtime.model import chat_ids

    m = wrap(tiny_llama(vocab=96, seed=0), None)
    for call, words in ((lambda: generate(m, PROMPT, ["medusa"]), "a method is one name"),
                        (lambda: load_medusa(None), "heads_dir must be the heads' folder"),
                        (lambda: chat_ids(byte_tokenizer(), 123), "a prompt is text or a list of chat messages"),
                        (lambda: chat_ids(byte_tokenizer(), "hi", system=5), "a prompt is text")):
        with pytest.raises(UserError, match=words):
            call()
