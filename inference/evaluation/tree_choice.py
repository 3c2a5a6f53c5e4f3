"""Which tree Medusa decodes with, measured on this machine (``tree=auto`` / ``calibrated:N``).

Per-depth, per-rank head accuracy is measured on calibration prompts (held out from the
evaluated ones, ``measure_head_accuracy``); a tree is grown greedily for each node budget; each
candidate's verification-step latency is measured on this device (``measure_step_latency``);
the tree maximising expected tau / step time wins — or none, when no tree beats plain
decoding's rate (weak heads must never make decoding slower).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from ..errors import UserError
from ..methods import generate
from ..runtime.model import MedusaModel
from ..runtime.tree import MedusaTree, grow_tree, resolve_tree
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
def measure_step_latency(m: MedusaModel, input_ids, trees: Sequence, *, steps: int = 8, warmup: int = 2,
                         sampling: Optional[SamplingConfig] = None) -> dict[str, float]:
    """Median wall time of one Medusa step (heads + tree forward + verify + compaction) per tree.

    EOS is ignored so every tree runs ``warmup + steps`` steps on the same prompt.
    """
    result = {}
    for spec in trees:
        tree = resolve_tree(spec, m.num_heads)
        out = generate(m, input_ids, tree=tree, max_new_tokens=(warmup + steps + 1) * (tree.max_depth + 1),
                       sampling=sampling, eos_token_ids=(), max_steps=warmup + steps, seed=0)
        times = out.step_s[warmup:]
        result[tree.name or f"{tree.num_nodes} nodes"] = statistics.median(times) if times else float("nan")
    return result


@dataclass
class TreeChoice:
    tree: Optional[MedusaTree]  # None: plain decoding is faster than any tree on this machine
    reason: str
    accuracies: Optional[list] = None  # [K][rank] measured on calibration prompts
    candidates: list = field(default_factory=list)  # {nodes, expected_tau, step_ms, rate}
    autoregressive_step_ms: float = 0.0

    def to_dict(self) -> dict:
        t = self.tree
        return {"name": t.name if t is not None else "none (plain decoding)",
                "nodes": t.num_nodes if t is not None else 0,
                "choices": t.choices if t is not None else [],
                "reason": self.reason, "candidates": self.candidates,
                "autoregressive_step_ms": self.autoregressive_step_ms}


def _median_ar_step(m: MedusaModel, prompt_ids: list[int], steps: int = 8) -> float:
    out = generate(m, prompt_ids, "autoregressive", max_new_tokens=steps + 3, eos_token_ids=())
    return statistics.median(out.step_s[2:]) if len(out.step_s) > 2 else statistics.median(out.step_s)


def calibrated_choice(tree_setting: str) -> Optional[int]:
    """N for ``tree=calibrated:N`` (grow the best N-node tree from measured accuracy and use it
    whatever its speed: the same node budget for every set of heads being compared), else None."""
    if not isinstance(tree_setting, str) or not tree_setting.startswith("calibrated:"):
        return None
    n = tree_setting.split(":", 1)[1]
    if not n.isdigit() or int(n) < 2:
        raise UserError(f"tree=calibrated:N needs N >= 2 nodes (root included), got {tree_setting!r}")
    return int(n)


def choose_tree(m: MedusaModel, calibration: Sequence[Sequence[int]], latency_prompt: Sequence[int], *,
                budgets: Sequence[int] = DEFAULT_BUDGETS, calibration_tokens: int = 48, topk: int = 10,
                latency_steps: int = 6, latency_rounds: int = 2,
                log: Callable[[str], None] = print, fixed_nodes: Optional[int] = None) -> TreeChoice:
    """Grow a tree per budget from measured accuracy; keep the one with the best tau / step time.
    With ``fixed_nodes`` grow that one tree and keep it (no latency measurement)."""
    acc = measure_head_accuracy(m, calibration, max_new_tokens=calibration_tokens, topk=topk)
    per_rank = acc.per_rank.tolist()
    if fixed_nodes is not None:
        tree, tau = grow_tree(per_rank, fixed_nodes - 1, name=f"calibrated{fixed_nodes}", fill=True)
        log(f"  tree {tree.name}: {tree.num_nodes} nodes, expected tau {tau:.3f} (fixed budget)")
        return TreeChoice(tree, f"fixed budget of {fixed_nodes} nodes grown from measured accuracy", per_rank,
                          [{"name": tree.name, "nodes": tree.num_nodes, "expected_tau": round(tau, 4)}])
    trees = []
    seen = set()
    for b in sorted(set(budgets)):
        tree, tau = grow_tree(per_rank, b, name=f"auto{b}")
        key = tuple(map(tuple, tree.choices))
        if tree.num_nodes == 0 or key in seen:
            continue
        seen.add(key)
        trees.append((tree, tau))
    # Rounds interleave plain decoding and every tree, and each keeps its fastest median, so
    # a burst of background load does not decide the choice (this machine is shared).
    ar_step, lat = float("inf"), {}
    for _ in range(latency_rounds):
        ar_step = min(ar_step, _median_ar_step(m, list(latency_prompt)))
        if trees:
            for name, sec in measure_step_latency(m, list(latency_prompt), [t for t, _ in trees],
                                                  steps=latency_steps).items():
                lat[name] = min(lat.get(name, float("inf")), sec)
    best = (None, 1.0 / ar_step, "plain decoding is fastest")
    cands = []
    if trees:
        for tree, tau in trees:
            step = lat[tree.name]
            rate = tau / step
            cands.append({"name": tree.name, "nodes": tree.num_nodes, "expected_tau": round(tau, 4),
                          "step_ms": round(step * 1e3, 2), "expected_tokens_per_s": round(rate, 2)})
            log(f"  tree {tree.name:>7}: {tree.num_nodes:>2} nodes, expected tau {tau:.3f}, "
                f"step {step * 1e3:.1f} ms -> {rate:.1f} tok/s expected")
            if rate > best[1]:
                best = (tree, rate, f"best expected tau / step time ({rate:.1f} tok/s vs plain "
                                    f"{1 / ar_step:.1f})")
    log(f"  plain decoding: step {ar_step * 1e3:.1f} ms -> {1 / ar_step:.1f} tok/s")
    return TreeChoice(best[0], best[2], per_rank, cands, round(ar_step * 1e3, 2))
