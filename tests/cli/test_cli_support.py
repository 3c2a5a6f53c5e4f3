"""The one error path every command line shares (``inference.cli_support``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import pytest

from inference.cli_support import (EXIT_USER_ERROR, config_error_line, enum_value, keys_given, parse_overrides,
                                   run_cli)
from inference.errors import UserError


@dataclass
class Schema:
    heads: str = "???"
    out: str = "???"
    steps: int = 3
    name: Optional[str] = None


def _exit_line(capsys, fn, *args):
    with pytest.raises(SystemExit) as e:
        fn(*args)
    err = capsys.readouterr().err
    assert e.value.code == EXIT_USER_ERROR
    assert len(err.strip().splitlines()) == 1, err
    return err.strip()


def test_missing_required_keys_are_one_line_not_a_traceback(capsys):
    """Guards against OmegaConf's MissingMandatoryValue traceback when a required key is unset:
    the user gets one line naming every missing key, exit 2, before the task runs."""
    ran = []
    line = _exit_line(capsys, run_cli, "prog", "doc", Schema, ran.append, ["heads=x"])
    assert line == "prog: error: out= is required (see prog --help)"
    line = _exit_line(capsys, run_cli, "prog", "doc", Schema, ran.append, ["steps=4"])
    assert "heads= and out= are required" in line
    assert ran == []


def test_unknown_key_wrong_type_and_bare_word_are_one_line(capsys):
    """Guards against OmegaConf's multi-line messages (reference_type, object_type ...) or a
    traceback reaching the user for a mistyped key, a wrong type or a word without '='."""
    assert "stepz" in _exit_line(capsys, parse_overrides, "prog", Schema, ["heads=a", "out=b", "stepz=1"])
    assert "steps" in _exit_line(capsys, parse_overrides, "prog", Schema, ["heads=a", "out=b", "steps=many"])
    assert "'train'" in _exit_line(capsys, parse_overrides, "prog", Schema, ["train"])


def test_user_error_in_the_task_is_one_line(capsys):
    """Guards against a UserError raised by the task escaping as a traceback."""
    def task(cfg):
        raise UserError(f"bad heads {cfg.heads}")

    assert _exit_line(capsys, run_cli, "prog", "doc", Schema, task, ["heads=a", "out=b"]) == "prog: error: bad heads a"


def test_ctrl_c_is_one_line_and_exit_130(capsys):
    """Guards against Ctrl-C in any command printing a KeyboardInterrupt traceback: one line, exit 130."""
    def task(cfg):
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as e:
        run_cli("prog", "doc", Schema, task, ["heads=a", "out=b"])
    assert e.value.code == 130 and capsys.readouterr().err.strip() == "prog: interrupted"


def test_a_reader_that_leaves_is_no_traceback(tmp_path):
    """Guards against `medusa-generate ... | head -c 1` ending in a BrokenPipeError traceback (twice: once more
    when Python flushes stdout at exit): the command stops quietly."""
    import subprocess
    import sys

    script = tmp_path / "talk.py"
    script.write_text("from dataclasses import dataclass\n"
                      "from inference.cli_support import run_cli\n"
                      "@dataclass\nclass S:\n    n: int = 1\n"
                      "def task(cfg):\n    while True:\n        print('word ' * 100, flush=True)\n"
                      "run_cli('prog', 'doc', S, task, [])\n")
    proc = subprocess.run(f"{sys.executable} {script} | head -c 1", shell=True, capture_output=True, text=True,
                          timeout=60, cwd=str(tmp_path), env={**__import__("os").environ,
                                                              "PYTHONPATH": str(__import__("pathlib").Path.cwd())})
    assert proc.stdout == "w" and "Traceback" not in proc.stderr and "Error" not in proc.stderr, proc.stderr


def test_help_and_values(capsys):
    """Guards against --help running the task, and against enums reaching reports unwrapped."""
    import enum

    run_cli("prog", "the doc", Schema, lambda cfg: pytest.fail("ran"), ["--help"])
    assert capsys.readouterr().out.strip() == "the doc"
    cfg = parse_overrides("prog", Schema, ["heads=a", "out=b", "steps=5"])
    assert (cfg.heads, cfg.out, cfg.steps) == ("a", "b", 5)

    class Color(enum.Enum):
        red = "red"

    assert enum_value(Color.red) == "red" and enum_value("blue") == "blue"
    assert config_error_line(ValueError("first\n    full_key: x\n    object_type=Schema")) == "first"


def test_the_keys_written_on_the_command_line_are_kept_whatever_their_values():
    """Guards against a key written equal to its default counting as not given (medusa-generate's tree=tree4 was
    ignored beside a choice file): the config keeps the keys written, not those the schema's defaults set, and no
    copy of its values (report.json's settings) carries them."""
    from omegaconf import OmegaConf

    cfg = parse_overrides("prog", Schema, ["heads=x", "out=y", "steps=3"])   # steps=3 is the default
    assert keys_given(cfg) == {"heads", "out", "steps"}
    assert cfg.steps == 3 and "name" not in keys_given(cfg)
    assert OmegaConf.to_container(cfg) == {"heads": "x", "out": "y", "steps": 3, "name": None}
    assert keys_given(Schema(heads="x")) is None   # no command line made it: callers judge by the values


def test_a_configurations_refusal_is_said_once_per_launch(monkeypatch, capsys):
    """Guards against `deepspeed --num_gpus N ... medusa-train` printing the same one-line refusal of the
    configuration N times (every process checks it alike): rank 0 says it, the others exit 2 in silence; an error
    of a rank's own work is still said by that rank."""
    from medusa_train.overrides import refuse

    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank, said in (("1", False), ("0", True), ("", True)):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as e:
            refuse("heads.num_heads must be >= 1", every_rank=False)
        assert e.value.code == EXIT_USER_ERROR and ("error: heads.num_heads" in capsys.readouterr().err) == said
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit):
        refuse("rank 1's data file is unreadable")
    assert "rank 1's data file" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "1")   # one process a scheduler gave a RANK: it says its refusal
    with pytest.raises(SystemExit):
        refuse("trainer.max_steps must be >= 1", every_rank=False)
    assert "trainer.max_steps" in capsys.readouterr().err


