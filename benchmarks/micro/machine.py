"""What this machine gives the runtime: one command that explains a speedup, or its absence.

    python scripts/bench.py machine [--prompts 4] [--tokens 64] [--threads 0] [--out runs/machine.json]

The runtime's plain loop and its tree steps are bound by reading the weights once per forward
(SmolLM2-135M in fp32: 0.54 GB). How close a forward gets to the machine's memory bandwidth is
decided by which BLAS kernel multiplies a weight by 1-16 rows, and that differs between
machines and BLAS builds; so the same code gives 1.0x on one machine and 1.7x on another. This
script measures, on this machine, with nothing else running:

  1. the machine: CPU model, cores, load, torch's BLAS / OpenMP build, threads;
  2. memory bandwidth: a 256 MiB copy, and the lm_head [49152 x 576] read by the BLAS products
     for 1 and 2 rows (``F.linear``, ``torch.mv``, ``(W @ x^T)^T``; not the prepacked one), in GB/s;
  3. the whole verification forward (decoder body + lm_head) for 1, 2 and 4 tokens, stock
     kernels vs routed (``inference/runtime/linear_kernels.py``), interleaved call by call,
     and the weight bandwidth each achieves (weight bytes / step time);
  4. the runtime's plain loop vs transformers' ``generate`` on MT-Bench first turns, greedy,
     interleaved prompt by prompt (the README's headline ratio), token-identical check included.

It prints a Markdown summary (the row benchmarks/history.md's "Across machines" table takes) and writes
JSON with every figure. Medians throughout.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.options import Parser, nonnegative_int, positive_int
from benchmarks.timing import plain_loop_vs_generate as compare_plain_loop, verification_step
from inference.backbone import load_backbone
from inference.prompts import load_prompts
from inference.runtime.linear_kernels import route_linear_kernels, routing_summary, stock_kernels
from inference.runtime.model import MedusaModel
from inference.runtime.race import machine_load

GB = 1e9


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def blas_build() -> list[str]:
    """The lines of torch's build configuration that say which BLAS / OpenMP / CPU ISA it uses."""
    keys = ("BLAS", "LAPACK", "MKL", "OpenMP", "CPU capability", "oneDNN", "OPENBLAS")
    return [l.strip() for l in torch.__config__.show().splitlines() if any(k.lower() in l.lower() for k in keys)]


