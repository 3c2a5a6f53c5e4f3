"""Ctrl-C (SIGINT), SIGTERM and kills at the awkward moments of a run: right after an optimizer step, twice,
during the final evaluation or export, after the final evaluation; and what the held-out log holds when the
held-out split has nothing to evaluate. Each interrupted run, rerun, must end as the uninterrupted one did."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import TINY_DATA, TINY_RECIPE, base_overrides, clean_env, console_script
from inference.errors import UserError
from medusa_train import checkpoint
from medusa_train import trainer as T
from medusa_train.launch import compose_recipe
from medusa_train.tracking import read_metrics
from test_distributed import _free_port
from test_trainer import interrupt_at_forward

RUN = ["trainer.log_every=1", "trainer.max_steps=8", "trainer.save_every=4", "logger.plot=false"]


def logged(out: Path) -> list[tuple]:
    """Every metrics.jsonl record less its wall-clock fields: what an interrupted run must reproduce."""
    return [tuple((k, v) for k, v in r.items() if k not in ("time", "tokens_per_s"))
            for r in read_metrics(Path(out) / "metrics.jsonl")]


def heads(out: Path) -> dict:
    return load_file(str(Path(out) / "heads" / "model.safetensors"))


def assert_same_run(a: Path, b: Path) -> None:
    assert logged(b) == logged(a)
    ha, hb = heads(a), heads(b)
    assert ha.keys() == hb.keys() and all(ha[k].equal(hb[k]) for k in ha)


def signal_after_optimizer_step(monkeypatch, n: int, sig: int) -> None:
    """Deliver ``sig`` to this process as the n-th ``engine.step()`` returns, before ``train`` counts the step."""
    build = T.MedusaTrainer._build_engine

    def build_then_wrap(self):
        build(self)
        real, calls = self.engine.step, {"n": 0}

        def step(*args, **kwargs):
            out = real(*args, **kwargs)
            calls["n"] += 1
            if calls["n"] == n:
                os.kill(os.getpid(), sig)
            return out

        self.engine.step = step

    monkeypatch.setattr(T.MedusaTrainer, "_build_engine", build_then_wrap)


def die_after_checkpoint(monkeypatch, step: int) -> None:
    """End the run (as a kill would) right after checkpoint ``step`` is written."""
    original = T.MedusaTrainer.save_checkpoint

    def save_then_die(self):
        path = original(self)
        if self.step == step:
            raise SystemExit(f"killed after the step-{step} checkpoint")
        return path

    monkeypatch.setattr(T.MedusaTrainer, "save_checkpoint", save_then_die)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One uninterrupted run of ``RUN`` (eval at step 4 as well), shared by the tests that compare with it."""
    out = tmp_path_factory.mktemp("reference") / "run"
    threads = torch.get_num_threads()
    T.run(compose_recipe(TINY_RECIPE, base_overrides(out) + RUN + ["trainer.eval_every=4"]))
    torch.set_num_threads(threads)
    return out


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl-c"])
def test_signal_right_after_an_optimizer_step_resumes_exactly(sig, reference, compose_tiny, out_dir, monkeypatch):
    """Guards against: a SIGTERM / Ctrl-C landing between engine.step() and the step counter saving a checkpoint
    labelled one step early (it held the weights and AdamW state after one more update), so the resumed run
    trained that step twice and its losses and heads differed from the uninterrupted run's."""
    signal_after_optimizer_step(monkeypatch, 5, sig)
    with pytest.raises(UserError, match=r"^interrupted at step 5; checkpoint saved to .*step-000005; run the same"):
        T.run(compose_tiny(*RUN, "trainer.eval_every=4"))
    monkeypatch.undo()
    state = checkpoint.read_state(out_dir / "checkpoints" / "step-000005")
    assert state["step"] == 5 and state["optimizer_step"] == 5 and state["lr_scheduler"]["last_epoch"] == 5
    T.run(compose_tiny(*RUN, "trainer.eval_every=4"))
    assert_same_run(reference, out_dir)


def test_second_ctrl_c_stops_at_once_without_a_checkpoint(reference, compose_tiny, out_dir, monkeypatch):
    """Guards against: a second Ctrl-C (the user does not want to wait for the step) being ignored, or saving a
    checkpoint of a half-done step: it stops at once, writes no checkpoint, and the rerun resumes from the
    last one as if nothing happened."""
    interrupt_at_forward(monkeypatch, 6, (signal.SIGINT, signal.SIGINT))
    with pytest.raises(UserError, match=r"^interrupted again: .*step-000004") as err:
        T.run(compose_tiny(*RUN, "trainer.eval_every=4"))
    assert "\n" not in str(err.value)
    monkeypatch.undo()
    assert sorted(p.name for p in (out_dir / "checkpoints").glob("step-*")) == ["step-000004"]
    T.run(compose_tiny(*RUN, "trainer.eval_every=4"))
    assert_same_run(reference, out_dir)


