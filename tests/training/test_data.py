"""Data side: readers (every accepted form), assistant-only tokenisation, the stream, packing."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from inference.errors import UserError
from medusa_train.backbone import byte_tokenizer
from medusa_train.data import readers
from medusa_train.data.readers import ReadStats, iter_conversations, normalize
from medusa_train.data.stream import (ConversationStream, MicroBatches, StreamStats, collate, eval_batches, pack,
                                      token_frequencies)
from medusa_train.data.tokenize import IGNORE, Encoded, encode_conversation

from conftest import TINY_DATA, labelled_runs


def _sharegpt(i: int) -> dict:
    return {"conversations": [{"from": "human", "value": f"question {i}?"}, {"from": "gpt", "value": f"answer {i}."}]}


def _openai(i: int) -> dict:
    return {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


# -- readers -------------------------------------------------------------------------------------
def test_truncated_json_array_recovers_complete_records(tmp_path):
    """Guards against: a JSON array cut off mid-record (the embedded ShareGPT file is) crashing the
    reader or losing the complete records before the cut; the cut record must be counted."""
    records = [_sharegpt(i) for i in range(6)]
    text = "[\n" + ",\n".join(json.dumps(r) for r in records)
    last = json.dumps(records[-1])
    cut = text[: text.rindex(last) + len(last) // 2]  # 5 complete records, then half of the 6th
    path = tmp_path / "cut.json"
    path.write_text(cut)
    stats = ReadStats()
    convs = list(iter_conversations(str(path), stats=stats))
    assert len(convs) == 5 and stats.recovered == 5
    assert convs[4][1]["content"] == "answer 4."
    assert stats.dropped == {"cut off at end of file": 1}
    assert "5 conversations usable, 1 records dropped" in stats.summary()


def test_complete_json_array_drops_nothing(tmp_path):
    """Guards against: the closing bracket of a complete array being counted as a cut-off record."""
    path = tmp_path / "ok.json"
    path.write_text(json.dumps([_sharegpt(i) for i in range(4)], indent=1))
    stats = ReadStats()
    assert len(list(iter_conversations(str(path), stats=stats))) == 4
    assert stats.dropped_total == 0


def test_json_array_across_read_chunks(tmp_path, monkeypatch):
    """Guards against: records straddling the reader's chunk boundary (1 MiB in production) being
    lost, duplicated or mis-parsed; the chunk is shrunk to a few bytes here."""
    monkeypatch.setattr(readers, "_CHUNK", 37)
    records = [_sharegpt(i) for i in range(30)]
    path = tmp_path / "many.json"
    path.write_text(json.dumps(records))
    got = list(iter_conversations(str(path)))
    assert [m[1]["content"] for m in got] == [f"answer {i}." for i in range(30)]


def test_jsonl_with_a_bad_line(tmp_path):
    """Guards against: one invalid JSON line aborting the file (it must be counted and skipped)."""
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(_sharegpt(0)) + "\n{not json\n\n" + json.dumps(_openai(1)) + "\n")
    stats = ReadStats()
    convs = list(iter_conversations(str(path), stats=stats))
    assert [c[-1]["content"] for c in convs] == ["answer 0.", "a1"]
    assert stats.dropped == {"invalid JSON line": 1}


def test_openai_form_and_json_lines_saved_as_json(tmp_path):
    """Guards against: OpenAI-form records (messages/role/content) or JSONL content in a .json file being rejected."""
    path = tmp_path / "openai.json"
    path.write_text("\n".join(json.dumps(_openai(i)) for i in range(3)) + "\n")
    convs = list(iter_conversations(str(path)))
    assert convs == [[{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]
                     for i in range(3)]


def test_parquet(tmp_path):
    """Guards against: parquet sources (nested list-of-struct columns) not being read as conversations."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist([_sharegpt(i) for i in range(5)])
    pq.write_table(table, tmp_path / "d.parquet")
    convs = list(iter_conversations(str(tmp_path / "d.parquet")))
    assert [c[1]["content"] for c in convs] == [f"answer {i}." for i in range(5)]


