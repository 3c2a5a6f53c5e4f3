"""Ctrl-C (SIGINT), SIGTERM and kills at the awkward moments of a run: right after an optimizer step, twice,
during the final evaluation or export, after the final evaluation; and what the held-out log holds when the
held-out split has nothing to evaluate. Each interrupted run, rerun, must end as the uninterrupted one did."""

from __future__ import annotations

import json
import os
import signal
import subprocess
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
    original = T.MedusaTrainer.save_checkpoint

    def save_then_die(self):
        path = original(self)
        if self.step == 4:
            raise SystemExit("killed after the step-4 checkpoint")
        return path

    monkeypatch.setattr(T.MedusaTrainer, "save_checkpoint", save_then_die)
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