@pytest.mark.parametrize("phase", ["evaluate", "export"])
def test_sigterm_in_the_final_evaluation_or_export_is_one_line(phase, reference, compose_tiny, out_dir, monkeypatch):
    """Guards against: a SIGTERM / Ctrl-C during the final evaluation or export ending in a KeyboardInterrupt
    traceback instead of one line saying the rerun finishes them; and that rerun then logging the final
    evaluation twice."""
    original = getattr(T.MedusaTrainer, phase)
    final = {"seen": False}

    def signalled(self):
        if self.step == 8 and not final["seen"]:
            final["seen"] = True
            os.kill(os.getpid(), signal.SIGTERM)
        return original(self)

    monkeypatch.setattr(T.MedusaTrainer, phase, signalled)
    with pytest.raises(UserError, match=r"^interrupted after training.*step-000008.*run the same command") as err:
        T.run(compose_tiny(*RUN, "trainer.eval_every=4"))
    assert "\n" not in str(err.value)
    monkeypatch.undo()
    assert T.run(compose_tiny(*RUN, "trainer.eval_every=4"))["step"] == 8
    assert_same_run(reference, out_dir)


def test_kill_after_the_final_evaluation_logs_it_once(reference, compose_tiny, out_dir, monkeypatch):
    """Guards against: a kill after the final evaluation was logged but before the export finished leaving that
    eval record in metrics.jsonl, so the rerun (which evaluates again) logged step 8's evaluation twice."""
    def killed(self):
        raise SystemExit("killed before the export")

    monkeypatch.setattr(T.MedusaTrainer, "export", killed)
    with pytest.raises(SystemExit):
        T.run(compose_tiny(*RUN, "trainer.eval_every=4"))
    monkeypatch.undo()
    assert [r["step"] for r in read_metrics(out_dir / "metrics.jsonl") if r["kind"] == "eval"] == [4, 8]
    T.run(compose_tiny(*RUN, "trainer.eval_every=4"))
    assert_same_run(reference, out_dir)


def test_kill_after_a_mid_run_evaluation_and_checkpoint_keeps_it(reference, compose_tiny, out_dir, monkeypatch):
    """Guards against: dropping the mid-run evaluation logged at a checkpoint's own step (the resumed run starts
    after it and never evaluates there again), or keeping it when the kill came before that checkpoint."""
    die_after_checkpoint(monkeypatch, 4)
    with pytest.raises(SystemExit):
        T.run(compose_tiny(*RUN, "trainer.eval_every=4"))
    monkeypatch.undo()
    T.run(compose_tiny(*RUN, "trainer.eval_every=4"))
    assert_same_run(reference, out_dir)


def test_empty_held_out_split_logs_no_fake_metrics(compose_tiny, out_dir, tmp_path, capsys):
    """Guards against: a held-out split with no token to predict (its conversations' replies all beyond
    data.max_length) reported as loss 0.000, top-1 0.000, tau 1.000, logged as real eval records and
    printed as the final accuracy table."""
    long_prompt = {"conversations": [{"from": "human", "value": "x" * 400}, {"from": "gpt", "value": "y" * 20}]}
    data = tmp_path / "evalempty.jsonl"
    data.write_text("".join(json.dumps(long_prompt) + "\n" for _ in range(2)) + TINY_DATA.read_text())
    summary = T.run(compose_tiny(f"data.source={data}", "data.eval_conversations=2", "trainer.max_steps=4",
                                 "trainer.eval_every=2", "trainer.log_every=1", "logger.plot=false"))
    assert [r["kind"] for r in read_metrics(out_dir / "metrics.jsonl")] == ["train"] * 4
    assert "sim_tau" not in summary and summary["step"] == 4
    out = capsys.readouterr().out
    warnings = [line for line in out.splitlines() if "held-out split is empty" in line]
    assert len(warnings) == 2, out  # the warning once, and the final summary instead of the table
    assert "data.eval_conversations" in warnings[0] and "data.max_length=256" in warnings[0]
    assert "simulated chain tau" not in out