def test_directory_of_files(tmp_path):
    """Guards against: a folder source skipping nested files or other formats, or reading in an unstable order."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    (tmp_path / "sub").mkdir()
    (tmp_path / "a.jsonl").write_text(json.dumps(_sharegpt(0)) + "\n")
    (tmp_path / "b.json").write_text(json.dumps([_openai(1), _openai(2)]))
    pq.write_table(pa.Table.from_pylist([_sharegpt(3)]), tmp_path / "sub" / "c.parquet")
    (tmp_path / "notes.txt").write_text("ignored")
    convs = list(iter_conversations(str(tmp_path)))
    assert [c[-1]["content"] for c in convs] == ["answer 0.", "a1", "a2", "answer 3."]


def test_a_folder_whose_file_names_name_splits_reads_the_chosen_split_alone(tmp_path):
    """Guards against: a downloaded dataset's folder (``data/train-00000-of-00001.jsonl`` beside
    ``data/test-...``) read whole, training on its test split, with ``data.split`` ignored on every local source;
    the split's files are the ones ``datasets.load_dataset(folder)`` takes, and a split the names do not name is
    refused in one line naming those they do."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train-00000-of-00001.jsonl").write_text(json.dumps(_sharegpt(0)) + "\n")
    (tmp_path / "data" / "test-00000-of-00001.jsonl").write_text(json.dumps(_sharegpt(1)) + "\n")
    (tmp_path / "dataset_info.json").write_text(json.dumps({"features": {}}))
    answers = lambda split: [c[-1]["content"] for c in iter_conversations(str(tmp_path), split)]  # noqa: E731
    assert answers("train") == ["answer 0."]
    assert answers("test") == ["answer 1."]
    with pytest.raises(UserError, match=r"data.split='validation' is not among .*: test, train$"):
        answers("validation")
    assert readers.data_fingerprint(str(tmp_path), "train") != readers.data_fingerprint(str(tmp_path), "test")


@pytest.mark.parametrize("layout", ["folder", "file", "embedded"])
def test_a_split_a_local_source_does_not_hold_is_refused(layout, tmp_path):
    """Guards against: ``data.split=test`` on one file, the embedded data or a folder whose names name no split
    silently training on the whole source as if it were that split."""
    (tmp_path / "chats.jsonl").write_text(json.dumps(_sharegpt(0)) + "\n")
    source = {"folder": str(tmp_path), "file": str(tmp_path / "chats.jsonl"), "embedded": "embedded:sharegpt"}[layout]
    with pytest.raises(UserError, match="data.split='test', but .*train split"):
        readers.local_files(source, "test")
    assert readers.data_fingerprint(source, "test") is None
    if layout != "embedded":
        assert [c[-1]["content"] for c in iter_conversations(source, "train")] == ["answer 0."]


def test_missing_and_unsupported_sources(tmp_path):
    """Guards against: a missing file being looked up on the hub (slow, confusing) instead of a clear UserError."""
    with pytest.raises(UserError, match="not found"):
        list(iter_conversations(str(tmp_path / "nope.jsonl")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no .json"):
        list(iter_conversations(str(tmp_path / "empty")))
    with pytest.raises(UserError, match="unknown embedded dataset"):
        list(iter_conversations("embedded:nope"))
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(UserError, match="unsupported"):
        list(readers._file_records(tmp_path / "x.csv", ReadStats()))


def test_role_normalisation():
    """Guards against: ShareGPT role names (human/gpt/chatgpt/bard/bing/model) not mapping to
    user/assistant, same-role turns not merging, empty turns or a trailing user turn being kept."""
    rec = {"conversations": [
        {"from": "system", "value": "sys"}, {"from": "Human", "value": "hi"}, {"from": "human", "value": "there"},
        {"from": "chatgpt", "value": "hello"}, {"from": "bard", "value": ""}, {"from": "user", "value": "q2"},
        {"from": "model", "value": "a2"}, {"from": "human", "value": "trailing question"}]}
    messages, why = normalize(rec)
    assert why == ""
    assert messages == [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi\n\nthere"},
                        {"role": "assistant", "content": "hello"}, {"role": "user", "content": "q2"},
                        {"role": "assistant", "content": "a2"}]


def test_openai_developer_role_and_text_parts_are_read():
    """Guards against OpenAI-format data (the ``developer`` role of its reasoning models, content as a list of text
    parts) dropped whole as "unknown role or non-text turn"."""
    rec = {"messages": [{"role": "developer", "content": "Be terse."},
                        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]},
                        {"role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
                        {"role": "user", "content": "Weather?"},
                        {"role": "assistant", "content": "Sunny.", "tool_calls": [{"function": {"name": "f"}}]}]}
    messages, why = normalize(rec)
    assert why == "" and messages == [{"role": "system", "content": "Be terse."},
                                      {"role": "user", "content": "Hi\nthere"},
                                      {"role": "assistant", "content": "Hello."},
                                      {"role": "user", "content": "Weather?"},
                                      {"role": "assistant", "content": "Sunny."}]


def test_system_prompt_only_added_when_absent():
    """Guards against: data.system_prompt overriding a conversation's own system turn or being dropped."""
    msgs, _ = normalize(_openai(0), system_prompt="Be nice.")
    assert msgs[0] == {"role": "system", "content": "Be nice."}
    rec = {"messages": [{"role": "system", "content": "own"}, *_openai(0)["messages"]]}
    msgs, _ = normalize(rec, system_prompt="Be nice.")
    assert msgs[0]["content"] == "own" and len(msgs) == 3


@pytest.mark.parametrize("record, reason", [
    ({"conversations": [{"from": "human", "value": "only a question"}]}, "no assistant turn"),
    ({"messages": [{"role": "assistant", "content": "   "}, {"role": "user", "content": "x"}]}, "no assistant turn"),
    ({"conversations": [{"from": "alien", "value": "x"}, {"from": "gpt", "value": "y"}]}, "unknown role"),
    ({"conversations": [{"from": "gpt", "value": 5}]}, "non-text"),
    ({"messages": [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": None, "tool_calls": [
        {"function": {"name": "get_weather"}}]}, {"role": "tool", "content": "sunny"}]}, "tool call"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
                   {"role": "assistant", "content": "a cat"}]}, "non-text turn"),
    ({"conversations": [{"from": "human", "value": "weather?"}, {"from": "function_call", "value": "{}"},
                        {"from": "gpt", "value": "sunny"}]}, "tool call"),
    ({"text": "plain"}, "no conversations/messages field"),
    (["not", "a", "dict"], "not an object"),
    ({"conversations": ["a string turn"]}, "malformed turn"),
])
def test_unusable_records_are_dropped_with_a_reason(record, reason):
    """Guards against: records with nothing to learn (no assistant reply) or a malformed shape being
    trained on or crashing the stream, instead of being counted with a reason."""
    messages, why = normalize(record)
    assert messages is None and reason in why


