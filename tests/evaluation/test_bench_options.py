"""``scripts/bench.py``'s subcommands refuse a mistaken option or path in one line (exit 2) before any model loads,
and ``bench.py train`` starts its measuring child so that the child's imports resolve.

Guards against a benchmark that fails late and loudly: a ``--rounds 0`` ending in a KeyError after the model
load, a heads path with a typo ending in a traceback, a study that makes its runs folder and then finds no
``medusa-eval``, and ``bench.py train``'s child run as a script (its folder first on sys.path, so
``benchmarks/micro/kernels.py`` shadowed the ``kernels`` package DeepSpeed imports). No model is loaded here,
except by the integration test (one tiny training step in the child).
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import options, study  # noqa: E402
from benchmarks.micro import train  # noqa: E402


def entry():
    """scripts/bench.py as a module (it is a script, not part of a package)."""
    spec = importlib.util.spec_from_file_location("bench_entry", ROOT / "scripts" / "bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def refused(argv, capsys) -> str:
    """bench.py's one error line for ``argv`` (exit 2, whether argparse or a UserError refused it)."""
    try:
        rc = entry().main(argv)
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2, (argv, rc, err)
    assert len(err.strip().splitlines()) == 1 and err.startswith("bench.py") and "error: " in err, err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize("argv", [
    ["kernels", "--rounds", "0"], ["kernels", "--rounds", "-1"], ["kernels", "--threads", "-2"],
    ["kernels", "--rounds", "x"],
    ["tree-attention", "--rounds", "0"], ["tree-attention", "--contexts", "-5"],
    ["tree-attention", "--contexts", "250", "0"],
    ["train", "--steps", "0"], ["train", "--heads", "0"], ["train", "--micro", "-1"], ["train", "--max-length", "0"],
    ["train", "--modes", "bogus"],
    ["machine", "--rounds", "0"], ["machine", "--prompts", "0"], ["machine", "--tokens", "-1"],
    ["static-steps", "--prompts", "0"], ["static-steps", "--tokens", "0"],
    ["host-work", "--tokens", "1"], ["host-work", "--rounds", "0"], ["host-work", "--only", "no such case"],
])
def test_numeric_and_choice_options_are_checked_when_read(argv, capsys):
    """Guards against an option value no run can use (zero rounds, a negative context) reaching the measurement:
    it ended in a KeyError, StatisticsError or RuntimeError traceback after the model had loaded."""
    err = refused(argv, capsys)
    assert argv[1] in err


@pytest.mark.parametrize("argv, says", [
    (["kernels", "--heads", "/nonexistent/heads"], "/nonexistent/heads: not found"),
    (["kernels", "--dtype", "int8"], "'int8'"),
    (["tree-attention", "--backbone", "/nonexistent/backbone"], "/nonexistent/backbone: not found"),
    (["tree-attention", "--backbone", "embedded:nope"], "unknown embedded backbone"),
])
def test_missing_paths_and_bad_names_are_one_line(argv, says, capsys):
    """Guards against a plain user mistake (a path with a typo, a dtype the loader refuses) printing the
    loader's UserError as a traceback with exit 1 instead of bench.py's one line and exit 2."""
    assert says in refused(argv, capsys)


def test_a_loader_user_error_is_one_line(tmp_path, capsys):
    """Guards against bench.py's main letting the project's UserError through: a folder that exists but is no
    heads export is refused by the loader (not by argparse), and must still end as one line, exit 2."""
    err = refused(["kernels", "--heads", str(tmp_path)], capsys)
    assert err.startswith("bench.py: error: ") and "not a heads export" in err


def test_refused_before_torch_loads():
    """Guards against the checks running only after the heavy imports: kernels and tree-attention refuse a bad
    value with torch still unloaded (their model imports come after the options are read)."""
    code = ("import runpy, sys\nsys.argv = ['scripts/bench.py'] + sys.argv[1:]\ntry:\n"
            "    runpy.run_path('scripts/bench.py', run_name='__main__')\nexcept SystemExit as e:\n"
            "    print('exit', e.code, 'torch loaded:', 'torch' in sys.modules)")
    for argv in (["kernels", "--rounds", "0"], ["tree-attention", "--backbone", "/nonexistent"],
                 ["train", "--steps", "0"]):
        proc = subprocess.run([sys.executable, "-c", code, *argv], cwd=ROOT, capture_output=True, text=True,
                              timeout=120)
        assert "exit 2 torch loaded: False" in proc.stdout, (argv, proc.stdout, proc.stderr)


