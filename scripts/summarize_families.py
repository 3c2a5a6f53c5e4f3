"""The four-families table of BENCHMARKS.md from scripts/bench_families.sh's outputs.

    python scripts/summarize_families.py runs/bench_families

Reads, per family: the held-out accuracy the trainer logged last (``metrics.jsonl``, kind "eval"), the
training time (``timings.txt``), and the three medusa-eval reports (two-row tree on MT-Bench and on the code
prompts, three-token chain on MT-Bench). Step cost is what one interleaved run measured: a method's step takes
tau / its tokens/s, a plain step 1 / the runtime loop's tokens/s, so their ratio is tau x loop / method.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

FAMILIES = ("medusa", "hydra", "mlp_speculator", "eagle3")
NAMES = {"medusa": "Medusa", "hydra": "Hydra", "mlp_speculator": "MLP speculator", "eagle3": "EAGLE-3"}


def last_eval(run: Path) -> dict:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [r for r in rows if r.get("kind") == "eval"]
    trains = [r for r in rows if r.get("kind") == "train"]
    return {"eval": evals[-1] if evals else {}, "steps": trains[-1]["step"] if trains else 0}


def train_seconds(bench: Path, family: str) -> str:
    timings = bench / "timings.txt"
    if not timings.exists():
        return "?"
    for line in timings.read_text().splitlines():
        if re.match(rf"train {family}\b", line):
            return line.rsplit(":", 1)[1].strip()
    return "?"


def method_row(report: dict) -> tuple[str, dict]:
    name = next(m for m in report["per_method"] if m not in ("autoregressive", "hf_generate"))
    return name, report["per_method"][name]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bench", type=Path)
    args = ap.parse_args()
    head = ("| family | trainable params | steps / training time | held-out top-1, depth 1 / 2 / 3 | "
            "tau, 2 rows (MT-Bench / code) | n-alpha, 3-token chain (depth 1 / 2 / 3) | tau, chain | "
            "step cost, 2 rows (x plain step) | vs runtime loop (MT-Bench / code) | vs HF generate | = greedy |")
    print(head)
    print("|" + "---|" * head.count(" | ") + "---|")
    for f in FAMILIES:
        run = args.bench / f
        paths = {k: args.bench / f"eval_{f}_{k}" / "report.json" for k in ("two", "chain", "code")}
        if not (run / "metrics.jsonl").exists() or not all(p.exists() for p in paths.values()):
            print(f"| {NAMES[f]} | (not run) |")
            continue
        r = {k: json.loads(p.read_text()) for k, p in paths.items()}
        trained = last_eval(run)
        ev = trained["eval"]
        top1 = " / ".join(f"{ev.get(f'head{k}/top1', float('nan')):.3f}" for k in (1, 2, 3))
        method, two = method_row(r["two"])
        _, code = method_row(r["code"])
        _, chain = method_row(r["chain"])
        loop = r["two"]["per_method"]["autoregressive"]["tokens_per_s"]
        cost = two["tau"] * loop / two["tokens_per_s"]
        params = r["two"]["costs"][method]["extra_parameters"] / 1e6
        alpha = " / ".join(f"{a:.3f}" for a in chain["n_alpha"][:3])
        same = [x["greedy_identical_fraction"] for x in (two, code, chain)]
        print(f"| {NAMES[f]} | {params:.1f}M | {trained['steps']} / {train_seconds(args.bench, f)} | {top1} | "
              f"{two['tau']:.3f} / {code['tau']:.3f} | {alpha} | {chain['tau']:.3f} | {cost:.2f} | "
              f"{two['speedup_vs_autoregressive']:.2f}x / {code['speedup_vs_autoregressive']:.2f}x | "
              f"{two['speedup_vs_hf_generate']:.2f}x | {'all' if min(same) == 1.0 else same} |")


if __name__ == "__main__":
    main()
