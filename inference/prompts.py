"""Prompt sets for medusa-eval and medusa-generate: MT-Bench, the bundled code prompts, or a JSONL file."""

from __future__ import annotations

import hashlib
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from . import assets
from .errors import UserError
from .runtime.decode import check_budget

CODE_PROMPTS = Path(__file__).resolve().parent / "data" / "code_prompts.jsonl"
PROMPT_SETS = {"code": CODE_PROMPTS, "embedded:code": CODE_PROMPTS}


@dataclass
class Prompt:
    id: str
    turns: list[str]
    category: str = ""
    system: str = ""   # the record's system message ("": none), given to the chat template with every turn
    # the assistant reply the record gives after turn k (None: none)
    replies: list[Optional[str]] = field(default_factory=list)


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")   # half of a UTF-16 pair: what JSON's "\\ud800" alone reads as


def turn_messages(p: Prompt, turn: int, answers: list[str]) -> list[dict]:
    """The chat of ``p``'s turn ``turn`` (0-based): each earlier user turn followed by the reply the record gives
    after it, else ``answers[k]`` (what the evaluation decoded for it), then the turn's own question."""
    msgs: list[dict] = []
    for k in range(turn):
        given = p.replies[k] if k < len(p.replies) else None
        msgs += [{"role": "user", "content": p.turns[k]}, {"role": "assistant", "content": given
                                                           if given is not None else answers[k]}]
    return msgs + [{"role": "user", "content": p.turns[turn]}]


def encode_turn(m, p: Prompt, turn: int = 0, answers: Optional[list[str]] = None) -> list[int]:
    """``turn_messages`` encoded for ``m``, with the record's system message (a ``system`` field or message was
    once dropped: the prompt was decoded without it)."""
    if p.system:
        return m.encode_chat(turn_messages(p, turn, answers or []), system=p.system)
    return m.encode_chat(turn_messages(p, turn, answers or []) if turn else p.turns[0])   # a first turn: its text


def answered_turn(p: Prompt) -> int:
    """The turn a single generation answers: the last one the record gives every earlier reply for (a chat of
    ``messages`` ending in a user message: its last question), else the first (MT-Bench's ``turns``, whose later
    turns follow answers not decoded yet: medusa-eval ``turns=both`` answers them in order)."""
    turn = 0
    while turn + 1 < len(p.turns) and turn < len(p.replies) and p.replies[turn] is not None:
        turn += 1
    return turn


def encode_checked(m, prompts: list[Prompt], max_new_tokens: int, turns: str = "first",
                   key: str = "max_new_tokens") -> list[list[int]]:
    """The first turns of ``prompts`` encoded for ``m``, every one checked to fit the backbone's positions with
    ``max_new_tokens`` before any is decoded (an evaluation refused mid-run has wasted what it decoded); with
    ``turns="both"`` the second turns too, the first answer (not decoded yet) counted at its longest,
    ``max_new_tokens`` (a long second turn was refused only once every first turn had been decoded). ``key``: the
    setting that gave ``max_new_tokens``, named in a refusal (``calibration_tokens`` for calibration prompts)."""
    ids = [encode_turn(m, p) for p in prompts]
    for p, row in zip(prompts, ids):
        check_budget(m, len(row), max_new_tokens, what=f"prompt {p.id!r}", key=key)
    for p in (x for x in prompts if turns == "both" and len(x.turns) > 1):
        check_budget(m, second_turn_bound(m, p, max_new_tokens), max_new_tokens,
                     what=f"turn 2 of prompt {p.id!r}" + ("" if _first_reply_given(p) else
                                                           " with a max_new_tokens answer"))
    return ids


def second_turn_bound(m, p: Prompt, max_new_tokens: int) -> int:
    """The longest the encoded second turn of ``p`` can be: with its record's own first reply, or a first answer
    of ``max_new_tokens`` (not decoded yet)."""
    return len(encode_turn(m, p, 1, [""])) + (0 if _first_reply_given(p) else max_new_tokens)


def _first_reply_given(p: Prompt) -> bool:
    """Whether the record holds its own first reply (its length is known), not one to be decoded."""
    return bool(p.replies) and p.replies[0] is not None


