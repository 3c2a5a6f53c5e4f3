"""The metrics tracker's end of a run (``medusa_train.tracking.Tracker.close``)."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from medusa_train.tracking import Tracker, read_metrics, stored_wandb_run


def test_a_wandb_run_that_fails_to_finish_is_one_line_not_a_traceback(tmp_path, capsys):
    """Guards against wandb's ``finish`` raising at the end of a run (its service process gone: a SIGTERM to the
    process group, a crashed service): the exception escaped ``Tracker.close`` during the trainer's cleanup, so an
    interrupted run ended in a wandb traceback after its one-line "checkpoint saved" message, and a finished run
    failed after training. The metrics are in metrics.jsonl either way: one line says so and the run ends as it
    would have."""
    cfg = SimpleNamespace(plot=False, wandb="disabled", project="p", run_name=None)
    tracker = Tracker(tmp_path, cfg, {}, total_steps=2, start_step=0, progress=False)

    class Broken:
        def finish(self):
            raise ConnectionResetError("Connection lost")

    tracker.wandb = Broken()
    assert tracker.close() is None
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"[medusa-train] wandb: finishing its run failed (ConnectionResetError: Connection lost); every "
                   f"metric is in {tmp_path / 'metrics.jsonl'}"]


class FakeWandb:
    """wandb's ``init`` / ``log`` / ``finish`` as the tracker calls them, recording each call."""

    def __init__(self):
        self.inits, self.logged, self.made = [], [], 0

    def init(self, **kwargs):
        self.inits.append(kwargs)
        self.made += 1
        run = SimpleNamespace(id=kwargs.get("id") or f"run{self.made}", finish=lambda: None)
        run.log = lambda metrics, step: self.logged.append((run.id, step))
        return run


def _tracker(tmp_path, monkeypatch, start_step, fake, mode="offline", project="p"):
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = SimpleNamespace(plot=False, wandb=mode, project=project, run_name=None)
    return Tracker(tmp_path, cfg, {"lr": 1}, total_steps=10, start_step=start_step, progress=False)


def test_a_resumed_run_continues_its_wandb_run_and_sends_no_step_twice(tmp_path, monkeypatch):
    """Guards against a resumed training run opening a second wandb run: every kill and resume left one more run
    in the project, the later one starting at the checkpoint's step, and an online resume into the first one
    re-sent the steps after the checkpoint (wandb drops a step below its current one with a warning per step). The
    first attempt's id is stored and reused from a checkpoint; steps that attempt logged are not sent again."""
    fake = FakeWandb()
    first = _tracker(tmp_path, monkeypatch, 0, fake)
    for step in range(1, 7):
        first.log(step, {"loss": 1.0 / step})
    assert json.loads((tmp_path / "wandb_run.json").read_text()) == {"id": "run1", "project": "p", "mode": "offline"}
    assert "id" not in fake.inits[0]
    # killed after step 6; the checkpoint is step 4: steps 5 and 6 run (and are logged) again
    again = _tracker(tmp_path, monkeypatch, 4, fake)
    assert fake.inits[1]["id"] == "run1" and fake.inits[1]["resume"] == "allow"
    assert fake.inits[1]["allow_val_change"] is True
    for step in range(5, 9):
        again.log(step, {"loss": 1.0 / step})
    assert fake.logged == [("run1", s) for s in range(1, 9)]
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == list(range(1, 9))


def test_a_start_from_step_0_opens_a_new_wandb_run(tmp_path, monkeypatch):
    """Guards against a fresh start in a folder an earlier attempt used (no checkpoint: its settings may differ)
    continuing that attempt's wandb run and having its first steps withheld as if already sent; and against an
    unreadable id file stopping or misdirecting a resume (a new run then)."""
    fake = FakeWandb()
    _tracker(tmp_path, monkeypatch, 0, fake).log(1, {"loss": 1.0})
    _tracker(tmp_path, monkeypatch, 0, fake).log(1, {"loss": 2.0})
    assert "id" not in fake.inits[1] and fake.logged == [("run1", 1), ("run2", 1)]
    assert json.loads((tmp_path / "wandb_run.json").read_text())["id"] == "run2"
    for text in ("{", '{"id": "../x"}', '["run2"]'):
        (tmp_path / "wandb_run.json").write_text(text)
        assert stored_wandb_run(tmp_path / "wandb_run.json") is None
    _tracker(tmp_path, monkeypatch, 1, fake)
    assert "id" not in fake.inits[2]


