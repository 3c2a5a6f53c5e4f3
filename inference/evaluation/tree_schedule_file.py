"""The Medusa-family trees a batched evaluation chose per batch size, saved so that ``medusa-generate`` decodes
batches with them.

``medusa-eval heads=<medusa / hydra / mlp_speculator heads> batch_size=[1,2,4,...]`` (tree=auto) measures a tree
per batch size on this machine (``batch_sizing.choose_schedule``) and writes ``tree_schedule.json`` beside
report.json: each measured batch size's tree (null where plain decoding won) and the expected tokens/s the
decoder's hysteresis compares. ``medusa-generate heads=<same heads> prompts_file=... batch_size=B
tree=<that file>`` then decodes every batch with the tree in force for its number of active rows, as the
evaluation did; a single prompt decodes with the batch-1 tree, or plainly where plain decoding won there.
As with the one-prompt evaluation's ``tree.json``, a file whose trees the heads cannot draft, or made for
another backbone's heads, is refused in one line before the backbone loads.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from ..errors import UserError
from ..runtime.speculation import SpeculationSchedule, schedule_from_record, schedule_record
from ..runtime.tree import MedusaTree

FORMAT = "medusa-train tree schedule"
VERSION = 1
FILE_NAME = "tree_schedule.json"


def schedule_trees(schedule: SpeculationSchedule) -> dict:
    """A schedule of Medusa trees as the report and the file store it: each batch size's tree (its name and
    choices; None: plain decoding), the expected tokens/s per tree, the switch gain."""
    return schedule_record(schedule, lambda t: {"name": t.name, "choices": t.choices})


def write_tree_schedule(out: Path, report: dict, base_model_fingerprint: str = "") -> Optional[Path]:
    """``<out>/tree_schedule.json`` from a batched report whose tree methods were sized per batch size
    (``batched.speculation.<method>`` with ``tree: auto`` and its ``trees``); None when none was."""
    for sized in ((report.get("batched") or {}).get("speculation") or {}).values():
        if sized.get("tree") == "auto" and isinstance(sized.get("trees"), dict):
            record = {"format": FORMAT, "version": VERSION, "base_model_fingerprint": base_model_fingerprint,
                      "schedule": sized["trees"]}
            path = out / FILE_NAME
            tmp = path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(record, indent=1) + "\n")
            tmp.replace(path)   # never a half-written file
            return path
    return None


def _record(path: str) -> Optional[dict]:
    """The file's JSON when it is a tree schedule, None for any other file (a tree.json, a choices list)."""
    p = Path(path)
    if p.suffix != ".json" or not p.is_file():
        return None
    try:
        raw = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None   # MedusaTree.load names the problem
    return raw if isinstance(raw, dict) and raw.get("format") == FORMAT else None


def is_tree_schedule(tree: Any) -> bool:
    return isinstance(tree, str) and _record(tree) is not None


def read_tree_schedule(path: str, spec) -> SpeculationSchedule:
    """The ``SpeculationSchedule`` of Medusa trees in a file ``write_tree_schedule`` wrote, each tree checked
    against the heads of ``spec`` (depth, ranks); one clear line for a damaged file or another backbone's heads."""
    record = _record(path)
    if record is None:
        raise UserError(f"tree={path}: not a tree schedule written by a batched medusa-eval")
    if record.get("version", 0) > VERSION:
        raise UserError(f"tree={path} was written by a newer medusa-train (version {record['version']})")
    theirs = record.get("base_model_fingerprint") or None
    ours = getattr(spec, "base_model_fingerprint", "") or None
    if theirs and ours and theirs != ours:
        raise UserError(f"tree={path} was chosen for heads of another backbone (fingerprint {theirs}, these "
                        f"heads' {ours}): run medusa-eval with these heads")
    try:
        schedule = schedule_from_record(record["schedule"], lambda t: MedusaTree(t["choices"], name=t.get("name")))
    except (KeyError, TypeError, ValueError, AttributeError):
        raise UserError(f"tree={path}: its per-batch-size schedule is damaged (rerun medusa-eval ... "
                        "batch_size=[...])") from None
    if not schedule.choices or min(schedule.choices) < 1:
        raise UserError(f"tree={path}: its schedule names no batch size >= 1")
    outputs = getattr(spec, "output_size", 0) or getattr(spec, "vocab_size", 0) or 1 << 30
    for tree in schedule.choices.values():
        if tree is not None:
            tree.check_fits(spec.num_heads, outputs)
    return schedule
