"""Training throughput benchmark: backbone forward tokens/s vs training-step tokens/s.

For each projection mode (own / shared / truncated) and head count (3, 5), one subprocess
builds the real trainer (``medusa1_smollm2`` recipe, DeepSpeed engine, packed ShareGPT
rows), then alternates, step by step, (a) a plain forward of the whole backbone (with its
lm_head, as ``model(input_ids)`` runs it) and (b) one training micro-step (backbone body
under no_grad + heads forward/backward + optimizer step) on the same batch. Reported:
median tokens/s of each, their ratio, and the subprocess's peak RSS. Interleaving makes the
ratio robust to the machine's background load; absolute numbers are not.

    python scripts/bench.py train                      # all modes, 3 and 5 heads
    python scripts/bench.py train --modes truncated --heads 3 --steps 6
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from argparse import SUPPRESS
from pathlib import Path

from benchmarks.options import Parser, positive_int

ROOT = Path(__file__).resolve().parents[2]
PROJECTIONS = ("truncated", "shared", "own")  # inference.heads.spec.PROJECTIONS (that module loads torch)


def measure(mode: str, heads: int, steps: int, micro: int, max_length: int) -> dict:
    import torch

    from medusa_train.launch import compose_recipe
    from medusa_train.trainer import MedusaTrainer

    out = tempfile.mkdtemp(prefix="bench-")
    cfg = compose_recipe("medusa1_smollm2", [
        f"output_dir={out}", f"heads.projection={mode}", f"heads.num_heads={heads}",
        f"trainer.micro_batch_size={micro}", f"trainer.global_batch_size={micro}", "trainer.resume=never",
        f"data.max_length={max_length}", "data.eval_conversations=1", "data.vocab_scan_conversations=500",
        "logger.wandb=disabled", "trainer.progress_bar=false"])
    tr = MedusaTrainer(cfg)
    tr.setup()
    model = tr.backbone.model
    it = iter(tr.batches)
    fwd, train = [], []
    tr.engine.train()
    for i in range(steps + 1):  # the first round warms up and is dropped
        batch = next(it)
        tokens = int((batch["doc_ids"] > 0).sum())
        ids, pos = batch["input_ids"], batch["position_ids"]
        with torch.no_grad():
            t0 = time.perf_counter()
            model(input_ids=ids, position_ids=pos, use_cache=False)
            t1 = time.perf_counter()
        hidden = tr.source.frozen.hidden_states(batch)
        loss = tr.engine(hidden, batch["labels"], batch["doc_ids"])
        tr.engine.backward(loss)
        tr.engine.step()
        t2 = time.perf_counter()
        if i:
            fwd.append(tokens / (t1 - t0))
            train.append(tokens / (t2 - t1))
    ratios = [t / f for t, f in zip(train, fwd)]
    trainable = sum(p.numel() for p in tr.module.parameters() if p.requires_grad)
    return {"mode": mode, "heads": heads, "tokens_per_batch": micro * max_length,
            "forward_tok_s": statistics.median(fwd), "train_tok_s": statistics.median(train),
            "ratio": statistics.median(ratios), "trainable_params_m": trainable / 1e6,
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def child_command() -> list[str]:
    """The child as a module, not as this file: run as a script, its folder would head sys.path and this
    package's ``kernels.py`` would shadow the ``kernels`` package DeepSpeed imports (an ImportError)."""
    return [sys.executable, "-m", "benchmarks.micro.train"]


def child_env() -> dict:
    """The child's environment: the repository first on PYTHONPATH (``benchmarks`` is not installed, and the
    child keeps the caller's working directory, so relative paths in the recipe mean what they meant)."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "WANDB_MODE": "disabled"}


def main(argv: list[str] | None = None) -> None:
    ap = Parser(prog="bench.py train", description=__doc__.splitlines()[0])
    ap.add_argument("--modes", nargs="+", choices=PROJECTIONS, default=list(PROJECTIONS))
    ap.add_argument("--heads", nargs="+", type=positive_int, default=[3, 5])
    ap.add_argument("--steps", type=positive_int, default=5)
    ap.add_argument("--micro", type=positive_int, default=2)
    ap.add_argument("--max-length", type=positive_int, default=1024)
    ap.add_argument("--out", default="runs/bench_train.json")
    ap.add_argument("--child", help=SUPPRESS)
    args = ap.parse_args(argv)
    if os.path.isdir(args.out):
        ap.error(f"--out {args.out}: is a directory (give the JSON file to write)")
    if args.child:
        mode, heads = args.child.split(":")
        print("RESULT " + json.dumps(measure(mode, int(heads), args.steps, args.micro, args.max_length)), flush=True)
        return
    rows = []
    for heads in args.heads:
        for mode in args.modes:
            cmd = [*child_command(), "--child", f"{mode}:{heads}", "--steps", str(args.steps),
                   "--micro", str(args.micro), "--max-length", str(args.max_length)]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env())
            line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
            if proc.returncode or not line:
                print(proc.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"benchmark child {mode}:{heads} failed")
            row = json.loads(line[0][7:])
            rows.append(row)
            print(f"{mode:>9} x{heads}: forward {row['forward_tok_s']:.0f} tok/s, train step {row['train_tok_s']:.0f} "
                  f"tok/s, ratio {row['ratio']:.2f}, trainable {row['trainable_params_m']:.1f}M, "
                  f"peak RSS {row['peak_rss_gb']:.2f} GB", flush=True)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=2)
    print("\n| projection | heads | backbone forward tok/s | train step tok/s | ratio | trainable params | peak RSS |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['heads']} | {r['forward_tok_s']:.0f} | {r['train_tok_s']:.0f} | {r['ratio']:.2f} | "
              f"{r['trainable_params_m']:.1f}M | {r['peak_rss_gb']:.2f} GB |")


if __name__ == "__main__":
    main()
