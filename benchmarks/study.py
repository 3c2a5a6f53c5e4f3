"""A study: training runs (a recipe + overrides) x ``medusa-eval`` argument sets, run as subprocesses, then one
generated section (``benchmarks/results/<name>.md``) from the evaluations' report.json files.

    python scripts/bench.py list
    python scripts/bench.py study families --dry-run        # the commands, nothing run
    python scripts/bench.py study families                  # train what is missing, evaluate, write the section
    python scripts/bench.py study families --only eval      # skip the training runs (their heads must exist)
    python scripts/bench.py study families --section        # only rewrite the section from the reports there

A study file, ``benchmarks/studies/<name>.yaml``::

    title: Four families, equal data, equal CPU-minutes   # the section's title
    history: Four families, equal data, equal CPU-minutes # the section of benchmarks/history.md it recorded
    about: what it measures, what it costs                # one paragraph
    out: runs/bench_families                              # its runs' folder; "{out}" in any value stands for it
    train_defaults: {key: value}                          # medusa-train overrides added to every training run
    train:                                                # medusa-train <recipe> k=v... output_dir=<out>/<name>
      <name>: {recipe: <recipes/NAME.yaml>, overrides: {key: value}, done: <path>}
    eval_defaults: {key: value}                           # medusa-eval keys added to every evaluation
    eval:                                                 # medusa-eval k=v... out=<out>/<name>[_<heads>][/rN]
      <name>: {heads: <a train entry | a path | a list of them>, args: {key: value}, repeats: N}

A training run is skipped when ``done`` exists (default: its heads' config.json), an evaluation when its
report.json does and the ``study_job.json`` the study wrote beside it records these very arguments (changed
arguments, or none recorded, run it again), so a study resumes where it stopped. The section gives each
evaluation's own command line and date (from that record), not today's. ``repeats`` runs an evaluation N times (one
report each): the section gives each ratio as the median and [min-max] over them. Every figure is a
latency: run a study alone on the machine.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import yaml

from inference.errors import UserError

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
STUDIES = HERE / "studies"
RESULTS = HERE / "results"
KEYS = {"title", "history", "about", "out", "train_defaults", "train", "eval_defaults", "eval"}
TRAIN_KEYS, EVAL_KEYS = {"recipe", "overrides", "done"}, {"heads", "args", "repeats"}


@dataclass
class Job:
    """One subprocess: ``cli`` (medusa-train | medusa-eval) with ``args``; skipped when ``done`` exists."""
    cli: str
    name: str
    args: list[str]
    done: Path
    heads: Optional[str] = None  # medusa-eval: the train entry or path it evaluates
    repeat: int = 0

    def command(self, bin_dir: Optional[Path]) -> list[str]:
        exe = str(bin_dir / self.cli) if bin_dir is not None else self.cli
        return [exe, *self.args]

    @property
    def record(self) -> Path:
        """An evaluation's ``study_job.json``: the arguments its report.json was made with, and when."""
        return self.done.parent / JOB_RECORD


JOB_RECORD = "study_job.json"


def recorded(j: Job) -> dict:
    """What ``j``'s record holds ({} where none was written)."""
    path = ROOT / j.record
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        return {}


def stale(j: Job) -> Optional[str]:
    """Why ``j`` must run (None: done). An evaluation is done only when its report.json was made with the
    arguments the study gives now: a report skipped on its mere existence once kept figures of other arguments."""
    if not (ROOT / j.done).exists():
        return "to run"
    if j.cli != "medusa-eval":
        return None
    args = recorded(j).get("args")
    return None if args == j.args else "to run again: " + ("no arguments recorded" if args is None
                                                           else "its arguments changed")


def names() -> list[str]:
    return sorted(p.stem for p in STUDIES.glob("*.yaml"))


