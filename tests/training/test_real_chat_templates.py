"""Assistant-only labels under the chat templates that users' models ship (their real Jinja text, each with its
source), rendered over the byte tokenizer with the template's special tokens as single ids, as the real
tokenizers have them: each reply must be labelled exactly as the template renders it after the generation prompt
(its words and its end-of-turn marker, nothing of the system / user turns or role headers), a reply cut at a
length limit without that marker (the last one as the backbone wrote it), and a conversation the template refuses
must be ``TemplateRefused``, not a crash."""

from __future__ import annotations

from pathlib import Path

import pytest

from medusa_train.backbone import byte_tokenizer
from medusa_train.data.tokenize import TemplateRefused, encode_conversation

from conftest import labelled_runs

# The templates, as their sources have them, one file each; README.md there names each one's source.
TEMPLATES_DIR = Path(__file__).resolve().parents[1] / "assets" / "chat_templates"


def _template(name: str) -> str:
    return (TEMPLATES_DIR / name).read_text()


LLAMA_3_3 = _template("llama-3-3.jinja")
LLAMA_3_2 = _template("llama-3-2.jinja")
QWEN_2_5 = _template("qwen-2-5.jinja")
QWEN_3 = _template("qwen-3.jinja")
GEMMA_2 = _template("gemma-2.jinja")
GEMMA_3 = _template("gemma-3.jinja")
MISTRAL_V0_3 = _template("mistral-v0-3.jinja")
MISTRAL_NEMO = _template("mistral-nemo.jinja")
PHI_3_5 = _template("phi-3-5.jinja")
PHI_4 = _template("phi-4.jinja")
DEEPSEEK_R1_DISTILL = _template("deepseek-r1-distill.jinja")
SMOLLM2 = _template("smollm2.jinja")
SMOLLM3 = _template("smollm3.jinja")
GPT_OSS = _template("gpt-oss.jinja")


def real(template: str, specials: list[str], bos: str | None = None, eos: str | None = None):
    """The byte tokenizer with ``template`` as its chat template and the template's markers as special tokens (one
    id each, as in the model's own tokenizer; ``byte_tokenizer`` already has ``<|im_start|>`` / ``<|im_end|>``)."""
    tok = byte_tokenizer()
    extra: dict = {"additional_special_tokens": specials}
    if bos:
        extra["bos_token"] = bos
    if eos:
        extra["eos_token"] = eos
    tok.add_special_tokens(extra)
    tok.chat_template = template
    return tok


def _after_think(content: str) -> str:
    return content.split("</think>")[-1]


def _qwen3(messages: list[dict], i: int) -> str:
    """Qwen3's rendering of reply ``i``: past the last user turn with its (maybe empty) think block, earlier ones
    without it."""
    content = messages[i]["content"]
    reasoning, answer = "", content
    if "</think>" in content:
        reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
        answer = _after_think(content).lstrip("\n")
    if i > max(j for j, m in enumerate(messages) if m["role"] == "user"):
        return "<think>\n" + reasoning.strip("\n") + "\n</think>\n\n" + answer.lstrip("\n") + "<|im_end|>"
    return answer + "<|im_end|>"


def _qwen3_no_thinking(messages: list[dict], i: int) -> str:
    """Qwen3 with thinking off: the empty think block is the generation prompt's, so a reply past the last user
    turn without reasoning is its words alone."""
    content = messages[i]["content"]
    if "</think>" not in content and i > max(j for j, m in enumerate(messages) if m["role"] == "user"):
        return content.lstrip("\n") + "<|im_end|>"
    return _qwen3(messages, i)