def test_option_spellings_match_the_library():
    """Guards against the bench's own copies of the library's names (kept so the checks need no torch) drifting
    from them: a dtype or projection the library takes would be refused, or one it refuses let through."""
    from inference.backbone import DTYPES
    from inference.heads.spec import PROJECTIONS

    assert set(options.DTYPES) == set(DTYPES)
    assert set(train.PROJECTIONS) == set(PROJECTIONS)


# -- bench.py study: --bin and the heads of --only eval, checked before the runs folder is made ---------------------
@pytest.fixture
def tiny_study(tmp_path, monkeypatch):
    """A study file of one training run and its evaluation, its runs folder under tmp_path (not yet made)."""
    studies = tmp_path / "studies"
    studies.mkdir()
    out = tmp_path / "runs"
    (studies / "tiny.yaml").write_text(json.dumps({
        "title": "T", "out": str(out), "train": {"a": {"recipe": "debug_tiny"}}, "eval": {"e": {"heads": "a"}}}))
    monkeypatch.setattr(study, "STUDIES", studies)
    return out


def test_study_refuses_a_missing_bin_before_making_anything(tiny_study, tmp_path, capsys):
    """Guards against `study --bin <typo>` making the study's runs folder and then ending in a
    FileNotFoundError traceback when it starts the first command."""
    err = refused(["study", "tiny", "--bin", str(tmp_path / "nope"), "--only", "eval"], capsys)
    assert "--bin" in err and "not found" in err
    assert not tiny_study.exists()


def test_study_refuses_a_bin_without_the_clis(tiny_study, tmp_path, capsys):
    """Guards against a --bin folder that exists but holds no medusa-train / medusa-eval failing only at its first
    command, after the runs folder was made."""
    (tmp_path / "bin").mkdir()
    err = refused(["study", "tiny", "--bin", str(tmp_path / "bin")], capsys)
    assert "no medusa-eval" in err or "no medusa-train" in err
    assert not tiny_study.exists()


def test_study_only_eval_needs_the_heads(tiny_study, tmp_path, capsys):
    """Guards against `--only eval` on a study whose training never ran: each evaluation would fail in turn on
    heads that do not exist; it is refused in one line naming them, before anything is made."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "medusa-eval").write_text("#!/bin/sh\nexit 1\n")
    err = refused(["study", "tiny", "--bin", str(bin_dir), "--only", "eval"], capsys)
    assert f"{tiny_study}/a/heads not found" in err
    assert not tiny_study.exists()


def test_unknown_study_exits_2(capsys):
    """Guards against a study's name with a typo exiting as a crash would (1) instead of as a user mistake (2)."""
    assert "no study 'no_such_study'" in refused(["study", "no_such_study"], capsys)


# -- bench.py train: the child ---------------------------------------------------------------------------------------
def test_train_child_runs_as_a_module_from_anywhere(tmp_path):
    """Guards against the child being started as a script (benchmarks/micro/train.py): its folder would head
    sys.path, and benchmarks/micro/kernels.py would shadow the `kernels` package DeepSpeed imports (ImportError
    in every child). Started as a module from any working directory, it must find itself and its imports."""
    cmd = train.child_command()
    assert not any(a.endswith(".py") for a in cmd), cmd  # no script path: nothing of benchmarks/micro on sys.path
    proc = subprocess.run([*cmd, "--help"], cwd=tmp_path, env=train.child_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "bench.py train" in proc.stdout, proc.stderr
    probe = ("import importlib.util, sys, benchmarks.micro.train\n"
             "spec = importlib.util.find_spec('kernels')\nprint(spec.origin if spec else None)")
    proc = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=train.child_env(), capture_output=True,
                          text=True, timeout=120)   # -c puts the working directory first on sys.path, as -m does
    assert proc.returncode == 0 and "benchmarks/micro" not in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.integration
def test_train_tiniest_run_writes_its_row(tmp_path):
    """Guards against `bench.py train` failing in its child (it did, on every run, with an ImportError): one
    step, one mode, 64 tokens, run from outside the repository, must print its row and write the JSON."""
    out = tmp_path / "bt.json"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), "train", "--steps", "1", "--modes",
                           "truncated", "--heads", "3", "--max-length", "64", "--micro", "1", "--out", str(out)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [(r["mode"], r["heads"]) for r in rows] == [("truncated", 3)] and rows[0]["train_tok_s"] > 0