def load_prompts(source: str, limit: Optional[int] = None) -> list[Prompt]:
    """MT-Bench (``embedded:mtbench``), the bundled code/structured-output set (``code``) or a
    JSONL file of prompts.

    A JSONL line may be ``{"prompt": str}``, ``{"text": str}``, ``{"turns": [str, ...]}``
    (MT-Bench's form) or ``{"messages": [{"role": "user", "content": str}, ...]}``; a ``system`` field (or a
    system message) is given to the chat template, and an assistant message after a user turn is that turn's
    reply in the next turn's chat (``turn_messages``). A prompt's id is its ``question_id``, else its ``id``, else
    its line number, each prompt's own (two with one id: refused, naming both lines).
    """
    if source in ("embedded:mtbench", "mtbench"):
        path = assets.mtbench_questions_path()
    else:
        path = PROMPT_SETS.get(source) or Path(source).expanduser()
    if Path(path).is_dir():
        raise UserError(f"{source} is a folder, not a prompts file: give a JSONL file of prompts")
    if not Path(path).is_file():
        raise UserError(f"{source} is not a regular file: give a JSONL file of prompts" if Path(path).exists() else
                        f"prompts file not found: {source}")
    prompts, lines = [], {}   # lines: the line of each id read
    try:   # a byte that is no UTF-8 (a UTF-16 or Latin-1 file) was a UnicodeDecodeError traceback
        with open(path, encoding="utf-8-sig") as f:   # -sig: a byte-order mark (Windows editors) is no JSON
            for n, line in enumerate(f, start=1):
                if line.strip():
                    prompts.append(_prompt(line, source, n))
                    _check_new_id(prompts[-1].id, n, lines, source)
    except UnicodeDecodeError as e:
        raise UserError(f"{source}: not UTF-8 text ({e.reason} 0x{e.object[e.start]:02x}): save it as UTF-8") \
            from None
    if not prompts:
        raise UserError(f"no prompts in {source}")
    return prompts[:limit] if limit else prompts


def _prompt(line: str, source: str, n: int) -> Prompt:
    """Line ``n`` of a prompts file as a ``Prompt``, or one line naming what is wrong with it."""
    try:
        rec = json.loads(line)
    except json.JSONDecodeError:
        raise UserError(f"{source}:{n} is not valid JSON") from None
    if isinstance(rec, list):
        raise UserError(f"{source}:{n} is a JSON array: a prompts file holds one JSON object (or string) per line")
    if _LONE_SURROGATE.search(json.dumps(rec, ensure_ascii=False)):   # no tokenizer takes one: a traceback there
        raise UserError(f"{source}:{n} holds a lone surrogate (an escape \\ud800-\\udfff without its pair): "
                        "not valid text; fix or remove that line")
    turns = _turns(rec)
    if any(t is not None and not isinstance(t, str) for t in turns):   # a part that is not text: an image, say
        raise UserError(f"{source}:{n} has a message whose content is not text (only text prompts are decoded)")
    if not turns or any(not isinstance(t, str) or not t.strip() for t in turns):
        raise UserError(f"{source}:{n} has an empty or missing prompt")
    if not isinstance(rec, dict):
        return Prompt(str(n), turns)
    system, replies = _context(rec)
    if not isinstance(system, str) or any(r is not None and not isinstance(r, str) for r in replies):
        raise UserError(f"{source}:{n} has a system message or reply that is not text")
    # null counts as absent: two records of "id": null were refused as repeating the id 'None'
    pid = next((rec[k] for k in ("question_id", "id") if rec.get(k) is not None), n)
    return Prompt(str(pid), turns, rec.get("category", ""), system, replies)


def _check_new_id(pid: str, n: int, lines: dict, source: str) -> None:
    """Refuse line ``n``'s id where an earlier line has it (``lines``: id -> line), else record it. An explicit id
    and the line number a record without one is given, or ``question_id`` 81 and ``"81"``, were once two prompts
    under one id: report.json's evaluated_prompt_ids named both, and ``prompt_record`` refused a calibration
    prompt as "also evaluated" that was another prompt."""
    if pid in lines:
        raise UserError(f"{source}:{n} repeats the id {pid!r} of line {lines[pid]} (a prompt without question_id or "
                        "id is numbered by its line): give each prompt its own id")
    lines[pid] = n


def split_calibration(prompts: list[Prompt], calibration_prompts: int) -> tuple[list[Prompt], list[Prompt]]:
    """(calibration prompts, the prompts left to evaluate): the last ``calibration_prompts`` are held out and never
    evaluated (a choice fit on the prompts it is then scored on flatters itself). A set with no more prompts than
    that leaves nothing to evaluate: refused in one line (the CLI checks it before the backbone loads)."""
    if len(prompts) <= calibration_prompts:
        raise UserError(f"calibration_prompts={calibration_prompts} holds out all {len(prompts)} prompts of the set, "
                        "leaving none to evaluate: give more prompts, a smaller calibration_prompts or choice=fixed")
    return prompts[-calibration_prompts:], prompts[:-calibration_prompts]


