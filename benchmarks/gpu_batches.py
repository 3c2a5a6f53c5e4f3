"""The GPU check's batched part of the CUDA graphs (``gpu_graphs``'s ``batches``): the plain batched loop at
batch 1 / 4 / 16 / 32, graphs off and on, interleaved rounds.

A batch of B rows decodes B tokens per step; with graphs off each step still costs the host's ~1,300 launches,
so tokens/s grow with B until the device is busy; captured, the (batch bucket, 1 row) step replays. Tokens/s
count every row's new tokens over the call's wall time (prefill included), medians and min / max of the rounds;
``on_vs_off`` is the ratio of the medians at each batch size. The rows' tokens under on are compared with off's.
"""

from __future__ import annotations

import time

from benchmarks.timing import off_if, spread
from inference.methods import generate_batch
from inference.runtime.model import MedusaModel

BATCHES, DRY_BATCHES = (1, 4, 16, 32), (1, 2)


def batch_loop(m: MedusaModel, prompts: list[list[int]], sz: dict) -> dict:
    """Tokens/s of ``generate_batch(autoregressive)`` per batch size, graphs off / on (``m`` has graphs on)."""
    n, batches = max(4, sz["new_tokens"] // 4), DRY_BATCHES if sz["dry"] else BATCHES
    rows = {b: [prompts[i % len(prompts)] for i in range(b)] for b in batches}

    def call(b: int, mode: str):
        with off_if(m, mode):
            t = time.perf_counter()
            out = generate_batch(m, rows[b], "autoregressive", max_new_tokens=n, eos_token_ids=())
            return out, sum(len(r.tokens) for r in out.rows) / (time.perf_counter() - t)

    # untimed: the captures of each batch bucket and kernel choices, largest batch first (a larger batch regrows
    # the KV buffer and drops the smaller ones' graphs, recaptured inside the timed rounds), twice (a bucket's
    # second use is checked against an eager run; a dry run captures nothing)
    for b in sorted(batches, reverse=True) * (1 if sz["dry"] else 2):
        for mode in ("on", "off"):
            call(b, mode)
    regrown = m.static.regrown
    rates = {(b, mode): [] for b in batches for mode in ("on", "off")}
    same = {b: True for b in batches}
    for r in range(sz["rounds"]):
        for b in batches:
            tokens = {}
            for mode in (("on", "off") if r % 2 == 0 else ("off", "on")):
                out, tps = call(b, mode)
                rates[b, mode].append(tps)
                tokens[mode] = [row.tokens for row in out.rows]
            same[b] &= tokens["on"] == tokens["off"]
    out = {"new_tokens": n, "rounds": sz["rounds"], "batches": {}, "regrown_while_timed": m.static.regrown - regrown}
    for b in batches:
        on, off = spread(rates[b, "on"]), spread(rates[b, "off"])
        out["batches"][b] = {"tokens_per_s": {"on": on, "off": off},
                             "on_vs_off": round(on["median"] / off["median"], 3), "identical": same[b]}
    return out


def summary_rows(row) -> None:
    """summary.md rows (``row(name, fig)`` of ``gpu_graphs.summary_lines``): tokens/s per batch size."""
    for b in BATCHES:
        row(f"batch {b} plain tokens/s off / on (on vs off)", lambda s, b=b: "{} / {} ({}x{})".format(
            s["batches"]["batches"][b]["tokens_per_s"]["off"]["median"],
            s["batches"]["batches"][b]["tokens_per_s"]["on"]["median"], s["batches"]["batches"][b]["on_vs_off"],
            "" if s["batches"]["batches"][b]["identical"] else ", tokens differ"))
