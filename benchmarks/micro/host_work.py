"""What a decoding step leaves on the host between its captured graphs, measured on this machine's CPU.

    python scripts/bench.py host-work [--tokens 48] [--rounds 5] [--only NAME] [--out runs/host_work.json]

With graphs=on the backbone's step and the drafter's calls replay as CUDA graphs; what is left each step is
Python: filling the graphs' inputs, acceptance, the bookkeeping, and the reads of device values, each of which
waits on a GPU for every kernel queued before it (and nothing is queued while the host then decides). This
counts that work without a GPU: a tiny random Llama (2 layers, hidden 64, vocab 96: the device's share is
nothing here) on static steps, capture stood in for by a replay that runs the captured function again, timed
and subtracted. Per method, per step: host reads (``benchmarks.host_reads.HostReads``), ops dispatched outside
the replays (each a Python call into torch, most a kernel launch on a GPU) and the host microseconds outside
the replays. Per-step figures difference a generation of --tokens tokens and one of half as many (the prompt's
forward cancels); microseconds are the median over --rounds such pairs, after two warm-up rounds of both lengths
that capture and check every call. Cases: every method, greedy; Medusa and EAGLE-3 sampling (temperature 0.8) and
typical acceptance; batches of 4 (``--only`` picks cases whose name contains it).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, LlamaConfig

from benchmarks.host_reads import HostReads
from benchmarks.options import Parser, int_at_least, positive_int
from inference.heads.registry import init_heads
from inference.heads.spec import HeadsSpec
from inference.loading import attach_heads
from inference.methods import generate, generate_batch
from inference.runtime.model import MedusaModel
from inference.runtime.race import machine_load
from inference.runtime.static_steps import StaticSteps
from inference.runtime.verify import SamplingConfig

PROMPT = [5, 17, 3, 88, 41, 9, 5, 17, 3, 88, 41, 9, 5, 17]
SAMPLE, TYPICAL = SamplingConfig(mode="sample", temperature=0.8), SamplingConfig(mode="typical", temperature=0.8)
CASES = {   # name -> (drafter kind, method, options, batch)
    "plain loop": (None, "autoregressive", {}, 1),
    "medusa tree8": ("medusa", "medusa", {"tree": "tree8"}, 1),
    "eagle3 n8-d3-k2": ("eagle3", "eagle3", {"nodes": 8, "depth": 3, "topk": 2}, 1),
    "eagle3 n8-d3-k2-p0.02": ("eagle3", "eagle3", {"nodes": 8, "depth": 3, "topk": 2, "min_prob": 0.02}, 1),
    "eagle3_lookup n8-d3-k2": ("eagle3", "eagle3_lookup", {"nodes": 8, "depth": 3, "topk": 2}, 1),
    "medusa_lookup tree8": ("medusa", "medusa_lookup", {"tree": "tree8"}, 1),
    "lookahead": ("medusa", "lookahead", {}, 1),
    "draft self:1 k4": ("medusa", "draft", {"draft": "self:1"}, 1),
    "medusa tree8, sample": ("medusa", "medusa", {"tree": "tree8", "sampling": SAMPLE, "seed": 0}, 1),
    "medusa tree8, typical": ("medusa", "medusa", {"tree": "tree8", "sampling": TYPICAL, "seed": 0}, 1),
    "eagle3 n8-d3-k2, sample": ("eagle3", "eagle3", {"nodes": 8, "depth": 3, "topk": 2, "sampling": SAMPLE,
                                                    "seed": 0}, 1),
    "plain loop, batch 4": (None, "autoregressive", {}, 4),
    "medusa tree8, batch 4": ("medusa", "medusa", {"tree": "tree8"}, 4),
    "eagle3 n8-d3-k2, batch 4": ("eagle3", "eagle3", {"nodes": 8, "depth": 3, "topk": 2}, 4),
    "eagle3_lookup n8-d3-k2, batch 4": ("eagle3", "eagle3_lookup", {"nodes": 8, "depth": 3, "topk": 2}, 4),
    "draft self:1 k4, batch 4": ("medusa", "draft", {"draft": "self:1"}, 4),
    "eagle3 n8-d3-k2, sample, batch 4": ("eagle3", "eagle3", {"nodes": 8, "depth": 3, "topk": 2, "sampling": SAMPLE,
                                                             "seed": 0}, 4),
}


class _Outside(TorchDispatchMode):
    """Counts the ops dispatched while no replay runs."""

    def __init__(self, inside: list):
        super().__init__()
        self.inside, self.ops = inside, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.inside[0]:
            self.ops += 1
        return func(*args, **(kwargs or {}))


class Stand:
    """Capture stood in for on CPU: the outputs stay the tensors the capture returned, each replay runs the
    function again into them; ``inside`` says whether a replay runs, ``spent`` the seconds replays took."""

    def __init__(self):
        self.inside, self.spent = [0], 0.0

    def __call__(self, fn, pool):
        self.inside[0] += 1
        try:
            outs = fn()
        finally:
            self.inside[0] -= 1

        def replay():
            t = time.perf_counter()
            self.inside[0] += 1
            try:
                for o, new in zip(outs, fn()):
                    o.copy_(new)
            finally:
                self.inside[0] -= 1
                self.spent += time.perf_counter() - t
        return replay, outs


def backbone():
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.02,
                      tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


def with_drafter(net, kind):
    cfg = net.config
    extra = {}
    if kind == "eagle3":
        from inference.heads.eagle3 import default_aux_layers, draft_layer_config

        extra = dict(aux_layers=default_aux_layers(cfg.num_hidden_layers), draft_layer=draft_layer_config(cfg))
    spec = HeadsSpec(num_heads=3 if kind == "medusa" else 2, num_layers=1, hidden_size=cfg.hidden_size,
                     vocab_size=cfg.vocab_size, kind=kind, base_model="random:llama", **extra)
    with torch.random.fork_rng():
        torch.manual_seed(1)
        heads = init_heads(spec, net.lm_head.weight, net.get_input_embeddings().weight)
        with torch.no_grad():
            for p in heads.parameters():
                p.add_(0.1 * torch.randn_like(p))   # arbitrary drafts: some accepted, most not
    return attach_heads(net, heads)


def decode(m, method: str, kw: dict, batch: int, tokens: int) -> int:
    """One generation of ``tokens`` tokens at ``batch`` (prompts of different lengths); its steps."""
    with torch.inference_mode():
        if batch == 1:
            return generate(m, PROMPT, method, max_new_tokens=tokens, eos_token_ids=(), **kw).steps
        prompts = [PROMPT[:n] for n in (14, 9, 5, 12)[:batch]]
        return len(generate_batch(m, prompts, method, max_new_tokens=tokens, eos_token_ids=(), **kw).step_s)


def one(m, stand: Stand, method: str, kw: dict, batch: int, tokens: int) -> tuple[int, int, float, int]:
    """(host reads, ops outside the replays, host seconds outside them, steps) of one generation."""
    stand.spent = 0.0
    with HostReads() as reads, _Outside(stand.inside) as outside:
        t = time.perf_counter()
        steps = decode(m, method, kw, batch, tokens)
        wall = time.perf_counter() - t
    return reads.count, outside.ops, wall - stand.spent, steps


def timed(m, stand: Stand, method: str, kw: dict, batch: int, tokens: int) -> tuple[float, int]:
    """(host seconds outside the replays, steps) of one generation, nothing counting."""
    stand.spent = 0.0
    t = time.perf_counter()
    steps = decode(m, method, kw, batch, tokens)
    return time.perf_counter() - t - stand.spent, steps


def run(tokens: int, rounds: int, only: str = "") -> dict:
    result = {"tokens": tokens, "rounds": rounds, "threads": torch.get_num_threads(), "load": machine_load(),
              "torch": torch.__version__, "cases": {}}
    for name, (kind, method, kw, batch) in CASES.items():
        if only not in name:
            continue
        net = backbone()
        m = with_drafter(net, kind) if kind else MedusaModel(model=net, tokenizer=None, heads=None)
        stand = Stand()
        m.static = StaticSteps(m, capture=stand, log=lambda line: None)
        for _ in range(2):      # every call of both lengths captured and checked (a batch shrinks at other steps)
            timed(m, stand, method, kw, batch, tokens)
            timed(m, stand, method, kw, batch, tokens // 2)
        long, short = one(m, stand, method, kw, batch, tokens), one(m, stand, method, kw, batch, tokens // 2)
        steps = long[3] - short[3]
        us = []
        for _ in range(rounds):
            a, sa = timed(m, stand, method, kw, batch, tokens)
            b, sb = timed(m, stand, method, kw, batch, tokens // 2)
            us.append((a - b) / max(1, sa - sb) * 1e6)
        result["cases"][name] = {
            "steps": steps, "reads_per_step": round((long[0] - short[0]) / max(1, steps), 2),
            "ops_per_step": round((long[1] - short[1]) / max(1, steps), 1),
            "host_us_per_step": round(statistics.median(us)), "host_us_range": [round(min(us)), round(max(us))]}
    return result


def main(argv=None) -> None:
    ap = Parser(prog="bench.py host-work", description=__doc__.split("\n\n")[0])
    # 2 at least: a step's figures are the difference between a run of --tokens and one of half as many
    ap.add_argument("--tokens", type=int_at_least(2), default=48)
    ap.add_argument("--rounds", type=positive_int, default=5)
    ap.add_argument("--only", default="", help="the cases whose name contains this (default: all)")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    if not any(a.only in name for name in CASES):
        ap.error(f"--only {a.only!r}: no case's name contains it (cases: {'; '.join(CASES)})")
    torch.set_num_threads(1)
    result = run(a.tokens, a.rounds, a.only)
    print(f"{a.tokens} vs {a.tokens // 2} tokens, {a.rounds} rounds, 1 thread, load {result['load']}, "
          f"torch {result['torch']}")
    print("| steps | host reads / step | ops outside the graphs / step | host us / step (min-max) |")
    print("|---|---|---|---|")
    for name, c in result["cases"].items():
        lo, hi = c["host_us_range"]
        print(f"| {name} | {c['reads_per_step']} | {c['ops_per_step']} | {c['host_us_per_step']} ({lo}-{hi}) |")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=2))
