"""Chat-template tokenisation with labels on assistant tokens only.

The reference Medusa trainer labels user turns too, so its heads learn to predict the
user's words. Here a token is labelled only if it lies inside an assistant reply (its
content and the end-of-turn marker the template puts after it); system prompt, user turns
and the template's role headers are ``IGNORE`` (-100). A reply marked ``"unfinished": true`` (cut at a length
limit) is labelled without its end-of-turn marker; the last one is kept as the backbone wrote it, its words
right after the generation prompt, where a template would dress it (Qwen3 puts an empty think block before a
reply cut inside its reasoning).

Assistant spans are found by rendering the template on growing prefixes of the
conversation: the reply of message i is what ``messages[:i+1]`` adds after
``messages[:i]`` + generation prompt. Templates that are not prefix-stable fall back to
locating the reply text in the rendered conversation.

A template may refuse a conversation (Gemma's raises on a system turn, others on roles that do not
alternate): ``TemplateRefused`` says so, and every caller drops that one conversation and counts it
(``TemplateRefused.reason``) like an unusable record, rather than ending the run.
"""

from __future__ import annotations

import functools
import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Optional

from inference.chat_template import template_args

IGNORE = -100
# An assistant turn's mark: its reply was cut before its end (self-distillation at max_new_tokens). Its words are
# labelled, the end-of-turn marker the template puts after them is not: the drafter must not learn to end a reply
# wherever a length limit fell.
UNFINISHED = "unfinished"


@dataclass
class Encoded:
    input_ids: list[int]
    labels: list[int]
    truncated: bool
    unlocated: int = 0   # replies left unlabelled: not found in the template's rendering (``assistant_spans``)


class TemplateRefused(Exception):
    """The chat template raised on this conversation (``raise_exception`` in the template, or a template error
    it hits on these messages): this conversation is unusable, the rest may be fine."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    @property
    def line(self) -> str:
        """The template's message as one short line."""
        return (self.message.strip().splitlines() or ["no message"])[0][:120]

    @property
    def reason(self) -> str:
        """What the dropped counts call it (one short line, whatever the template raised)."""
        return f"chat template refused it: {self.line}"


@contextmanager
def template_refusals():
    """Turn an error the chat template raises (jinja2's ``TemplateError``) into ``TemplateRefused``."""
    try:
        yield
    except Exception as e:
        from jinja2.exceptions import TemplateError   # lazy: transformers has imported it by the time a template ran

        if isinstance(e, TemplateError):
            raise TemplateRefused(str(e)) from None
        raise


def _render(tokenizer, messages, add_generation_prompt=False) -> str:
    with template_refusals():
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             **template_args(tokenizer))


def assistant_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]], int]:
    """The rendered conversation, the [start, end) character spans of assistant replies, and how many replies
    were not found in the rendering (left unlabelled: counted, so a template that rewrites replies is seen)."""
    text = _render(tokenizer, messages)
    spans: list[tuple[int, int]] = []
    cursor, unlocated = 0, 0
    for i, msg in enumerate(messages):
        # a reply that answers no user turn (a greeting after the system prompt) has nothing to be learned from,
        # as self-distillation also treats it
        if msg["role"] != "assistant" or not any(m["role"] == "user" for m in messages[:i]):
            continue
        before = _render(tokenizer, messages[:i], add_generation_prompt=True)
        # the turns before the reply rendered as a whole conversation: read by both rules below, rendered once
        closed = functools.cache(lambda: _render(tokenizer, messages[:i]))
        upto = _without_closing_eos(tokenizer, closed, before, _render(tokenizer, messages[: i + 1]), text)
        if _dressed_last_cut(text, before, msg, i == len(messages) - 1, cursor):
            # the backbone wrote these words right after the generation prompt (self-distillation): the template's
            # dress (Qwen3: an empty think block before a reply cut inside its reasoning) was never in its context
            text = before + msg["content"]
            end = len(before) + len(msg["content"].rstrip())
            if end > len(before):
                spans.append((len(before), end))
            break
        stable = upto.startswith(before) and len(before) >= cursor
        swapped = _swapped_end(text, upto, tokenizer, _prompt_tail(closed, before)) \
            if stable and not text.startswith(upto) else None
        if stable and text.startswith(upto):
            start, end = len(before), len(upto)
        elif swapped is not None:
            start, end = len(before), swapped
        else:  # not prefix-stable: find the reply text itself, after the turn it answers
            floor = _past_header(text, _past_prompt(text, messages[i - 1], cursor), closed, before)
            found = _locate_reply(text, tokenizer, msg["content"], floor, cursor)
            if found is None:
                unlocated += 1
                continue
            start, end = found
        if msg.get(UNFINISHED) is True:
            end = _content_end(text, msg["content"], start, end)
        # keep the end-of-turn marker but not the newline the template adds after it
        while end > start and text[end - 1].isspace():
            end -= 1
        spans.append((start, end))
        cursor = end
    return text, spans, unlocated


