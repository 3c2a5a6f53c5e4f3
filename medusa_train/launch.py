"""``medusa-train``'s run once its words are read (``cli.py``): the recipe composed with Hydra and checked
(``config.validate``, ``preflight``) in one line per mistake, the run's folder created, then Hydra runs the
task the recipe names. Imports Hydra and the checks (torch) at its top: ``cli.py`` imports it only once the
command line's words are accepted, so ``medusa-train --help`` stays instant.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import hydra
from hydra import compose, initialize_config_module
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.types import RunMode
from omegaconf import OmegaConf, open_dict

from inference.cli_support import config_error_line, enum_value, non_boolean_override
from inference.errors import UserError, no_room_line
from .backbone import RANDOM_BACKBONE_DIR
from .config import check_unread_overrides, register_configs, validate
from .distributed import leave_after_lost_peer, lost_peer
from .families import stray_key_line
from .manifest import RECORD_DIR, write_text_atomic
from .overrides import INTERRUPTED_BEFORE_RUN, RECIPE_PACKAGE, override_key, recipe_overrides, refuse
from .preflight import preflight

# What a run's setup writes before training (its record, a random backbone): a refused new run takes them back.
SETUP_WRITES = frozenset({RECORD_DIR, RANDOM_BACKBONE_DIR})
_PRECHECKED = False
_TASK_STARTED = False  # a task ran (which stops on a Ctrl-C / SIGTERM in its own line)
_CREATED: list[Path] = []  # the folders create_output_dir made, deepest first (remove_created_dirs)


def launch(recipe: str, overrides: list[str], flags: list[str], multirun: bool, prints: bool) -> None:
    """Check every run first (each job of a sweep, before Hydra runs the first; nothing for flags that only
    print, ``prints``), then hand the recipe to Hydra. ``overrides`` as ``overrides.recipe_overrides`` made them.
    A Ctrl-C before a task runs (these checks, Hydra's start) is one line; each task stops on its own signals."""
    try:
        _launch(recipe, overrides, flags, multirun, prints)
    except KeyboardInterrupt:
        remove_created_dirs()
        refuse(INTERRUPTED_BEFORE_RUN if not _TASK_STARTED else "interrupted; run the same command again")


def _launch(recipe: str, overrides: list[str], flags: list[str], multirun: bool, prints: bool) -> None:
    if multirun and not prints:
        # Every job of a sweep, before Hydra runs the first: one bad combination refuses the sweep, nothing written.
        for number, job in enumerate(sweep_jobs(overrides)):
            _precheck(recipe, job, sweep=True, job_number=number)
    elif not prints:
        _precheck(recipe, overrides)  # a single run: fail fast, in one line, before Hydra runs
    register_configs()
    # Flags first: Hydra's argparse takes no flag after its first override (output_dir=x -m a=1,2).
    sys.argv = [f"medusa-train {recipe}", *flags, *overrides]
    hydra.main(version_base=None, config_path=f"pkg://{RECIPE_PACKAGE}", config_name=recipe)(_task)()


def compose_recipe(recipe: str, overrides: list[str] | None = None):
    """The composed, type-checked config of a recipe, without running it (tests, tooling)."""
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module=RECIPE_PACKAGE, version_base=None):
        return compose(config_name=recipe, overrides=recipe_overrides(list(overrides or [])))


def compose_error_line(recipe: str, overrides: list[str], e: BaseException) -> str:
    """A composition error as one line; a ``heads`` key that the chosen family's group does not have (another
    family's setting, or a typo) names the family whose key it is."""
    text = f"{e}\n{e.__cause__ or ''}"
    stray = re.search(r"Key '(\w+)' not in '\w*HeadsConfig'", text)
    if stray is None:
        return f"{config_error_line(e)} (list the keys: medusa-train {recipe} --cfg job)"
    chosen = [a.split("=", 1)[1] for a in recipe_overrides(overrides) if override_key(a) == "heads" and "=" in a]
    try:
        kind = chosen[-1] if chosen else compose_recipe(recipe, []).heads.kind
        return stray_key_line(kind, stray.group(1))
    except Exception:  # the family itself is unknown: Hydra's own line names the missing group option
        return f"{config_error_line(e)} (list the keys: medusa-train {recipe} --cfg job)"


