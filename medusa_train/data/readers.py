"""Conversation sources -> a stream of ``[{"role", "content"}, ...]`` message lists.

Accepted: the embedded ShareGPT JSON, local .json / .jsonl / .parquet files (or a folder of
them), and HF datasets ids; records in ShareGPT form (``conversations``: from/value) or
OpenAI form (``messages``: role/content). Everything is read lazily, record by record, so
a corpus larger than memory streams. A JSON array is decoded item by item, which also
recovers every complete record of a file cut off mid-way (the embedded ShareGPT file is);
what could not be used is counted in ``ReadStats`` and reported, never a crash.

An assistant turn marked ``"unfinished": true`` (a reply cut at a length limit, as self-distillation writes
it) keeps the mark: its words are trained on, the end-of-turn marker the template puts after it is not.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

from inference.errors import UserError
from inference import assets
from inference.prompts import text_content
from .tokenize import UNFINISHED

ROLE_MAP = {
    "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
    "bard": "assistant", "bing": "assistant", "model": "assistant", "system": "system",
    "developer": "system",   # OpenAI's name for the system turn of its reasoning models
}
# tool calls and their results (OpenAI, Llama 3's ipython, LLaMA-Factory's ShareGPT): not the model's reply text
TOOL_ROLES = frozenset({"tool", "function", "ipython", "observation", "function_call"})
_CHUNK = 1 << 20
_MAX_RECORD = 64 << 20  # characters: an array element still open after this is no conversation
_LAYOUT_PROBE = 4 * _CHUNK  # characters read at most to tell how a .json file holds its records
_FINGERPRINT_SPAN = 1 << 20  # bytes hashed at each end of a data file


@dataclass
class ReadStats:
    recovered: int = 0
    dropped: Counter = field(default_factory=Counter)
    read: bool = False  # whether a pass over the source began here: all zeros mean nothing read, not an empty source
    # (epoch, batch index) a resumed training stream restarted at: the counts are then this process's reading only
    resumed_at: Optional[tuple[int, int]] = None

    @property
    def dropped_total(self) -> int:
        return sum(self.dropped.values())

    def refuse(self, why: str) -> None:
        """A conversation counted usable that a later step (the chat template) could not use: dropped, with ``why``."""
        self.recovered -= 1
        self.dropped[why] += 1

    def counts(self) -> str:
        reasons = ", ".join(f"{n} {why}" for why, n in self.dropped.most_common()) or "none"
        return f"{self.recovered} conversations usable, {self.dropped_total} records dropped ({reasons})"

    def summary(self) -> str:
        if self.resumed_at is None:
            return self.counts()
        # A resumed process reads only what it replays and trains on: say so rather than look like a whole source.
        epoch, index = self.resumed_at
        where = f"resumed at epoch {epoch}, batch {index}"
        if not self.read:
            return f"{where}: no conversation read by this process (nothing left to train)"
        return f"{where}: this process read {self.counts()}"


def iter_json_array(path: Path, stats: ReadStats) -> Iterator[dict]:
    """Yield the items of a (possibly truncated) top-level JSON array, reading 1 MiB at a time."""
    with open(path, "r", encoding="utf-8-sig", errors="replace") as f:
        text = _Text(f)
        pos = _skip(text.buf, 0, "[")
        if pos is None:
            raise UserError(f"{path} is not a JSON array of conversations")
        yield from _elements(text, pos, stats)


def _iter_json_values(path: Path, stats: ReadStats) -> Iterator[dict]:
    """Yield JSON values written one after another (pretty-printed records), as the items of an array."""
    with open(path, "r", encoding="utf-8-sig", errors="replace") as f:
        yield from _elements(_Text(f), 0, stats)


class _Text:
    """The part of a file still to be read, one ``_CHUNK`` at a time."""

    def __init__(self, f):
        self.f, self.buf, self.eof = f, f.read(_CHUNK), False

    def refill(self, pos: int) -> None:
        """Drop what lies before ``pos`` and read one more chunk."""
        more = self.f.read(_CHUNK)
        self.eof = not more
        self.buf = self.buf[pos:] + more


_SKIPPED, _END = object(), object()


def _elements(text: _Text, pos: int, stats: ReadStats) -> Iterator[dict]:
    """The elements from ``pos`` on (commas between them optional) up to a closing ']' or the end of the file."""
    decoder = json.JSONDecoder()
    while True:
        pos = _skip(text.buf, pos, ",")
        if pos < len(text.buf) and text.buf[pos] == "]":
            return
        try:
            item, pos = decoder.raw_decode(text.buf, pos)
        except json.JSONDecodeError:
            item, pos = _complete(text, pos, decoder, stats)
            if item is _END:
                return
            if item is _SKIPPED:
                continue
        if len(text.buf) - pos < _CHUNK // 4 and not text.eof:  # keep the buffer from growing without bound
            text.refill(pos)
            pos = 0
        yield item


def _complete(text: _Text, pos: int, decoder: json.JSONDecoder, stats: ReadStats) -> tuple[object, int]:
    """The element at ``pos`` did not decode: it is cut by the buffer's end, or invalid. Read on until its end is
    in the buffer (found by brackets and strings alone, ``_Scan``), then decode it again or skip it, counted, so
    one bad record costs only itself. An element still open after ``_MAX_RECORD`` characters is no record: it is
    skipped as it streams by, never held whole. (item or _SKIPPED or _END, position after it)."""
    scan, streamed_by = _Scan(pos), False
    while True:
        end = scan.end(text.buf)
        if end is not None:
            break
        if text.eof:
            if streamed_by or text.buf[pos:].strip():
                stats.dropped["cut off at end of file"] += 1
            return _END, 0
        if len(text.buf) - pos > _MAX_RECORD:
            pos, streamed_by = len(text.buf), True
        scan.at -= pos
        text.refill(pos)
        pos = 0
    if not streamed_by:
        if not text.buf[pos:end].strip():
            return _SKIPPED, end  # no element here: the closing ']' (or a stray ',')
        try:
            return decoder.raw_decode(text.buf, pos)
        except json.JSONDecodeError:
            pass
    stats.dropped["invalid JSON record"] += 1
    return _SKIPPED, end


_SURROGATE = re.compile(r"[\ud800-\udfff]")  # json pairs escaped surrogates; any one left is alone
_OUTSIDE = re.compile(r'["{}\[\],]')
_INSIDE = re.compile(r'["\\]')


class _Scan:
    """Where one element of a JSON array (or one of several values) ends, from its strings and brackets only, so
    an element that is not valid JSON (a raw tab in a string) still has an end to skip to. Resumable: call ``end``
    again once more text is in the buffer (``at`` shifted to the buffer's new start)."""

    def __init__(self, at: int):
        self.at, self.in_string, self.escaped = at, False, False
        self.closers: list[str] = []   # what each open bracket awaits, innermost last

    def end(self, buf: str) -> Optional[int]:
        """The position just after the element: after the bracket that closes it, or at the ',' or ']' that
        follows an element that is not an object or array; None while that is beyond ``buf``."""
        i, n = self.at, len(buf)
        while i < n:
            if self.escaped:
                i, self.escaped = i + 1, False
                continue
            m = (_INSIDE if self.in_string else _OUTSIDE).search(buf, i)
            if m is None:
                break
            c, i = m.group(), m.end()
            if self.in_string:
                self.escaped, self.in_string = c == "\\", c == "\\"
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.closers.append("}" if c == "{" else "]")
            elif self.closers:
                # a closer closes its own bracket and any left open inside it ({"a": [1, 2} ends at its '}', not
                # with the records after it); one that closes nothing open is part of the bad element
                if c != "," and c in self.closers:
                    while self.closers.pop() != c:
                        pass
                    if not self.closers:
                        return i
            else:
                return i if c == "}" else m.start()  # a stray '}' is part of the bad element; ',' / ']' end it
        self.at = n
        return None


def _skip(buf: str, pos: int, sep: str) -> Optional[int]:
    """Skip whitespace and at most one ``sep``; None if a required '[' is absent."""
    n = len(buf)
    while pos < n and buf[pos].isspace():
        pos += 1
    if pos < n and buf[pos] == sep:
        pos += 1
    elif sep == "[":
        return None
    while pos < n and buf[pos].isspace():
        pos += 1
    return pos


def iter_jsonl(path: Path, stats: ReadStats) -> Iterator[dict]:
    with open(path, "r", encoding="utf-8-sig", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                stats.dropped["invalid JSON line"] += 1


def iter_parquet(path: Path, stats: ReadStats) -> Iterator[dict]:
    import pyarrow   # lazy: parquet sources only
    import pyarrow.parquet as pq   # lazy: as pyarrow

    try:  # an empty or corrupt file fails on open or on any batch: one line naming it, not pyarrow's traceback
        for batch in pq.ParquetFile(path).iter_batches(batch_size=256):
            yield from batch.to_pylist()
    except (pyarrow.ArrowException, OSError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(f"{path} is not a readable parquet file ({first})") from None


def _file_records(path: Path, stats: ReadStats, in_folder: bool = False) -> Iterator[dict]:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        yield from iter_jsonl(path, stats)
    elif suffix == ".json":
        try:
            layout = _json_layout(path)
        except _JsonObject as e:
            if not in_folder:
                raise UserError(str(e)) from None
            # a folder's metadata beside its shards (a saved dataset's dataset_info.json): that file only
            stats.dropped["file of JSON that is no conversation record"] += 1
            return
        if layout == "array":
            yield from iter_json_array(path, stats)
        elif layout == "values":
            yield from _iter_json_values(path, stats)  # pretty-printed records, one after another
        else:
            yield from iter_jsonl(path, stats)  # JSON lines saved as .json
    elif suffix == ".parquet":
        yield from iter_parquet(path, stats)
    else:
        raise UserError(f"unsupported data file {path} (use .json, .jsonl or .parquet)")


def _is_record(value) -> bool:
    return isinstance(value, dict) and any(isinstance(value.get(k), list) for k in ("conversations", "messages"))


def _json_layout(path: Path) -> str:
    """How a .json file holds its records: "array", "lines" (JSON lines saved as .json) or "values" (records
    pretty-printed one after another). One JSON object that is no conversation record (``{"data": [...]}``) is
    refused: read line by line it would only be counted as N invalid lines, which says nothing of the cause."""
    with open(path, "r", encoding="utf-8-sig", errors="replace") as f:
        text = _Text(f)
        start = len(text.buf) - len(text.buf.lstrip())
        if text.buf.startswith("[", start):
            return "array"
        if not text.buf.startswith("{", start):
            return "lines"
        scan = _Scan(start)
        while (end := scan.end(text.buf)) is None:
            # a first line cut off or invalid never closes (JSON lines, counted as they always were); nor does a
            # first object past a few chunks: read as lines too, never buffered further just to tell the layout
            if text.eof or len(text.buf) > _LAYOUT_PROBE:
                return "lines"
            text.refill(0)
        first = text.buf[start:end]
        try:
            value = json.loads(first)
        except json.JSONDecodeError:
            return "lines"
        one_line = "\n" not in first
        if _is_record(value):
            return "lines" if one_line else "values"
        if one_line:  # a JSON line: JSON lines, unless it is all the file holds
            text.refill(end)
            if text.buf.strip():
                return "lines"
        keys = f" (keys: {', '.join(list(map(str, value))[:5])})" if value else ""
    raise _JsonObject(f"{path} holds JSON that is no conversation record, starting with an object{keys}: not an "
                      "array of conversations or JSON lines; put the conversations in a top-level JSON array, or one "
                      "per line in a .jsonl file")


class _JsonObject(Exception):
    """A .json file of JSON objects that are no conversation records: refused as a source, skipped and
    counted inside a folder."""


DATA_SUFFIXES = (".json", ".jsonl", ".parquet")


def data_files(folder: Path, split: str = "train") -> list[Path]:
    """The data files of a folder source that hold ``split``, in the order they are read. A folder whose file or
    folder names name splits (``data/train-00000-of-00002.parquet``, ``test.jsonl``, ``validation/``) is split the
    way ``datasets.load_dataset(folder)`` splits it, its files of no split left out: reading them all trained on a
    downloaded dataset's test split. A folder whose names name no split is one train split, every data file in it."""
    files = sorted(p for p in folder.rglob("*") if p.suffix.lower() in DATA_SUFFIXES)
    if not files:
        raise UserError(f"no .json/.jsonl/.parquet files in {folder}")
    splits = _named_splits(folder)
    if splits is None:
        if split != "train":
            raise UserError(f"data.split={split!r}, but the names of the files in {folder} name no split: its "
                            "conversations are all the train split (leave data.split=train, or name the split's "
                            "file or folder in data.source)")
        return files
    if split not in splits:
        raise UserError(f"data.split={split!r} is not among the splits the file names in {folder} name: "
                        f"{', '.join(sorted(splits))}")
    chosen = [p for p in files if p.resolve() in splits[split]]
    if not chosen:
        raise UserError(f"no .json/.jsonl/.parquet files of split {split!r} in {folder}")
    return chosen


def _named_splits(folder: Path) -> Optional[dict[str, set[Path]]]:
    """Each split's files as ``datasets`` resolves a local folder's split names; None where they name none."""
    from datasets.data_files import DataFilesDict, get_data_patterns   # lazy: folder sources only

    patterns = get_data_patterns(str(folder))
    if set(map(str, patterns)) == {"train"} and list(patterns.values())[0] == ["**"]:
        return None
    resolved = DataFilesDict.from_patterns(patterns, base_path=str(folder))
    return {str(name): {Path(f).resolve() for f in found} for name, found in resolved.items()}


def local_files(source: str, split: str) -> Optional[tuple[list[Path], Optional[Path]]]:
    """The files a local or embedded ``source`` reads for ``split``, and the folder they are in (None for one
    file); None for a hub id. One file (and the embedded data) is a train split alone, as ``datasets`` reads it."""
    if source.startswith("embedded:"):
        if source not in assets.EMBEDDED_DATA:
            raise UserError(f"unknown embedded dataset {source!r}; available: {', '.join(assets.EMBEDDED_DATA)}")
        files, folder = [assets.sharegpt_json_path()], None
    else:
        path = Path(source).expanduser()
        if path.is_dir():
            return data_files(path, split), path
        if not path.is_file():
            if source.startswith((".", "/", "~")) or source.endswith(DATA_SUFFIXES):
                raise UserError(f"data file not found: {source}")
            return None
        files, folder = [path], None
    if split != "train":
        raise UserError(f"data.split={split!r}, but data.source={source} is one file: its conversations are the "
                        "train split (leave data.split=train, or name the file that holds that split)")
    return files, folder


def iter_records(source: str, split: str, stats: ReadStats) -> Iterator[dict]:
    """Raw records from any accepted source."""
    local = local_files(source, split)
    if local is None:
        yield from _hub_records(source, split)
        return
    files, folder = local
    for f in files:
        yield from _file_records(f, stats, in_folder=folder is not None)


def _hub_records(name: str, split: str) -> Iterator[dict]:
    import datasets   # lazy: 1.1 s to import, hub datasets only

    host = assets.hub_unreachable()
    offline = datasets.config.HF_HUB_OFFLINE
    if host:   # its cache alone, at once: the hub client would retry for half a minute, a line per retry
        datasets.config.HF_HUB_OFFLINE = True
    try:
        ds = datasets.load_dataset(name, split=split, streaming=True)
    except Exception as e:  # datasets raises many types for "not found / offline"
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        why = f"{host} cannot be reached from this machine and the datasets cache here does not hold it" if host \
            else first
        raise UserError(f"cannot open dataset {name!r} (split {split!r}): {why}") from None
    finally:
        datasets.config.HF_HUB_OFFLINE = offline   # this process's setting, for whatever reads the hub next
    yield from ds


def normalize(record, system_prompt: Optional[str] = None) -> tuple[Optional[list[dict]], str]:
    """A record -> (messages, "") or (None, reason it was dropped)."""
    if not isinstance(record, dict):
        return None, "not an object"
    if isinstance(record.get("conversations"), list):
        turns, rk, ck = record["conversations"], "from", "value"
    elif isinstance(record.get("messages"), list):
        turns, rk, ck = record["messages"], "role", "content"
    else:
        return None, "no conversations/messages field"
    messages: list[dict] = []
    for turn in turns:
        if not isinstance(turn, dict):
            return None, "malformed turn"
        name = str(turn.get(rk, turn.get("role", ""))).lower()
        role = ROLE_MAP.get(name)
        content = text_content(turn.get(ck, turn.get("content")))   # OpenAI's list of text parts: its text
        calls = turn.get("tool_calls") or turn.get("function_call")
        if name in TOOL_ROLES or (calls and not isinstance(content, str)):   # a call beside its text: the text trains
            return None, "a tool call or tool result (not trained on)"
        if role is None:
            return None, "unknown role"
        if not isinstance(content, str):
            return None, "non-text turn (an image, audio or other part)"
        if _SURROGATE.search(content):  # "\ud83d" alone is valid JSON, but no tokenizer encodes it (TypeError)
            return None, "invalid unicode (lone surrogate)"
        if not content.strip():
            continue
        if messages and messages[-1]["role"] == role:  # merge consecutive same-role turns
            messages[-1]["content"] += "\n\n" + content
            messages[-1].pop(UNFINISHED, None)   # only the merged turn's last part decides where it ends
        else:
            messages.append({"role": role, "content": content})
        if role == "assistant" and turn.get(UNFINISHED) is True:
            messages[-1][UNFINISHED] = True
    if not any(m["role"] == "assistant" for m in messages):
        return None, "no assistant turn"
    while messages and messages[-1]["role"] != "assistant":
        messages.pop()  # a trailing user turn has nothing to learn from
    if system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages, ""


def iter_conversations(source: str, split: str = "train", stats: Optional[ReadStats] = None,
                       system_prompt: Optional[str] = None) -> Iterator[list[dict]]:
    stats = stats if stats is not None else ReadStats()
    stats.read = True
    for record in iter_records(source, split, stats):
        messages, why = normalize(record, system_prompt)
        if messages is None:
            stats.dropped[why] += 1
            continue
        stats.recovered += 1
        yield messages


def data_fingerprint(source: str, split: str = "train") -> Optional[str]:
    """What a local ``data.source`` holds, cheaply: size and a hash of each data file's first and last MiB (a
    folder: over the split's data files, in reading order, with their names). A features cache's or distillation's
    identity names the source by path only: rewriting the file must not hand its old records to a run on new data.
    Never mtimes: a reinstall of the embedded package (same file) must keep its cache. None for a hub id, and for
    a source the reader refuses (it says why in one line)."""
    try:
        local = local_files(source, split)
    except UserError:
        return None
    if local is None:
        return None
    files, root = local
    digest, total = hashlib.sha256(), 0
    for path in files:
        size = path.stat().st_size
        total += size
        digest.update(f"{path.relative_to(root) if root else ''}\0{size}\0".encode())
        with open(path, "rb") as f:
            digest.update(f.read(_FINGERPRINT_SPAN))
            if size > _FINGERPRINT_SPAN:
                f.seek(max(_FINGERPRINT_SPAN, size - _FINGERPRINT_SPAN))
                digest.update(f.read())
    return f"{len(files)} file{'s' if len(files) != 1 else ''}, {total} bytes, sha256 {digest.hexdigest()[:16]}"
