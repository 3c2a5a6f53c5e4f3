"""The static-shape steps (``graphs=``) against the dynamic ones, on this machine: what ``graphs=uncaptured`` costs
where nothing is captured (the CPU), and an A/A pair that shows the noise.

    python scripts/bench.py static-steps [--prompts 6] [--tokens 64] [--tree tree4] [--drafter eagle3]
                                         [--out runs/static_steps.json]

SmolLM2-135M-Instruct (the embedded GGUF, fp32, kernels routed as medusa-eval routes them) with random
Medusa heads (3; random drafts are rarely accepted: the figure is the cost of the same steps, not a speedup),
on MT-Bench first turns. ``--drafter eagle3``: a random EAGLE-3 drafter of ``eagle3_smollm2``'s shape instead
(three backbone layers, one decoder layer, draft vocabulary 8,192), decoded by ``eagle3`` and ``eagle3_lookup`` at
n8-d3-k2 (a deeper tree than the recipe's, so that the drafter's expansion runs). Per prompt, the plain loop and
the drafter's methods are decoded with graphs off, uncaptured
and off again, the order rotating from prompt to prompt; tokens are checked identical. Prints the median
tokens/s of each and the per-prompt ratios to the first ``off`` (median, min-max).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import torch

from benchmarks.gpu_models import eagle3_model
from benchmarks.options import Parser, positive_int
from inference.backbone import load_backbone
from inference.prompts import load_prompts
from inference.heads.registry import init_heads
from inference.heads.spec import HeadsSpec
from inference.loading import attach_heads, kernel_plans_path
from inference.methods import generate
from inference.runtime.model import MedusaModel, apply_kernels
from inference.runtime.race import machine_load
from inference.runtime.static_steps import apply_graphs

MODES = ("off", "uncaptured", "off again")


def model(drafter: str = "medusa"):
    net, tok, _ = load_backbone("embedded:smollm2", device="cpu", dtype="float32")
    if drafter == "eagle3":   # the GPU check's random drafter of eagle3_smollm2's shape
        m = eagle3_model(MedusaModel(model=net, tokenizer=tok, heads=None), tokenizer=tok)
    else:
        cfg = net.config
        spec = HeadsSpec(num_heads=3, num_layers=1, hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size,
                         base_model="embedded:smollm2")
        with torch.random.fork_rng():
            torch.manual_seed(0)
            heads = init_heads(spec, net.get_output_embeddings().weight)
        m = attach_heads(net, heads, tok)
    return apply_kernels(m, "auto", kernel_plans_path())


EAGLE3_SETTING = dict(nodes=8, depth=3, topk=2)


def cases(drafter: str, tree: str) -> dict:
    """Each timed case: its method and options."""
    if drafter == "eagle3":
        return {"plain loop": ("autoregressive", {}), "eagle3 n8-d3-k2": ("eagle3", EAGLE3_SETTING),
                "eagle3_lookup n8-d3-k2": ("eagle3_lookup", EAGLE3_SETTING)}
    return {"plain loop": ("autoregressive", {}), f"medusa {tree}": ("medusa", {"tree": tree})}


def run(prompts: int, tokens: int, tree: str, drafter: str = "medusa") -> dict:
    m = model(drafter)
    ids = [m.encode_chat(p.turns[0]) for p in load_prompts("embedded:mtbench", prompts)]
    timed = cases(drafter, tree)
    rates = {c: {x: [] for x in MODES} for c in timed}
    same = True
    for i, p in enumerate(ids):
        order = MODES[i % 3:] + MODES[:i % 3]
        for case, (method, kw) in timed.items():
            out = {}
            for mode in order:
                apply_graphs(m, "off" if mode.startswith("off") else mode)
                with torch.inference_mode():
                    g = generate(m, p, method, max_new_tokens=tokens, eos_token_ids=(), **kw)
                rates[case][mode].append(g.decode_tokens_per_s)
                out[mode] = g.tokens
            same &= len({tuple(t) for t in out.values()}) == 1
    result = {"prompts": len(ids), "tokens": tokens, "threads": torch.get_num_threads(), "load": machine_load(),
              "token_identical": same, "cases": {}}
    for case, r in rates.items():
        base = r["off"]
        result["cases"][case] = {
            "tokens_per_s": {x: round(statistics.median(v), 2) for x, v in r.items()},
            "ratio_to_off": {x: [round(statistics.median([a / b for a, b in zip(v, base)]), 3),
                                 round(min(a / b for a, b in zip(v, base)), 3), round(max(a / b for a, b in zip(v, base)), 3)]
                             for x, v in r.items() if x != "off"}}
    return result


def main(argv=None) -> None:
    ap = Parser(prog="bench.py static-steps", description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=positive_int, default=6)
    ap.add_argument("--tokens", type=positive_int, default=64)
    ap.add_argument("--tree", default="tree4")
    ap.add_argument("--drafter", choices=["medusa", "eagle3"], default="medusa")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    result = run(a.prompts, a.tokens, a.tree, a.drafter)
    print(f"{result['prompts']} prompts x {result['tokens']} tokens, {result['threads']} threads, "
          f"load {result['load']}, token-identical: {result['token_identical']}")
    print("| steps | off tok/s | uncaptured tok/s | off again tok/s | uncaptured / off | off again / off |")
    print("|---|---|---|---|---|---|")
    for case, c in result["cases"].items():
        t, r = c["tokens_per_s"], c["ratio_to_off"]
        ratio = {x: f"{v[0]:.3f} ({v[1]:.3f}-{v[2]:.3f})" for x, v in r.items()}
        print(f"| {case} | {t['off']} | {t['uncaptured']} | {t['off again']} | {ratio['uncaptured']} | "
              f"{ratio['off again']} |")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=2))
