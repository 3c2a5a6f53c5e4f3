"""Method medusa's speculation shape: which Medusa tree to decode with, measured on this machine
(``choice=auto``; ``tree=calibrated:N`` grows one N-node tree; a named tree is used as given).

Per-depth, per-rank head accuracy is measured on calibration prompts (held out from the evaluated
ones, ``measure_head_accuracy``); a tree is grown greedily for each node budget; each candidate's
verification-step latency is measured on this device (``step_times``) in ``runtime.race``'s
interleaved rounds; the tree maximising expected tau / step time wins, or none, when no tree beats
plain decoding's rate (weak heads must never make decoding slower).

Batched (``MedusaTreeShape.size``): small trees grown from the measured accuracy and top-1 chains,
which stop paying later than trees because every node sits on the one path most likely accepted,
each timed per batch size (``runtime.sizing``). ``medusa`` and ``medusa_lookup`` share the choice.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Optional, Sequence

import torch

from ..errors import UserError
from ..runtime.model import MedusaModel
from ..runtime.race import PLAIN, clear_winner, progress_bar, race, robust_step
from ..runtime.sizing import DEFAULT_BATCH_SIZES, BatchSizing, size_speculation
from ..runtime.speculation import SpeculationSchedule
from ..runtime.tree import (MAX_TREE_NODES, MedusaTree, chain_tree, expected_tau, grow_tree, refuse_oversized,
                            refuse_rootless, resolve_tree)
from ..runtime.verify import SamplingConfig
from .registry import generate, get
from .shape import DEFAULT_BUDGETS, ChoiceContext, Chosen, SpeculationShape

BATCH_BUDGETS = (1, 2, 3, 4, 8)   # draft nodes of the grown candidate trees at batch sizes (root not counted)
BATCH_CHAINS = (2, 3)             # chain lengths (root included)

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



def measure_step_latency(m: MedusaModel, input_ids, trees: Sequence, *, steps: int = 8, warmup: int = 2,
                         sampling: Optional[SamplingConfig] = None) -> dict[str, float]:
    """Median wall time of one Medusa step per tree (stalls dropped: ``robust_step``), keyed by tree name."""
    result = {}
    for spec in trees:
        tree = resolve_tree(spec, m.num_heads, rootless_ok=True)   # tree1: a 1-token step, the cost compared with
        result[tree.name or f"{tree.num_nodes} nodes"] = robust_step(
            step_times(m, input_ids, tree, steps=steps, warmup=warmup, sampling=sampling))[0]
    return result



@dataclass
class TreeChoice:
    tree: Optional[MedusaTree]  # None: no tree pays on this machine (plain decoding; medusa_lookup: lookup alone)
    reason: str
    accuracies: Optional[list] = None  # [K][rank] measured on calibration prompts
    candidates: list = field(default_factory=list)  # {name, nodes, expected_tau, step_ms (+ spread), rate}
    autoregressive_step_ms: Optional[float] = None   # None: not measured (a given choice)
    timing: dict = field(default_factory=dict)  # rounds, plain decoding's spread, load, warnings

    def to_dict(self) -> dict:
        t = self.tree
        out = {"name": t.name if t is not None else "none (no tree)",   # a grafting method still proposes its own
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
    bar = progress_bar(progress, len(calibration), "calibrating heads")

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
        if tree.num_nodes <= 1 or key in seen:   # the root alone drafts nothing: plain decoding is raced anyway
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


def candidate_trees(per_rank, num_heads: int, budgets: Sequence[int] = BATCH_BUDGETS,
                    chains: Sequence[int] = BATCH_CHAINS) -> list[tuple[MedusaTree, float]]:
    """Distinct trees grown for ``budgets`` and top-1 chains of ``chains`` tokens, with expected tau."""
    out, seen = [], set()
    for b in sorted(set(budgets)):
        tree, tau = grow_tree(per_rank, b)
        tree.name = f"auto{len(tree.paths)}"   # the nodes it has (root excluded): growth stops at value 0
        out.append((tree, tau))
    for n in chains:
        if n - 1 <= num_heads:
            tree = chain_tree(n)
            out.append((tree, expected_tau(tree, per_rank)))
    unique = []
    for tree, tau in out:
        key = tuple(map(tuple, tree.choices))
        if tree.num_nodes > 1 and key not in seen:
            seen.add(key)
            unique.append((tree, tau))
    return unique


def choose_schedule(m: MedusaModel, per_rank, latency_prompts: Sequence[Sequence[int]],
                    batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES, *, drafter: Callable, budgets: Sequence[int] = BATCH_BUDGETS,
                    chains: Sequence[int] = BATCH_CHAINS, **timing) -> BatchSizing:
    """Medusa heads: the tree per batch size, from the heads' measured per-rank accuracy (module docstring);
    ``drafter(m, tree)``: the batched drafter a tree (None: plain steps) is timed with."""
    if m.heads is None:
        raise UserError("sizing speculation per batch needs Medusa heads (heads=<export directory>)")
    cands = {t.name: (t, tau) for t, tau in candidate_trees(per_rank, m.num_heads, budgets, chains)}
    return size_speculation(m, cands, lambda tree: drafter(m, tree), latency_prompts, batch_sizes,
                            what="speculation", **timing)


def _accuracy_report(per_rank: list, calibration: int) -> dict:
    return {"head_accuracy": {"per_rank": per_rank, "topk": torch.tensor(per_rank).cumsum(1).tolist(),
                              "measured_on": f"{calibration} calibration prompts (backbone greedy tokens)"}}


class MedusaTreeShape(SpeculationShape):
    """The Medusa tree of every method that decodes one (options field ``tree``): one choice, shared by them
    (module docstring). ``drafter(m, tree)``: the batched drafter a candidate is timed with."""

    noun = "tree"
    fixed_by = ("tree",)   # a tree named on the command line (tree=tree8, a file, calibrated:N) is used as given

    def __init__(self, drafter: Callable):
        self.drafter = drafter

    def group(self, method: str) -> str:
        return "medusa tree"

    def calibrates(self, options, mode: str, batched: bool) -> bool:
        return mode == "auto" or calibrated_choice(options.tree) is not None

    def reads_budgets(self, options, mode: str, batched: bool) -> bool:
        # one prompt at a time only: the batched sizing grows its own candidates (BATCH_BUDGETS), and a node
        # count given (tree=calibrated:N) grows that one tree
        return mode == "auto" and not batched and calibrated_choice(options.tree) is None

    def choose(self, ctx: ChoiceContext, method: str, options, mode: str) -> Chosen:
        nodes = calibrated_choice(options.tree)
        if mode == "auto" or nodes is not None:
            ctx.log(f"choosing the tree: head accuracy on {len(ctx.calibration)} calibration prompts, step latency "
                    "on this device")
            choice = choose_tree(ctx.m, ctx.calibration, ctx.calibration[0], budgets=ctx.budgets,
                                 calibration_tokens=ctx.calibration_tokens, log=ctx.log, fixed_nodes=nodes,
                                 progress=ctx.progress)
        else:
            choice = TreeChoice(self.fixed_choice(options, ctx.m), "given")
        ctx.log(f"tree: {choice.to_dict()['name']} ({choice.reason})")
        report = {"tree": choice.to_dict()}
        if choice.accuracies is not None:
            report.update(_accuracy_report(choice.accuracies, len(ctx.calibration)))
            if choice.tree is not None:
                report["tree"]["expected_tau"] = round(expected_tau(choice.tree, choice.accuracies), 4)
        return Chosen(replace(options, tree=choice.tree), SpeculationSchedule({1: choice.tree}), report["tree"], report,
                      report["tree"]["name"], choice.reason, measured=choice.reason != "given")

    def size(self, ctx: ChoiceContext, method: str, options, mode: str, sizes: Sequence[int]) -> Chosen:
        nodes = calibrated_choice(options.tree)
        if mode != "auto" and nodes is None:
            schedule = options.tree if isinstance(options.tree, SpeculationSchedule) else \
                SpeculationSchedule({b: self.fixed_choice(options, ctx.m) for b in sizes})
            return Chosen(replace(options, tree=schedule), schedule,
                          {"tree": "given", "schedule": schedule.to_dict(), "sizing": None})
        if nodes is not None:
            choice = choose_tree(ctx.m, ctx.calibration, ctx.calibration[0], calibration_tokens=ctx.calibration_tokens,
                                 log=ctx.log, fixed_nodes=nodes, progress=ctx.progress)
            schedule = SpeculationSchedule({b: choice.tree for b in sizes})
            return Chosen(replace(options, tree=schedule), schedule,
                          {"tree": options.tree, "schedule": schedule.to_dict(), "sizing": None},
                          _accuracy_report(choice.accuracies, len(ctx.calibration)), choice.tree.name, choice.reason,
                          measured=True)
        ctx.log(f"choosing the speculation per batch size: head accuracy on {len(ctx.calibration)} calibration "
                "prompts, batch step latency on this device")
        per_rank = measure_head_accuracy(ctx.m, ctx.calibration, max_new_tokens=ctx.calibration_tokens).per_rank.tolist()
        # batch 1 is always sized too: the last rows of a batch decode alone once the others have finished
        sizing = choose_schedule(ctx.m, per_rank, ctx.latency, sorted({1, *sizes}), drafter=self.drafter, log=ctx.log,
                                 progress=ctx.progress)
        ctx.log("speculation per batch size: " + ", ".join(f"{b}: {t}" for b, t in sizing.schedule.to_dict().items()))
        return Chosen(replace(options, tree=sizing.schedule), sizing.schedule,
                      {"tree": "auto", "schedule": sizing.schedule.to_dict(), "sizing": sizing.to_dict()},
                      _accuracy_report(per_rank, len(ctx.calibration)), "per batch size",
                      "sized per batch size on this machine", measured=True)

    def fixed_choice(self, options, heads=None):
        tree = options.tree
        if tree == "auto":
            raise UserError("tree=auto is gone: give choice=auto (a tree measured on this machine), or name a tree "
                            "(tree=tree8, a tree file, calibrated:N)")
        if tree is None or isinstance(tree, MedusaTree):
            return tree
        if isinstance(tree, SpeculationSchedule):   # a schedule given (a choice file): its smallest batch size's
            return tree.choices[min(tree.choices)]
        return resolve_tree(tree, heads.num_heads)

    def apply(self, options, schedule: SpeculationSchedule, batched: bool):
        return replace(options, tree=schedule if batched else schedule.choices[min(schedule.choices)])

    def encode(self, choice, options=None) -> dict:
        return {"tree": {"name": choice.name, "choices": choice.choices}}

    def decode(self, keys: dict, method: str, options):
        choices, name = keys["tree"]["choices"], keys["tree"].get("name")
        refuse_oversized(choices, f"its tree {name}")
        tree = MedusaTree(choices, name=name)
        grafted = get(method).grafted
        if not (grafted and grafted(options)):   # a method grafting its own drafts (lookups) still drafts without it
            refuse_rootless(tree, f"its tree {name}")   # else plain decoding under this method's name
        return tree

    def check_spec(self, choice, spec) -> None:
        """A tree the heads of ``spec`` cannot draft (deeper than the heads, more ranks than their outputs)."""
        outputs = getattr(spec, "output_size", 0) or getattr(spec, "vocab_size", 0) or 1 << 30
        choice.check_fits(spec.num_heads, outputs)