def prompt_digest(p: Prompt) -> str:
    """What a prompt asks (its turns, system message and given replies), hashed: the same prompt under another id
    or in another file is still the same prompt."""
    replies = list(p.replies)
    while replies and replies[-1] is None:   # a messages record's unanswered last turn: as a plain prompt has none
        replies.pop()
    text = json.dumps([p.system, p.turns, replies], ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def hold_out(prompts: list[Prompt], digests) -> tuple[list[Prompt], list[Prompt]]:
    """(the prompts left, the prompts held out): those whose ``prompt_digest`` is in ``digests`` (the prompts a
    given choice file was chosen on) are never evaluated with that choice."""
    chose = set(digests)
    return [p for p in prompts if prompt_digest(p) not in chose], [p for p in prompts if prompt_digest(p) in chose]


def select_prompts(prompts: list[Prompt], num_prompts: Optional[int], calibration_prompts: int) -> tuple[
        list[Prompt], list[Prompt]]:
    """(evaluated prompts, calibration prompts) for an evaluation that calibrates: the last ``calibration_prompts``
    of the set held out (``split_calibration``), the first ``num_prompts`` of the others evaluated (all of them
    without it; fewer than asked when fewer remain: ``prompt_record`` says so). The calibration prompts do not
    depend on ``num_prompts``, and never overlap the evaluated ones (they once did: num_prompts=80 of MT-Bench's
    80 fit the choice on 8 of the prompts it was then scored on)."""
    calibration, rest = split_calibration(prompts, calibration_prompts)
    return (rest if num_prompts is None else rest[:num_prompts]), calibration


def prompt_record(evaluated: list[Prompt], calibration: list[Prompt], asked: Optional[int]) -> dict:
    """report.json's ``evaluated_prompt_ids`` / ``calibration_prompt_ids``, and ``prompts_note`` (also printed on
    stderr) when ``num_prompts`` asked for more prompts than remained (after the calibration ones, if any, were
    held out).
    Refuses calibration prompts that are also evaluated (a caller's slip)."""
    shared = sorted({p.id for p in evaluated} & {p.id for p in calibration})
    if shared:
        raise UserError(f"calibration prompts {', '.join(shared)} are also evaluated: hold them out")
    out: dict = {"evaluated_prompt_ids": [p.id for p in evaluated],
                 "calibration_prompt_ids": [p.id for p in calibration]}
    # said whether or not calibration held prompts out: choice=fixed on a 3-prompt file once evaluated 3 of 10 silently
    if isinstance(asked, int) and not isinstance(asked, bool) and asked > len(evaluated):
        left = (f"the {len(evaluated)} left once the {len(calibration)} calibration prompts were held out"
                if calibration else f"the {len(evaluated)} left to evaluate")   # a choice file's own held out too
        out["prompts_note"] = f"num_prompts={asked} asked for more prompts than {left}: evaluating {len(evaluated)}"
        print(f"note: {out['prompts_note']}", file=sys.stderr)
    return out


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
        return [text_content(m.get("content")) for m in rec["messages"]
                if isinstance(m, dict) and m.get("role") == "user"]
    return []


TEXT_PARTS = frozenset({"text", "input_text", "output_text"})   # OpenAI's chat and Responses APIs' text parts


def text_content(content):
    """A message's content as text: OpenAI's list of parts (``[{"type": "text", "text": ...}]``) joined line by
    line (no parts: empty); anything else as it is (a part that is not text, an image, leaves the list: refused as
    not text)."""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in TEXT_PARTS
                                         and isinstance(p.get("text"), str) for p in content):
        return "\n".join(p["text"] for p in content)
    return content


def _context(rec: dict) -> tuple:
    """(the system message, the reply given after each user turn: None where none is) of a record whose turns
    ``_turns`` read: a ``system`` field, or the system / assistant messages of a ``messages`` record that ``_turns``
    reads (both were once dropped: the turns were encoded without the system message, the model's own answer
    standing in for the reply the record gives)."""
    system, replies = rec.get("system") if rec.get("system") is not None else "", []
    if isinstance(rec.get("turns"), list) or any(isinstance(rec.get(k), str) for k in ("prompt", "text", "question")):
        return system, replies
    for msg in rec.get("messages") or []:
        role = msg.get("role") if isinstance(msg, dict) else None
        if role == "system" and not system:
            system = text_content(msg.get("content"))
        elif role == "user":
            replies.append(None)
        elif role == "assistant" and replies and replies[-1] is None:
            replies[-1] = text_content(msg.get("content"))
    return system, replies