def _task(cfg) -> None:
    global _TASK_STARTED
    _TASK_STARTED = True
    try:
        run = task_runner(cfg)
        hc = HydraConfig.get()
        if hc.mode == RunMode.MULTIRUN:  # each sweep job trains into its own folder
            with open_dict(cfg):
                cfg.output_dir = hc.runtime.output_dir
        if not _PRECHECKED:  # runs with Hydra flags (sweeps) are checked here, per job
            validate(cfg)
            preflight(cfg)
        # The task writes the record itself, once its data is accepted: data refused at its start then leaves
        # an existing run's record as it was (and a new run's folder without one).
        with holding_output_dir(cfg.output_dir):
            try:
                run(cfg, record=lambda: write_run_record(cfg))
            except UserError:   # what this refused run made goes while it still holds the folder, not after
                remove_created_dirs()
                raise
    except UserError as e:
        remove_created_dirs()
        refuse(str(e))
    except Exception as e:
        no_room = no_room_line(e)
        if no_room:   # a full disk: one line; every writer swaps its file in, so the run resumes
            refuse(no_room)
        if not lost_peer(e):
            raise
        refuse(leave_after_lost_peer(e))   # the launcher ends this process too soon after: one line, not a traceback


@contextmanager
def holding_output_dir(output_dir) -> Iterator[None]:
    """Hold ``output_dir`` for this launch while its task runs (rank 0 holds an exclusive ``flock`` on the folder
    itself: nothing is written, and the kernel lets go when the process ends, however it ends). A second launch
    into the same folder is refused in one line before it writes: both once ran, resuming each other's
    checkpoints, logging every step twice and exporting over each other's heads. A filesystem without ``flock`` on
    folders (NFS emulates it with write locks, which a folder cannot take) leaves the folder unguarded, as before;
    so do the other ranks of a refused launch until its launcher ends them (only rank 0 holds the folder)."""
    fd = None
    if int(os.environ.get("RANK", "0") or 0) == 0:
        try:
            fd = os.open(str(output_dir), os.O_RDONLY | os.O_DIRECTORY)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            _CREATED.clear()   # the folder is the other run's (it may have made it first): remove nothing
            raise UserError(f"output_dir={output_dir} is in use by another medusa-train run (it holds the folder); "
                            "wait for it to end, or use another output_dir") from None
        except OSError:   # no such folder (the task makes it) or no flock there: unguarded
            pass
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)


def task_runner(cfg):
    """What a recipe runs: ``task: distill`` -> distill.run; ``features.mode=build`` -> features.run_build;
    otherwise the trainer (which reads the feature cache itself under ``features.mode=train``). Each is called
    as ``run(cfg, record=...)``: ``record()`` writes the run's record (``write_run_record``) when the task has
    accepted its data."""
    if enum_value(cfg.task) == "distill":
        from .distill import run   # lazy: only the task the recipe runs is imported (its own dependencies)
    elif enum_value(cfg.features.mode) == "build":
        from .features import run_build as run   # lazy: as distill's
    else:
        from .trainer import run   # lazy: as distill's
    return run


def create_output_dir(output_dir) -> None:
    """Create the accepted run's folder (what Hydra would do next), or say in one line why it cannot be
    (``config.check_output_dir`` cannot tell from permissions alone: root may write /proc, the kernel refuses)."""
    path = Path(str(output_dir))
    missing = [p for p in (path, *path.parents) if not p.exists()]
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        refuse(f"output_dir={output_dir} cannot be created: {e.strerror or e}")
    _CREATED[:] = missing


def remove_created_dirs() -> None:
    """Remove again the folders ``create_output_dir`` made for a run its task then refused (data it found no
    training conversation in, a feature cache built for another run) or a Ctrl-C stopped during its setup: a
    refused command leaves no folder behind. What setup alone writes into the new folder (the run's record and a
    random backbone, both rewritten by a rerun) goes with it; a folder holding anything else (a feature cache's
    shards, a checkpoint) is kept, and with it every folder above it."""
    if int(os.environ.get("RANK", "0") or 0) != 0:  # one process decides, as for the record
        return
    run = _CREATED[0] if _CREATED else None
    if run is not None and run.is_dir() and {e.name for e in run.iterdir()} <= SETUP_WRITES:
        for entry in run.iterdir():
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
    for folder in _CREATED:
        try:
            folder.rmdir()
        except OSError:  # not empty (or already gone): it and the folders above it stay
            return
    _CREATED.clear()