def test_a_stored_wandb_run_is_continued_only_where_it_got_every_step(tmp_path, monkeypatch):
    """Guards against a resume continuing a stored wandb run that did not receive the steps it withholds as sent:
    an attempt with wandb disabled (or whose wandb did not start) between two that logged, or a resume into
    another project or mode (offline, then online: the server's run of that id would start at the resume's step,
    the first steps never sent). Such an attempt drops the stored id; another project or mode opens a new run."""
    fake = FakeWandb()
    _tracker(tmp_path, monkeypatch, 0, fake).log(1, {"loss": 1.0})
    _tracker(tmp_path, monkeypatch, 1, fake, mode="disabled").log(2, {"loss": 1.0})
    assert not (tmp_path / "wandb_run.json").exists()
    again = _tracker(tmp_path, monkeypatch, 2, fake)
    assert "id" not in fake.inits[1]
    again.log(3, {"loss": 1.0})
    online = _tracker(tmp_path, monkeypatch, 3, fake, mode="online")
    assert "id" not in fake.inits[2] and json.loads((tmp_path / "wandb_run.json").read_text())["mode"] == "online"
    online.log(4, {"loss": 1.0})
    _tracker(tmp_path, monkeypatch, 4, fake, mode="online", project="q")
    assert "id" not in fake.inits[3]
    assert fake.logged == [("run1", 1), ("run2", 3), ("run3", 4)]
    fake.init = lambda **kwargs: None   # wandb did not start: nothing of this attempt is sent
    _tracker(tmp_path, monkeypatch, 5, fake, mode="online", project="q")
    assert not (tmp_path / "wandb_run.json").exists()


def test_real_wandb_offline_resumes_under_the_stored_id(tmp_path, monkeypatch):
    """Guards against the resume arguments being ones the installed wandb refuses: ``_start_wandb`` turns any
    failure into "wandb disabled", so a refused ``id`` / ``resume`` / ``allow_val_change`` would quietly stop all
    wandb logging of every resumed run. Offline, as the recipes log by default."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = SimpleNamespace(plot=False, wandb="offline", project="p", run_name=None)
    first = Tracker(tmp_path, cfg, {"trainer": {"max_steps": 4}}, total_steps=4, start_step=0, progress=False)
    first.log(1, {"loss": 1.0})
    first.close()
    run_id = stored_wandb_run(tmp_path / "wandb_run.json")["id"]
    assert run_id is not None and first.wandb.id == run_id
    again = Tracker(tmp_path, cfg, {"trainer": {"max_steps": 8}}, total_steps=8, start_step=1, progress=False)
    try:
        assert again.wandb is not None and again.wandb.id == run_id
        assert again.wandb.config["trainer"]["max_steps"] == 8
    finally:
        again.close()


def _credentials_check(tmp_path, **env):
    """``check_wandb_credentials`` for ``logger.wandb=online`` in a fresh process (wandb's login is per process)
    with no wandb credentials but those ``env`` gives: the UserError's text, or "" when accepted."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_") and k not in ("NETRC", "RANK")}
    base.update(HOME=str(tmp_path), WANDB_CONFIG_DIR=str(tmp_path / "wandb-config"), **env)
    code = ("from types import SimpleNamespace\nfrom medusa_train.tracking import check_wandb_credentials\n"
            "from inference.errors import UserError\n"
            "try:\n    check_wandb_credentials(SimpleNamespace(wandb='online'))\n    print('')\n"
            "except UserError as e:\n    print(e)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=base, timeout=120,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip()


def test_online_logging_without_credentials_is_refused_up_front(tmp_path):
    """Guards against ``logger.wandb=online`` on a machine where wandb has no API key being found out only when
    the tracker starts, after the backbone, the data and the engine loaded: on a terminal wandb stopped the run at
    its login menu (the other processes of a launch waiting), without one it trained unlogged after a warning. A
    key from the environment or ~/.netrc is accepted without a network call; rank > 0 (which logs nothing) is not
    asked; ``WANDB_MODE=offline`` does not stop ``logger.wandb=online`` from going online, so it changes nothing."""
    pytest.importorskip("wandb")
    assert _credentials_check(tmp_path).startswith("logger.wandb=online: wandb has no API key here")
    assert _credentials_check(tmp_path, WANDB_API_KEY="a" * 40) == ""
    (tmp_path / ".netrc").write_text(f"machine api.wandb.ai\n  login user\n  password {'b' * 40}\n")
    (tmp_path / ".netrc").chmod(0o600)
    assert _credentials_check(tmp_path) == ""
    (tmp_path / ".netrc").unlink()
    assert _credentials_check(tmp_path, RANK="1") == ""
    # wandb.init(mode="online") goes online whatever WANDB_MODE says: asked as online all the same
    assert _credentials_check(tmp_path, WANDB_MODE="offline").startswith("logger.wandb=online: wandb has no API")
    assert _credentials_check(tmp_path, WANDB_MODE="offline", WANDB_API_KEY="a" * 40) == ""
