"""The GPU check's grouped-query part of the CUDA graphs (``gpu_graphs``'s ``gqa``): the captured 1-row and
16-row steps with the query groups folded onto their key/value heads (``runtime.attention.FOLD_GROUPS``, what
decoding runs on CUDA) against transformers' path (its ``repeat_kv`` copy of every key/value head for a masked
multi-row call), each way on its own static steps, captured under that setting, interleaved rounds; medians.

Every static step attends over the whole buffer under a mask, so the copy grows with the buffer: these steps run on
a buffer fixed at ``CAPACITY`` slots (a chat's length), where the rest of the check's are 256.
"""

from __future__ import annotations

from benchmarks.timing import median, verification_step
from inference.runtime import attention
from inference.runtime.model import MedusaModel
from inference.runtime.static_steps import apply_graphs

ROWS = (1, 16)
CAPACITY = 2048   # a chat's worth of slots: what the copy costs there


def gqa_fold(m: MedusaModel, prompt: list[int], sz: dict, graphs: str) -> dict:
    """Median ms of the captured ``ROWS``-row steps folded vs repeated (``m`` keeps its own static steps)."""
    saved, saved_fold = m.static, attention.FOLD_GROUPS
    ways: dict = {}
    try:
        for fold in (True, False):
            attention.FOLD_GROUPS = fold
            apply_graphs(m, graphs, capacity=CAPACITY, log=lambda line: None)
            fn = verification_step(m, prompt, max_nodes=max(ROWS))
            for n in ROWS:
                fn(n), fn(n)                  # captured under this setting, then replayed
            ways[fold] = (m.static, fn)
        times: dict = {(fold, n): [] for fold in ways for n in ROWS}
        for r in range(sz["step_rounds"]):
            for fold in ((True, False) if r % 2 == 0 else (False, True)):
                attention.FOLD_GROUPS = fold  # uncaptured (the dry run) the setting acts at every call
                m.static, fn = ways[fold]
                for n in ROWS:
                    times[fold, n] += [fn(n) for _ in range(sz["per_round"])]
    finally:
        m.static, attention.FOLD_GROUPS = saved, saved_fold
    out = {"capacity": CAPACITY, "rows": {}}
    for n in ROWS:
        folded, repeated = median(times[True, n]) * 1e3, median(times[False, n]) * 1e3
        out["rows"][n] = {"folded_ms": round(folded, 3), "repeated_ms": round(repeated, 3),
                          "folded_vs_repeated": round(folded / repeated, 3), "samples": len(times[True, n])}
    return out


def summary_rows(row) -> None:
    """summary.md rows (``row(name, fig)`` of ``gpu_graphs.summary_lines``)."""
    for n in ROWS:
        row(f"{n}-row captured step, {CAPACITY} slots: GQA folded / repeated ms", lambda s, n=n: "{} / {} ({}x)".format(
            s["gqa"]["rows"][n]["folded_ms"], s["gqa"]["rows"][n]["repeated_ms"],
            s["gqa"]["rows"][n]["folded_vs_repeated"]))
