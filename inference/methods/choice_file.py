"""The one choice file: what an evaluation chose for a method on this machine, saved so that ``medusa-eval``
and ``medusa-generate`` decode with it (``choice=<file>``).

``medusa-eval ... choice=auto`` writes, beside report.json, one ``<method>_choice.json`` per method whose
speculation shape it measured (``shape.Chosen.measured``): one prompt at a time a schedule of batch size 1,
batched (``batch_size=[1,2,4,...]``) each measured batch size's choice. Every choice is written as the
method's own option keys (its shape's ``encode``), so the same reader serves every method:

    {"format": "medusa-train speculation choice", "version": 2, "method": "eagle3_lookup",
     "name": "per batch size: 1: n4-d1-k4+t6-m2, 4: plain", "reason": "...", "base_model_fingerprint": "...",
     "chosen_on_prompts": ["3f2a...", ...],
     "schedule": {"choices": {"1": {"eagle_nodes": 4, "eagle_depth": 1, "eagle_topk": 4, ...}, "4": null},
                  "rates": {"1": {"plain": 9.1, "n4-d1-k4+t6-m2": 11.8}, "4": {...}}, "switch_gain": 0.05},
     "static_shapes": {"1": [11, 7], "4": [1, 0]}}

``null`` is plain decoding at that batch size; ``rates`` are the expected tokens/s the batched decoder's
hysteresis compares; ``static_shapes`` the (rows verified per sequence and step, depth) each batch size uses,
what a captured step buckets on; ``chosen_on_prompts`` the digests of the calibration prompts it was measured on
(``prompts.prompt_digest``): an evaluation given the file holds those out, as it holds out its own. Reading it
(``read_choice``) refuses in one line, before anything loads: a
missing or damaged file, a file of the three formats it replaced (``tree.json`` given as a choice,
``tree_schedule.json``, ``eagle3[_lookup]_tree.json``), a method these heads cannot decode with, or a file
chosen for another backbone's heads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from ..errors import UserError
from ..runtime.speculation import SpeculationSchedule, schedule_from_record, schedule_record
from . import registry

FORMAT = "medusa-train speculation choice"
VERSION = 2
SUFFIX = "_choice.json"
# the formats this one replaced: what each was, and what to run instead
OLD_FORMATS = {"medusa-train tree schedule": "a batched evaluation's tree_schedule.json",
               "medusa-train eagle3 tree choice": "an EAGLE-3 eagle3_tree.json / eagle3_lookup_tree.json"}
RERUN = "rerun medusa-eval with these heads (choice=auto writes <out>/<method>_choice.json)"


@dataclass
class SavedChoice:
    """A choice file read: its method and the ``SpeculationSchedule`` of that method's choices (None: plain)."""

    method: str
    schedule: SpeculationSchedule
    path: str
    chosen_on: Optional[tuple] = None   # digests of the prompts it was measured on (prompts.prompt_digest); None: unknown

    @property
    def plain_alone(self) -> bool:
        """Plain decoding won at the smallest batch size measured: one prompt decodes plainly."""
        return self.schedule.choices[min(self.schedule.choices)] is None


def write_choice(out: Path, method: str, chosen, options, base_model_fingerprint: str = "",
                 chosen_on: Sequence[str] = ()) -> Path:
    """``<out>/<method>_choice.json`` for a measured ``shape.Chosen`` of ``method`` (``options``: its options,
    which name the choice's keys; ``chosen_on``: the digests of the calibration prompts it was measured on, which
    an evaluation given the file holds out)."""
    shape, grafted = registry.get(method).shape, registry.get(method).grafted
    record = {"format": FORMAT, "version": VERSION, "method": method, "name": chosen.name, "reason": chosen.reason,
              "base_model_fingerprint": base_model_fingerprint, "chosen_on_prompts": list(chosen_on),
              "schedule": schedule_record(chosen.schedule, lambda c: shape.encode(c, options)),
              "static_shapes": {str(b): list(s) for b, s in shape.static_shapes(
                  chosen.schedule, grafted(options) if grafted else 0).items()}}
    path = out / f"{method}{SUFFIX}"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.replace(path)   # never a half-written choice
    return path


def _decodable(method, spec) -> bool:
    """Whether an evaluation of the heads of ``spec`` (None: none) could measure ``method``."""
    if method not in registry.names():
        return False
    if not registry.get(method).needs_heads:
        return True
    return spec is not None and method in registry.methods_for_heads(spec)