# thinking off as the model's template does it (``enable_thinking=False``), set in the template: the trainer renders
# with the template's defaults
NO_THINKING = "{%- set enable_thinking = false -%}"
LLAMA_MARKS = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
# name: (template, special tokens, bos, eos, the labelled text of reply i of messages (finished), its end marker)
TEMPLATES = {
    "llama-3.3": (LLAMA_3_3, LLAMA_MARKS, "<|begin_of_text|>", "<|eot_id|>",
                  lambda m, i: m[i]["content"].strip() + "<|eot_id|>", "<|eot_id|>"),
    "llama-3.2": (LLAMA_3_2, LLAMA_MARKS, "<|begin_of_text|>", "<|eot_id|>",
                  lambda m, i: m[i]["content"].strip() + "<|eot_id|>", "<|eot_id|>"),
    "qwen2.5": (QWEN_2_5, [], None, "<|im_end|>", lambda m, i: m[i]["content"] + "<|im_end|>", "<|im_end|>"),
    "qwen3": (QWEN_3, ["<think>", "</think>"], None, "<|im_end|>", _qwen3, "<|im_end|>"),
    "qwen3 thinking off": (NO_THINKING + QWEN_3, ["<think>", "</think>"], None, "<|im_end|>", _qwen3_no_thinking,
                           "<|im_end|>"),
    "gemma-2": (GEMMA_2, ["<start_of_turn>", "<end_of_turn>"], "<bos>", "<eos>",
                lambda m, i: m[i]["content"].strip() + "<end_of_turn>", "<end_of_turn>"),
    "gemma-3": (GEMMA_3, ["<start_of_turn>", "<end_of_turn>"], "<bos>", "<eos>",
                lambda m, i: m[i]["content"].strip() + "<end_of_turn>", "<end_of_turn>"),
    "mistral-v0.3": (MISTRAL_V0_3, ["[INST]", "[/INST]"], "<s>", "</s>",
                     lambda m, i: " " + m[i]["content"].strip() + "</s>", "</s>"),
    "mistral-nemo": (MISTRAL_NEMO, ["[INST]", "[/INST]"], "<s>", "</s>", lambda m, i: m[i]["content"] + "</s>",
                     "</s>"),
    "phi-3.5": (PHI_3_5, ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"], "<s>", "<|endoftext|>",
                lambda m, i: m[i]["content"] + "<|end|>", "<|end|>"),
    "phi-4": (PHI_4, ["<|im_sep|>"], None, "<|im_end|>", lambda m, i: m[i]["content"] + "<|im_end|>", "<|im_end|>"),
    "deepseek-r1-distill": (DEEPSEEK_R1_DISTILL, ["<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"],
                            "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>",
                            lambda m, i: _after_think(m[i]["content"]) + "<｜end▁of▁sentence｜>",
                            "<｜end▁of▁sentence｜>"),
    "smollm2": (SMOLLM2, [], None, "<|im_end|>", lambda m, i: m[i]["content"] + "<|im_end|>", "<|im_end|>"),
    "smollm3": (SMOLLM3, ["<think>", "</think>"], None, "<|im_end|>",
                lambda m, i: m[i]["content"].lstrip("\n") + "<|im_end|>", "<|im_end|>"),
    "smollm3 no_think": (NO_THINKING + SMOLLM3, ["<think>", "</think>"], None, "<|im_end|>",
                         lambda m, i: m[i]["content"].lstrip("\n") + "<|im_end|>", "<|im_end|>"),
    "gpt-oss": (GPT_OSS, ["<|start|>", "<|message|>", "<|channel|>", "<|end|>", "<|call|>"], "<|startoftext|>",
                "<|return|>", lambda m, i: "<|channel|>final<|message|>" + m[i]["content"]
                + ("<|return|>" if i == len(m) - 1 else "<|end|>"), None),
}


def _conv(*turns: tuple[str, str]) -> list[dict]:
    return [{"role": role, "content": content} for role, content in turns]


def _cut(messages: list[dict], i: int) -> list[dict]:
    return [{**m, "unfinished": True} if j == i else m for j, m in enumerate(messages)]


U, A, S = "user", "assistant", "system"
THREE = _conv((S, "Be kind."), (U, "q1"), (A, "a1 answer"), (U, "q2"), (A, "a2 answer"), (U, "q3"), (A, "a3 answer"))
THINKING = _conv((U, "Think about 2+2"), (A, "<think>\nTwo and two.\n</think>\n\nFour."), (U, "And 3+3?"),
                 (A, "<think>\nThree and three.\n</think>\n\nSix."))