def test_a_write_that_fails_for_want_of_room_is_one_line(capsys):
    """Guards against: a full disk (or a file-size limit, a quota) while a command writes its report or export
    ending in a 22-line traceback after the whole evaluation: one line saying what to do. safetensors reports it
    as its own error with the errno in its text; an error raised while handling one is traced to it; any other
    error (a bug) keeps its traceback."""
    import errno

    from safetensors import SafetensorError

    from inference.errors import no_room_line

    full = OSError(errno.ENOSPC, "No space left on device", "/x/report.md")
    assert no_room_line(full) == ("could not write /x/report.md: No space left on device; free space (or raise the "
                                  "limit) and run the same command again: what was written before is whole, and a "
                                  "training run resumes from its last checkpoint")
    assert no_room_line(SafetensorError("Error while serializing: I/O error: File too large (os error 27)")).startswith(
        "could not write: File too large;")
    try:
        try:
            raise full
        except OSError:
            raise RuntimeError("while cleaning up")
    except RuntimeError as chained:
        assert no_room_line(chained).startswith("could not write /x/report.md")
    assert no_room_line(OSError(errno.EACCES, "Permission denied")) is None
    assert no_room_line(ValueError("a bug")) is None

    def task(cfg):
        raise full

    line = _exit_line(capsys, run_cli, "medusa-eval", "doc", Schema, task, ["heads=h", "out=o"])
    assert line.startswith("medusa-eval: error: could not write /x/report.md: No space left on device;"), line

    def bug(cfg):
        raise ValueError("a bug")

    with pytest.raises(ValueError):
        run_cli("medusa-eval", "doc", Schema, bug, ["heads=h", "out=o"])
