"""Timing candidates against plain decoding on a shared machine: the one racing rule every speculation
shape's choice uses (``methods.shape``), at batch 1 and per batch size.

The machine may be shared: step times are taken in repeated interleaved rounds until the winner is
stable, stalls and noisy rounds are discounted by medians, and the spread is recorded (``race``). A
candidate wins only when it beats plain decoding by more than that spread (``clear_winner``): weak
drafts must never make decoding slower. What a candidate is (a Medusa tree, an EAGLE-3 setting, a chain
length) and how one of its steps is timed is the shape's business; this module sees names, expected
tokens per step and a timer.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from pathlib import Path
from typing import Callable, Collection, Optional, Sequence

import torch

from ..errors import UserError

OUTLIER_FACTOR = 3.0  # a step slower than this many times its run's median is a stall, not the step's cost
NOISY_SPREAD = 0.5    # (max - min) / median over rounds above this: the timings are too noisy to trust

def robust_step(times: Sequence[float], mean: bool = False) -> tuple[float, int]:
    """(median of the step times after dropping stalls above ``OUTLIER_FACTOR`` x the median, number dropped).
    ``mean``: their mean instead, for a method whose steps differ by themselves (a looked-up chain verified on
    some steps only), where the median is a step without the costlier work and would not count it."""
    times = [t for t in times if t == t]  # NaN out
    if not times:
        return float("nan"), 0
    mid = statistics.median(times)
    kept = [t for t in times if t <= OUTLIER_FACTOR * mid]
    return (statistics.mean(kept) if mean else statistics.median(kept)), len(times) - len(kept)


def machine_load(samples: int = 5, interval_s: float = 0.02) -> tuple[Optional[float], int]:
    """(how many cores other processes keep busy right now, or None where unknown; the CPU cores
    this process may run on).

    Linux: the median over a few samples of the runnable tasks in ``/proc/loadavg`` (4th field),
    less this process's reading thread. Unlike the 1-minute load average it has no memory: right
    after a training run on an idle machine it says 0, not 2. Elsewhere: the 1-minute average."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    running = []
    for i in range(samples):
        try:
            running.append(int(Path("/proc/loadavg").read_text().split()[3].split("/")[0]) - 1)
        except (OSError, ValueError, IndexError):
            break
        if i + 1 < samples:
            time.sleep(interval_s)
    if running:
        return float(statistics.median(running)), cores
    try:
        return os.getloadavg()[0], cores
    except (AttributeError, OSError):
        return None, cores


def auto_threads(load: Optional[float] = None, cores: Optional[int] = None, default: Optional[int] = None) -> int:
    """CPU threads for decoding when none are set (``threads=0``): torch's default (one per core),
    less the cores other processes keep busy (``machine_load``, rounded up), at least 1.

    OpenMP threads wait for each other at the end of every op: on cores shared with another busy
    process, one descheduled thread stalls the whole op, so tiny-model steps become tens of times
    slower (and their timings noise) where one thread would not be slowed at all."""
    if load is None or cores is None:
        measured_load, measured_cores = machine_load()
        load = measured_load if load is None else load
        cores = measured_cores if cores is None else cores
    default = default or torch.get_num_threads()
    free = cores - math.ceil(load - 0.25) if load is not None else cores  # a little idle noise is no load
    return max(1, min(default, free))


def spread(values: Sequence[float], dropped: int = 0) -> dict:
    """Per-candidate timing record (ms) over rounds: median, min, max, interquartile range, median absolute
    deviation from the median (what ``clear_winner`` reads: one stalled round does not move it), rounds."""
    ms = sorted(v * 1e3 for v in values)
    q1, q3 = (statistics.quantiles(ms, n=4, method="inclusive")[::2] if len(ms) > 1 else (ms[0], ms[0]))
    mid = statistics.median(ms)
    return {"step_ms": round(mid, 3), "step_ms_min": round(ms[0], 3),
            "step_ms_max": round(ms[-1], 3), "step_ms_iqr": [round(q1, 3), round(q3, 3)],
            "step_ms_mad": round(statistics.median(abs(v - mid) for v in ms), 3),
            "rounds": len(ms), "stalled_steps_dropped": dropped}


