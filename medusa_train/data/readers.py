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

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

from inference.errors import UserError
from inference import assets
from .tokenize import UNFINISHED

ROLE_MAP = {
    "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
    "bard": "assistant", "bing": "assistant", "model": "assistant", "system": "system",
}
_CHUNK = 1 << 20


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
    decoder = json.JSONDecoder()
    with open(path, "r", encoding="utf-8", errors="replace") as f:
        buf, pos, eof = f.read(_CHUNK), 0, False
        pos = _skip(buf, pos, "[")
        if pos is None:
            raise UserError(f"{path} is not a JSON array of conversations")
        while True:
            pos = _skip(buf, pos, ",")
            if pos < len(buf) and buf[pos] == "]":
                return
            try:
                item, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    if buf[pos:].strip():
                        stats.dropped["cut off at end of file"] += 1
                    return
                more = f.read(_CHUNK)
                eof = not more
                buf, pos = buf[pos:] + more, 0
                continue
            pos = end
            if len(buf) - pos < _CHUNK // 4 and not eof:  # keep the buffer from growing without bound
                more = f.read(_CHUNK)
                eof = not more
                buf, pos = buf[pos:] + more, 0
            yield item


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
    with open(path, "r", encoding="utf-8", errors="replace") as f:
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


def _file_records(path: Path, stats: ReadStats) -> Iterator[dict]:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        yield from iter_jsonl(path, stats)
    elif suffix == ".json":
        with open(path, "r", encoding="utf-8", errors="replace") as f:
            head = f.read(4096).lstrip()
        if head.startswith("["):
            yield from iter_json_array(path, stats)
        else:
            yield from iter_jsonl(path, stats)  # JSON lines saved as .json
    elif suffix == ".parquet":
        yield from iter_parquet(path, stats)
    else:
        raise UserError(f"unsupported data file {path} (use .json, .jsonl or .parquet)")


def iter_records(source: str, split: str, stats: ReadStats) -> Iterator[dict]:
    """Raw records from any accepted source."""
    if source.startswith("embedded:"):
        if source not in assets.EMBEDDED_DATA:
            raise UserError(f"unknown embedded dataset {source!r}; available: {', '.join(assets.EMBEDDED_DATA)}")
        yield from iter_json_array(assets.sharegpt_json_path(), stats)
        return
    path = Path(source).expanduser()
    if path.is_file():
        yield from _file_records(path, stats)
        return
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix.lower() in (".json", ".jsonl", ".parquet"))
        if not files:
            raise UserError(f"no .json/.jsonl/.parquet files in {path}")
        for f in files:
            yield from _file_records(f, stats)
        return
    if source.startswith((".", "/", "~")) or source.endswith((".json", ".jsonl", ".parquet")):
        raise UserError(f"data file not found: {source}")
    yield from _hub_records(source, split)


def _hub_records(name: str, split: str) -> Iterator[dict]:
    import datasets   # lazy: 1.1 s to import, hub datasets only

    try:
        ds = datasets.load_dataset(name, split=split, streaming=True)
    except Exception as e:  # datasets raises many types for "not found / offline"
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(f"cannot open dataset {name!r} (split {split!r}): {first}") from None
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
        role = ROLE_MAP.get(str(turn.get(rk, turn.get("role", ""))).lower())
        content = turn.get(ck, turn.get("content"))
        if role is None or not isinstance(content, str):
            return None, "unknown role or non-text turn"
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