def test_read_stats_count_drops(tmp_path):
    """Guards against: dropped records disappearing from the report (the user must see what was skipped)."""
    path = tmp_path / "mix.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        _sharegpt(0), {"conversations": [{"from": "human", "value": "q"}]}, _openai(1),
        {"messages": [{"role": "user", "content": "q"}]}]) + "\n")
    stats = ReadStats()
    assert len(list(iter_conversations(str(path), stats=stats))) == 2
    assert stats.recovered == 2 and stats.dropped == {"no assistant turn": 2}


# -- assistant-only labels -----------------------------------------------------------------------
def test_labels_only_on_assistant_replies_multi_turn(tok):
    """Guards against: labels on user turns, the system prompt or role headers (the reference Medusa
    bug: its heads learn to predict the user's words); each reply must keep its end-of-turn marker."""
    messages = [
        {"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi é, what is 2+2?"},
        {"role": "assistant", "content": "It is 4 — ünïcode ok."}, {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "6.\nDone"}]
    enc = encode_conversation(tok, messages, 1024)
    assert enc is not None and not enc.truncated
    assert labelled_runs(tok, enc) == ["It is 4 — ünïcode ok.<|im_end|>", "6.\nDone<|im_end|>"]
    text = tok.decode(enc.input_ids)
    assert text == tok.apply_chat_template(messages, tokenize=False)
    # every token of the system prompt, user turns and role headers is ignored
    n_labelled = sum(l != IGNORE for l in enc.labels)
    reply_tokens = len(tok("It is 4 — ünïcode ok.<|im_end|>6.\nDone<|im_end|>", add_special_tokens=False)["input_ids"])
    assert n_labelled == reply_tokens


def templated(template: str):
    """The byte tokenizer with ``template`` as its chat template."""
    tok = byte_tokenizer()
    tok.chat_template = template
    return tok


# Qwen3-style: only the last reply gets a think block, so earlier replies are not prefix-stable (located by text).
LAST_TURN_THINKS = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n'}}"
    "{% if message['role'] == 'assistant' and loop.last %}{{'<think></think>'}}{% endif %}"
    "{{message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def test_a_reply_quoted_by_its_prompt_is_labelled_in_the_reply_not_the_prompt():
    """Guards against: with a template that is not prefix-stable (Qwen3's think block on the last reply only), an
    earlier reply located by searching its text from the previous reply's end, so a short reply the user's turn
    quotes ("Say yes" -> "yes") labels the user's words and leaves the real reply untrained."""
    tok = templated(LAST_TURN_THINKS)
    messages = [{"role": "user", "content": "Say yes"}, {"role": "assistant", "content": "yes"},
                {"role": "user", "content": "Now say yes again, loud"}, {"role": "assistant", "content": "YES"}]
    enc = encode_conversation(tok, messages, 1024)
    assert labelled_runs(tok, enc) == ["yes<|im_end|>", "<think></think>YES<|im_end|>"]
    first = [i for i, l in enumerate(enc.labels) if l != IGNORE][0]
    assert tok.decode(enc.input_ids[:first]).endswith("<|im_start|>assistant\n")  # the reply, not "Say yes"


def test_truncation_keeps_partial_reply_and_flags_it(tok):
    """Guards against: an over-long conversation not being truncated to max_length, or not being counted as truncated."""
    messages = [{"role": "user", "content": "Tell me."}, {"role": "assistant", "content": "x" * 300}]
    enc = encode_conversation(tok, messages, 64)
    assert enc.truncated and len(enc.input_ids) == len(enc.labels) == 64
    labelled = [t for t in enc.labels if t != IGNORE]
    assert labelled and tok.decode(labelled) == "x" * len(labelled)
    assert not encode_conversation(tok, messages, 1024).truncated


