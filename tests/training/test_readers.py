"""Conversation readers on damaged or unusual files: lone surrogates, an invalid record inside a JSON array,
byte-order marks, and a .json holding one JSON object that is not conversations."""

from __future__ import annotations

import json
import tracemalloc

import pytest

from inference.errors import UserError
from medusa_train.data import readers
from medusa_train.data.readers import ReadStats, iter_conversations


def _sharegpt(i: int, pad: str = "") -> dict:
    return {"conversations": [{"from": "human", "value": f"question {i}?{pad}"},
                              {"from": "gpt", "value": f"answer {i}."}]}


def _answers(convs: list[list[dict]]) -> list[str]:
    return [c[-1]["content"] for c in convs]


def test_lone_surrogate_record_is_dropped_and_counted(tmp_path):
    """Guards against: a record whose text holds a lone surrogate ("\\ud83d" alone, which Python's json accepts)
    passing the reader and crashing the run later with a raw tokenizer TypeError; it must be dropped and
    counted, the records around it read."""
    bad = json.dumps(_sharegpt(1)).replace("answer 1.", "answer \\ud83d 1.")
    pair = json.dumps(_sharegpt(2)).replace("answer 2.", "answer \\ud83d\\ude00 2.")  # a whole pair is fine
    path = tmp_path / "scraped.jsonl"
    path.write_text("\n".join([json.dumps(_sharegpt(0)), bad, pair, json.dumps(_sharegpt(3))]) + "\n")
    stats = ReadStats()
    convs = list(iter_conversations(str(path), stats=stats))
    assert _answers(convs) == ["answer 0.", "answer \U0001F600 2.", "answer 3."]
    assert stats.dropped == {"invalid unicode (lone surrogate)": 1} and stats.recovered == 3


@pytest.mark.parametrize("chunk", [None, 37], ids=["one-read", "small-chunks"])
def test_invalid_record_inside_a_json_array_is_skipped(chunk, tmp_path, monkeypatch):
    """Guards against: one invalid record in the middle of a JSON array (a raw tab inside a string) losing every
    record after it and being reported as "cut off at end of file"; the reader must skip to the next element."""
    if chunk:
        monkeypatch.setattr(readers, "_CHUNK", chunk)
    items = [json.dumps(_sharegpt(i)) for i in range(6)]
    items[2] = items[2].replace("question 2?", "question\t2?")  # a raw control character: invalid JSON
    items[4] = '{"conversations": [{"from": "human", "value": "a, b]"}, {"from": "gpt", "value": "x\\"},{"}]}'
    path = tmp_path / "tab.json"
    path.write_text("[\n" + ",\n".join(items) + "\n]\n")
    stats = ReadStats()
    convs = list(iter_conversations(str(path), stats=stats))
    assert _answers(convs) == ["answer 0.", "answer 1.", "answer 3.", 'x"},{', "answer 5."]
    assert stats.dropped == {"invalid JSON record": 1}


def test_invalid_record_then_a_cut_off_one(tmp_path, monkeypatch):
    """Guards against: a file cut off mid-record after an invalid record counting the cut as an invalid record
    (or the reverse): "cut off at end of file" only where the end of the file came inside the record."""
    monkeypatch.setattr(readers, "_CHUNK", 37)
    items = [json.dumps(_sharegpt(i)) for i in range(4)]
    items[1] = items[1].replace("answer 1.", "answer\t1.")
    text = "[" + ",".join(items)
    path = tmp_path / "cut.json"
    path.write_text(text[: len(text) - 10])
    stats = ReadStats()
    assert _answers(iter_conversations(str(path), stats=stats)) == ["answer 0.", "answer 2."]
    assert stats.dropped == {"invalid JSON record": 1, "cut off at end of file": 1}


def _peak_bytes_reading(path) -> tuple[list[str], ReadStats, int]:
    stats = ReadStats()
    tracemalloc.start()
    try:
        answers = _answers(iter_conversations(str(path), stats=stats))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return answers, stats, peak


def test_invalid_record_near_the_start_does_not_read_the_file_into_memory(tmp_path, monkeypatch):
    """Guards against: a decoding failure near the start of a big JSON array growing the read buffer until the end
    of the file (a multi-GB file read into memory); the reader must keep streaming a chunk at a time."""
    monkeypatch.setattr(readers, "_CHUNK", 1 << 14)
    items = [json.dumps(_sharegpt(i, pad=" pad" * 200)) for i in range(8000)]  # ~6.6 MB
    items[1] = items[1].replace("question 1?", "question\t1?")
    path = tmp_path / "big.json"
    path.write_text("[" + ",\n".join(items) + "]")
    answers, stats, peak = _peak_bytes_reading(path)
    assert peak < 2_000_000, f"peak {peak:,} bytes while reading a {path.stat().st_size:,}-byte file"
    assert len(answers) == 7999 and stats.dropped == {"invalid JSON record": 1}


