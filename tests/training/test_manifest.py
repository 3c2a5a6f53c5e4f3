"""The one claim/compare/atomic-write helper behind distillation's and the feature cache's directories."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from inference.errors import UserError
from medusa_train import manifest as M

IDENTITY = {"backbone": {"name": "tiny", "weights": "abc"}, "seed": 0}


def claim(root: Path, identity: dict = IDENTITY, foreign=lambda: None):
    return M.claim(root, "run.json", identity, {"format": 1, "done": 0},
                   ours=lambda m: None if m.get("format") == 1 else f"{root} holds another format",
                   mismatch=f"{root} holds another run ({{diff}}); use another dir", foreign=foreign)


def test_claim_creates_then_continues_the_same_identity(tmp_path):
    """Guards against: a second run with the same settings being refused (resume would be impossible) or
    getting a fresh manifest that forgets what the first run recorded."""
    root = tmp_path / "out"
    first = claim(root)
    assert first == {"format": 1, "done": 0, "identity": IDENTITY}
    M.write_json_atomic(root / "run.json", {**first, "done": 3})
    assert claim(root)["done"] == 3


def test_another_identity_is_refused_naming_the_difference(tmp_path):
    """Guards against: continuing a directory written for other settings (two datasets mixed into one), or a
    refusal that does not say which setting differs (nested keys named with dots), or spans lines."""
    root = tmp_path / "out"
    claim(root)
    before = (root / "run.json").read_text()
    other = {"backbone": {"name": "tiny", "weights": "xyz"}, "seed": 0}
    with pytest.raises(UserError) as err:
        claim(root, other)
    msg = str(err.value)
    assert "backbone.weights='abc' there, 'xyz' here" in msg and "seed" not in msg and "\n" not in msg, msg
    assert (root / "run.json").read_text() == before  # the refused run wrote nothing


def test_foreign_directory_other_format_and_broken_json_are_refused(tmp_path):
    """Guards against: taking over a directory that holds someone else's files, reading a manifest of
    another format, or a traceback on a manifest that is not JSON."""
    with pytest.raises(UserError, match="not ours"):
        claim(tmp_path / "a", foreign=lambda: "not ours")
    assert not (tmp_path / "a").exists()
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "run.json").write_text(json.dumps({"format": 2, "identity": IDENTITY}))
    with pytest.raises(UserError, match="another format"):
        claim(tmp_path / "b")
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "run.json").write_text('{"format": 1, "ident')
    with pytest.raises(UserError, match="not valid JSON.*delete"):
        claim(tmp_path / "c")


def test_a_kill_mid_write_leaves_the_old_json(tmp_path, monkeypatch):
    """Guards against: a kill (or full disk) while the manifest is being written leaving half a JSON file
    under its name (the next run could not read it) or a temporary file behind."""
    path = tmp_path / "run.json"
    M.write_json_atomic(path, {"done": 1})
    real = Path.write_text

    def killed_halfway(self, text, *args, **kwargs):
        real(self, text[: len(text) // 2])
        raise KeyboardInterrupt  # the process dies before the write completes

    monkeypatch.setattr(Path, "write_text", killed_halfway)
    with pytest.raises(KeyboardInterrupt):
        M.write_json_atomic(path, {"done": 2, "more": "x" * 100})
    monkeypatch.undo()
    assert json.loads(path.read_text()) == {"done": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["run.json"]


def test_recorded_facts_are_refused_when_they_differ_and_kept_when_missing(tmp_path):
    """Guards against: a fact kept beside the identity (data content, tokenizer) refused when the manifest predates it
    (every older cache or distillation refused), taken without being written (never checked later), or a
    differing one continued; an unknown value here (None: a hub dataset) must neither refuse nor be written."""
    path = tmp_path / "run.json"
    manifest = {"format": 1, "data": "a"}
    M.write_json_atomic(path, manifest)
    refusal = lambda key, there, here: f"{key}: {there} there, {here} here"
    kept = M.check_recorded(path, manifest, {"data": "a", "tokenizer": "t1", "hub": None}, refusal)
    assert kept == json.loads(path.read_text()) == {"format": 1, "data": "a", "tokenizer": "t1"}
    with pytest.raises(UserError, match="tokenizer: t1 there, t2 here"):
        M.check_recorded(path, kept, {"data": "a", "tokenizer": "t2"}, refusal)
    assert M.check_recorded(path, kept, {"data": "a", "tokenizer": None}, refusal) == kept
