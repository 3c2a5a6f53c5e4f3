"""Killing a writer at each point of the directory swap that the heads export (``save_heads``) and the
engine-format exports (``formats.export.write_plan``) share (``heads.native.swap_dir_into_place``):
the next write into the same place recovers and cleans up, and a loader names what a kill left."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from inference.errors import UserError
from inference.formats.export import ExportPlan, write_plan
from inference.heads import native
from inference.heads.native import read_native_spec, recover_dir, save_heads
from test_heads_format import _trained_heads

POINTS = ["writing", "first_rename", "between_renames", "removing_old"]


class Killed(BaseException):
    """What a kill looks like from inside, when it is simulated by raising."""


def write(kind: str, out: Path, seed: int) -> None:
    if kind == "save_heads":
        save_heads(_trained_heads("own", seed=seed), out)
    else:
        write_plan(ExportPlan(config={"seed": seed}, weights_file="model.safetensors",
                              tensors={"w": torch.full((4,), float(seed))}), out)


def written(kind: str, out: Path) -> int | None:
    """Which seed's export ``out`` holds, complete (None: no export there)."""
    from safetensors.torch import load_file

    if not out.is_dir():
        return None
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"], os.listdir(out)
    got = load_file(str(out / "model.safetensors"))
    for seed in (0, 1, 2):
        if kind == "save_heads":
            want = _trained_heads("own", seed=seed).state_dict()
            if all(torch.equal(got[k], want[k]) for k in want):
                return seed
        elif torch.equal(got["w"], torch.full((4,), float(seed))):
            return seed
    raise AssertionError("an export that is neither the old one nor the new one")


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def arm(point: str, action) -> None:
    """Make ``action()`` happen at ``point`` of the next write (in this process)."""
    import safetensors.torch

    real_replace, real_rmtree, real_save = os.replace, shutil.rmtree, safetensors.torch.save_file

    def save_file(tensors, path, *a, **k):
        real_save(tensors, path, *a, **k)
        if point == "writing":
            action()

    def replace(src, dst):
        if point == "first_rename" and ".old-" in os.path.basename(str(dst)):
            action()
        if point == "between_renames" and ".tmp-" in os.path.basename(str(src)):
            action()
        return real_replace(src, dst)

    def rmtree(path, *a, **k):
        if point == "removing_old" and ".old-" in os.path.basename(str(path)):
            action()
        return real_rmtree(path, *a, **k)

    safetensors.torch.save_file = save_file
    native.os.replace = replace  # the os module: native and export share it
    native.shutil.rmtree = rmtree
    return lambda: (setattr(safetensors.torch, "save_file", real_save), setattr(native.os, "replace", real_replace),
                    setattr(native.shutil, "rmtree", real_rmtree))


@pytest.mark.parametrize("kind", ["save_heads", "write_plan"])
@pytest.mark.parametrize("point", POINTS)
def test_an_exception_at_each_point_leaves_old_or_new_and_no_leftovers(kind, point, tmp_path):
    """Guards against: a failure (disk full, Ctrl-C) inside an export leaving neither export, a mix of
    both, or .tmp-* / .old-* folders that stay behind."""
    out = tmp_path / "heads"
    write(kind, out, 0)

    def boom():
        raise Killed(point)

    undo = arm(point, boom)
    try:
        with pytest.raises(Killed):
            write(kind, out, 1)
    finally:
        undo()
    assert written(kind, out) in (0, 1)
    write(kind, out, 2)
    assert written(kind, out) == 2 and leftovers(tmp_path) == []


@pytest.mark.parametrize("kind", ["save_heads", "write_plan"])
@pytest.mark.parametrize("point", POINTS)
def test_a_kill_at_each_point_is_recovered_by_the_next_write(kind, point, tmp_path):
    """Guards against: a writer killed (a real process death: no finally, no except) at any point of the
    export leaving .tmp-* folders no later run removes, or -- between the swap's two renames -- no
    export at all and an .old-* nobody restores: the next write into the same place must end with the
    new export and nothing else, and recovery alone must give back the previous export."""
    out = tmp_path / "heads"
    write(kind, out, 0)
    pid = os.fork()
    if pid == 0:  # the child: write seed 1 and die at `point`
        try:
            arm(point, lambda: os._exit(137))
            write(kind, out, 1)
        finally:
            os._exit(3)  # never reached when the kill point is hit
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 137
    if point == "between_renames":
        assert not out.exists() and [n for n in leftovers(tmp_path) if ".old-" in n]
        from inference.loading import read_heads_spec

        with pytest.raises(UserError) as err:
            read_heads_spec(out)  # what load_medusa / medusa-eval call first
        msg = str(err.value)
        assert "\n" not in msg and ".heads.old-" in msg and "interrupted" in msg, msg
    else:
        assert written(kind, out) in (0, 1)
    assert leftovers(tmp_path)  # the kill did leave something behind
    before = written(kind, out)
    recover_dir(out)
    assert leftovers(tmp_path) == []
    assert written(kind, out) == (0 if point == "between_renames" else before)
    write(kind, out, 2)
    assert written(kind, out) == 2 and leftovers(tmp_path) == []


