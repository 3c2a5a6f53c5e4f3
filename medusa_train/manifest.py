"""One output directory, one run: claim a directory against an identity, write its manifest atomically.

Distillation data (``distill.json``) and the feature cache (``features.json``) are both resumable
directories that several commands (and several processes) continue. Continuing a directory that
was written for other settings would silently mix two datasets, so each directory carries a JSON
manifest with the *identity* of what it holds (the settings its content depends on), and a run
that wants the directory must claim it first: same identity -> continue; another identity ->
refused in one line naming what differs; no manifest -> the directory is created with one.

The manifest is always written beside its final name and renamed into place, so a kill, a full
disk or a crash mid-write leaves the previous manifest (never half a file), and every rank may
write the same content at once. A choice the processes must share but may make differently (distillation's
engine) is created once instead (``claim_once``): the first to create it wins, the others take its record.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Callable, Optional

from inference.errors import UserError


RECORD_DIR = ".hydra"   # a run's record of its configuration (launch.write_run_record)



def differences(old: dict, new: dict, prefix: str = "") -> list[str]:
    """``key=old there, new here`` for every (nested, dotted) setting that differs."""
    out = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += differences(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}={a!r} there, {b!r} here")
    return out


def write_text_atomic(path: Path, text: str) -> None:
    """Write beside the target, then rename: a reader (or the next run) never sees half a file, and a Ctrl-C
    mid-write leaves the file as it was, and no temporary file."""
    path = Path(path)
    # the writer's own name: processes, and threads of one (two writing one manifest at once shared a name, and
    # the second rename found the file gone)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_json_atomic(path: Path, obj: dict) -> None:
    """``write_text_atomic`` of ``obj`` as indented JSON."""
    write_text_atomic(path, json.dumps(obj, indent=2, default=str) + "\n")


def read_manifest(path: Path, root: Path) -> Optional[dict]:
    """The manifest at ``path``, None when there is none; unreadable JSON is a one-line error."""
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        raise UserError(f"{path} is not valid JSON; delete {root} to start over") from None


def claim(root: Path, name: str, identity: dict, fresh: dict, *, ours: Callable[[dict], Optional[str]],
          mismatch: str, foreign: Callable[[], Optional[str]] = lambda: None) -> dict:
    """Continue ``root`` if its manifest ``name`` holds ``identity``; create it (``fresh`` + identity) if absent.

    ``ours(manifest)`` returns why a manifest is not of this kind/version (None when it is);
    ``mismatch`` is the refusal for another identity, with ``{diff}`` for the differences;
    ``foreign()`` returns why a directory without a manifest must not be taken (None: take it).
    """
    root = Path(root)
    path = root / name
    manifest = read_manifest(path, root)
    if manifest is not None:
        wrong = ours(manifest)
        if wrong:
            raise UserError(wrong)
        diff = differences(manifest.get("identity", {}), identity)
        if diff:
            raise UserError(mismatch.format(diff="; ".join(diff[:3])))
        return manifest
    wrong = foreign()
    if wrong:
        raise UserError(wrong)
    root.mkdir(parents=True, exist_ok=True)
    manifest = {**fresh, "identity": identity}
    write_json_atomic(path, manifest)  # every rank may: same content, atomic rename
    return manifest


def check_recorded(path: Path, manifest: dict, recorded: dict, refusal: Callable[[str, object, object], str]) -> dict:
    """Facts kept beside a manifest's identity (what the data or tokenizer held, ...), not in it: refuse the first of
    ``recorded`` that differs from what the manifest at ``path`` holds (``refusal(key, there, here)``); write those
    it lacks into it, so a manifest made before a fact was kept is taken as it is and checked from then on. A value
    of None (not known here: a hub dataset's content) is not checked."""
    missing = {}
    for key, value in recorded.items():
        old = manifest.get(key)
        if value is None or old == value:
            continue
        if old is not None:
            raise UserError(refusal(key, old, value))
        missing[key] = value
    if missing:
        manifest = {**manifest, **missing}
        write_json_atomic(path, manifest)  # every rank may: same content, atomic rename
    return manifest


def claim_once(path: Path, record: dict, valid: Callable[[dict], bool], wait_s: float = 30.0) -> Optional[dict]:
    """Create ``path`` holding ``record`` unless it exists; return what it holds then (ours or an earlier claim's;
    None if it stays unreadable or not ``valid`` for ``wait_s``).

    The record is written whole to a file of this process's own, then hard-linked to ``path``: ``link`` fails when
    the name exists and is atomic on POSIX filesystems and NFS, so of processes claiming at the same instant exactly
    one wins, and no reader sees half a record. Without hard links: exclusive create, readers waiting out the write."""
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex}")   # unique across the hosts sharing the filesystem
    text = json.dumps(record, indent=2, default=str) + "\n"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            _write_synced(f, text)
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass   # another process claimed first: its record wins
        except OSError:   # a filesystem without hard links
            _create_exclusive(path, text)
    finally:
        tmp.unlink(missing_ok=True)
    deadline = time.monotonic() + wait_s
    while not valid(claimed := read_once(path)):
        if time.monotonic() > deadline:
            return None
        time.sleep(0.1)   # the exclusive-create fallback only: its creator is still writing the record
    return claimed


def _create_exclusive(path: Path, text: str) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        _write_synced(f, text)


def _write_synced(f, text: str) -> None:
    f.write(text)
    f.flush()
    os.fsync(f.fileno())


def is_temp_name(name: str) -> bool:
    """Whether a folder entry is a writer's temporary ``.<name>.tmp-<id>`` (being written, or left by a kill):
    part of the folder's own content, never another run's."""
    return name.startswith(".") and ".tmp-" in name


def read_once(path: Path) -> dict:
    """What a ``claim_once`` file holds; {} when there is none yet, or half of one (being written)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return {}