# Llama-3-style: every turn's content is trimmed, so a reply's words do not end where its raw text does.
TRIMS_REPLIES = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] | trim}}"
    "{{'<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@pytest.mark.parametrize("template", [None, LAST_TURN_THINKS, TRIMS_REPLIES], ids=["prefix-stable", "located",
                                                                                    "trimmed"])
def test_an_unfinished_reply_is_labelled_without_its_end_of_turn_marker(template, tok):
    """Guards against: a reply cut at a length limit (self-distillation at max_new_tokens) trained with the
    end-of-turn marker the template puts after it, teaching the drafter to end replies mid-sentence wherever a
    limit fell; or the mark also taking the end away from the finished replies beside it, or its words."""
    if template is not None:
        tok = templated(template)
    messages = [{"role": "user", "content": "Count."}, {"role": "assistant", "content": "1 2 3 4 "},
                {"role": "user", "content": "Again?"}, {"role": "assistant", "content": "Yes."}]
    finished = labelled_runs(tok, encode_conversation(tok, messages, 1024))
    messages[1] = {**messages[1], "unfinished": True}
    got = labelled_runs(tok, encode_conversation(tok, messages, 1024))
    assert finished[0].endswith("<|im_end|>") and got[0] == finished[0][:-len("<|im_end|>")].rstrip()
    assert got[0].rstrip().endswith("1 2 3 4") and got[1:] == finished[1:]
    messages[1], messages[3] = {k: v for k, v in messages[1].items() if k != "unfinished"}, {**messages[3],
                                                                                            "unfinished": True}
    got = labelled_runs(tok, encode_conversation(tok, messages, 1024))
    dress = len("<think></think>") if template == LAST_TURN_THINKS else 0   # a last cut reply: as it was written
    assert got[0] == finished[0] and got[-1] == finished[-1][dress:-len("<|im_end|>")].rstrip()
    assert got[-1].endswith("Yes.")


# Qwen3's own handling of the reply after the last user turn (its chat template, cut to that part): the reasoning
# split off at </think> and put back in a think block, an empty one when the reply has no </think>.
QWEN3_LAST_REPLY = (
    "{% for message in messages %}{% set content = message['content'] %}"
    "{% if message['role'] == 'assistant' and loop.last %}{% set reasoning = '' %}"
    "{% if '</think>' in content %}{% set reasoning = content.split('</think>')[0].split('<think>')[-1] %}"
    "{% set content = content.split('</think>')[-1].lstrip('\\n') %}{% endif %}"
    "{{'<|im_start|>assistant\n<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' + content}}"
    "{% else %}{{'<|im_start|>' + message['role'] + '\n' + content}}{% endif %}{{'<|im_end|>\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def test_a_last_reply_cut_inside_its_reasoning_is_trained_as_the_backbone_wrote_it():
    """Guards against: a distilled reply cut at max_new_tokens inside its <think> block rendered by a Qwen3
    template with an empty think block before it ("<think>\n\n</think>\n\n<think>\nLet me..."), a context the
    backbone never wrote its words in, so the drafter learnt them after a prefix it will never see; the finished
    reply and an earlier cut one kept as the template renders them."""
    tok = templated(QWEN3_LAST_REPLY)
    cut = "<think>\nLet me count: 1 2 3"
    messages = [{"role": "user", "content": "Count."}, {"role": "assistant", "content": cut, "unfinished": True}]
    enc = encode_conversation(tok, messages, 1024)
    assert tok.decode(enc.input_ids) == "<|im_start|>user\nCount.<|im_end|>\n<|im_start|>assistant\n" + cut
    assert labelled_runs(tok, enc) == [cut]
    done = "<think>\nCounted.\n</think>\n\n1 2 3"
    messages[1] = {"role": "assistant", "content": done}
    assert labelled_runs(tok, encode_conversation(tok, messages, 1024)) == [done + "<|im_end|>"]
    messages = [messages[0], {"role": "assistant", "content": cut, "unfinished": True},
                {"role": "user", "content": "Go on."}, {"role": "assistant", "content": done}]
    assert labelled_runs(tok, encode_conversation(tok, messages, 1024)) == [cut, done + "<|im_end|>"]


def test_the_unfinished_mark_is_read_with_the_turn_it_marks():
    """Guards against: the reader dropping an assistant turn's ``unfinished`` mark (distilled replies cut at
    max_new_tokens would be trained with an end again), keeping it on a user turn, or keeping it on a merged
    reply whose last part was finished."""
    record = {"messages": [{"role": "user", "content": "a", "unfinished": True},
                           {"role": "assistant", "content": "b", "unfinished": True},
                           {"role": "user", "content": "c"}, {"role": "assistant", "content": "d", "unfinished": True},
                           {"role": "assistant", "content": "e"}]}
    messages, why = normalize(record)
    assert why == "" and messages == [{"role": "user", "content": "a"},
                                      {"role": "assistant", "content": "b", "unfinished": True},
                                      {"role": "user", "content": "c"}, {"role": "assistant", "content": "d\n\ne"}]
    sharegpt = {"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b", "unfinished": True}]}
    assert normalize(sharegpt)[0][-1] == {"role": "assistant", "content": "b", "unfinished": True}
    assert "unfinished" not in normalize({"messages": [{"role": "user", "content": "a"}, {"role": "assistant",
                                          "content": "b", "unfinished": "yes"}]})[0][-1]