def load(name: str) -> dict:
    path = STUDIES / f"{name}.yaml"
    if not path.is_file():
        raise UserError(f"no study {name!r} (known: {', '.join(names())})")
    study = yaml.safe_load(path.read_text())
    problems = [f"unknown key {k!r}" for k in set(study) - KEYS]
    problems += [f"no {k}" for k in ("title", "out") if k not in study]
    for name, run in (study.get("train") or {}).items():
        problems += [f"train.{name}: {k!r} is not recipe / overrides / done" for k in set(run) - TRAIN_KEYS]
        problems += [f"train.{name}: no recipe"] if "recipe" not in run else []
    for name, ev in (study.get("eval") or {}).items():
        problems += [f"eval.{name}: {k!r} is not heads / args / repeats" for k in set(ev or {}) - EVAL_KEYS]
    if problems:
        raise UserError(f"{path.relative_to(ROOT)}: " + "; ".join(sorted(problems)))
    study["eval"] = {k: v or {} for k, v in (study.get("eval") or {}).items()}
    return study


def value(v: Any, out: str) -> str:
    """A YAML value as a command-line override: lists as [a,b], booleans true/false, None null."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "null"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(value(x, out) for x in v) + "]"
    return str(v).replace("{out}", out)


def overrides(*maps: Optional[dict], out: str) -> list[str]:
    merged: dict = {}
    for m in maps:
        merged.update(m or {})
    return [f"{k}={value(v, out)}" for k, v in merged.items()]


def train_args(study: dict, name: str) -> list[str]:
    """A training run's medusa-train arguments: its recipe, the overrides, output_dir (default <out>/<name>)."""
    run, out = study["train"][name], study["out"]
    args = [run["recipe"], *overrides(study.get("train_defaults"), run.get("overrides"), out=out)]
    return args if any(a.startswith("output_dir=") for a in args) else [*args, f"output_dir={out}/{name}"]


def heads_path(ref: str, study: dict) -> str:
    """A train entry's name -> its heads folder; anything else is a path, kept as written."""
    if ref in (study.get("train") or {}):
        out_dir = next(a for a in train_args(study, ref) if a.startswith("output_dir="))
        return out_dir.split("=", 1)[1] + "/heads"
    return value(ref, study["out"])


def plan(study: dict) -> list[Job]:
    """Every command of the study, training runs first, in file order."""
    out = study["out"]
    jobs = []
    train = study.get("train") or {}
    for name, run in train.items():
        done = value(run["done"], out) if run.get("done") else heads_path(name, study) + "/config.json"
        jobs.append(Job("medusa-train", name, train_args(study, name), Path(done)))
    for name, ev in (study.get("eval") or {}).items():
        refs = ev.get("heads")
        refs = refs if isinstance(refs, list) else [refs]
        repeats = int(ev.get("repeats", 1))
        for ref in refs:
            label = ref if ref in train else Path(str(ref)).parent.name   # a path: the run folder above heads/
            folder = f"{out}/{name}" if len(refs) == 1 else f"{out}/{name}_{label}"
            for r in range(1, repeats + 1):
                where = folder if repeats == 1 else f"{folder}/r{r}"
                args = ([f"heads={heads_path(str(ref), study)}"] if ref is not None else []) + overrides(
                    study.get("eval_defaults"), ev.get("args"), out=out) + [f"out={where}"]
                jobs.append(Job("medusa-eval", name, args, Path(where) / "report.json", ref, r))
    return jobs


def default_bin() -> Optional[Path]:
    """The folder of this Python's console scripts (the venv's bin), if medusa-train is there; else PATH."""
    d = Path(sys.executable).parent
    return d if (d / "medusa-train").exists() else None