# -- two ranks ------------------------------------------------------------------------------------------------
WRAPPER = '''
import os, signal, sys
import medusa_train.trainer as T

N, RANK = int(os.environ["SIGNAL_AT_STEP"]), os.environ["SIGNAL_RANK"]
build = T.MedusaTrainer._build_engine

def build_then_wrap(self):
    build(self)
    real, calls = self.engine.step, [0]

    def step(*args, **kwargs):
        out = real(*args, **kwargs)
        calls[0] += 1
        if calls[0] == N and os.environ.get("RANK") == RANK:
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    self.engine.step = step

T.MedusaTrainer._build_engine = build_then_wrap
from medusa_train.cli import main
main(sys.argv[1:])
'''

TWO_RANKS = ["trainer.zero_stage=2", "trainer.max_steps=6", "trainer.save_every=3", "trainer.keep_last=5",
             "trainer.eval_every=3", "logger.wandb=disabled", "trainer.progress_bar=false", "logger.plot=false",
             "trainer.log_every=1", "trainer.threads=1"]


def launch_two(out: Path, signal_at: int = 0) -> subprocess.CompletedProcess:
    script = out.parent / "signal_one_rank.py"
    script.write_text(WRAPPER)
    cmd = [console_script("deepspeed"), "--num_gpus", "2", "--master_port", str(_free_port()), str(script),
           "debug_tiny", f"output_dir={out}", f"data.source={TINY_DATA}", *TWO_RANKS]
    env = clean_env(SIGNAL_AT_STEP=str(signal_at), SIGNAL_RANK="1")
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=out.parent, timeout=400)


def test_sigterm_to_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    """Guards against: a SIGTERM reaching one rank of a multi-process run (a scheduler's, or the DeepSpeed
    launcher's) killing it without a checkpoint, or the ranks stopping at different steps (a hang in the
    collective save, or a checkpoint mixing two steps); the resumed run must equal the uninterrupted one."""
    a, b = tmp_path / "a", tmp_path / "b"
    ref = launch_two(a)
    assert ref.returncode == 0, ref.stderr[-3000:]
    stopped = launch_two(b, signal_at=4)
    assert stopped.returncode != 0
    assert "interrupted at step 4; checkpoint saved to" in stopped.stderr, (stopped.stdout[-2000:],
                                                                          stopped.stderr[-3000:])
    assert "Traceback" not in stopped.stdout + stopped.stderr, stopped.stderr[-3000:]
    state = checkpoint.read_state(b / "checkpoints" / "step-000004")
    assert state["step"] == 4 and state["optimizer_step"] == 4 and state["world_size"] == 2
    resumed = launch_two(b)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "step-000004" in resumed.stdout
    assert_same_run(a, b)


# -- during setup ---------------------------------------------------------------------------------------------
SETUP_WRAPPER = '''
import os, signal, sys
import medusa_train.backbone as B
import medusa_train.features as F

PHASE, SIG = os.environ["SIGNAL_PHASE"], getattr(signal, os.environ["SIGNAL_NAME"])

if PHASE == "backbone":  # while the random backbone is kept with the run: its weights written, its tokenizer not
    make_tokenizer = B.byte_tokenizer

    def byte_tokenizer():
        tok = make_tokenizer()
        save = tok.save_pretrained

        def signalled(*args, **kwargs):
            os.kill(os.getpid(), SIG)
            return save(*args, **kwargs)

        tok.save_pretrained = signalled
        return tok

    B.byte_tokenizer = byte_tokenizer
else:  # while the feature cache is built: its held-out file and first shard written, the second on disk unrenamed
    save_file, calls = F.save_file, [0]

    def signalled(*args, **kwargs):
        save_file(*args, **kwargs)
        calls[0] += 1
        if calls[0] == 3:
            os.kill(os.getpid(), SIG)

    F.save_file = signalled
from medusa_train.cli import main
main(sys.argv[1:])
'''

SETUP_CASES = [("backbone", "SIGINT", "loading the backbone"), ("cache", "SIGTERM", "building the feature cache")]