def test_none_when_no_assistant_token_survives_truncation(tok):
    """Guards against: conversations whose replies are cut off entirely entering training with no target."""
    messages = [{"role": "user", "content": "y" * 200}, {"role": "assistant", "content": "answer"}]
    assert encode_conversation(tok, messages, 32) is None
    assert encode_conversation(tok, messages, 1024) is not None


def test_leading_assistant_turn_is_not_labelled(tok):
    """Guards against: a reply with no prompt before it (ShareGPT has some) being trained as if it had context;
    with a system prompt before it (``data.system_prompt`` inserts one) it was trained, while self-distillation
    drops such a greeting."""
    messages = [{"role": "assistant", "content": "I start."}, {"role": "user", "content": "ok"},
                {"role": "assistant", "content": "Then me."}]
    enc = encode_conversation(tok, messages, 1024)
    assert labelled_runs(tok, enc) == ["Then me.<|im_end|>"]
    enc = encode_conversation(tok, [{"role": "system", "content": "Be kind."}] + messages, 1024)
    assert labelled_runs(tok, enc) == ["Then me.<|im_end|>"]


# Qwen3's handling of reasoning: an earlier reply is rendered without its <think> block, the last one with it.
DROPS_EARLIER_THINKING = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n'}}"
    "{% set content = message['content'] %}"
    "{% if message['role'] == 'assistant' and not loop.last %}"
    "{% set content = content.split('</think>')[-1].lstrip('\\n') %}{% endif %}"
    "{{content + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def test_replies_whose_reasoning_the_template_drops_are_still_labelled():
    """Guards against: with a Qwen3-style template (earlier replies rendered without their <think> block), every
    reply but the last being searched for with its reasoning, not found, and silently left untrained."""
    tok = templated(DROPS_EARLIER_THINKING)
    messages = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "<think>\nGreet.\n</think>\n\nHello."},
                {"role": "user", "content": "More?"},
                {"role": "assistant", "content": "<think>\nOk.\n</think>\n\nSure."}]
    enc = encode_conversation(tok, messages, 1024)
    assert labelled_runs(tok, enc) == ["Hello.<|im_end|>", "<think>\nOk.\n</think>\n\nSure.<|im_end|>"]
    assert enc.unlocated == 0


def test_a_reply_the_template_rewrites_past_recognition_is_counted():
    """Guards against: a reply the template rewrote (so neither its words nor their trimmed form appear) being
    left untrained without a count: the run's summary must say how many replies went unlabelled."""
    tok = templated(LAST_TURN_THINKS.replace("message['content'] +", "message['content'] | upper +"))
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "first"},
                {"role": "user", "content": "b"}, {"role": "assistant", "content": "second"}]
    enc = encode_conversation(tok, messages, 1024)
    assert enc.unlocated == 1 and labelled_runs(tok, enc) == ["<think></think>SECOND<|im_end|>"]


