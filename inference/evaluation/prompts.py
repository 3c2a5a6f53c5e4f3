"""Prompt sets for evaluation: MT-Bench, the bundled code / structured-output set, or a JSONL file."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .. import assets
from ..errors import UserError
from ..runtime.decode import check_budget

CODE_PROMPTS = Path(__file__).resolve().parents[1] / "data" / "code_prompts.jsonl"
PROMPT_SETS = {"code": CODE_PROMPTS, "embedded:code": CODE_PROMPTS}


@dataclass
class Prompt:
    id: str
    turns: list[str]
    category: str = ""


def encode_checked(m, prompts: list[Prompt], max_new_tokens: int) -> list[list[int]]:
    """The first turns of ``prompts`` encoded for ``m``, every one checked to fit the backbone's positions with
    ``max_new_tokens`` before any is decoded (an evaluation refused mid-run has wasted what it decoded)."""
    ids = [m.encode_chat(p.turns[0]) for p in prompts]
    for p, row in zip(prompts, ids):
        check_budget(m, len(row), max_new_tokens, what=f"prompt {p.id!r}")
    return ids


def load_prompts(source: str, limit: Optional[int] = None) -> list[Prompt]:
    """MT-Bench (``embedded:mtbench``), the bundled code/structured-output set (``code``) or a
    JSONL file of prompts.

    A JSONL line may be ``{"prompt": str}``, ``{"text": str}``, ``{"turns": [str, ...]}``
    (MT-Bench's form) or ``{"messages": [{"role": "user", "content": str}, ...]}``.
    """
    if source in ("embedded:mtbench", "mtbench"):
        path = assets.mtbench_questions_path()
    else:
        path = PROMPT_SETS.get(source) or Path(source).expanduser()
    if not Path(path).is_file():
        raise UserError(f"prompts file not found: {source}")
    prompts: list[Prompt] = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                raise UserError(f"{source}:{n} is not valid JSON") from None
            turns = _turns(rec)
            if not turns or any(not isinstance(t, str) or not t.strip() for t in turns):
                raise UserError(f"{source}:{n} has an empty or missing prompt")
            pid = str(rec.get("question_id", rec.get("id", n))) if isinstance(rec, dict) else str(n)
            prompts.append(Prompt(pid, turns, rec.get("category", "") if isinstance(rec, dict) else ""))
    if not prompts:
        raise UserError(f"no prompts in {source}")
    return prompts[:limit] if limit else prompts


def split_calibration(prompts: list[Prompt], calibration_prompts: int) -> tuple[list[Prompt], list[Prompt]]:
    """(calibration prompts, evaluated prompts): the last ``calibration_prompts`` are held out when
    there are more prompts than that; otherwise the first ones calibrate and are evaluated too."""
    if len(prompts) > calibration_prompts >= 1:
        return prompts[-calibration_prompts:], prompts[:-calibration_prompts]
    return prompts[:max(calibration_prompts, 1)], prompts


def select_prompts(prompts: list[Prompt], num_prompts: Optional[int], calibration_prompts: int) -> tuple[
        list[Prompt], list[Prompt]]:
    """(evaluated prompts, calibration prompts) for an evaluation that calibrates: without ``num_prompts`` as
    ``split_calibration``; with it, exactly the first ``num_prompts`` evaluated and up to ``calibration_prompts``
    of those after them held out (none after them: the first evaluated ones calibrate too). Held-out prompts
    fewer than ``calibration_prompts`` once made the evaluation split them again, evaluating more prompts than
    asked (num_prompts=1 of 3 evaluated all 3)."""
    if num_prompts is None:
        calibration, evaluated = split_calibration(prompts, calibration_prompts)
        return evaluated, calibration
    evaluated = prompts[:num_prompts]
    return evaluated, prompts[num_prompts:][-calibration_prompts:] or evaluated[:calibration_prompts]


def _turns(rec) -> list:
    if isinstance(rec, str):
        return [rec]
    if not isinstance(rec, dict):
        return []
    if isinstance(rec.get("turns"), list):
        return rec["turns"]
    for key in ("prompt", "text", "question"):
        if isinstance(rec.get(key), str):
            return [rec[key]]
    if isinstance(rec.get("messages"), list):
        return [m.get("content") for m in rec["messages"] if isinstance(m, dict) and m.get("role") == "user"]
    return []