def check(study: dict, jobs: list[Job], bin_dir: Optional[Path], only: Optional[str]) -> None:
    """A ``UserError`` for what would fail only once the study runs: a ``--bin`` that is no folder or lacks a
    CLI the jobs start, and (``--only eval``) heads that no training made. Called before anything is created."""
    todo = [j for j in jobs if stale(j)]
    if bin_dir is not None and not bin_dir.is_dir():
        raise UserError(f"--bin {bin_dir}: {'not a directory' if bin_dir.exists() else 'not found'}")
    for cli in sorted({j.cli for j in todo}):
        found = (bin_dir / cli).is_file() if bin_dir is not None else shutil.which(cli) is not None
        if not found:
            raise UserError(f"no {cli} in {bin_dir if bin_dir is not None else 'PATH'} (pass --bin <the folder of "
                            "medusa-train and medusa-eval>, or install the project into this Python)")
    if only == "eval":  # the training runs are skipped: what they would make must be there already
        for j in todo:
            heads = heads_path(str(j.heads), study) if j.heads is not None else None
            if heads is not None and not (ROOT / heads).exists():
                raise UserError(f"eval.{j.name}: heads {heads} not found (run the study without --only eval to "
                                "train them)")


def run(name: str, dry_run: bool = False, only: Optional[str] = None, bin_dir: Optional[Path] = None) -> int:
    study = load(name)
    # absolute: the commands run after the chdir to the repository below, from wherever --bin was given
    bin_dir = Path(os.path.abspath(os.path.expanduser(bin_dir))) if bin_dir is not None else default_bin()
    jobs = [j for j in plan(study) if only is None or j.cli == f"medusa-{only}"]
    if dry_run:
        for j in jobs:
            state = stale(j) or "done: skipped"
            print(f"# {j.name} -> {j.done} ({state})\n{shlex.join(j.command(bin_dir))}")
        return 0
    check(study, jobs, bin_dir, only)  # before the folder below is made: a refused run leaves nothing behind
    os.chdir(ROOT)
    Path(study["out"]).mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "WANDB_MODE": os.environ.get("WANDB_MODE", "disabled")}
    for j in jobs:
        why = stale(j)
        if why is None:
            print(f"[bench] {j.name}: done ({j.done})", flush=True)
            continue
        cmd = j.command(bin_dir)
        print(f"[bench] {j.name}: {why}\n[bench] {shlex.join(cmd)}", flush=True)
        start = time.time()
        rc = subprocess.run(cmd, env=env).returncode
        with open(Path(study["out"]) / "timings.txt", "a") as f:
            f.write(f"{j.name} ({j.cli}): {time.time() - start:.0f} s, exit {rc}\n")
        if rc:
            print(f"[bench] {j.name} failed (exit {rc}); fix it and run the study again (done runs are kept)",
                  file=sys.stderr)
            return rc
        if j.cli == "medusa-eval":   # what this report.json was made with, and when
            j.record.write_text(json.dumps({"cli": j.cli, "args": j.args,
                                            "finished": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=2) + "\n")
    print(f"[bench] wrote {write_section(name, study)}")
    return 0


# -- the generated section ----------------------------------------------------------------------------------------
def _spread(xs: list[float], fmt: str = "{:.2f}x") -> str:
    xs = [x for x in xs if x is not None]
    if not xs:
        return "-"
    med, lo, hi = (fmt.format(x) for x in (statistics.median(xs), min(xs), max(xs)))
    return med if lo == hi else f"{med} [{lo}-{hi}]"


def _rows(reports: list[dict]) -> list[tuple[str, str, list[dict]]]:
    """(batch size or "", method, that row in each report) for every row the reports share."""
    first = reports[0]
    if "batched" in first:
        return [(size, meth, [r["batched"]["per_batch_size"][size]["per_method"][meth] for r in reports])
                for size, entry in first["batched"]["per_batch_size"].items() for meth in entry["per_method"]]
    return [("", meth, [r["per_method"][meth] for r in reports]) for meth in first.get("per_method", {})]


def _identity(row: dict) -> str:
    if "greedy_identical" in row:   # batched: every row against the plain batched loop and batch-1 greedy
        return "yes" if row["greedy_identical"] else "no"
    frac = row.get("greedy_identical_fraction")
    return "-" if frac is None else f"{frac:.0%}"


def table(reports: list[dict]) -> list[str]:
    """One evaluation (its repeats) as a Markdown table: tau, tokens/s, speedups as median [min-max]."""
    batched = "batched" in reports[0]
    head = ("| batch | method | tau | tokens/s | vs the plain loop | vs `generate` | = greedy |" if batched else
            "| method | tau | tokens/s | vs the plain loop | vs `generate` | = greedy |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for size, meth, rows in _rows(reports):
        cells = [meth, _spread([r.get("tau") for r in rows], "{:.3f}"),
                 _spread([r.get("tokens_per_s") for r in rows], "{:.2f}"),
                 _spread([r.get("speedup_vs_autoregressive") for r in rows]),
                 _spread([r.get("speedup_vs_hf_generate") for r in rows]),
                 " / ".join(sorted({_identity(r) for r in rows}))]
        lines.append("| " + " | ".join(([str(size)] if batched else []) + cells) + " |")
    choices = sorted({f"{k}: {v['name']}" for r in reports for k, v in r.items()
                      if k.endswith(("tree", "choice")) and isinstance(v, dict) and v.get("name")})
    if choices:
        lines += ["", "Chosen: " + "; ".join(choices) + "."]
    return lines


def records(study: dict) -> str:
    """Where the study's figures were first recorded: one or more sections of benchmarks/history.md."""
    sections = study.get("history") or []
    sections = [sections] if isinstance(sections, str) else sections
    return (" Record: benchmarks/history.md " + ", ".join(f'"{s}"' for s in sections) + ".") if sections else ""


def _made(jobs: list[Job]) -> tuple[str, list[str]]:
    """(the command line the reports of ``jobs`` were made with, their dates) from the study's records; a report
    without one: the study file's arguments, marked, and its file's date."""
    recs = [recorded(j) for j in jobs]
    args = recs[0].get("args") or jobs[0].args
    shown = " ".join(a for a in args if not a.startswith("out="))
    if not recs[0].get("args"):
        shown += "` (arguments not recorded: the study file's)"
    elif args != jobs[0].args:
        shown += "` (the study file now gives other arguments: run the study again)"
    else:
        shown += "`"
    dates = [r.get("finished", "")[:10] or time.strftime("%Y-%m-%d", time.localtime((ROOT / j.done).stat().st_mtime))
             for r, j in zip(recs, jobs)]
    return shown, dates


def write_section(name: str, study: dict) -> Path:
    """benchmarks/results/<name>.md from the report.json files of the study's evaluations that exist, each with
    the command line and date it was made with (``_made``)."""
    lines = [f"<!-- generated by `python scripts/bench.py study {name}`; rewritten by every run -->",
             f"## {study['title']}", "",
             f"Command: `python scripts/bench.py study {name}` ({(STUDIES / f'{name}.yaml').relative_to(ROOT)})."
             + records(study), ""]
    groups: dict[tuple, list[Job]] = {}
    for j in plan(study):
        if j.cli == "medusa-eval" and (ROOT / j.done).exists():
            groups.setdefault((j.name, j.heads), []).append(j)
    machine, dates = None, set()
    for (ev, ref), jobs in groups.items():
        reports = [json.loads((ROOT / j.done).read_text()) for j in jobs]
        machine = machine or reports[0].get("machine")
        shown, made = _made(jobs)
        dates.update(made)
        lines += [f"### {ev}" + (f" ({ref})" if ref is not None else ""), "",
                  f"`medusa-eval {shown}" + (f", {len(reports)} runs" if len(reports) > 1 else "")
                  + f" ({', '.join(sorted(set(made)))})", "", *table(reports), ""]
    if machine:
        where = machine.get("gpu", machine.get("cpu"))
        span = min(dates) if len(dates) == 1 else f"{min(dates)} to {max(dates)}"
        lines.insert(4, f"Machine: {where}, {machine.get('cores')} cores, {machine.get('threads')} threads, "
                        f"torch {machine.get('torch')}; reports of {span}.")
    if not groups:
        lines.append("(no evaluation has a report yet)")
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.md"
    path.write_text("\n".join(lines).rstrip() + "\n")
    return path