@pytest.mark.parametrize("phase, sig, where", SETUP_CASES, ids=[f"{p}-{s}" for p, s, _ in SETUP_CASES])
def test_signal_during_setup_is_one_line_and_leaves_no_half_written_file(phase, sig, where, tmp_path):
    """Guards against: a Ctrl-C or SIGTERM while the run sets up (the backbone loading and kept with the run, the
    feature cache being built), before any step, ending in a KeyboardInterrupt traceback (or, for SIGTERM, a
    silent kill) instead of one line saying where it stopped and what is kept, exit 2 as a stop during training;
    and leaving a half-written file: a kept backbone without its tokenizer, a cache shard's temporary file."""
    from test_train_refusals import assert_one_line_refusal

    script, out = tmp_path / "signal_in_setup.py", tmp_path / "run"
    script.write_text(SETUP_WRAPPER)
    args = [f"output_dir={out}", f"data.source={TINY_DATA}", "logger.wandb=disabled", "trainer.progress_bar=false",
            "trainer.threads=1", "trainer.max_steps=4", "logger.plot=false"]
    if phase == "cache":
        args += ["features.mode=train", "features.shard_batches=1", "features.dtype=fp32"]
    proc = subprocess.run([sys.executable, str(script), "debug_tiny", *args], capture_output=True, text=True,
                          cwd=tmp_path, env=clean_env(SIGNAL_PHASE=phase, SIGNAL_NAME=sig), timeout=400)
    assert_one_line_refusal(proc, f"interrupted during setup ({where}): nothing was trained")
    assert "run the same command again" in proc.stderr
    assert not [p for p in out.rglob("*") if ".tmp" in p.name], sorted(out.rglob("*"))
    assert not (out / "checkpoints").exists() and not (out / "heads").exists()
    if phase == "backbone":
        assert not (out / "backbone").exists(), sorted(out.rglob("*"))  # whole or not at all
    else:
        assert "1 complete shard of the feature cache kept in" in proc.stderr, proc.stderr
        assert sorted(p.name for p in (out / "features").glob("*.safetensors")) == ["eval.safetensors",
                                                                                    "train-000000.safetensors"]


def test_ctrl_c_before_the_task_runs_is_one_line(tmp_path, monkeypatch, capsys):
    """Guards against: a Ctrl-C while medusa-train checks the configuration and starts Hydra (before the task, and
    its own handling of signals, runs) ending in a KeyboardInterrupt traceback, or leaving the run's new folder."""
    from medusa_train import cli, launch

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(launch, "_PRECHECKED", False)
    monkeypatch.setattr(launch, "_TASK_STARTED", False, raising=False)
    monkeypatch.setattr(launch, "register_configs", interrupted)  # right after the run's folder is created
    out = tmp_path / "new" / "run"
    try:
        cli.main(["debug_tiny", *base_overrides(out)])
    except KeyboardInterrupt:
        pytest.fail("a Ctrl-C before the task escaped as a KeyboardInterrupt (a traceback)")
    except SystemExit as e:
        assert e.code == 2
    else:
        pytest.fail("no exit")
    assert capsys.readouterr().err.strip().splitlines() == [
        "medusa-train: error: interrupted before the run started; nothing was written; run the same command again"]
    assert not (tmp_path / "new").exists()


def test_ctrl_c_in_a_cache_build_keeps_its_complete_shards_in_one_line(compose_tiny, out_dir, monkeypatch):
    """Guards against: a Ctrl-C during ``features.mode=build`` ending in a KeyboardInterrupt traceback instead of
    one line naming the complete shards kept, or leaving the interrupted shard's temporary file."""
    from medusa_train import features

    save_file, calls = features.save_file, {"n": 0}

    def interrupted(tensors, path, metadata=None):
        save_file(tensors, path, metadata=metadata)
        calls["n"] += 1
        if calls["n"] == 3:  # the held-out file and shard 0 written, shard 1 on disk under its temporary name
            raise KeyboardInterrupt

    monkeypatch.setattr(features, "save_file", interrupted)
    cfg = compose_tiny("features.mode=build", "features.shard_batches=1", "trainer.max_steps=4")
    try:
        with pytest.raises(UserError, match=r"^interrupted while building the feature cache: 1 complete shard of "
                                            r"the feature cache kept in .*; run the same command again") as err:
            features.run_build(cfg)
    except KeyboardInterrupt:
        pytest.fail("the Ctrl-C escaped as a KeyboardInterrupt (a traceback)")
    assert "\n" not in str(err.value)
    root = out_dir / "features"
    assert sorted(p.name for p in root.iterdir() if p.name != features.MANIFEST) == ["eval.safetensors",
                                                                                     "train-000000.safetensors"]