CLEAR_GAIN_MADS = 2.0  # a candidate beats plain decoding when its expected gain exceeds this many relative MADs


def noise_margin(record: dict) -> float:
    """The relative gain a median step time of one ``spread`` record cannot vouch for: ``CLEAR_GAIN_MADS`` x
    the median absolute deviation of the race's rounds / their median. Robust to one stalled round (the
    median's own rule), large where the rounds disagree with each other."""
    return CLEAR_GAIN_MADS * record.get("step_ms_mad", 0.0) / record["step_ms"] if record["step_ms"] > 0 else 0.0


MOST_ROUNDS = 0.75  # of the race's rounds (3 of 3, 3 of 4, 4 of 5, 6 of 8) in which a candidate must beat plain decoding (beats_in_most_rounds)


def rounds_won(rate: float, plain_rate: float, record: dict) -> tuple[int, int]:
    """(rounds in which a candidate's expected tokens/s beats plain decoding's, rounds counted), each round
    costed by its own ratio to the plain runs beside it (``race``). A round whose ratio is more than
    ``OUTLIER_FACTOR`` x off the median either way is left out, as the median leaves it out: a stalled
    candidate run (high) or a stalled plain run beside it (low, which would count as a win)."""
    by_round, mid = record.get("vs_plain_by_round"), record.get("vs_plain_step")
    if not by_round or not mid:
        return 0, 0
    counted = [r for r in by_round if mid / OUTLIER_FACTOR <= r <= OUTLIER_FACTOR * mid]
    return sum(rate * mid / r > plain_rate for r in counted), len(counted)


def beats_in_most_rounds(rate: float, plain_rate: float, record: dict) -> bool:
    """Whether a candidate beats plain decoding in at least ``MOST_ROUNDS`` of the race's counted rounds
    (``rounds_won``): a median gain carried by half the rounds on a drifting host is a coin toss, not a
    gain. Records without per-round ratios (none timed) pass."""
    wins, counted = rounds_won(rate, plain_rate, record)
    return counted == 0 or wins >= MOST_ROUNDS * counted


def clear_winner(plain_rate: float, plain_spread: dict, candidates: dict[str, tuple[float, dict]], *,
                 varying: bool = False) -> tuple[Optional[str], str]:
    """(the candidate to decode with, or None for plain decoding; why), from expected tokens/s.

    ``candidates``: name -> (expected tokens/s, its ``spread`` record). A candidate must beat plain decoding
    by more than the timings' own spread (``noise_margin`` of the candidate's record: ``race`` costs each
    candidate against the plain runs beside it, so that spread is its ratio's, and a host's drift between
    rounds, which moves both, does not raise the bar; plain decoding's spread when ``varying``, where the
    candidate's own work varies): a median over a few noisy rounds can be off by that much, and choosing a
    tree on an 8% expected gain from rounds 37-69 ms apart once made decoding 17% slower than plain decoding
    (BENCHMARKS.md, "Soft targets for EAGLE-3"). Among those that clear the bar, the best expected tokens/s
    wins; on a quiet machine (rounds within a few %) the bar is a few %."""
    noise_plain = noise_margin(plain_spread)
    best, best_rate, held_back = None, plain_rate, None
    for name, (rate, record) in candidates.items():
        margin = noise_plain if varying else noise_margin(record)
        clears = rate > plain_rate * (1 + margin)
        if clears and (varying or beats_in_most_rounds(rate, plain_rate, record)):
            if rate > best_rate:
                best, best_rate = name, rate
        elif rate > plain_rate and (held_back is None or rate > held_back[1]):
            if clears:
                wins, counted = rounds_won(rate, plain_rate, record)
                why = f"beat plain decoding in only {wins} of {counted} timing rounds"
            else:
                why = f"expected gain ({rate / plain_rate - 1:.0%}) is within the timings' spread ({margin:.0%})"
            held_back = (name, rate, why)
    if best is not None:
        return best, f"{best_rate:.1f} tok/s expected vs plain {plain_rate:.1f}"
    if held_back is not None:
        name, _, why = held_back
        return None, f"plain decoding: {name}'s {why}; rerun on an idle machine or with threads=1"
    return None, "plain decoding is fastest"