def _dressed_last_cut(text: str, before: str, msg: dict, last: bool, cursor: int) -> bool:
    """Whether ``msg`` is a last reply cut at a length limit that the template dresses in reasoning markup the
    backbone never wrote there (Qwen3: an empty think block before a reply cut inside its reasoning; DeepSeek-R1:
    its generation prompt's "<think>\n" dropped from the reply's rendering), with the earlier replies' spans (up to
    ``cursor``) inside ``before``. What else a template puts there, the backbone writes too (Mistral's space after
    ``[/INST]``, gpt-oss's channel header): that rendering is kept."""
    if not (last and msg.get(UNFINISHED) is True and len(before) >= cursor and text[:cursor] == before[:cursor]):
        return False
    if text.startswith(before + msg["content"]):
        return False
    common = len(os.path.commonprefix([text, before]))
    at = next((i for w in _reply_words(msg["content"]) if w and (i := text.find(w, common)) >= 0), common)
    differs = before[common:] + text[common:at]   # the generation prompt's own tail, the template's insert
    return "<think>" in differs or "</think>" in differs


def _without_closing_eos(tokenizer, closed: Callable[[], str], before: str, upto: str, text: str) -> str:
    """``upto`` (the rendering up to a reply) without the end-of-sequence token a template puts after the last turn
    only when no generation prompt follows (Phi-3: ``{% else %}{{ eos_token }}``): it is not the reply's. Left on,
    no reply's ``upto`` but the last was a prefix of the conversation, so each was located by its words and lost
    its end-of-turn marker ``<|end|>``, and the last one was labelled with the template's newline and that token."""
    eos = getattr(tokenizer, "eos_token", None)
    # a reply that ends in eos inside the conversation (Mistral's "</s>") ends there: no need to render again
    if not eos or not upto.endswith(eos) or (text.startswith(upto) and len(upto) < len(text)):
        return upto
    bare = closed()   # the turns before the reply, closed as a whole conversation
    return upto[: -len(eos)] if bare.endswith(eos) and not before.startswith(bare) else upto


def _prompt_tail(closed: Callable[[], str], before: str) -> str:
    """The generation prompt's own text: ``before`` past the rendering of the turns before it (``closed``)."""
    return before[len(os.path.commonprefix([before, closed()])):]


def _swapped_end(text: str, upto: str, tokenizer, prompt_tail: str) -> Optional[int]:
    """Where a reply ends in ``text`` when the template ends a last reply with the end-of-sequence token and the
    same reply followed by more turns with another special token (gpt-oss: ``<|return|>``, else ``<|end|>``):
    ``upto`` but that token is a prefix of ``text``, which has a special token there that opens no turn (none of
    the generation prompt's ``prompt_tail``: a template that puts nothing between turns has the next turn's opener
    there); else None. Located by its words instead, the reply lost the channel header before them and the
    end-of-turn marker after them."""
    eos = getattr(tokenizer, "eos_token", None)
    if not eos or not upto.endswith(eos) or not text.startswith(upto[: -len(eos)]):
        return None
    at = len(upto) - len(eos)
    specials = sorted((t.content for t in tokenizer.added_tokens_decoder.values() if t.special), key=len, reverse=True)
    mark = next((m for m in specials if text.startswith(m, at)), None)
    return at + len(mark) if mark and mark not in prompt_tail else None


def _locate_reply(text: str, tokenizer, content: str, past_prompt: int, cursor: int) -> Optional[tuple[int, int]]:
    """The [start, end) of a reply found by its words in a rendering that is not prefix-stable, or None. The words
    are tried in the forms ``_reply_words`` gives (Qwen3-style templates drop ``<think>...</think>`` from earlier
    replies); first past the turn the reply answers, else past the previous reply (the template rewrote that
    turn). The span takes the spaces before the words (a SentencePiece token "▁Hello" starts at its space: a span
    from the "H" would leave the reply's first token unlabelled) and the end-of-sequence marker right after them."""
    eos = getattr(tokenizer, "eos_token", None)
    specials = [t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special]
    for floor in (past_prompt, cursor):
        for words in _reply_words(content):
            start = text.find(words, floor) if words else -1
            while start >= 0 and _inside_special(text, start, specials):   # "a" of DeepSeek's <｜Assistant｜>
                start = text.find(words, start + 1)
            if start < 0:
                continue
            end = start + len(words)
            while start > floor and text[start - 1] == " ":
                start -= 1
            if eos and text.startswith(eos, end):
                end += len(eos)
            return start, end
    return None