def test_a_located_reply_keeps_its_first_sentencepiece_token():
    """Guards against: a reply found by its words (a template that is not prefix-stable, e.g. Mistral's moving the
    system prompt into the last user turn) starting its span at the first letter, so a SentencePiece token
    "▁Hello" (whose offsets start at its space) was left unlabelled: every reply lost its first token."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    words = ["▁Hello", "▁there.", "▁Sure", "▁thing.", "▁hi", "▁more", "</s>", "[INST]", "[/INST]", "▁sys",
             "<unk>"]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never")
    core.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="never")
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="</s>", unk_token="<unk>")
    tok.add_special_tokens({"additional_special_tokens": ["[INST]", "[/INST]"]})
    # Mistral v0.3's shape: the system prompt goes into the last user turn only, so renderings are not prefixes
    tok.chat_template = (
        "{% set sys = messages[0]['content'] if messages[0]['role'] == 'system' else '' %}"
        "{% set loop_messages = messages[1:] if sys else messages %}{% set last_user = namespace(i=-1) %}"
        "{% for m in loop_messages %}{% if m['role'] == 'user' %}{% set last_user.i = loop.index0 %}{% endif %}"
        "{% endfor %}{% for m in loop_messages %}{% if m['role'] == 'user' %}{{'[INST]'}}"
        "{% if loop.index0 == last_user.i and sys %}{{' ' + sys}}{% endif %}{{' ' + m['content'] + '[/INST]'}}"
        "{% else %}{{' ' + m['content'] + '</s>'}}{% endif %}{% endfor %}")
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "Hello there."}, {"role": "user", "content": "more"},
                {"role": "assistant", "content": "Sure thing."}]
    enc = encode_conversation(tok, messages, 1024)
    labelled = [tok.convert_ids_to_tokens(t) for t in enc.labels if t != IGNORE]
    assert labelled == ["▁Hello", "▁there.", "</s>", "▁Sure", "▁thing.", "</s>"]


# -- stream --------------------------------------------------------------------------------------
def _data_cfg(**kw):
    base = dict(source=str(TINY_DATA), split="train", max_length=256, packing=True, bucket_buffer=32,
                shuffle_buffer=16, max_conversations=None, eval_conversations=8, vocab_scan_conversations=32,
                system_prompt=None)
    base.update(kw)
    return SimpleNamespace(**base)


def _texts(tok, stream, epoch=0):
    return [tok.decode(e.input_ids) for e in stream.encoded(epoch)]


def test_eval_held_out_and_train_disjoint(tok):
    """Guards against: evaluation conversations leaking into training (inflated per-head accuracy)."""
    d = _data_cfg()
    ev = _texts(tok, ConversationStream(d, tok, eval_split=True))
    tr = _texts(tok, ConversationStream(d, tok))
    assert len(ev) == 8 and len(tr) == 32
    assert not set(ev) & set(tr)


def test_ranks_get_disjoint_shards_covering_the_data(tok):
    """Guards against: every rank training on the same conversations (or some never being seen) with 2+ ranks."""
    d = _data_cfg()
    shards = [_texts(tok, ConversationStream(d, tok, rank=r, world_size=2)) for r in range(2)]
    assert not set(shards[0]) & set(shards[1])
    assert sorted(shards[0] + shards[1]) == sorted(_texts(tok, ConversationStream(d, tok)))


def test_shuffle_is_seeded_and_changes_per_epoch(tok):
    """Guards against: a non-deterministic stream (resume could not replay it) or the same order every epoch."""
    d = _data_cfg()
    a = _texts(tok, ConversationStream(d, tok, seed=3), epoch=0)
    assert a == _texts(tok, ConversationStream(d, tok, seed=3), epoch=0)
    assert sorted(a) == sorted(_texts(tok, ConversationStream(d, tok, seed=3), epoch=1))
    assert a != _texts(tok, ConversationStream(d, tok, seed=3), epoch=1)


def test_each_rank_reshuffles_its_shard_every_epoch(tok):
    """Guards against: with 2+ ranks the epoch set on the shuffled stream before it is split by rank being lost,
    so every rank saw the same conversations in the same order every epoch (a single process reshuffled)."""
    d = _data_cfg()
    every = sorted(_texts(tok, ConversationStream(d, tok)))
    shards = [[_texts(tok, ConversationStream(d, tok, seed=3, rank=r, world_size=2), epoch=e) for r in range(2)]
              for e in (0, 1)]
    for e in (0, 1):   # each epoch: the ranks' shards disjoint, together every conversation once
        assert not set(shards[e][0]) & set(shards[e][1]) and sorted(shards[e][0] + shards[e][1]) == every
    assert shards[0][0] != shards[1][0] and shards[0][1] != shards[1][1]
    assert shards[0][0] == _texts(tok, ConversationStream(d, tok, seed=3, rank=0, world_size=2), epoch=0)


def test_max_conversations_limits_training(tok):
    """Guards against: data.max_conversations being ignored (a debug run reading a whole corpus)."""
    assert len(_texts(tok, ConversationStream(_data_cfg(max_conversations=5), tok))) == 5


def test_empty_training_split_is_a_user_error(tmp_path, tok):
    """Guards against: an all-unusable dataset hanging in an endless epoch loop instead of a UserError."""
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps({"conversations": [{"from": "human", "value": "q"}]}) + "\n")
    stream = ConversationStream(_data_cfg(source=str(path), eval_conversations=0), tok)
    with pytest.raises(UserError, match="no training conversations.*no assistant turn"):
        next(iter(MicroBatches(stream, 2, tok.pad_token_id)))


def test_resumed_micro_batches_replay_exactly(tok):
    """Guards against: resuming at (epoch, index) yielding other batches than the uninterrupted stream
    (a resumed run would then train on different data)."""
    d = _data_cfg()
    full = MicroBatches(ConversationStream(d, tok, seed=1), 2, tok.pad_token_id, buffer=d.bucket_buffer)
    it = iter(full)
    seen = [next(it) for _ in range(9)]  # crosses at least one epoch boundary on this data
    assert full.epoch >= 1
    for cut in (2, 5, 7):
        ref = MicroBatches(ConversationStream(d, tok, seed=1), 2, tok.pad_token_id, buffer=d.bucket_buffer)
        it2 = iter(ref)
        for _ in range(cut):
            next(it2)
        state = ref.state()
        resumed = MicroBatches(ConversationStream(d, tok, seed=1), 2, tok.pad_token_id, buffer=d.bucket_buffer,
                               **state)
        got = next(iter(resumed))
        for key in ("input_ids", "labels", "position_ids", "doc_ids"):
            assert torch.equal(got[key], seen[cut][key]), (cut, key)


def test_read_stats_describe_the_source_once(tok):
    """Guards against: the end-of-run data report counting the source once per epoch (a 40-record file
    reported as '120 conversations usable' after 3 epochs)."""
    d = _data_cfg()
    stream = ConversationStream(d, tok)
    mb = MicroBatches(stream, 2, tok.pad_token_id, buffer=d.bucket_buffer)
    it = iter(mb)
    while mb.epoch < 2:
        next(it)
    assert stream.read_stats.recovered == 40  # the file has 40 usable conversations


def test_read_stats_after_a_resume_say_what_this_process_read(tok):
    """Guards against: a run resumed past its first epoch (or with no step left) reporting '0 conversations
    usable, 0 records dropped' for a 40-record file: the counters only counted epoch 0 of this process."""
    from medusa_train.data.stream import RankData

    data = RankData(_data_cfg(), tok, seed=0, rank=0, world_size=1, micro_batch_size=2, pad_id=tok.pad_token_id)
    mb = data.batches(epoch=1, index=2)
    it = iter(mb)
    while mb.epoch < 3:
        next(it)
    summary = data.read_stats.summary()
    assert data.read_stats.recovered == 40, summary  # once, not per epoch, whichever epoch came first
    assert summary.startswith("resumed at epoch 1, batch 2: this process read 40 conversations usable"), summary
    idle = RankData(_data_cfg(), tok, seed=0, rank=0, world_size=1, micro_batch_size=2, pad_id=tok.pad_token_id)
    idle.batches(epoch=0, index=7)  # resumed at max_steps: evaluated and exported, nothing read
    assert idle.read_stats.summary() == "resumed at epoch 0, batch 7: no conversation read by this process " \
                                        "(nothing left to train)"