PLAIN = "plain decoding"


def progress_bar(progress: bool, total: Optional[int], desc: str, **kw):
    """A tqdm bar (``kw``: tqdm's own, over a measurement's transient bar), or None without ``progress``
    (imported here: tqdm only loads when a bar is shown)."""
    if not progress:
        return None
    from tqdm.auto import tqdm   # lazy: tqdm loads only when a bar is shown

    return tqdm(**{"total": total, "desc": desc, "unit": "step" if total is None else "it", "dynamic_ncols": True,
                   "leave": False, **kw})


class _Rounds:
    """The race's measurements so far: each candidate's raw step per round, its ratio to the two plain runs
    beside it, and the stalled steps dropped (``race``)."""

    def __init__(self, taus: dict[str, float], varying: bool):
        self.taus, self.varying = taus, varying
        self.cands = [n for n in taus if n != PLAIN]
        self.rounds: dict[str, list[float]] = {name: [] for name in [PLAIN] + self.cands}  # plain: the round's median
        self.ratios: dict[str, list[float]] = {name: [] for name in self.cands}
        self.dropped = dict.fromkeys([PLAIN] + self.cands, 0)
        self.winners: list[str] = []

    def estimate(self) -> dict[str, float]:
        plain = statistics.median(self.rounds[PLAIN])
        return {PLAIN: plain, **{n: statistics.median(self.ratios[n]) * plain for n in self.cands}}

    def spreads(self, step: dict[str, float]) -> dict[str, dict]:
        out = {PLAIN: spread(self.rounds[PLAIN], self.dropped[PLAIN])}
        for n in self.cands:
            out[n] = {**spread([r * step[PLAIN] for r in self.ratios[n]], self.dropped[n]),
                      "vs_plain_step": round(statistics.median(self.ratios[n]), 6),
                      "vs_plain_by_round": [round(r, 6) for r in self.ratios[n]]}
        return out

    def winner(self) -> str:
        # The same rule as the final choice (clear_winner, on the rounds so far): a stop rule that ranked by
        # expected tokens/s alone could stop on a tree the noise bar then refuses, or go on timing a race
        # whose choice (plain decoding) had long been settled.
        step = self.estimate()
        s = self.spreads(step)
        rates = {n: (self.taus[n] / step[n], s[n]) for n in self.cands}
        best, _ = clear_winner(1.0 / step[PLAIN], s[PLAIN], rates, varying=self.varying)
        return PLAIN if best is None else best

    def warnings(self, max_rounds: int, log: Callable[[str], None]) -> tuple[bool, list[str]]:
        """(whether the winner was stable, what the record warns of: noisy rounds, an unsettled winner)."""
        stable = len(self.winners) >= 2 and self.winners[-1] == self.winners[-2] or max_rounds == 1
        noisy = {name: (max(v) - min(v)) / statistics.median(v) for name, v in self.rounds.items()
                 if len(v) > 1 and statistics.median(v) > 0 and (not self.varying or name == PLAIN)}
        worst = max(noisy, key=noisy.get) if noisy else None
        out = []
        if worst is not None and noisy[worst] > NOISY_SPREAD:
            v = self.rounds[worst]
            out.append(f"step times varied between timing rounds ({worst}: {min(v) * 1e3:.1f}-{max(v) * 1e3:.1f} "
                       f"ms over {len(v)} rounds): the machine looks loaded, the choice may not be the best "
                       "one (rerun on an idle machine or with threads=1)")
        if not stable:
            out.append(f"the fastest candidate still changed after {len(self.winners)} timing rounds "
                       f"(winners by round: {', '.join(self.winners)}); kept the last one")
        for w in out:
            log(f"warning: {w}")
        return stable, out


