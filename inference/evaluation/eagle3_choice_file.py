"""The EAGLE-3 setting an evaluation chose, saved so that ``medusa-generate`` decodes with it.

``medusa-eval heads=<eagle3 heads> eagle_tree=auto`` measures (nodes, depth, top-k[, floor]) per method on
this machine (``tree_choice.choose_eagle3``) and writes, next to report.json, one file per method it sized:
``eagle3_tree.json`` / ``eagle3_lookup_tree.json``. ``medusa-generate heads=<same heads>
eagle_tree=<that file>`` then decodes with that method and those settings, as Medusa heads take the
evaluation's ``tree.json`` (``tree=<file>``). The file holds the method and its command-line keys, so what
generate decodes is exactly what the evaluation measured; a file made for other heads' backbone, or for a
method these heads cannot decode with, is refused in one line before anything loads.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from ..errors import UserError

FORMAT = "medusa-train eagle3 tree choice"
SETTING_KEYS = ("eagle_nodes", "eagle_depth", "eagle_topk", "eagle_min_prob",
                "eagle_lookup_tokens", "eagle_lookup_max_ngram", "eagle_lookup_min_ngram")


def write_choices(out: Path, report: dict, base_model_fingerprint: str = "") -> dict[str, Path]:
    """One ``<method>_tree.json`` per method whose tree the evaluation chose (report's ``<method>_tree``,
    its options' keys from report's ``method_options``); {method: path written}. A batched evaluation
    sizes per batch size instead (report's ``batched``) and writes none."""
    paths = {}
    for method, options in (report.get("method_options") or {}).items():
        chosen = report.get(f"{method}_tree")
        if not chosen:
            continue
        keys = {k: options[k] for k in SETTING_KEYS if k in options}
        record = {"format": FORMAT, "method": method, "name": chosen.get("name"), "reason": chosen.get("reason"),
                  "settings": keys, "base_model_fingerprint": base_model_fingerprint}
        path = out / f"{method}_tree.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(record, indent=2) + "\n")
        tmp.replace(path)  # never a half-written choice
        paths[method] = path
    return paths


def read_choice(path: str, spec, usable: list[str]) -> tuple[str, dict]:
    """(method, {command-line key: value}) from a file ``write_choices`` wrote; one clear line for a missing
    or foreign file, a method these heads cannot decode with (``usable``), or another backbone's drafter."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"eagle_tree={path}: no such file (medusa-eval ... eagle_tree=auto writes "
                        "<out>/eagle3_tree.json and eagle3_lookup_tree.json)")
    try:
        record = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"eagle_tree={path}: not a readable JSON file ({e})") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT or not isinstance(record.get("settings"), dict):
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
    unknown = sorted(set(record["settings"]) - set(SETTING_KEYS))
    if unknown:
        raise UserError(f"eagle_tree={path}: unknown settings {unknown} (written by another medusa-train? "
                        "rerun medusa-eval ... eagle_tree=auto)")
    return method, dict(record["settings"])