def test_kill_between_renames_then_write_restores_nothing_stale(tmp_path):
    """Guards against: the next export after a kill between the renames keeping the previous export in
    .old-* forever (or putting it back over the new one)."""
    out = tmp_path / "heads"
    write("save_heads", out, 0)
    pid = os.fork()
    if pid == 0:
        try:
            arm("between_renames", lambda: os._exit(137))
            write("save_heads", out, 1)
        finally:
            os._exit(3)
    os.waitpid(pid, 0)
    write("save_heads", out, 2)  # no recover_dir call first: the write recovers by itself
    assert written("save_heads", out) == 2 and leftovers(tmp_path) == []


def test_sigkilled_export_subprocess_is_cleaned_up(tmp_path):
    """Guards against: an export process SIGKILLed mid-write (OOM killer, scheduler) leaving a
    .heads.tmp-* folder that survives every later export."""
    out = tmp_path / "heads"
    write("save_heads", out, 0)
    code = (
        "import os, signal, safetensors.torch, sys\n"
        "sys.path.insert(0, os.getcwd())\n"
        "from tests.heads.test_heads_format import _trained_heads\n"
        "from inference.heads.native import save_heads\n"
        "real = safetensors.torch.save_file\n"
        "def save_file(t, p, *a, **k):\n"
        "    real(t, p, *a, **k)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "safetensors.torch.save_file = save_file\n"
        f"save_heads(_trained_heads('own', seed=1), {str(out)!r})\n")
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(root)})
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert [n for n in leftovers(tmp_path) if n.startswith(".heads.tmp-")]
    assert written("save_heads", out) == 0  # the previous export is intact meanwhile
    write("save_heads", out, 2)
    assert written("save_heads", out) == 2 and leftovers(tmp_path) == []


def test_raise_between_renames_with_failed_restore_is_recovered(tmp_path, monkeypatch):
    """Guards against: an in-process failure between the renames whose restore also fails leaving the
    previous export in .old-* for good: the loader names it and the next write puts things right."""
    out = tmp_path / "heads"
    write("save_heads", out, 0)
    real = os.replace

    def replace(src, dst):
        if ".tmp-" in os.path.basename(str(src)) or ".old-" in os.path.basename(str(src)):
            raise Killed("rename")
        return real(src, dst)

    monkeypatch.setattr(native.os, "replace", replace)
    with pytest.raises(Killed):
        write("save_heads", out, 1)
    monkeypatch.undo()
    assert not out.exists()
    with pytest.raises(UserError, match="holds the previous export"):
        read_native_spec(out)
    recover_dir(out)
    assert written("save_heads", out) == 0 and leftovers(tmp_path) == []


def test_live_writers_leftovers_are_not_touched(tmp_path):
    """Guards against: recovery removing the temp folder of an export still being written by another
    live process (it would fail that export), or an .old-* that a live writer is about to rename back."""
    out = tmp_path / "heads"
    write("save_heads", out, 0)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / f".heads.tmp-{live.pid}-abc").mkdir()
        (tmp_path / f".heads.old-{live.pid}-def").mkdir()
        write("save_heads", out, 2)
        assert leftovers(tmp_path) == [f".heads.old-{live.pid}-def", f".heads.tmp-{live.pid}-abc"]
    finally:
        live.kill()
        live.wait()
    write("save_heads", out, 1)
    assert written("save_heads", out) == 1 and leftovers(tmp_path) == []


def test_a_swap_that_cannot_move_out_aside_leaves_no_empty_backup(tmp_path):
    """Guards against: a swap whose first rename fails (out= a link to a folder: a link cannot be renamed onto a
    folder) leaving the empty ``.<out>.old-*`` folder it made for it."""
    real, link, new = tmp_path / "real", tmp_path / "link", tmp_path / "new"
    real.mkdir()
    new.mkdir()
    link.symlink_to(real)
    with pytest.raises(OSError):
        native.swap_dir_into_place(new, link)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "new", "real"]


def test_a_folder_is_on_the_disk_before_its_rename_publishes_it(tmp_path, monkeypatch):
    """Guards against: heads exports (and checkpoints, through the same ``sync_tree``) renamed into place without an
    fsync: after a power loss, rather than a kill, the complete name could hold empty or cut files."""
    synced, real = [], os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real(fd))[1])
    tmp = tmp_path / ".x.tmp"
    (tmp / "sub").mkdir(parents=True)
    (tmp / "a").write_text("1")
    (tmp / "sub" / "b").write_text("2")
    native.swap_dir_into_place(tmp, tmp_path / "x")
    assert set(synced) == {str(tmp / "a"), str(tmp / "sub" / "b"), str(tmp)}
    assert (tmp_path / "x" / "sub" / "b").read_text() == "2"