def test_summary_line_after_resuming_past_the_first_epoch(compose_tiny, out_dir, capsys):
    """Guards against: the run's last 'data:' line after a resume saying '0 conversations usable, 0 records
    dropped' (the resumed process starts past epoch 0, whose reading alone was counted)."""
    import shutil

    from medusa_train import trainer as T

    run = ["trainer.save_every=16", "logger.plot=false"]
    T.run(compose_tiny(*run, "trainer.max_steps=16"))
    state = json.loads((out_dir / "checkpoints" / "step-000016" / "trainer_state.json").read_text())
    assert state["data"]["epoch"] >= 1  # the resume below starts past epoch 0
    capsys.readouterr()
    T.run(compose_tiny(*run, "trainer.max_steps=18"))
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("data: "))
    assert "this process read 40 conversations usable" in line and "resumed at epoch" in line, line
    shutil.rmtree(out_dir / "heads")  # killed before its export: the rerun trains no step, then exports
    T.run(compose_tiny(*run, "trainer.max_steps=18"))
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("data: "))
    assert "0 conversations usable" not in line and "no conversation read by this process" in line, line


def test_the_summary_line_counts_conversations_dropped_without_a_reply_token(compose_tiny, tmp_path, capsys):
    """Guards against: conversations whose prompt fills data.max_length (no reply token left) vanishing from
    training while the run's last 'data:' line said nothing was dropped or truncated."""
    from medusa_train import trainer as T

    path = tmp_path / "chats.jsonl"
    rows = [{"messages": [{"role": "user", "content": ("long " * 80 if i % 2 else f"q{i}")},
                          {"role": "assistant", "content": f"answer {i}"}]} for i in range(24)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    T.run(compose_tiny(f"data.source={path}", "data.max_length=128", "data.eval_conversations=4",
                       "trainer.max_steps=2", "logger.plot=false"))
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("data: "))
    assert "10 more dropped with no reply token to train on (a prompt filling 128 tokens" in line, line


def test_token_frequencies_count_only_assistant_tokens(tok, tmp_path):
    """Guards against: the truncated vocabulary being chosen from user/system tokens as well."""
    path = tmp_path / "f.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "zzzz"},
                                             {"role": "assistant", "content": "aab"}]}) + "\n")
    stream = ConversationStream(_data_cfg(source=str(path), eval_conversations=0, shuffle_buffer=1), tok)
    counts = token_frequencies(stream, len(tok), 10)
    ids = lambda s: tok(s, add_special_tokens=False)["input_ids"]
    assert counts[ids("a")[0]] == 2 and counts[ids("b")[0]] == 1
    assert counts[tok.eos_token_id] == 1
    assert counts[ids("z")[0]] == 0
    assert int(counts.sum()) == 4


def test_token_frequencies_read_and_report_exactly_the_conversations_counted(tok):
    """Guards against: the vocabulary scan reading one conversation past its limit, so its line said 'in 3001
    conversations' for a scan of up to 3,000."""
    stream = ConversationStream(_data_cfg(), tok)
    counts = token_frequencies(stream, len(tok), 5)
    assert stream.stats.conversations == 5 and int(counts.sum()) > 0


# -- packing ---------------------------------------------------------------------------------------
def _doc(n: int, start: int = 0) -> Encoded:
    ids = [(start + i) % 200 + 1 for i in range(n)]
    return Encoded(ids, [IGNORE] + ids[1:], False)


