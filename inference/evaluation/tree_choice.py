"""Which tree Medusa decodes with, measured on this machine (``tree=auto`` / ``calibrated:N``).

Per-depth, per-rank head accuracy is measured on calibration prompts (held out from the
evaluated ones, ``measure_head_accuracy``); a tree is grown greedily for each node budget; each
candidate's verification-step latency is measured on this device (``measure_step_latency``);
the tree maximising expected tau / step time wins — or none, when no tree beats plain
decoding's rate (weak heads must never make decoding slower).

The machine may be shared: step times are taken in repeated interleaved rounds until the winner
is stable, stalls and noisy rounds are discounted by medians, and the spread is recorded
(``race``, shared by both choices below).

Method eagle3 (``eagle_tree=auto``) is chosen by the same rule (``choose_eagle3``): its dynamic
trees have no fixed node values to add up, so each candidate (nodes, depth, topk) of a small grid
gets its tau measured by greedy decoding of the calibration prompts instead.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from ..errors import UserError
from ..methods import generate, registry
from ..runtime.model import MedusaModel
from ..runtime.tree import MAX_TREE_NODES, MedusaTree, grow_tree, resolve_tree
from ..runtime.verify import SamplingConfig

DEFAULT_BUDGETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


# -- calibration --------------------------------------------------------------------------
@dataclass
class HeadAccuracy:
    """How often head k's rank-r guess equals the backbone's own greedy token (k+2 ahead)."""

    hits: torch.Tensor    # [K, topk] long
    totals: torch.Tensor  # [K] long: positions evaluated per head

    @property
    def per_rank(self) -> torch.Tensor:
        """[K, topk]: P(rank r is right); the matrix ``tree.grow_tree`` takes."""
        return self.hits.double() / self.totals.clamp(min=1)[:, None].double()

    @property
    def topk(self) -> torch.Tensor:
        """[K, topk]: cumulative top-k accuracy."""
        return self.per_rank.cumsum(1)

    def to_dict(self) -> dict:
        return {"per_rank": self.per_rank.tolist(), "topk": self.topk.tolist(),
                "totals": self.totals.tolist()}


@torch.inference_mode()
def measure_head_accuracy(m: MedusaModel, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 64,
                          topk: int = 10, progress: Optional[Callable[[int, int], None]] = None) -> HeadAccuracy:
    """Per-head, per-rank accuracy against the backbone's greedy continuation of each prompt.

    For every position t from the last prompt token on, head k's top-k at t is compared with
    the greedy token at t+k+2 (the backbone's own output, not the dataset's text: what
    greedy Medusa decoding will have to match). Dependent heads are fed the greedy tokens
    t+1..t+k+1 (the path they extend when every earlier guess was right), so their accuracy
    is conditional on a correct prefix, which is what a tree node's value multiplies.
    """
    if m.heads is None:
        raise UserError("this model has no Medusa heads to calibrate")
    k_heads = m.num_heads
    out_size = getattr(m.heads.spec, "output_size", m.vocab_size)
    if not 1 <= topk <= out_size:
        raise UserError(f"topk must be in 1..{out_size}, got {topk}")
    if not prompts:
        raise UserError("calibration needs at least one prompt")
    hits = torch.zeros(k_heads, topk, dtype=torch.long)
    totals = torch.zeros(k_heads, dtype=torch.long)
    for i, prompt in enumerate(prompts):
        gen = generate(m, list(prompt), "autoregressive", max_new_tokens=max_new_tokens)
        seq = list(prompt) + gen.tokens
        n0, n = len(prompt), len(seq)
        ids = torch.tensor([seq], device=m.device)
        h = m.hidden(ids, torch.arange(n, device=m.device)[None], m.new_cache(n))[0]
        for k in range(k_heads):
            t = torch.arange(n0 - 1, n - k - 2, device=m.device)   # positions with a target in range
            if t.numel() == 0:
                continue
            future = ids[0, t[:, None] + 1 + torch.arange(k + 1, device=m.device)]  # x_{t+1..t+k+1}
            logits = m.heads.path_logits(h[t], future, k)
            guesses = m.heads.to_vocab_ids(logits.topk(topk, dim=-1).indices)
            target = ids[0, t + k + 2]
            hits[k] += (guesses == target[:, None]).sum(0).cpu()
            totals[k] += t.numel()
        if progress is not None:
            progress(i + 1, len(prompts))
    return HeadAccuracy(hits, totals)


def calibrated_tree(m: MedusaModel, prompts: Sequence[Sequence[int]], num_nodes: int, *, max_new_tokens: int = 64,
                    topk: int = 10, name: Optional[str] = None) -> tuple[MedusaTree, float, HeadAccuracy]:
    """Measure the heads on ``prompts`` and grow the best tree of ``num_nodes`` tokens (root
    included) for them; returns (tree, expected tau, the measured accuracies)."""
    if num_nodes < 1:
        raise UserError(f"a tree has at least 1 node (the root), got {num_nodes}")
    acc = measure_head_accuracy(m, prompts, max_new_tokens=max_new_tokens, topk=topk)
    tree, tau = grow_tree(acc.per_rank, num_nodes - 1, name=name or f"calibrated{num_nodes}")
    return tree, tau, acc


# -- measurement --------------------------------------------------------------------------
OUTLIER_FACTOR = 3.0  # a step slower than this many times its run's median is a stall, not the step's cost
NOISY_SPREAD = 0.5    # (max - min) / median over rounds above this: the timings are too noisy to trust


def step_times(m: MedusaModel, prompt_ids: Sequence[int], tree: Optional[MedusaTree], *, steps: int = 8,
               warmup: int = 2, sampling: Optional[SamplingConfig] = None) -> list[float]:
    """Wall time (s) of each of ``steps`` decoding steps after ``warmup`` ones, on one prompt, EOS
    ignored: Medusa steps (heads + tree forward + verify + compaction) with ``tree``, plain
    autoregressive steps with ``tree=None``. The one place decoding is timed for the tree choice."""
    if tree is None:
        out = generate(m, list(prompt_ids), "autoregressive", max_new_tokens=warmup + steps + 1, eos_token_ids=())
    else:
        out = generate(m, list(prompt_ids), tree=tree, max_new_tokens=(warmup + steps + 1) * (tree.max_depth + 1),
                       sampling=sampling, eos_token_ids=(), max_steps=warmup + steps, seed=0)
    times = list(out.step_s)
    return times[warmup:] if len(times) > warmup else times


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


def measure_step_latency(m: MedusaModel, input_ids, trees: Sequence, *, steps: int = 8, warmup: int = 2,
                         sampling: Optional[SamplingConfig] = None) -> dict[str, float]:
    """Median wall time of one Medusa step per tree (stalls dropped: ``robust_step``), keyed by tree name."""
    result = {}
    for spec in trees:
        tree = resolve_tree(spec, m.num_heads)
        result[tree.name or f"{tree.num_nodes} nodes"] = robust_step(
            step_times(m, input_ids, tree, steps=steps, warmup=warmup, sampling=sampling))[0]
    return result


def _median_ar_step(m: MedusaModel, prompt_ids: list[int], steps: int = 8) -> float:
    return robust_step(step_times(m, prompt_ids, None, steps=steps))[0]


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


@dataclass
class TreeChoice:
    tree: Optional[MedusaTree]  # None: plain decoding is faster than any tree on this machine
    reason: str
    accuracies: Optional[list] = None  # [K][rank] measured on calibration prompts
    candidates: list = field(default_factory=list)  # {name, nodes, expected_tau, step_ms (+ spread), rate}
    autoregressive_step_ms: float = 0.0
    timing: dict = field(default_factory=dict)  # rounds, plain decoding's spread, load, warnings

    def to_dict(self) -> dict:
        t = self.tree
        out = {"name": t.name if t is not None else "none (plain decoding)",
               "nodes": t.num_nodes if t is not None else 0,
               "choices": t.choices if t is not None else [],
               "reason": self.reason, "candidates": self.candidates,
               "autoregressive_step_ms": self.autoregressive_step_ms}
        if self.timing:
            out["timing"] = self.timing
        return out


def calibrated_choice(tree_setting: str) -> Optional[int]:
    """N for ``tree=calibrated:N`` (grow the best N-node tree from measured accuracy and use it
    whatever its speed: the same node budget for every set of heads being compared), else None."""
    if not isinstance(tree_setting, str) or not tree_setting.startswith("calibrated:"):
        return None
    n = tree_setting.split(":", 1)[1]
    if not n.isdigit() or not 2 <= int(n) <= MAX_TREE_NODES:
        raise UserError(f"tree=calibrated:N needs N >= 2 nodes (root included), at most {MAX_TREE_NODES}, "
                        f"got {tree_setting!r}")
    return int(n)


PLAIN = "plain decoding"


def _bar(progress: bool, total: Optional[int], desc: str):
    if not progress:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="step" if total is None else "it", dynamic_ncols=True, leave=False)


def race(taus: dict[str, float], timer: Callable[[str], Sequence[float]], *, latency_steps: int, min_rounds: int,
         max_rounds: int, log: Callable[[str], None], progress: bool, what: str = "trees",
         label: Callable[[str], str] = str, varying: bool = False) -> tuple[dict[str, float], dict[str, dict], dict]:
    """Time plain decoding (``PLAIN``, tau 1) and every candidate (name -> expected tau) in interleaved
    rounds until the choice (``clear_winner``: the best expected tokens/s that clears the timings' noise) is
    stable (``choose_tree``'s docstring); ``timer(name)`` times one run of steps.

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
    the costlier steps its median would pass over."""
    if min_rounds < 1 or max_rounds < min_rounds:
        raise UserError(f"{what} timing needs 1 <= min_rounds <= max_rounds, got {min_rounds}, {max_rounds}")
    warnings = []
    load, cores = machine_load()
    if load is not None and load > cores:
        warnings.append(f"other processes keep {load:.1f} of {cores} cores busy before timing {what}: step times "
                        "may be noisy (rerun on an idle machine or with threads=1)")
        log(f"warning: {warnings[-1]}")
    cands = [n for n in taus if n != PLAIN]
    names = [PLAIN] + cands
    rounds: dict[str, list[float]] = {name: [] for name in names}  # raw step per round (plain: the round's median)
    ratios: dict[str, list[float]] = {name: [] for name in cands}  # step / its two plain neighbours' mean
    dropped = dict.fromkeys(names, 0)
    winners: list[str] = []

    def estimate() -> dict[str, float]:
        plain = statistics.median(rounds[PLAIN])
        return {PLAIN: plain, **{n: statistics.median(ratios[n]) * plain for n in cands}}

    def spreads_now(step: dict[str, float]) -> dict[str, dict]:
        out = {PLAIN: spread(rounds[PLAIN], dropped[PLAIN])}
        for n in cands:
            out[n] = {**spread([r * step[PLAIN] for r in ratios[n]], dropped[n]),
                      "vs_plain_step": round(statistics.median(ratios[n]), 6),
                      "vs_plain_by_round": [round(r, 6) for r in ratios[n]]}
        return out

    def winner(step: dict[str, float]) -> str:
        # The same rule as the final choice (clear_winner, on the rounds so far): a stop rule that ranked by
        # expected tokens/s alone could stop on a tree the noise bar then refuses, or go on timing a race
        # whose choice (plain decoding) had long been settled.
        s = spreads_now(step)
        rates = {n: (taus[n] / step[n], s[n]) for n in cands}
        best, _ = clear_winner(1.0 / step[PLAIN], s[PLAIN], rates, varying=varying)
        return PLAIN if best is None else best

    def timed(name: str, r: int) -> float:
        if bar is not None:
            shown = PLAIN if name == PLAIN else label(name)
            bar.set_description_str(f"timing {what}: round {r + 1}, {shown}")
        sec, n_dropped = robust_step(timer(name), mean=varying and name != PLAIN)
        dropped[name] += n_dropped
        if bar is not None:
            bar.update(1)
        return sec

    bar = _bar(progress, max_rounds * (2 * len(cands) + 1), f"timing {what}")
    try:
        for r in range(max_rounds):
            order = cands[r % len(cands):] + cands[:r % len(cands)] if cands else []
            plain_runs = [timed(PLAIN, r)]
            for name in order:
                sec = timed(name, r)
                plain_runs.append(timed(PLAIN, r))
                rounds[name].append(sec)
                ratios[name].append(sec / (0.5 * (plain_runs[-2] + plain_runs[-1])))
            rounds[PLAIN].append(statistics.median(plain_runs))
            winners.append(winner(estimate()))
            if r + 1 >= min_rounds and len(winners) > 1 and winners[-1] == winners[-2]:
                break
    finally:
        if bar is not None:
            bar.close()
    stable = len(winners) >= 2 and winners[-1] == winners[-2] or max_rounds == 1
    noisy = {name: (max(v) - min(v)) / statistics.median(v) for name, v in rounds.items()
             if len(v) > 1 and statistics.median(v) > 0 and (not varying or name == PLAIN)}
    worst = max(noisy, key=noisy.get) if noisy else None
    if worst is not None and noisy[worst] > NOISY_SPREAD:
        v = rounds[worst]
        warnings.append(f"step times varied between timing rounds ({worst}: {min(v) * 1e3:.1f}-{max(v) * 1e3:.1f} "
                        f"ms over {len(v)} rounds): the machine looks loaded, the choice may not be the best "
                        "one (rerun on an idle machine or with threads=1)")
        log(f"warning: {warnings[-1]}")
    if not stable:
        warnings.append(f"the fastest candidate still changed after {len(winners)} timing rounds "
                        f"(winners by round: {', '.join(winners)}); kept the last one")
        log(f"warning: {warnings[-1]}")
    step = estimate()
    spreads = spreads_now(step)
    timing = {"rounds": len(winners), "min_rounds": min_rounds, "max_rounds": max_rounds,
              "steps_per_round": latency_steps, "winner_by_round": winners, "stable": stable,
              "paired": "each candidate costed against the plain runs just before and after it",
              "autoregressive": spreads[PLAIN],
              "load_average": None if load is None else round(load, 2), "cores": cores,
              "threads": torch.get_num_threads(), "warnings": warnings}
    return step, spreads, timing


def choose_tree(m: MedusaModel, calibration: Sequence[Sequence[int]], latency_prompt: Sequence[int], *,
                budgets: Sequence[int] = DEFAULT_BUDGETS, calibration_tokens: int = 48, topk: int = 10,
                latency_steps: int = 6, min_rounds: int = 3, max_rounds: int = 8,
                log: Callable[[str], None] = print, fixed_nodes: Optional[int] = None,
                progress: bool = False) -> TreeChoice:
    """Grow a tree per budget from measured accuracy; keep the one with the best tau / step time.
    With ``fixed_nodes`` grow that one tree and keep it (no latency measurement).

    Step times are measured in rounds (``race``): each round times every candidate once, in an order
    rotated from round to round, each between two runs of plain decoding, and costs it by its step over
    theirs, so background load and a host's drifting speed hit both sides alike. A candidate's step time
    is the median over rounds of that ratio times plain decoding's median step (steps slower than
    ``OUTLIER_FACTOR`` x their run's median dropped as stalls). Rounds continue, from ``min_rounds`` up
    to ``max_rounds``, until two consecutive rounds agree on the choice (``clear_winner`` on the rounds so
    far, the rule the final choice applies). Each candidate's spread over rounds goes into the choice
    (report.json's ``tree``): a tree must beat plain decoding by more than that spread
    (``clear_winner``); a visibly loaded machine (load average above the cores, or a spread above
    ``NOISY_SPREAD``) gets a one-line warning."""
    if min_rounds < 1 or max_rounds < min_rounds:
        raise UserError(f"tree timing needs 1 <= min_rounds <= max_rounds, got {min_rounds}, {max_rounds}")
    bar = _bar(progress, len(calibration), "calibrating heads")

    def calibrated(i: int, n: int) -> None:
        if bar is not None:
            bar.set_description_str(f"calibrating heads: prompt {i}/{n}")
            bar.update(1)

    try:
        acc = measure_head_accuracy(m, calibration, max_new_tokens=calibration_tokens, topk=topk, progress=calibrated)
    finally:
        if bar is not None:
            bar.close()
    per_rank = acc.per_rank.tolist()
    if fixed_nodes is not None:
        tree, tau = grow_tree(per_rank, fixed_nodes - 1, name=f"calibrated{fixed_nodes}", fill=True)
        log(f"  tree {tree.name}: {tree.num_nodes} nodes, expected tau {tau:.3f} (fixed budget)")
        return TreeChoice(tree, f"fixed budget of {fixed_nodes} nodes grown from measured accuracy", per_rank,
                          [{"name": tree.name, "nodes": tree.num_nodes, "expected_tau": round(tau, 4)}])
    trees = []
    seen = set()
    for b in sorted(set(budgets)):
        tree, tau = grow_tree(per_rank, b)
        tree.name = f"auto{len(tree.paths)}"   # the nodes it has (root excluded): growth stops at value 0
        key = tuple(map(tuple, tree.choices))
        if tree.num_nodes == 0 or key in seen:
            continue
        seen.add(key)
        trees.append((tree, tau))
    by_name = {PLAIN: None, **{t.name: t for t, _ in trees}}
    prompt = list(latency_prompt)
    step, spreads, timing = race({t.name: tau for t, tau in trees},
                                 lambda name: step_times(m, prompt, by_name[name], steps=latency_steps),
                                 latency_steps=latency_steps, min_rounds=min_rounds, max_rounds=max_rounds, log=log,
                                 progress=progress, what="trees", label=lambda name: f"tree {name}")
    ar_step = step[PLAIN]
    cands, rates = [], {}
    for tree, tau in trees:
        rate = rates[tree.name] = tau / step[tree.name]
        cands.append({"name": tree.name, "nodes": tree.num_nodes, "expected_tau": round(tau, 4),
                      **spreads[tree.name], "expected_tokens_per_s": round(rate, 2)})
        log(f"  tree {tree.name:>7}: {tree.num_nodes:>2} nodes, expected tau {tau:.3f}, "
            f"step {step[tree.name] * 1e3:.1f} ms -> {rate:.1f} tok/s expected")
    log(f"  plain decoding: step {ar_step * 1e3:.1f} ms -> {1 / ar_step:.1f} tok/s")
    name, why = clear_winner(1.0 / ar_step, spreads[PLAIN], {n: (r, spreads[n]) for n, r in rates.items()})
    tree = by_name[name] if name is not None else None
    reason = f"best expected tau / step time ({why})" if tree is not None else why
    return TreeChoice(tree, reason, per_rank, cands, round(ar_step * 1e3, 2), timing)


# -- EAGLE-3's dynamic trees (method eagle3, eagle_tree=auto) -------------------------------------
# (nodes N, depth D, top-k k): one, two or four depth-1 guesses (no expansion call: the catch-up call
# that every step makes already drafts them; they pay for drafters trained one step deep, whose deeper
# drafts are rarely right), chains, then trees of growing width. On a CPU with the prepacked kernels
# (runtime/linear_kernels.py) a 3-8-node verification costs ~1.2-1.4x a 1-token step (16 nodes ~1.75x),
# so wide shallow trees are cheap; EAGLE-2's own default is about (59, 6, 10), sized for a GPU. A fourth
# element is a probability floor (eagle_min_prob): of the N nodes, only those the drafter rates at least
# that likely are verified, so a step verifies 2 rows where the drafter is sure and up to N + 1 where it
# hesitates (on a CPU each row costs ~7% of a step; on a GPU the race will prefer the shapes without it).
EAGLE3_GRID = ((1, 1, 1), (2, 1, 2), (4, 1, 4), (4, 1, 4, 0.1), (2, 2, 1), (3, 2, 2), (8, 2, 4), (8, 2, 4, 0.1),
               (4, 4, 1), (4, 3, 2), (8, 4, 4), (16, 5, 4), (32, 6, 8))


@dataclass
class Eagle3Choice:
    """(nodes, depth, topk[, min_prob]) for method eagle3, or None: plain decoding is faster on this machine."""

    shape: Optional[tuple]
    reason: str
    candidates: list = field(default_factory=list)  # {name, nodes, depth, topk, measured_tau, step_ms (+ spread), rate}
    autoregressive_step_ms: float = 0.0
    timing: dict = field(default_factory=dict)

    def options(self) -> dict:
        """The eagle3 option fields this choice sets (nodes=0: plain decoding)."""
        return {**eagle3_fields(self.shape or (0, 1, 1)), "tree": "fixed"}

    def to_dict(self) -> dict:
        out = {"name": eagle3_name(self.shape) if self.shape else "none (plain decoding)",
               **eagle3_fields(self.shape or (0, 0, 0)), "reason": self.reason, "candidates": self.candidates,
               "autoregressive_step_ms": self.autoregressive_step_ms}
        if self.timing:
            out["timing"] = self.timing
        return out


# A shape's elements past (nodes, depth, topk), each None or absent = the options' own value: the probability
# floor, then for methods with a looked-up branch its tokens (0: the drafter alone) and its switch
_OPTIONAL_FIELDS = ("min_prob", "num_tokens", "switch")


def eagle3_fields(shape: tuple) -> dict:
    """The option fields a grid shape sets: (nodes, depth, topk), then those of min_prob, num_tokens and
    switch it gives (a shape without them keeps the options' own)."""
    out = {"nodes": shape[0], "depth": shape[1], "topk": shape[2]}
    out.update({k: v for k, v in zip(_OPTIONAL_FIELDS, shape[3:]) if v is not None})
    return out


def eagle3_name(shape: tuple) -> str:
    """A shape's name, as ``Eagle3Options.label`` names the same setting: n4-d1-k4, n4-d1-k4-p0.1; with a
    looked-up branch's fields: n4-d1-k4-t0 (the drafter alone), n4-d1-k4-s3 (switching), lookup-only."""
    f = eagle3_fields(shape)
    if not f["nodes"]:
        return "none (plain decoding)" if f.get("num_tokens") == 0 else "lookup-only"
    name = "n{}-d{}-k{}".format(*shape[:3]) + (f"-p{f['min_prob']:g}" if f.get("min_prob") else "")
    return name + "".join(f"-{tag}{f[k]}" for tag, k in (("t", "num_tokens"), ("s", "switch")) if k in f)


def eagle3_step_times(m: MedusaModel, prompt_ids: Sequence[int], shape: Optional[tuple], *,
                      steps: int = 8, warmup: int = 2, method: str = "eagle3", options=None) -> list[float]:
    """``step_times`` for ``method`` (eagle3, or eagle3_lookup with ``options``' lookup settings) with
    (nodes, depth, topk[, min_prob]) = ``shape`` (None: plain decoding)."""
    if shape is None:
        return step_times(m, prompt_ids, None, steps=steps, warmup=warmup)
    extra = getattr(options, "num_tokens", 0)          # a looked-up chain deepens a step's tree
    out = generate(m, list(prompt_ids), method, options=options, **eagle3_fields(shape), tree="fixed",
                   eos_token_ids=(), max_new_tokens=(warmup + steps + 1) * (shape[1] + extra + 1),
                   max_steps=warmup + steps, seed=0)
    times = list(out.step_s)
    return times[warmup:] if len(times) > warmup else times


def measure_eagle3_tau(m: MedusaModel, prompts: Sequence[Sequence[int]], shape: tuple, *,
                       max_new_tokens: int = 48, method: str = "eagle3", options=None,
                       step_s: Optional[list[float]] = None) -> float:
    """Tokens per step of greedy ``method`` decoding with ``shape`` over ``prompts``: a dynamic tree has
    no fixed node values to add up, so its expected tau is measured by decoding. ``step_s``: a list that
    gets every step's wall time (``mean_over_median``)."""
    tokens = steps = 0
    for p in prompts:
        out = generate(m, list(p), method, options=options, **eagle3_fields(shape), tree="fixed",
                       max_new_tokens=max_new_tokens)
        tokens, steps = tokens + sum(out.accept_lengths), steps + out.steps
        if step_s is not None:
            step_s += out.step_s
    return tokens / steps if steps else 1.0


def mean_over_median(times: Sequence[float]) -> float:
    """Mean step over median step of one decoding (stalls dropped as ``robust_step`` drops them): what a
    method whose steps differ by themselves costs per step beyond its typical step. ``eagle3_lookup``
    verifies its looked-up chain on some steps only (~15% on MT-Bench, each ~1.3x a step without it), so
    the race's median step is a step without one, and tau / median would count the chains' tokens and
    not their cost."""
    mid = statistics.median(times) if times else 0.0
    kept = [t for t in times if t <= OUTLIER_FACTOR * mid]
    return statistics.mean(kept) / mid if kept and mid > 0 else 1.0


def choose_eagle3(m: MedusaModel, calibration: Sequence[Sequence[int]], latency_prompt: Sequence[int], *,
                  grid: Sequence[tuple] = EAGLE3_GRID, calibration_tokens: int = 48,
                  latency_steps: int = 6, min_rounds: int = 3, max_rounds: int = 8,
                  log: Callable[[str], None] = print, progress: bool = False, method: str = "eagle3",
                  options=None) -> Eagle3Choice:
    """``choose_tree``'s rule for method eagle3: each (nodes, depth, topk[, min_prob]) of ``grid``'s tau is measured
    by greedy decoding of the calibration prompts, its step time in ``race``'s interleaved rounds
    against plain decoding; the best expected tokens/s wins, plain decoding when nothing beats it by more
    than the timings' spread (``clear_winner``). ``method="eagle3_lookup"`` (with ``options``, whose
    lookup settings are kept) races the same shapes with the looked-up branch on: its choice None sets
    eagle_nodes=0, which that method decodes as prompt lookup alone."""
    if not calibration:
        raise UserError("choosing eagle3's tree needs at least one calibration prompt")
    # a combined method races its parts too (eagle3_lookup: the lookup alone, the drafter alone, switching)
    parts = getattr(options, "part_shapes", None)
    grid = tuple(grid) + (tuple(parts()) if parts is not None else ())
    shapes = {eagle3_name(s): tuple(s) for s in dict.fromkeys(tuple(s) for s in grid)}
    bar = _bar(progress, len(shapes), f"calibrating {method}")
    taus, mix = {}, {}
    try:
        for i, (name, shape) in enumerate(shapes.items()):
            if bar is not None:
                bar.set_description_str(f"calibrating {method}: {name} ({i + 1}/{len(shapes)})")
            calibration_steps: list[float] = []
            taus[name] = measure_eagle3_tau(m, calibration, shape, max_new_tokens=calibration_tokens,
                                            method=method, options=options, step_s=calibration_steps)
            # a looked-up branch or a probability floor: the setting's steps differ in the rows they verify
            setting = registry.make_options(method, options, **eagle3_fields(shape), tree="fixed")
            mix[name] = mean_over_median(calibration_steps) if setting.steps_vary else 1.0
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    prompt = list(latency_prompt)
    step, spreads, timing = race(taus, lambda name: eagle3_step_times(m, prompt, shapes.get(name),
                                                                      steps=latency_steps, method=method,
                                                                      options=options),
                                 latency_steps=latency_steps, min_rounds=min_rounds, max_rounds=max_rounds, log=log,
                                 progress=progress, what=f"{method} trees")
    ar_step = step[PLAIN]
    # the race times one prompt's steps; a branch's share of costlier steps comes from the calibration
    # prompts, the same decodes that gave tau (their mean / median step, measured within each decode set)
    step = {name: sec * mix.get(name, 1.0) for name, sec in step.items()}
    cands, rates = [], {}
    for name, shape in shapes.items():
        rates[name] = taus[name] / step[name]
        cands.append({"name": name, **eagle3_fields(shape), "measured_tau": round(taus[name], 4), **spreads[name],
                      "mean_over_median_step": round(mix[name], 4),
                      "expected_tokens_per_s": round(rates[name], 2)})
        log(f"  {method} {name:>11}: tau {taus[name]:.3f} (measured), step {step[name] * 1e3:.1f} ms -> "
            f"{rates[name]:.1f} tok/s expected")
    log(f"  plain decoding: step {ar_step * 1e3:.1f} ms -> {1 / ar_step:.1f} tok/s")
    name, why = clear_winner(1.0 / ar_step, spreads[PLAIN], {n: (rates[n], spreads[n]) for n in shapes})
    reason = f"best measured tau / step time ({why})" if name is not None else why
    # plain decoding, as these options write it (eagle3: nodes=0; a method with a branch: that off too)
    plain = getattr(options, "plain_shape", None)
    chosen = shapes[name] if name is not None else (plain if plain is not None else None)
    return Eagle3Choice(chosen, reason, cands, round(ar_step * 1e3, 2), timing)