CONVERSATIONS = {
    "one turn": _conv((U, "Hi there, what is 2+2?"), (A, "It is 4.")),
    "system": _conv((S, "You are terse."), (U, "Hi"), (A, "Hello!")),
    "three turns": THREE,
    "four turns": _conv((U, "w"), (A, "x one"), (U, "y"), (A, "z two"), (U, "u"), (A, "v three"), (U, "last"),
                        (A, "four")),
    "spaces": _conv((U, "Say something"), (A, "  leading and trailing  \n"), (U, "again"), (A, "\n\nnewlines first\n")),
    "quoted": _conv((U, "Say yes"), (A, "yes"), (U, "Say yes again"), (A, "yes")),
    "quoted with system": _conv((S, "sys yes"), (U, "Repeat: the cat sat"), (A, "the cat sat"),
                                (U, "the cat sat again"), (A, "the cat sat")),
    "thinking": THINKING,
    "one thought": THINKING[:2],
    "cut last": _cut(THREE, 6),
    "cut middle": _cut(THREE, 2),
    "thinking cut middle": _cut(THINKING, 1),
    "thinking cut last": _cut(THINKING, 3),
    "greeting": _conv((S, "sys"), (A, "Hello, how can I help?"), (U, "help me"), (A, "Sure thing.")),
    "greeting first": _conv((A, "Hello, how can I help?"), (U, "help me"), (A, "Sure thing.")),
    # replies that are letters of the role header after the turn they answer (Qwen3's "<|im_start|>assistant\n")
    "short replies": _conv((U, "Pick (a) or (b)."), (A, "a"), (U, "Why?"), (A, "is"), (U, "And?"), (A, "t"),
                           (U, "Last"), (A, "Because.")),
}


def expected_runs(name: str, messages: list[dict]) -> list[str]:
    """Each reply that answers a user turn as the template renders it, a cut one without its end-of-turn marker
    (a last cut one that the template dresses in reasoning markup as written: the backbone's words right after the
    generation prompt; anything else the template puts before them, Mistral's space or gpt-oss's channel header, the
    backbone writes too)."""
    reply, end = TEMPLATES[name][4], TEMPLATES[name][5]
    runs = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or not any(x["role"] == "user" for x in messages[:i]):
            continue
        text = reply(messages, i)
        if m.get("unfinished"):
            mark = next(e for e in (end, "<|return|>", "<|end|>") if e and text.endswith(e))
            text = text[: -len(mark)].rstrip()
            # reasoning markup the template dresses a cut last reply in (Qwen3's empty think block; DeepSeek-R1's
            # generation prompt ends in "<think>\n", which its rendering drops): as written
            dressed = ("<think>" in text and "<think>" not in m["content"]) or name.startswith("deepseek")
            if i == len(messages) - 1 and dressed:
                text = m["content"]
        runs.append(text)
    return runs


# the conversations each template refuses (raise_exception in the template itself)
REFUSED = {"gemma-2": {"system", "three turns", "quoted with system", "cut last", "cut middle", "greeting",
                       "greeting first"},
           "gemma-3": {"greeting", "greeting first"}, "mistral-v0.3": {"greeting", "greeting first"},
           "mistral-nemo": {"greeting", "greeting first"}}


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def template(request):
    name = request.param
    tpl, specials, bos, eos = TEMPLATES[name][:4]
    return name, real(tpl, specials, bos, eos)


@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
def test_replies_are_labelled_exactly_under_real_templates(template, conversation):
    """Guards against (every real template, every shape): a reply partly or wholly unlabelled, user / system text
    or a role header labelled, a cut reply's end-of-turn marker trained, a reply counted as unlocated, or a
    refused conversation crashing instead of raising ``TemplateRefused``."""
    name, tok = template
    messages = CONVERSATIONS[conversation]
    if conversation in REFUSED.get(name, ()):
        with pytest.raises(TemplateRefused):
            encode_conversation(tok, messages, 4096)
        return
    enc = encode_conversation(tok, messages, 4096)
    assert labelled_runs(tok, enc) == expected_runs(name, messages)
    assert enc.unlocated == 0