def test_record_larger_than_the_bound_is_skipped_without_keeping_it(tmp_path, monkeypatch):
    """Guards against: an undecodable record larger than any conversation (its end not in sight) being buffered
    whole; past the bound it is skipped as it streams by and counted, and the records after it are read."""
    monkeypatch.setattr(readers, "_CHUNK", 1 << 12)
    monkeypatch.setattr(readers, "_MAX_RECORD", 1 << 16, raising=False)
    huge = json.dumps(_sharegpt(1, pad="\tx" * 1_000_000)).replace("\\t", "\t")  # 2 MB of raw tabs: invalid
    items = [json.dumps(_sharegpt(0)), huge, *(json.dumps(_sharegpt(i)) for i in range(2, 6))]
    path = tmp_path / "huge.json"
    path.write_text("[" + ",".join(items) + "]")
    answers, stats, peak = _peak_bytes_reading(path)
    assert answers == ["answer 0.", "answer 2.", "answer 3.", "answer 4.", "answer 5."]
    assert stats.dropped == {"invalid JSON record": 1}
    assert peak < 1_000_000, f"peak {peak:,} bytes"


@pytest.mark.parametrize("layout", ["array", "array-indented", "lines-as-json", "jsonl"])
def test_byte_order_mark(layout, tmp_path):
    """Guards against: a UTF-8 byte-order mark (Windows editors write one) breaking a file: a BOM'd .json array
    read as JSON lines (every line dropped as "invalid JSON line"), a BOM'd .jsonl losing its first record."""
    records = [_sharegpt(i) for i in range(3)]
    if layout.startswith("array"):
        text = json.dumps(records, indent=2 if layout == "array-indented" else None)
    else:
        text = "\n".join(json.dumps(r) for r in records) + "\n"
    path = tmp_path / ("d.jsonl" if layout == "jsonl" else "d.json")
    path.write_bytes(b"\xef\xbb\xbf" + text.encode())
    stats = ReadStats()
    assert _answers(iter_conversations(str(path), stats=stats)) == ["answer 0.", "answer 1.", "answer 2."]
    assert stats.dropped_total == 0


@pytest.mark.parametrize("indent", [2, None], ids=["pretty", "one-line"])
def test_json_object_that_is_not_conversations_is_refused(indent, tmp_path):
    """Guards against: a .json holding one JSON object that is not a conversation record ({"data": [...]}, often
    pretty-printed) read as JSON lines and reported as N "invalid JSON line" records, which says nothing of the
    cause; it must be refused in one line naming the file and saying what it holds."""
    path = tmp_path / "wrapped.json"
    path.write_text(json.dumps({"data": [_sharegpt(i) for i in range(3)], "version": 1}, indent=indent) + "\n")
    with pytest.raises(UserError) as err:
        list(iter_conversations(str(path)))
    msg = str(err.value)
    assert str(path) in msg and "\n" not in msg, msg
    assert "no conversation record, starting with an object (keys: data, version)" in msg, msg


@pytest.mark.parametrize("indent", [2, None], ids=["pretty", "one-line"])
def test_json_holding_one_conversation_record(indent, tmp_path):
    """Guards against: the object refusal taking a .json whose single object IS a conversation record (one line,
    or pretty-printed, which was read line by line and dropped whole)."""
    path = tmp_path / "one.json"
    path.write_text(json.dumps(_sharegpt(7), indent=indent) + "\n")
    stats = ReadStats()
    assert _answers(iter_conversations(str(path), stats=stats)) == ["answer 7."]
    assert stats.dropped_total == 0


def test_json_lines_saved_as_json_keep_their_line_counts(tmp_path):
    """Guards against: the object check misreading JSON lines saved as .json whose first line is invalid: the rest
    must be read and the bad line counted, as before."""
    path = tmp_path / "lines.json"
    path.write_text("{not json\n" + "\n".join(json.dumps(_sharegpt(i)) for i in range(3)) + "\n")
    stats = ReadStats()
    assert _answers(iter_conversations(str(path), stats=stats)) == ["answer 0.", "answer 1.", "answer 2."]
    assert stats.dropped == {"invalid JSON line": 1}


def test_a_record_with_mismatched_brackets_skips_only_itself(tmp_path):
    """Guards against: a record whose brackets do not match (``{"a": [1, 2}``) counted closed by depth alone, so
    its end was sought past the records after it, which were swallowed into one "invalid JSON record"."""
    items = [json.dumps(_sharegpt(0)), '{"conversations": [1, 2}', json.dumps(_sharegpt(1)), json.dumps(_sharegpt(2))]
    path = tmp_path / "brackets.json"
    path.write_text("[\n" + ",\n".join(items) + "\n]\n")
    stats = ReadStats()
    assert _answers(list(iter_conversations(str(path), stats=stats))) == ["answer 0.", "answer 1.", "answer 2."]
    assert stats.dropped == {"invalid JSON record": 1}


def test_large_json_lines_with_a_cut_first_line_are_read_as_lines(tmp_path, monkeypatch):
    """Guards against: JSON lines saved as .json whose first line never closes (cut or unbalanced) refused as
    "one JSON object" once the file outgrew the layout probe (a small one was read), and up to 64 MiB buffered
    just to tell the file's layout."""
    monkeypatch.setattr(readers, "_CHUNK", 1 << 10)
    monkeypatch.setattr(readers, "_LAYOUT_PROBE", 1 << 12)
    lines = ['{"conversations": [{"from": "human", "value": "cut'] + [json.dumps(_sharegpt(i)) for i in range(200)]
    path = tmp_path / "lines.json"
    path.write_text("\n".join(lines) + "\n")
    stats = ReadStats()
    assert len(list(iter_conversations(str(path), stats=stats))) == 200
    assert stats.dropped == {"invalid JSON line": 1}