def old_choice_file(value: Any) -> Optional[str]:
    """What an old choice file at ``value`` was (one of ``OLD_FORMATS``), or None for anything else."""
    record = _json(value)
    return OLD_FORMATS.get(record.get("format")) if isinstance(record, dict) else None


def _json(value: Any) -> Any:
    p = Path(value) if isinstance(value, str) and value.endswith(".json") else None
    if p is None or not p.is_file():
        return None
    try:
        return json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None


def _record(path: str) -> dict:
    """The file's record, or one line naming what it is instead."""
    if Path(path).is_dir():   # an evaluation's out= folder, most likely: name the files in it to give instead
        held = sorted(str(p) for p in Path(path).glob(f"*{SUFFIX}"))
        inside = f"give choice={held[0]}" if len(held) == 1 else f"give one of {', '.join(held)}" if held else RERUN
        raise UserError(f"choice={path} is a folder, not a choice file: {inside}")
    if not Path(path).is_file():
        raise UserError(f"choice={path}: no such file ({RERUN})")
    record = _json(path)
    if record is None:
        raise UserError(f"choice={path}: not a readable JSON choice file ({RERUN})")
    old = old_choice_file(path)
    if old is not None:
        raise UserError(f"choice={path} is {old}, a format from before the one choice file: {RERUN}")
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        if isinstance(record, list) or (isinstance(record, dict) and "choices" in record):
            raise UserError(f"choice={path} is a Medusa tree, not a choice file: give it as tree={path}, or {RERUN}")
        raise UserError(f"choice={path}: not a choice file written by medusa-eval ({RERUN})")
    version = record.get("version", 0)
    if isinstance(version, bool) or not isinstance(version, int):
        raise UserError(f"choice={path}: its version is {version!r}, not a number ({RERUN})")
    if version > VERSION:
        raise UserError(f"choice={path} was written by a newer medusa-train (version {record['version']})")
    return record


def read_choice(path: str, spec, usable: list[str], options_of: Callable[[str], Any],
                evaluated: bool = False) -> SavedChoice:
    """The choice in a file ``write_choice`` wrote, each choice decoded over ``options_of(method)`` (the
    command line's options) and checked against the heads of ``spec``; ``usable``: the methods these heads
    (or none) decode with, or (``evaluated``) the methods an evaluation measures. One clear line for anything it
    cannot take (module docstring)."""
    record = _record(path)
    method = record.get("method")
    if method not in usable and evaluated and _decodable(method, spec):   # the evaluation was not asked for it
        raise UserError(f"choice={path} is for method {method!r}, which is not among the methods evaluated here "
                        f"({', '.join(usable)}): add it, methods=[{','.join([*usable, str(method)])}]")
    if method not in usable:
        theirs = registry.methods_for_heads(spec) if evaluated and spec is not None else usable
        raise UserError(f"choice={path} is for method {method!r}, which these heads do not decode with "
                        f"(they decode with: {', '.join(theirs) or 'none'})")
    theirs = record.get("base_model_fingerprint") or None
    ours = getattr(spec, "base_model_fingerprint", "") or None
    if theirs and ours and theirs != ours:
        raise UserError(f"choice={path} was chosen for heads of another backbone (fingerprint {theirs}, these "
                        f"heads' {ours}): {RERUN}")
    shape, options = registry.get(method).shape, options_of(method)
    try:
        schedule = schedule_from_record(record["schedule"], lambda keys: shape.decode(keys, method, options))
    except UserError as e:
        raise UserError(f"choice={path}: {e}") from None
    except (KeyError, TypeError, ValueError, AttributeError):
        raise UserError(f"choice={path}: its schedule is damaged ({RERUN})") from None
    if not schedule.choices or min(schedule.choices) < 1:
        raise UserError(f"choice={path}: its schedule names no batch size >= 1 ({RERUN})")
    if spec is not None:
        for choice in schedule.choices.values():
            if choice is not None:
                shape.check_spec(choice, spec)
    chosen_on = record.get("chosen_on_prompts")   # absent from files written before it was recorded
    if chosen_on is not None and not (isinstance(chosen_on, list) and all(isinstance(d, str) for d in chosen_on)):
        raise UserError(f"choice={path}: its chosen_on_prompts is damaged ({RERUN})")
    return SavedChoice(method, schedule, path, None if chosen_on is None else tuple(chosen_on))


def is_choice_file(value: Any) -> bool:
    """Whether ``value`` is a path (not ``auto`` / ``fixed``) given as ``choice=``."""
    return isinstance(value, str) and value not in ("auto", "fixed")
