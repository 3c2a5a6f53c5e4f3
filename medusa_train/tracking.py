"""Where metrics go: a JSONL log (always), wandb (offline by default), a progress bar, a PNG.

Only rank 0 tracks. ``metrics.jsonl`` is the source of truth for plots and for resume: on
resume, records after the checkpoint's step are dropped so the log matches the run, and so are eval
records at that step when the resumed run evaluates there again (its final evaluation, when an attempt
was killed after it but before its export).

A resumed run continues its wandb run rather than opening a second one: the run's id is kept in
``wandb_run.json`` beside ``metrics.jsonl`` and reused when the trainer resumes from a checkpoint, and the steps
that run already logged are not sent again (resume is bit-exact, so they would be the same values; wandb drops a
step below its current one with a warning). A start from step 0 opens a new run: its settings may differ.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Optional

from tqdm.auto import tqdm

from inference.errors import UserError
from inference.report_plots import integer_axis, pyplot

from .manifest import write_text_atomic


class Tracker:
    def __init__(self, output_dir: Path, logger_cfg, run_config: dict, total_steps: int, start_step: int,
                 enabled: bool = True, progress: bool = True, redo_eval_at_start: bool = False):
        self.enabled = enabled
        self.path = Path(output_dir) / "metrics.jsonl"
        self.wandb = None
        self.wandb_logged_to = 0   # the last step the continued wandb run holds: later steps only are sent
        self.bar = None
        self.plot_enabled = bool(logger_cfg.plot)
        if not enabled:
            return
        logged_to = self._truncate_after(start_step, drop_eval_at_step=redo_eval_at_start)
        mode = str(getattr(logger_cfg.wandb, "value", logger_cfg.wandb))
        if mode != "disabled":
            self._open_wandb(mode, logger_cfg, run_config, Path(output_dir), start_step, logged_to)
        else:   # this attempt's steps reach no wandb run: a later resume must not take them as sent
            (Path(output_dir) / WANDB_RUN_FILE).unlink(missing_ok=True)
        if progress:
            self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step",
                            dynamic_ncols=True, file=sys.stderr)

    def _open_wandb(self, mode: str, logger_cfg, run_config: dict, output_dir: Path, start_step: int,
                    logged_to: int) -> None:
        """The wandb run: a resumed run's own (its id stored by an earlier attempt that logged to the same project
        in the same mode; the steps up to ``logged_to`` that attempt sent are not sent again), else a new one whose
        id is stored for the next resume. An attempt that logs to no wandb run removes the stored id: every
        attempt since it was stored has then sent its steps to that run."""
        id_path = output_dir / WANDB_RUN_FILE
        where = {"project": str(logger_cfg.project), "mode": mode}
        stored = stored_wandb_run(id_path) if start_step > 0 else None
        run_id = stored["id"] if stored and all(stored.get(k) == v for k, v in where.items()) else None
        self.wandb = _start_wandb(mode, logger_cfg, run_config, output_dir, run_id)
        new_id = getattr(self.wandb, "id", None)
        if run_id is not None and new_id == run_id:
            self.wandb_logged_to = logged_to
            return
        try:
            if new_id:
                write_text_atomic(id_path, json.dumps({"id": new_id, **where}) + "\n")
            else:
                id_path.unlink(missing_ok=True)
        except OSError as e:   # tracking never stops training: a resume then opens a new wandb run
            print(f"[medusa-train] wandb: could not keep the run's id in {id_path} ({e.strerror or e}); "
                  "a resumed run will log to a new wandb run", file=sys.stderr)

    def _truncate_after(self, step: int, drop_eval_at_step: bool = False) -> int:
        """Keep the records of steps up to ``step`` (the checkpoint's), less its eval records when
        ``drop_eval_at_step`` (the run logs them again). Returns the last step the file held before (0: none),
        what an earlier attempt logged."""
        if not self.path.exists():
            return 0

        def keep(record: dict) -> bool:
            at = record.get("step", 0)
            return at < step or (at == step and not (drop_eval_at_step and record.get("kind") == "eval"))

        lines = _metric_lines(self.path)
        kept = [line for line, record in lines if keep(record)]
        write_text_atomic(self.path, "".join(l + "\n" for l in kept))
        return max((record.get("step", 0) for _, record in lines), default=0)

    def log(self, step: int, metrics: dict, phase: str = "train") -> None:
        if not self.enabled:
            return
        record = {"step": step, "kind": phase, "time": round(time.time(), 3), **metrics}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.wandb is not None and step > self.wandb_logged_to:
            self.wandb.log({f"{phase}/{k}": v for k, v in metrics.items()}, step=step)
        if self.bar is not None and phase == "train":
            self.bar.set_postfix(loss=f"{metrics.get('loss', float('nan')):.3f}",
                                 tau=f"{metrics.get('sim_tau', 0):.2f}",
                                 tok_s=f"{metrics.get('tokens_per_s', 0):.0f}")

    def advance(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def write(self, line: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def close(self, plot_path: Optional[Path] = None) -> Optional[Path]:
        if not self.enabled:
            return None
        if self.bar is not None:
            self.bar.close()
        out = None
        if plot_path is not None and self.plot_enabled:
            out = plot_curves(self.path, plot_path)
        if self.wandb is not None:
            try:
                self.wandb.finish()
            except Exception as e:  # tracking must never turn a finished (or interrupted) run into a traceback
                print(f"[medusa-train] wandb: finishing its run failed ({type(e).__name__}: "
                      f"{str(e).splitlines()[0] if str(e) else ''}); every metric is in {self.path}",
                      file=sys.stderr, flush=True)
        return out


WANDB_RUN_FILE = "wandb_run.json"
_WANDB_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")   # what wandb makes (8 of [a-z0-9]); no path or URL characters


def stored_wandb_run(path: Path) -> Optional[dict]:
    """The wandb run an earlier attempt of this run stored ({"id", "project", "mode"}), or None (none stored, or a
    file that is not one: the resumed run then opens a new wandb run, which is all that is lost)."""
    try:
        stored = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    run_id = stored.get("id") if isinstance(stored, dict) else None
    return stored if isinstance(run_id, str) and _WANDB_ID.fullmatch(run_id) else None


def check_wandb_credentials(logger_cfg) -> None:
    """``logger.wandb=online`` where wandb has no credentials: refused before anything loads. wandb itself found out
    only once the backbone, the data and the engine were ready: on a terminal it stopped the run at a login menu
    (every other process of a launch waiting on rank 0), without one the run trained unlogged after a warning.
    Rank 0 alone tracks, so rank 0 alone is asked. ``wandb.init(mode="online")`` goes online whatever
    ``WANDB_MODE`` or ``wandb offline`` say, so the login is asked as online too (offline, wandb's login answers
    False whatever the key)."""
    mode = str(getattr(logger_cfg.wandb, "value", logger_cfg.wandb))
    if mode != "online" or int(os.environ.get("RANK", "0") or 0) != 0:
        return
    os.environ.setdefault("WANDB_SILENT", "true")
    given = os.environ.get("WANDB_MODE")
    os.environ["WANDB_MODE"] = "online"
    try:
        import wandb   # lazy: only for logger.wandb=online

        logged_in = wandb.login(prompt=False, verify=False)   # reads the key's sources only: no prompt, no network
    except Exception:  # noqa: BLE001 (a wandb without prompt=, or one that fails here: wandb.init says what it says)
        return
    finally:
        if given is None:
            os.environ.pop("WANDB_MODE", None)
        else:
            os.environ["WANDB_MODE"] = given
    if not logged_in:
        raise UserError("logger.wandb=online: wandb has no API key here (run `wandb login`, or set WANDB_API_KEY); "
                        "logger.wandb=offline logs locally for a later `wandb sync`")


def _start_wandb(mode: str, logger_cfg, run_config: dict, output_dir: Path, run_id: Optional[str] = None):
    """A wandb run, or None when wandb cannot start. With ``run_id`` (a resumed run) that run continues
    (``resume="allow"``: a new one of that id where the server never saw it); the config may differ in what a
    resume allows (``trainer.max_steps``, ...), which wandb would otherwise refuse as a changed value."""
    os.environ.setdefault("WANDB_SILENT", "true")
    resume = {"id": run_id, "resume": "allow", "allow_val_change": True} if run_id else {}
    try:
        import wandb   # lazy: only when wandb logging is on; a failing import must not stop training

        return wandb.init(project=logger_cfg.project, name=logger_cfg.run_name, mode=mode,
                          dir=str(output_dir), config=run_config, reinit="finish_previous", **resume)
    except Exception as e:  # tracking must never kill a training run
        print(f"[medusa-train] wandb disabled: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
              file=sys.stderr)
        return None


def read_metrics(path: Path) -> list[dict]:
    """The records of a ``metrics.jsonl``, less a last line cut short: a record is appended as it is logged, so a
    full disk or a kill can end the file inside one (past the last checkpoint, which a resume logs again); one that
    could not be read failed every later resume. A bad line before the last one is no cut append: one line."""
    return [record for _, record in _metric_lines(path)]


def _metric_lines(path: Path) -> list[tuple[str, dict]]:
    """(line, record) of each record ``read_metrics`` reads."""
    if not Path(path).exists():
        return []
    lines = [l for l in Path(path).read_text(errors="replace").splitlines() if l.strip()]
    records = []
    for i, line in enumerate(lines):
        try:
            records.append((line, json.loads(line)))
        except json.JSONDecodeError as e:
            if i == len(lines) - 1:
                break
            raise UserError(f"{path}: line {i + 1} is not a metrics record ({e}); a run writes this file itself: "
                            "restore it, or remove it to resume without the records before") from None
    return records


def plot_curves(metrics_path: Path, out_path: Path) -> Optional[Path]:
    """Per-head loss and top-1 accuracy against step (train and eval), as one PNG. The eval (held-out) loss is
    drawn too: it is what the final table prints, and what tells overfitting from a falling train loss."""
    records = read_metrics(metrics_path)
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    if not train:
        return None
    plt = pyplot()   # matplotlib loads here: 0.7 s, for one PNG at the end of training
    heads = sorted({int(k[4:].split("/")[0]) for k in train[-1] if k.startswith("head") and k.endswith("/loss")})
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(13, 4))
    steps, eval_steps = [r["step"] for r in train], [r["step"] for r in evals]
    for h in heads:
        line, = ax_loss.plot(steps, [r[f"head{h}/loss"] for r in train], label=f"head {h} train")
        ax_acc.plot(steps, [r[f"head{h}/top1"] for r in train], color=line.get_color(), label=f"head {h} train")
        if evals:
            ax_loss.plot(eval_steps, [r[f"head{h}/loss"] for r in evals], "o--", color=line.get_color(),
                         label=f"head {h} eval")
            ax_acc.plot(eval_steps, [r[f"head{h}/top1"] for r in evals], "o--",
                        color=line.get_color(), label=f"head {h} eval")
    ax_loss.set(xlabel="step", ylabel="cross-entropy", title="per-head loss")
    ax_acc.set(xlabel="step", ylabel="top-1 accuracy", title="per-head top-1 accuracy")
    for ax in (ax_loss, ax_acc):
        integer_axis(ax.xaxis)   # optimizer steps: no step 2.5
        # beside the axes: inside, the legend covered the curves of a short run
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=110)
    plt.close(fig)
    return Path(out_path)
