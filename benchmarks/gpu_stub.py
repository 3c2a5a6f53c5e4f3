"""The GPU check's stub drafter of controlled acceptance (benchmarks/gpu_graphs.py runs it): a chain of k tokens,
each the true greedy continuation with probability p, so tau is set, not projected, and the speed a given tau buys
on captured steps is measured end to end."""

from __future__ import annotations

import random

import torch

from benchmarks.timing import median, off_if, rate, spread
from inference.methods import generate
from inference.runtime.decode import TokenStream, prefill_token, run_decoder
from inference.runtime.model import MedusaModel
from inference.runtime.verify import SamplingConfig


STUB_TAUS = ((1.5, 1), (2.0, 3), (3.0, 7))   # (target tau, chain length k): k + 1 rows fill a bucket exactly
STUB_OFF_TAU = 2.0                  # the one tau also decoded with graphs off


# -- stub: a drafter of set acceptance, end to end ------------------------------------------------------------
def chain_p(tau: float, k: int) -> float:
    """The per-token acceptance p with sum_{i=0..k} p^i = tau (bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(mid ** i for i in range(k + 1)) < tau else (lo, mid)
    return (lo + hi) / 2


class StubChain:
    """A benchmark-only ``Decoder``: each step proposes k tokens, position i the token ``truth`` holds there with
    probability p (seeded), else another one; the backbone verifies root + chain in one forward (positions
    past.., ``attention_mask=None``: causal over the new rows), greedy acceptance against its argmax, the cache
    truncated to the accepted prefix (a chain's accepted rows already sit in place), as draft.py verifies."""

    def __init__(self, m: MedusaModel, truth: list[int], k: int, p: float, seed: int):
        self.m, self.truth, self.k, self.p = m, truth, k, p
        self.rng = random.Random(seed)
        self.cache, self.past, self.seq = None, 0, []

    def prefill(self, prompt: torch.Tensor, max_new_tokens: int) -> int:
        self.past = prompt.shape[1]
        self.cache = self.m.new_cache(self.past + max_new_tokens + self.k + 1)
        _, root = prefill_token(self.m, prompt, self.cache, SamplingConfig(), None)
        self.seq, self.offsets = [root], torch.arange(self.k + 1, device=self.m.device)
        return root

    def guess(self, i: int) -> int:
        true = self.truth[i] if i < len(self.truth) else 0
        return true if self.rng.random() < self.p else (true + 1 + self.rng.randrange(self.m.vocab_size - 1)) % \
            self.m.vocab_size

    def step(self) -> tuple[list[int], int]:
        m, k, done = self.m, self.k, len(self.seq)
        drafts = [self.guess(done + i) for i in range(k)]
        ids = torch.tensor([[self.seq[-1], *drafts]], device=m.device)
        pred = m.logits(m.hidden(ids, (self.offsets + self.past)[None], self.cache)[0]).argmax(-1).tolist()
        n = 0
        while n < k and drafts[n] == pred[n]:
            n += 1
        self.cache.truncate(self.past + 1 + n)
        self.past += 1 + n
        new = drafts[:n] + [pred[n]]
        self.seq += new
        return new, k


def stub_decode(m: MedusaModel, prompt: list[int], truth: list[int], k: int, p: float, seed: int, n: int):
    s = TokenStream(run_decoder(StubChain(m, truth, k, p, seed), m, prompt, n, (), None))
    for _ in s:
        pass
    return s.result


def stub_speed(m: MedusaModel, prompt: list[int], sz: dict) -> dict:
    """Each (tau, k) of ``STUB_TAUS`` graphs on, ``STUB_OFF_TAU`` also off, vs the captured plain loop, rounds
    interleaved. The truth per (k, graphs) is the stub's own greedy path (one pass at p = 1): bf16 rows verified
    k + 1 at a time can round to another argmax than the plain loop's one row (``truth_first_change``)."""
    n, kmax = sz["stub_tokens"], max(k for _, k in STUB_TAUS)
    greedy = generate(m, prompt, "autoregressive", max_new_tokens=n + kmax + 1, eos_token_ids=()).tokens
    cases = [(tau, k, "on") for tau, k in STUB_TAUS] + [(tau, k, "off") for tau, k in STUB_TAUS if tau == STUB_OFF_TAU]
    truths, changed = {}, {}
    for _, k, mode in cases:
        if (k, mode) not in truths:
            with off_if(m, mode):
                truths[k, mode] = stub_decode(m, prompt, greedy, k, 1.0, 0, n + kmax + 1).tokens
            changed[f"k{k}_{mode}"] = next((i for i, (a, b) in enumerate(zip(greedy, truths[k, mode])) if a != b), None)
    plain, outs = [], {c: [] for c in cases}
    for r in range(sz["stub_rounds"]):
        plain.append(rate(generate(m, prompt, "autoregressive", max_new_tokens=n, eos_token_ids=())))
        for i, (tau, k, mode) in enumerate(cases):
            with off_if(m, mode):
                outs[tau, k, mode].append(stub_decode(m, prompt, truths[k, mode], k, chain_p(tau, k), 1000 * r + i, n))
    base = median(plain)
    runs = []
    for (tau, k, mode), os_ in outs.items():
        tps = spread([rate(o) for o in os_])
        runs.append({"target_tau": tau, "k": k, "p": round(chain_p(tau, k), 4), "graphs": mode,
                     "measured_tau": round(sum(sum(o.accept_lengths) for o in os_) / sum(o.steps for o in os_), 3),
                     "tokens_per_s": tps, "vs_plain_on": round(tps["median"] / base, 3),
                     "off_truth": sum(o.tokens != truths[k, mode][:len(o.tokens)] for o in os_)})
    return {"new_tokens": n, "plain_on_tokens_per_s": spread(plain), "runs": runs, "truth_first_change": changed}


# -- capture ways: torch.cuda.CUDAGraph directly vs torch.compile(mode="reduce-overhead") -------------------------
# reduce-overhead replays through inductor's CUDA-graph trees, whose per-call host work has regressed lately:
# https://github.com/pytorch/pytorch/issues/174575 (2.10 vs 2.9 on an H100: 7x slower cudaGraphLaunch and new
# Python overhead in cudagraph_trees.py, 40-55% less decode throughput; open); on small graphs dynamo's guard
# lookup + the trees' checks cost ~300 us a call: https://github.com/pytorch/pytorch/issues/150488.