def test_phi3_replies_keep_their_end_of_turn_marker():
    """Guards against: Phi-3's template closing a conversation rendered without a generation prompt with
    ``eos_token`` (``{% else %}{{ eos_token }}``), so no reply's rendering was a prefix of the conversation:
    every reply but the last was located by its words and lost its ``<|end|>`` (the drafter never learnt where
    a reply ends), one ending in spaces lost them too, and the last was labelled with the template's newline
    and that ``<|endoftext|>``."""
    tok = real(PHI_3_5, ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"], "<s>", "<|endoftext|>")
    enc = encode_conversation(tok, THREE, 4096)
    assert labelled_runs(tok, enc) == ["a1 answer<|end|>", "a2 answer<|end|>", "a3 answer<|end|>"]
    messages = CONVERSATIONS["spaces"]
    enc = encode_conversation(tok, messages, 4096)
    assert labelled_runs(tok, enc) == ["  leading and trailing  \n<|end|>", "\n\nnewlines first\n<|end|>"]


def test_a_cut_reply_whose_reasoning_qwen3_drops_is_labelled_without_its_end():
    """Guards against: a reply cut at max_new_tokens inside a conversation, rendered by Qwen3 without its <think>
    block (an earlier reply), found by its answer but then not recognised as its words, so the ``<|im_end|>``
    after the cut was trained as if the reply had ended there."""
    tok = real(QWEN_3, ["<think>", "</think>"], None, "<|im_end|>")
    enc = encode_conversation(tok, _cut(THINKING, 1), 4096)
    assert labelled_runs(tok, enc) == ["Four.", "<think>\nThree and three.\n</think>\n\nSix.<|im_end|>"]


def test_deepseek_r1_replies_keep_their_words_and_a_last_cut_one_is_as_written():
    """Guards against, with DeepSeek-R1-Distill's template (reasoning dropped from every reply, a generation prompt
    ending in "<think>\\n"): the newlines it keeps after ``</think>`` left unlabelled (the reply's first token),
    and a last reply cut inside its reasoning labelled as its answer plus ``<｜end▁of▁sentence｜>`` instead of the
    words the backbone wrote after the generation prompt."""
    tok = real(DEEPSEEK_R1_DISTILL, ["<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"],
               "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>")
    enc = encode_conversation(tok, THINKING, 4096)
    assert labelled_runs(tok, enc) == ["\n\nFour.<｜end▁of▁sentence｜>", "\n\nSix.<｜end▁of▁sentence｜>"]
    cut = [THINKING[0], {"role": "assistant", "content": "Two and two make", "unfinished": True}]
    enc = encode_conversation(tok, cut, 4096)
    assert tok.decode(enc.input_ids).endswith("<｜User｜>Think about 2+2<｜Assistant｜><think>\nTwo and two make")
    assert labelled_runs(tok, enc) == ["Two and two make"]
    enc = encode_conversation(tok, _cut(THINKING, 3), 4096)
    assert labelled_runs(tok, enc) == ["\n\nFour.<｜end▁of▁sentence｜>", THINKING[3]["content"]]


def test_gpt_oss_earlier_replies_keep_their_channel_and_end():
    """Guards against: gpt-oss ending the last reply with ``<|return|>`` and the same reply followed by more turns
    with ``<|end|>``, so no earlier reply's rendering was a prefix of the conversation: each was located by its
    words and lost its ``<|channel|>final<|message|>`` header and its ``<|end|>``."""
    tok = real(GPT_OSS, ["<|start|>", "<|message|>", "<|channel|>", "<|end|>", "<|call|>"], "<|startoftext|>",
               "<|return|>")
    enc = encode_conversation(tok, THREE, 4096)
    assert labelled_runs(tok, enc) == ["<|channel|>final<|message|>a1 answer<|end|>",
                                       "<|channel|>final<|message|>a2 answer<|end|>",
                                       "<|channel|>final<|message|>a3 answer<|return|>"]
    enc = encode_conversation(tok, _cut(THREE, 2), 4096)
    assert labelled_runs(tok, enc)[0] == "<|channel|>final<|message|>a1 answer"


# A template that closes only the last reply with eos and puts nothing between turns (no such model is known; the
# shape gpt-oss's <|return|> / <|end|> rule must not be mistaken for)
CLOSES_LAST_ONLY = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] }}"
                    "{% if loop.last and m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
                    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def test_an_earlier_reply_never_takes_the_next_turns_opener_as_its_end():
    """Guards against the rule for gpt-oss (an earlier reply ends with another special token where the last one
    ends with eos) taking any special token at that place: under a template that puts nothing between turns, the
    earlier reply's span swallowed the next turn's opening <|im_start|>."""
    tok = real(CLOSES_LAST_ONLY, ["<|endoftext|>"], eos="<|endoftext|>")
    messages = _conv((U, "Say yes"), (A, "yes sir"), (U, "Again"), (A, "YES"))
    assert labelled_runs(tok, encode_conversation(tok, messages, 1024)) == ["yes sir", "YES<|endoftext|>"]


def test_a_conversation_that_repeats_itself_keeps_every_reply_under_qwen3_thinking_off():
    """Guards against: the header skip taking the thinking-off generation prompt's whole text, which stands before
    the last reply alone, so in a conversation that repeats itself ("again" / "ok" three times) an earlier reply
    was located on the last one's words: one reply trained twice, another not at all."""
    name = "qwen3 thinking off"
    tok = real(*TEMPLATES[name][:4])
    messages = _conv((U, "again"), (A, "ok"), (U, "again"), (A, "ok"), (U, "again"), (A, "ok"))
    enc = encode_conversation(tok, messages, 4096)
    assert labelled_runs(tok, enc) == expected_runs(name, messages) and enc.unlocated == 0