def write_run_record(cfg) -> None:
    """Hydra's record of the run, ``<output_dir>/.hydra/{config,hydra,overrides}.yaml``, written by the task
    (``record``, see ``_task``) once the configuration and its data are accepted: the recipes set
    ``hydra.output_subdir: null`` because Hydra writes it before the app runs, so a refused command left one
    behind, and a refused resume overwrote the run's own record with the settings it refused. Each file is
    replaced atomically and only when its text changes: an idle rerun touches nothing; an accepted resume
    records what it changed (safe keys only, e.g. trainer.max_steps)."""
    if int(os.environ.get("RANK", "0") or 0) != 0:  # one writer per run
        return
    hydra_cfg = HydraConfig.instance().cfg
    record = {"config.yaml": OmegaConf.to_yaml(cfg), "hydra.yaml": OmegaConf.to_yaml(hydra_cfg),
              "overrides.yaml": OmegaConf.to_yaml(hydra_cfg.hydra.overrides.task)}
    folder = Path(str(cfg.output_dir)) / RECORD_DIR
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in record.items():
        path = folder / name
        if path.is_file() and path.read_text(encoding="utf-8") == text:
            continue
        write_text_atomic(path, text)


def _precheck(recipe: str, overrides: list[str], sweep: bool = False, job_number: int = 0) -> None:
    """Compose and validate the config, and check that the backbone can take (and this machine hold)
    ``data.max_length`` from its config alone; one error line for a bad key, type, value or size.
    A single run's folder is then created; a sweep job (``sweep``, number ``job_number``) leaves that to Hydra and
    is checked in the folder the recipes' ``hydra.sweep`` names for it, its resume included."""
    global _PRECHECKED
    try:
        cfg = compose_recipe(recipe, overrides)
    except Exception as e:  # Hydra / OmegaConf composition errors
        refuse(compose_error_line(recipe, overrides, e), every_rank=False)
    check_boolean_overrides(cfg, overrides)
    try:
        validate(cfg)
        check_unread_overrides(cfg, [override_key(a) for a in overrides])
    except UserError as e:   # the configuration's values: every process of a launch refuses alike, rank 0 says it
        refuse(str(e), every_rank=False)
    # A sweep job's folder, as recipes/base/run.yaml names it: a job refused for its checkpoint only once the jobs
    # before it had trained on (and the sweep's multirun.yaml been rewritten). Another sweep layout: per job.
    known_folder = sweep and not any(override_key(a).startswith("hydra.sweep") for a in overrides)
    if known_folder:
        with open_dict(cfg):
            cfg.output_dir = str(Path(str(cfg.output_dir)) / "multirun" / str(job_number))
    try:
        preflight(cfg, resume=not sweep or known_folder)
    except UserError as e:   # what this process finds on its node (files, memory, a device): said by each
        refuse(str(e))
    if not sweep:
        create_output_dir(cfg.output_dir)  # accepted: now the folder may be made (Hydra would, with a traceback)
        _PRECHECKED = True


def check_boolean_overrides(cfg, overrides: list[str]) -> None:
    """A boolean key takes true/false (yes/no, on/off, 1/0) only: OmegaConf alone would read any integer
    (``heads.scale_input=3``) as true. Judged on the composed config ``cfg``, whose ``heads`` node is the
    chosen family's schema (its own boolean keys included)."""
    not_boolean = non_boolean_override(cfg, overrides)
    if not_boolean:
        arg, value = not_boolean
        refuse(f"{override_key(arg)} must be true or false (or yes/no, on/off, 1/0), got {value!r}", every_rank=False)


def sweep_jobs(overrides: list[str]) -> list[list[str]]:
    """The overrides of each job a Hydra sweep (``-m``) runs, crossed as Hydra's basic sweeper crosses them
    (``a=1,2 b=x,y``: four jobs; ``range()`` and ``choice()`` too); one line for what it cannot parse."""
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
        return [list(job) for job in BasicSweeper.split_arguments(parsed, None)[0]]
    except Exception as e:  # an override Hydra's grammar refuses, or a sweep the basic sweeper cannot run
        refuse(f"{config_error_line(e)} (a sweep is key=a,b,c, range(start,stop) or choice(a,b))")