def _inside_special(text: str, at: int, specials: list[str]) -> bool:
    """Whether ``text[at]`` lies inside a special token's text, past its start (one id: a reply found there labels
    nothing); a reply may begin with one (``<think>``)."""
    return any(text.find(m, max(0, at - len(m) + 1), at + len(m) - 1) >= 0 for m in specials if len(m) > 1)


def _reply_words(content: str) -> list[str]:
    """The forms a reply's words take in a rendering: as written, trimmed, and without a reasoning block as the
    template leaves them (DeepSeek-R1 keeps the newlines after ``</think>``, Qwen3 strips them) then trimmed."""
    words = [content, content.strip()]
    if "</think>" in content:
        after = content.split("</think>")[-1]
        words += [after, after.strip()]
    return words


def _content_end(text: str, content: str, start: int, end: int) -> int:
    """Where the reply's own words end inside its span [start, end) (the end-of-turn marker after them is not
    theirs), matched in any form ``_reply_words`` gives (a cut reply whose reasoning the template dropped kept its
    end-of-turn marker); ``end`` if none is there."""
    for words in _reply_words(content):
        at = text.rfind(words, start, end) if words else -1
        if at >= 0:
            return at + len(words)
    return end


_CLOSING_MAX = 64   # characters a template puts between a turn's words and the next turn's header (<|im_end|>\n)


def _past_header(text: str, floor: int, closed: Callable[[], str], before: str) -> int:
    """Past the reply's header (Qwen3's "<|im_start|>assistant\n") when it follows ``floor`` (the end of the turn the
    reply answers) with nothing but that turn's closing between: the generation prompt's text (``_prompt_tail``), or
    its first line (a thinking-off prompt's empty think block is not rendered for earlier replies). A short reply
    ("is", "a") was found inside the header ("ass|istant"), and the header trained instead of the reply."""
    tail = _prompt_tail(closed, before)
    # the first line first: a thinking-off prompt's whole text stands before the last reply alone, so found from an
    # earlier one in a conversation that repeats itself it jumped past that reply (and the ones between)
    for head in (tail[: tail.find("\n") + 1] if "\n" in tail else tail, tail):
        at = text.find(head, floor, floor + _CLOSING_MAX + len(head)) if head.strip() else -1
        if at >= 0 and closed().endswith(text[floor:at]):
            return at + len(head)
    return floor


def _past_prompt(text: str, turn: dict, cursor: int) -> int:
    """Where the reply to ``turn`` (the user / system turn before it) can begin in ``text``: past that turn's
    content, found from ``cursor`` (the end of the previous reply); ``cursor`` if the template rewrote it. A short
    reply is often quoted by the turn it answers ("Say yes" -> "yes"): searched from the previous reply's end
    alone, the user's words would be labelled instead of the reply."""
    at = text.find(turn["content"], cursor) if turn["role"] != "assistant" else -1
    return at + len(turn["content"]) if at >= 0 else cursor


def encode_conversation(tokenizer, messages: list[dict], max_length: int,
                        keep_unlabelled: bool = False) -> Optional[Encoded]:
    """Token ids and assistant-only labels, truncated to ``max_length``; None if nothing to learn (no reply token
    within ``max_length``; with ``keep_unlabelled``, only fewer than two tokens: ``heads.train_on=all`` learns
    the backbone's own predictions at every other position); ``TemplateRefused`` if the chat template raises on
    this conversation."""
    text, spans, unlocated = assistant_spans(tokenizer, messages)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc["input_ids"]
    labels = [IGNORE] * len(ids)
    si = 0
    for t, (start, _end) in enumerate(enc["offset_mapping"]):
        while si < len(spans) and start >= spans[si][1]:
            si += 1
        if si < len(spans) and spans[si][0] <= start < spans[si][1]:
            labels[t] = ids[t]
    truncated = len(ids) > max_length
    ids, labels = ids[:max_length], labels[:max_length]
    if len(ids) < 2 or (not keep_unlabelled and all(l == IGNORE for l in labels[1:])):  # position 0: no target
        return None
    return Encoded(ids, labels, truncated, unlocated)


def reply_end_ids(tokenizer) -> list[int]:
    """The special tokens the chat template closes an assistant reply with, as the labels hold them (ChatML's
    <|im_end|>, Llama-3's <|eot_id|>, Gemma's <end_of_turn>): read off a one-turn probe conversation. [] where the
    template refuses the probe."""
    probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    try:
        enc = encode_conversation(tokenizer, probe, 4096)
    except TemplateRefused:
        return []
    special = {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special}
    return sorted({t for t in (enc.labels if enc is not None else []) if t != IGNORE and t in special})