def timed(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls after one warm-up."""
    fn()
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def bandwidth(lm_head: torch.Tensor, repeats: int) -> dict:
    src = torch.empty(64 * 2**20, dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)
    w = lm_head.detach().contiguous()
    nbytes = w.numel() * w.element_size()
    x1, x2 = torch.randn(1, w.shape[1]), torch.randn(2, w.shape[1])
    with torch.inference_mode():
        secs = {
            "copy_256MiB": timed(lambda: dst.copy_(src), repeats),
            "lm_head_linear_1row": timed(lambda: F.linear(x1, w), repeats),
            "lm_head_mv_1row": timed(lambda: torch.mv(w, x1[0]), repeats),
            "lm_head_linear_2rows": timed(lambda: F.linear(x2, w), repeats),
            "lm_head_w_xt_2rows": timed(lambda: (w @ x2.T).T, repeats),
        }
    moved = {"copy_256MiB": 2 * src.numel() * 4}  # read + write
    return {k: {"ms": round(v * 1e3, 2), "GB_per_s": round(moved.get(k, nbytes) / v / GB, 1)} for k, v in secs.items()}


def forward_steps(m: MedusaModel, rounds: int) -> dict:
    """Verification forward over n tokens after a prompt, stock vs routed, interleaved call by call."""
    forward = verification_step(m, m.encode_chat("Explain how a hash map works, with an example."), max_nodes=8)
    weight_bytes = sum(p.numel() * p.element_size() for p in m.model.parameters())
    nodes = (1, 2, 4)
    for n in nodes:
        forward(n)  # first use of a row count measures the routed kernels
    times: dict[tuple[int, str], list[float]] = {}
    for _ in range(rounds):
        for n in nodes:
            for _ in range(5):
                with stock_kernels():
                    times.setdefault((n, "stock"), []).append(forward(n))
                times.setdefault((n, "routed"), []).append(forward(n))
    out = {}
    for n in nodes:
        s, r = statistics.median(times[(n, "stock")]), statistics.median(times[(n, "routed")])
        out[n] = {"stock_ms": round(s * 1e3, 1), "routed_ms": round(r * 1e3, 1), "routed_speedup": round(s / r, 3),
                  "stock_GB_per_s": round(weight_bytes / s / GB, 1), "routed_GB_per_s": round(weight_bytes / r / GB, 1)}
    return out


def plain_loop_vs_generate(m: MedusaModel, prompts: int, tokens: int) -> dict:
    """The runtime's plain loop (routed) vs transformers' greedy generate (stock), interleaved."""
    ids = [m.encode_chat(p.turns[0]) for p in load_prompts("embedded:mtbench", limit=prompts)]
    return compare_plain_loop(m, ids, tokens)


def main(argv: list[str] | None = None) -> None:
    ap = Parser(prog="bench.py machine", description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=positive_int, default=4)
    ap.add_argument("--tokens", type=positive_int, default=64)
    ap.add_argument("--rounds", type=positive_int, default=3)
    ap.add_argument("--threads", type=nonnegative_int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--out", default=None, help="write every figure here as JSON")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    load, _ = machine_load()  # cores other processes keep busy now: the figures below assume 0
    model, tok, _ = load_backbone("embedded:smollm2")
    m = MedusaModel(model=model, tokenizer=tok, heads=None)
    result = {"machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "busy_cores_before": load,
                          "threads": torch.get_num_threads(), "torch": torch.__version__, "blas": blas_build()},
              "bandwidth": bandwidth(m.lm_head.weight, repeats=20)}
    plans = route_linear_kernels(m.model)
    m.kernel_plans = plans
    result["routing"] = routing_summary(plans)
    result["forward"] = forward_steps(m, args.rounds)
    result["plain_loop_vs_generate"] = plain_loop_vs_generate(m, args.prompts, args.tokens)

    mc, bw, fw, pl = result["machine"], result["bandwidth"], result["forward"], result["plain_loop_vs_generate"]
    print(f"\n{mc['cpu']}, {mc['cores']} cores, {mc['threads']} threads, load {load}, torch {mc['torch']}")
    print(f"copy bandwidth {bw['copy_256MiB']['GB_per_s']} GB/s; lm_head 1 row: F.linear "
          f"{bw['lm_head_linear_1row']['GB_per_s']} GB/s, mv {bw['lm_head_mv_1row']['GB_per_s']} GB/s; 2 rows: "
          f"F.linear {bw['lm_head_linear_2rows']['GB_per_s']} GB/s, (W @ x^T)^T {bw['lm_head_w_xt_2rows']['GB_per_s']} GB/s")
    print("\n| machine | copy GB/s | 1-token step stock -> routed (ms) | weights GB/s stock -> routed | "
          "2 / 4 nodes routed (ms) | plain loop vs generate |")
    print("|---|---|---|---|---|---|")
    print(f"| {mc['cpu']} | {bw['copy_256MiB']['GB_per_s']} | {fw[1]['stock_ms']} -> {fw[1]['routed_ms']} "
          f"({fw[1]['routed_speedup']:.2f}x) | {fw[1]['stock_GB_per_s']} -> {fw[1]['routed_GB_per_s']} | "
          f"{fw[2]['routed_ms']} / {fw[4]['routed_ms']} | {pl['ratio']:.2f}x ({pl['runtime_tokens_per_s']} vs "
          f"{pl['hf_generate_tokens_per_s']} tok/s, {pl['identical']}/{pl['prompts']} identical) |")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