def test_ctrl_c_while_distillation_loads_its_backbone_is_one_line(compose_tiny, out_dir, monkeypatch):
    """Guards against: a Ctrl-C / SIGTERM while distillation loads its backbone (before its shard loop, the only
    part that handled them) ending in a KeyboardInterrupt traceback instead of one line, after its manifest was
    already written into a new output_dir."""
    from medusa_train import distill

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(distill.frozen, "load_backbone", interrupted)
    try:
        with pytest.raises(UserError, match=r"^interrupted during setup \(loading the backbone\): no shard written "
                                            r"by this run; run the same command again"):
            distill.run(compose_tiny("task=distill", "distill.max_conversations=4", "distill.engine=generate"))
    except KeyboardInterrupt:
        pytest.fail("the Ctrl-C escaped as a KeyboardInterrupt (a traceback)")
    assert not out_dir.exists()


def test_a_full_disk_at_a_checkpoint_is_one_line_and_the_rerun_resumes(reference, out_dir, monkeypatch, capsys):
    """Guards against: a full disk while a checkpoint is written ending the command in Hydra's "Error executing job"
    and a SafetensorError traceback: one line saying to free space and run the same command again, which resumes
    from the checkpoint before and ends as the uninterrupted run."""
    import errno

    from medusa_train import cli, launch

    original = T.MedusaTrainer.save_checkpoint

    def full_at_step_8(self):
        if self.step == 8:
            raise OSError(errno.ENOSPC, "No space left on device", str(out_dir / "checkpoints" / ".tmp-step-000008"))
        return original(self)

    monkeypatch.setattr(launch, "_PRECHECKED", False)
    monkeypatch.setattr(T.MedusaTrainer, "save_checkpoint", full_at_step_8)
    args = ["debug_tiny", *base_overrides(out_dir), *RUN, "trainer.eval_every=4"]
    with pytest.raises(SystemExit) as e:
        cli.main(args)
    assert e.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith(f"medusa-train: error: could not write {out_dir / 'checkpoints'}/.tmp-step-000008: "
                                "No space left on device; free space"), lines
    assert not any("Traceback" in line or "Error executing job" in line for line in lines), lines
    monkeypatch.setattr(T.MedusaTrainer, "save_checkpoint", original)
    cli.main(args)
    assert_same_run(reference, out_dir)


def test_a_metrics_record_cut_short_does_not_block_the_resume(reference, compose_tiny, out_dir, monkeypatch):
    """Guards against: a metrics.jsonl whose last record was cut short (a full disk or a kill inside the append)
    failing every later resume with a JSONDecodeError; the cut record is past the checkpoint, and the resume logs
    its step again. A bad line before the last is no cut append: one line."""
    die_after_checkpoint(monkeypatch, 4)
    with pytest.raises(SystemExit):
        T.run(compose_tiny(*RUN, "trainer.eval_every=4"))
    monkeypatch.undo()
    metrics = out_dir / "metrics.jsonl"
    whole = metrics.read_text()
    with open(metrics, "a") as f:
        f.write('{"step": 5, "kind": "train", "loss": 7.9')
    T.run(compose_tiny(*RUN, "trainer.eval_every=4"))
    assert_same_run(reference, out_dir)
    metrics.write_text('{"step": 1, "kind": "tr\n' + whole)
    with pytest.raises(UserError, match=r"metrics.jsonl: line 1 is not a metrics record \(.*\); a run writes this "
                                        "file itself: restore it, or remove it"):
        read_metrics(metrics)


def test_the_command_ignores_a_second_ctrl_c_once_it_has_said_its_line(tmp_path):
    """Guards against: a double Ctrl-C during the final evaluation or export printing the one line, then an
    "Exception ignored in atexit callback ... KeyboardInterrupt" traceback: the first restored the default handler,
    and the second landed in torch's clean-up at exit. Once the command exits with its line, Ctrl-C is ignored; a
    caller in Python keeps its own handlers."""
    code = ("import signal, sys\n"
            "import medusa_train.launch as L\n"
            "L.launch = lambda *a, **k: L.refuse('interrupted')\n"
            "import medusa_train.cli as c\n"
            "def check(argv):\n"
            "    try:\n"
            "        c.main(argv)\n"
            "    except SystemExit:\n"
            "        print(signal.getsignal(signal.SIGINT) is signal.SIG_IGN)\n"
            "    signal.signal(signal.SIGINT, signal.default_int_handler)\n"
            "check(['debug_tiny'])\n"
            "sys.argv = ['medusa-train', 'debug_tiny']\n"
            "check(None)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                          env=clean_env(), timeout=120)
    assert proc.stdout.split() == ["False", "True"], proc.stdout + proc.stderr