def test_pack_respects_row_length_and_keeps_every_document():
    """Guards against: packed rows longer than max_length (shape errors / silent cut) or documents lost or duplicated."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 120, (200,), generator=g).tolist() + [128, 128, 1]
    docs = [_doc(n, i) for i, n in enumerate(lengths)]
    rows = pack(docs, 128)
    assert all(sum(len(d.input_ids) for d in row) <= 128 for row in rows)
    packed = [id(d) for row in rows for d in row]
    assert sorted(packed) == sorted(id(d) for d in docs)
    # best-fit decreasing is near-optimal: no more rows than 1 + total/row_len * 1.25
    assert len(rows) <= 1 + sum(lengths) / 128 * 1.25


def test_collate_positions_restart_and_doc_ids():
    """Guards against: position ids continuing across packed documents (RoPE would see one long text)
    or padding not being marked as document 0."""
    rows = [[_doc(3), _doc(2, 50)], [_doc(4, 90)]]
    b = collate(rows, pad_id=0, row_len=8)
    assert b["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 0, 0], [0, 1, 2, 3, 0, 0, 0, 0]]
    assert b["doc_ids"].tolist() == [[1, 1, 1, 2, 2, 0, 0, 0], [1, 1, 1, 1, 0, 0, 0, 0]]
    assert b["input_ids"][0, :5].tolist() == rows[0][0].input_ids + rows[0][1].input_ids
    assert b["labels"][0].tolist() == [IGNORE, 2, 3, IGNORE, 52, IGNORE, IGNORE, IGNORE]
    assert (b["input_ids"][b["doc_ids"] == 0] == 0).all()


class _StubStream:
    """The part of ConversationStream that MicroBatches uses, over fixed documents."""

    def __init__(self, docs, packing=True, max_length=64):
        self.docs = docs
        self.data = SimpleNamespace(packing=packing, max_length=max_length, source="stub")
        self.stats = StreamStats()

    def encoded(self, epoch=0):
        yield from self.docs


def test_no_padding_when_packed_documents_fill_rows():
    """Guards against: packing leaving room in rows that documents could fill (wasted compute); on a
    stream whose documents tile the rows exactly, the padding fraction must be 0."""
    docs = [_doc(n, i) for i, n in enumerate([16, 32, 48, 16] * 8)]  # 14 full rows of 64 tokens
    stream = _StubStream(docs)
    mb = MicroBatches(stream, 2, pad_id=0, buffer=len(docs))
    it = iter(mb)
    batches = [next(it) for _ in range(7)]
    assert all(b["input_ids"].shape == (2, 64) for b in batches)
    assert all((b["doc_ids"] > 0).all() for b in batches)
    assert stream.stats.padding == 0 and stream.stats.padding_fraction == 0.0
    assert stream.stats.tokens == 14 * 64


def test_padding_fraction_counts_padding_tokens():
    """Guards against: a wrong padding fraction in the logs (packing=false pads to the longest doc)."""
    docs = [_doc(10), _doc(30), _doc(20), _doc(40)]
    stream = _StubStream(docs, packing=False)
    mb = MicroBatches(stream, 2, pad_id=0, buffer=4)
    it = iter(mb)
    b1, b2 = next(it), next(it)
    real = int((b1["doc_ids"] > 0).sum() + (b2["doc_ids"] > 0).sum())
    total = b1["doc_ids"].numel() + b2["doc_ids"].numel()
    assert real == 100
    assert stream.stats.padding_fraction == pytest.approx((total - real) / total)
    assert b1["input_ids"].shape == (2, 20) and b2["input_ids"].shape == (2, 40)  # length-bucketed


def test_eval_batches_keep_every_held_out_conversation(tok):
    """Guards against: evaluation silently dropping held-out conversations (accuracy on a subset)."""
    d = _data_cfg()
    batches = eval_batches(ConversationStream(d, tok, eval_split=True), 3, tok.pad_token_id)
    assert sum(int(b["input_ids"].shape[0]) for b in batches) == 8
    assert all(int(b["doc_ids"].max()) == 1 for b in batches)  # one conversation per row


def test_a_reply_quoting_a_rewritten_prompt_is_still_labelled():
    """Guards against the search past the prompt's words (above) landing inside the reply: a template that trims
    the user's turn leaves the untrimmed words nowhere but in a reply quoting them verbatim, the search for the
    reply then started past its beginning and the reply went untrained."""
    tok = templated(LAST_TURN_THINKS.replace("message['content'] +", "message['content'] | trim +"))
    messages = [{"role": "user", "content": "repeat: abc "}, {"role": "assistant", "content": "repeat: abc ok"},
                {"role": "user", "content": "again"}, {"role": "assistant", "content": "fine"}]
    enc = encode_conversation(tok, messages, 1024)
    assert labelled_runs(tok, enc)[0].startswith("repeat: abc ok")
