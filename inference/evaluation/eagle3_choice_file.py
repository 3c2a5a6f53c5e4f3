"""The EAGLE-3 setting an evaluation chose, saved so that ``medusa-generate`` decodes with it.

``medusa-eval heads=<eagle3 heads> eagle_tree=auto`` measures (nodes, depth, top-k[, floor]) per method on
this machine (``tree_choice.choose_eagle3``) and writes, next to report.json, one file per method it sized:
``eagle3_tree.json`` / ``eagle3_lookup_tree.json``. ``medusa-generate heads=<same heads>
eagle_tree=<that file>`` then decodes with that method and those settings, as Medusa heads take the
evaluation's ``tree.json`` (``tree=<file>``). The file holds the method and its command-line keys, so what
generate decodes is exactly what the evaluation measured; a file made for other heads' backbone, or for a
method these heads cannot decode with, is refused in one line before anything loads.

A batched evaluation (``medusa-eval ... batch_size=[1,2,4,...] eagle_tree=auto``) sizes each method per batch
size instead (``batch_sizing.choose_eagle3_schedule``); its file adds the ``schedule``: each measured batch
size's keys (null: plain decoding there) and the expected tokens/s the decoder's hysteresis compares, so that
``medusa-generate ... prompts_file=... batch_size=B eagle_tree=<file>`` speculates as the evaluation measured
at every number of active rows, and a single prompt decodes with the batch-1 choice.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

from ..errors import UserError

FORMAT = "medusa-train eagle3 tree choice"
SETTING_KEYS = ("eagle_nodes", "eagle_depth", "eagle_topk", "eagle_min_prob",
                "eagle_lookup_tokens", "eagle_lookup_max_ngram", "eagle_lookup_min_ngram", "eagle_lookup_switch")


@dataclass
class Choice:
    """What a choice file says to decode with: ``method``; ``settings``, its command-line keys for one prompt
    at a time (a batched evaluation's: its batch-1 choice, or, where it found plain decoding best at batch 1
    (``plain_alone``), the keys of the smallest batch size that speculates, so that the looked-up branch's
    keys match the schedule's); ``schedule``: a batched evaluation's, of keys, or None."""

    method: str
    settings: dict
    schedule: Any = None     # a SpeculationSchedule of setting keys (None: plain decoding at that batch size)
    plain_alone: bool = False


def setting_keys(options_report: dict) -> dict:
    """The command-line keys of one setting (an ``options_report`` of eagle3 / eagle3_lookup options)."""
    return {k: options_report[k] for k in SETTING_KEYS if k in options_report}


def schedule_settings(schedule) -> dict:
    """A ``SpeculationSchedule`` of eagle3 settings as a choice file stores it: each measured batch size's
    keys (None: plain decoding), the expected tokens/s per setting that the decoder's hysteresis compares,
    and its switch gain."""
    from ..methods.registry import options_report
    from ..runtime.speculation import schedule_record as record_of

    return record_of(schedule, lambda c: setting_keys(options_report(c)))


def _write(out: Path, method: str, record: dict) -> Path:
    path = out / f"{method}_tree.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    tmp.replace(path)  # never a half-written choice
    return path


def write_choices(out: Path, report: dict, base_model_fingerprint: str = "") -> dict[str, Path]:
    """One ``<method>_tree.json`` per method whose tree the evaluation chose: one prompt at a time, report's
    ``<method>_tree`` with its options' keys from ``method_options``; batched, report's
    ``batched.speculation.<method>`` sized with ``tree: auto`` (its ``settings``, from ``schedule_settings``).
    {method: path written}."""
    paths = {}
    for method, options in (report.get("method_options") or {}).items():
        chosen = report.get(f"{method}_tree")
        if not chosen:
            continue
        record = {"format": FORMAT, "method": method, "name": chosen.get("name"), "reason": chosen.get("reason"),
                  "settings": setting_keys(options), "base_model_fingerprint": base_model_fingerprint}
        paths[method] = _write(out, method, record)
    for method, sized in ((report.get("batched") or {}).get("speculation") or {}).items():
        if sized.get("tree") != "auto" or not isinstance(sized.get("settings"), dict):
            continue
        record = {"format": FORMAT, "method": method,
                  "name": "per batch size: " + ", ".join(f"{b}: {t}" for b, t in sized["schedule"].items()),
                  "reason": "sized per batch size by a batched evaluation on this machine",
                  "settings": sized["settings"]["choices"].get("1"), "schedule": sized["settings"],
                  "base_model_fingerprint": base_model_fingerprint}
        paths[method] = _write(out, method, record)
    return paths


def _check_setting(path: str, keys: Any) -> dict:
    if not isinstance(keys, dict):
        raise UserError(f"eagle_tree={path}: a setting is not a mapping of eagle_* keys ({keys!r})")
    unknown = sorted(set(keys) - set(SETTING_KEYS))
    if unknown:
        raise UserError(f"eagle_tree={path}: unknown settings {unknown} (written by another medusa-train? "
                        "rerun medusa-eval ... eagle_tree=auto)")
    return dict(keys)


def _check_schedule(path: str, record: Any):
    """A batched file's ``schedule`` as a ``SpeculationSchedule`` of setting keys (None: plain), its batch sizes
    and settings checked (one line for a damaged file)."""
    from ..runtime.speculation import schedule_from_record

    try:
        schedule = schedule_from_record(record, lambda keys: _check_setting(path, keys))
    except (KeyError, TypeError, ValueError, AttributeError):
        raise UserError(f"eagle_tree={path}: its per-batch-size schedule is damaged (rerun medusa-eval ... "
                        "batch_size=[...] eagle_tree=auto)") from None
    if not schedule.choices or min(schedule.choices) < 1:
        raise UserError(f"eagle_tree={path}: its schedule names no batch size >= 1")
    return schedule


def read_choice(path: str, spec, usable: list[str]) -> Choice:
    """The ``Choice`` in a file ``write_choices`` wrote; one clear line for a missing or foreign file, a
    method these heads cannot decode with (``usable``), another backbone's drafter or a damaged setting."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"eagle_tree={path}: no such file (medusa-eval ... eagle_tree=auto writes "
                        "<out>/eagle3_tree.json and eagle3_lookup_tree.json)")
    try:
        record = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"eagle_tree={path}: not a readable JSON file ({e})") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT or \
            not (isinstance(record.get("settings"), dict) or record.get("schedule") is not None):
        raise UserError(f"eagle_tree={path}: not an EAGLE-3 tree choice written by medusa-eval (give the "
                        "eagle3_tree.json or eagle3_lookup_tree.json it wrote beside report.json)")
    method = record.get("method")
    if method not in usable:
        raise UserError(f"eagle_tree={path} is for method {method!r}, which these heads do not decode with "
                        f"(they decode with: {', '.join(usable) or 'none'})")
    theirs: Optional[str] = record.get("base_model_fingerprint") or None
    ours = getattr(spec, "base_model_fingerprint", "") or None
    if theirs and ours and theirs != ours:
        raise UserError(f"eagle_tree={path} was chosen for a drafter of another backbone "
                        f"(fingerprint {theirs}, these heads' {ours}): run medusa-eval with these heads")
    if record.get("schedule") is None:
        return Choice(method, _check_setting(path, record["settings"]))
    schedule = _check_schedule(path, record["schedule"])
    first = schedule.choices[min(schedule.choices)]
    speculating = [keys for _, keys in sorted(schedule.choices.items()) if keys is not None]
    settings = first if first is not None else (speculating[0] if speculating else {})
    return Choice(method, settings, schedule, plain_alone=first is None)


def eagle3_schedule(method: str, schedule, config):
    """The ``SpeculationSchedule`` of ``method``'s options that a batched choice file's schedule of keys
    (``Choice.schedule``) describes: each batch size's keys over ``config``'s (the command line's) other keys;
    None stays plain decoding."""
    from ..methods.registry import get, options_from_keys
    from ..runtime.speculation import SpeculationSchedule

    base = {key: getattr(config, key, None) for key in get(method).keys()}

    def options(keys):
        return options_from_keys(method, SimpleNamespace(**{**base, **keys, "eagle_tree": "fixed"}))

    return SpeculationSchedule({b: options(keys) if keys is not None else None for b, keys in schedule.choices.items()},
                               schedule.rates, schedule.switch_gain)