def race(taus: dict[str, float], timer: Callable[[str], Sequence[float]], *, latency_steps: int, min_rounds: int,
         max_rounds: int, log: Callable[[str], None], progress: bool, what: str = "trees",
         label: Callable[[str], str] = str, varying: bool = False,
         by_mean: Collection[str] = ()) -> tuple[dict[str, float], dict[str, dict], dict]:
    """Time plain decoding (``PLAIN``, tau 1) and every candidate (name -> expected tau) in interleaved
    rounds until the choice (``clear_winner``: the best expected tokens/s that clears the timings' noise) is
    stable; ``timer(name)`` times one run of steps. Rounds continue, from ``min_rounds`` up to
    ``max_rounds``, until two consecutive rounds agree on the choice.

    Each candidate is timed between two runs of plain decoding (a round is plain, c1, plain, c2, ...,
    plain, the candidates' order rotated from round to round) and costed by its step over the mean of
    those two neighbours: a host whose speed drifts from one second to the next (a 2-core cloud machine's
    plain step moved 32 -> 57 ms within one evaluation, BENCHMARKS.md) moves both alike, so the ratio
    keeps what the candidate itself costs, where two medians taken at different moments once put a
    3-node tree below plain decoding and chose it. A candidate's step time is the median over rounds of
    that ratio times plain decoding's median step, and its spread is the ratio's.

    Returns (median step time per name, in s; each name's spread over rounds; the timing record, whose
    warnings are also logged). ``varying``: the candidates' work changes from step to step by itself
    (prompt lookup's proposals follow the text), so only plain decoding's spread says whether the
    machine is loaded, and a candidate's run is costed by its mean step (stalls dropped), which counts
    the costlier steps its median would pass over. ``by_mean``: the candidates costed by their mean step
    while the others keep their median (runs of a whole reply, whose step mix is the candidate's cost)."""
    if min_rounds < 1 or max_rounds < min_rounds:
        raise UserError(f"{what} timing needs 1 <= min_rounds <= max_rounds, got {min_rounds}, {max_rounds}")
    warnings = []
    load, cores = machine_load()
    if load is not None and load > cores:
        warnings.append(f"other processes keep {load:.1f} of {cores} cores busy before timing {what}: step times "
                        "may be noisy (rerun on an idle machine or with threads=1)")
        log(f"warning: {warnings[-1]}")
    state = _Rounds(taus, varying)
    cands = state.cands
    bar = progress_bar(progress, max_rounds * (2 * len(cands) + 1), f"timing {what}")

    def timed(name: str, r: int) -> float:
        if bar is not None:
            bar.set_description_str(f"timing {what}: round {r + 1}, {PLAIN if name == PLAIN else label(name)}")
        sec, n_dropped = robust_step(timer(name), mean=(varying or name in by_mean) and name != PLAIN)
        state.dropped[name] += n_dropped
        if bar is not None:
            bar.update(1)
        return sec

    try:
        for r in range(max_rounds):
            order = cands[r % len(cands):] + cands[:r % len(cands)] if cands else []
            plain_runs = [timed(PLAIN, r)]
            for name in order:
                sec = timed(name, r)
                plain_runs.append(timed(PLAIN, r))
                state.rounds[name].append(sec)
                state.ratios[name].append(sec / (0.5 * (plain_runs[-2] + plain_runs[-1])))
            state.rounds[PLAIN].append(statistics.median(plain_runs))
            state.winners.append(state.winner())
            if r + 1 >= min_rounds and len(state.winners) > 1 and state.winners[-1] == state.winners[-2]:
                break
    finally:
        if bar is not None:
            bar.close()
    stable, late = state.warnings(max_rounds, log)
    step = state.estimate()
    spreads = state.spreads(step)
    timing = {"rounds": len(state.winners), "min_rounds": min_rounds, "max_rounds": max_rounds,
              "steps_per_round": latency_steps, "winner_by_round": state.winners, "stable": stable,
              "paired": "each candidate costed against the plain runs just before and after it",
              "autoregressive": spreads[PLAIN],
              "load_average": None if load is None else round(load, 2), "cores": cores,
              "threads": torch.get_num_threads(), "warnings": warnings + late}
    return step, spreads, timing
