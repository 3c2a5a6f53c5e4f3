"""The metrics tracker's end of a run (``medusa_train.tracking.Tracker.close``)."""

from types import SimpleNamespace

from medusa_train.tracking import Tracker


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
