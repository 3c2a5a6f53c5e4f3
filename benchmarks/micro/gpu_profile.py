"""Where a decoding step's time goes on the GPU: the device's kernels, or the host launching them.

    python scripts/bench.py profile-gpu --out DIR            # on the lent GPU machine (~1 minute)
    python scripts/bench.py profile-gpu --out DIR --dry-run  # the same code on CPU, a tiny Llama, seconds

The GPU check (benchmarks/gpu_check.py) found a SmolLM2-135M-shaped verification step at ~20 ms on an H200 whatever the
node count (1 or 64 nodes cost the same), and the batched decoder's step 3-5x that and noisy: the
signature of a host-bound loop. This measures it, on the same random SmolLM2-135M-shaped Llama in bf16
(on the H200 it found the cuDNN SDPA backend planning a graph per key length, 1.4 ms of host time per
attention call in the batched step; inference/attention_backends.py; benchmarks/history.md "GPU check (NVIDIA H200)"):
  1. launch: what one tiny kernel launch costs the host here (1000 launches, one sync);
  2. for a plain 1-token step, a 16-node verification step and ``BatchTreeDecoder.step`` (random drafts,
     4 nodes per row) at batch 1 and 8: wall time (median), the summed time of the device kernels
     (torch.profiler), their ratio (GPU busy fraction), the kernels launched and the host-device syncs
     per step;
  3. the first attention call's arguments (shapes, strides, dtypes) and one call's cost alone;
  4. torch.profiler's ops by self CPU time and cProfile's top Python functions by own time, for the
     plain and the batched steps: where the host overhead sits.
Writes profile.json and profile.txt (also printed) under --out.
"""

from __future__ import annotations

import cProfile
import io
import json
import pstats
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.gpu_check import SMOLLM2_135M, TINY, _RandomDrafter, backbone, machine
from benchmarks.options import Parser
from benchmarks.timing import median, sync, verification_step
from inference.runtime.batch_decode import BatchTreeDecoder
from inference.runtime.model import MedusaModel
from inference.runtime.tree import chain_tree

SYNC_OPS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync", "cudaMemcpy")


def launch_cost(device: torch.device, n: int) -> dict:
    """Host microseconds per launch of a one-element add, n launches then one sync."""
    x = torch.zeros(1, device=device)
    for _ in range(50):
        x.add_(1)
    sync(device)
    t = time.perf_counter()
    for _ in range(n):
        x.add_(1)
    host = time.perf_counter() - t
    sync(device)
    total = time.perf_counter() - t
    return {"launches": n, "host_us_per_launch": round(1e6 * host / n, 2),
            "total_us_per_launch": round(1e6 * total / n, 2)}


def activities(device: torch.device) -> list:
    return [ProfilerActivity.CPU, ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]


def profiled(fn, device: torch.device, steps: int) -> dict:
    """Wall ms per call (median of ``steps``, synced) and, over ``steps`` more calls under torch.profiler,
    device-kernel ms per call, kernels per call and host-device syncs/copies per call."""
    for _ in range(3):
        fn()
    sync(device)
    walls = []
    for _ in range(steps):
        t = time.perf_counter()
        fn()
        sync(device)
        walls.append(time.perf_counter() - t)
    out = {"wall_ms": round(1e3 * median(walls), 3)}
    with profile(activities=activities(device)) as prof:
        for _ in range(steps):
            fn()
        sync(device)
    # Each kernel's time is charged to exactly one op's self device time, so the sum is the kernels' total.
    kernel_us = sum(getattr(e, "self_device_time_total", 0.0) for e in prof.key_averages())
    names = [e.name for e in prof.events()]
    launches = sum("LaunchKernel" in n for n in names)
    syncs = sum(n in SYNC_OPS for n in names)
    out.update(kernel_ms=round(kernel_us / 1e3 / steps, 3), kernels=round(launches / steps, 1),
               syncs_or_copies=round(syncs / steps, 1))
    out["gpu_busy"] = round(out["kernel_ms"] / out["wall_ms"], 3)
    return out


def describe(t) -> str:
    if not isinstance(t, torch.Tensor):
        return repr(t)
    return f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')} stride {t.stride()} contiguous {t.is_contiguous()}"


def attention_calls(fn, device: torch.device, steps: int) -> dict:
    """The arguments of the step's first scaled_dot_product_attention call, and what one call costs
    alone (synced before and after, median), by wrapping torch.nn.functional's function for ``steps`` calls."""
    real = torch.nn.functional.scaled_dot_product_attention
    seen: dict = {"times": []}

    def wrapped(q, k, v, attn_mask=None, *a, **kw):
        if "args" not in seen:
            seen["args"] = {"q": describe(q), "k": describe(k), "v": describe(v), "mask": describe(attn_mask),
                            "kwargs": {k_: repr(v_) for k_, v_ in kw.items()}}
        sync(device)
        t = time.perf_counter()
        r = real(q, k, v, attn_mask, *a, **kw)
        sync(device)
        seen["times"].append(time.perf_counter() - t)
        return r

    torch.nn.functional.scaled_dot_product_attention = wrapped
    try:
        for _ in range(steps):
            fn()
    finally:
        torch.nn.functional.scaled_dot_product_attention = real
    return {"args": seen.get("args"), "calls": len(seen["times"]),
            "ms_per_call": round(1e3 * median(seen["times"]), 3) if seen["times"] else None}


def op_table(fn, device: torch.device, steps: int) -> str:
    with profile(activities=activities(device)) as prof:
        for _ in range(steps):
            fn()
        sync(device)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=48)


def top_python(fn, steps: int, n: int = 18) -> str:
    """cProfile over ``steps`` calls: the top functions by own time."""
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(steps):
        fn()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(n)
    return s.getvalue()


def main(argv: list[str] | None = None) -> None:
    ap = Parser(prog="bench.py profile-gpu", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/profile_gpu_step")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        ap.error("no CUDA device (use --dry-run to check the script on CPU)")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        ap.error(f"--out {out}: is a file (give the folder to write the profile into)")
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cpu" if args.dry_run else "cuda")
    shape = TINY if args.dry_run else SMOLLM2_135M
    steps = 3 if args.dry_run else 20
    m = MedusaModel(model=backbone(shape, device, torch.bfloat16), tokenizer=None, heads=None)
    res = {"machine": machine(), "dry_run": args.dry_run,
           "launch": launch_cost(device, 100 if args.dry_run else 1000)}

    report = []
    step = verification_step(m, list(range(7, 7 + 64)), max_nodes=16)
    chain16 = chain_tree(16)
    with torch.inference_mode():
        res["plain_step"] = profiled(lambda: step(1), device, steps)
        res["plain_attention"] = attention_calls(lambda: step(1), device, 2)
        report.append("-- plain 1-token step: torch.profiler ops by self CPU time\n"
                      + op_table(lambda: step(1), device, 5))
        report.append(f"-- plain 1-token step: cProfile over {steps} steps\n" + top_python(lambda: step(1), steps))
        res["verify_16"] = profiled(lambda: step(16, chain16), device, steps)
    g = torch.Generator().manual_seed(2)
    for b in (1, 8):
        prompts = [torch.randint(0, m.vocab_size, (64,), generator=g).tolist() for _ in range(b)]
        tree = chain_tree(4)
        dec = BatchTreeDecoder(m, _RandomDrafter(tree, m.vocab_size, device))
        with torch.inference_mode():
            # room for warm-up + timed + profiled + cProfile'd steps, 4 tokens each at most
            dec.prefill(prompts, (4 * steps + 30) * (tree.max_depth + 1))
            res[f"batch{b}_step"] = profiled(dec.step, device, steps)
            res[f"batch{b}_attention"] = attention_calls(dec.step, device, 2)
            report.append(f"-- BatchTreeDecoder.step, batch {b}: torch.profiler ops by self CPU time\n"
                          + op_table(dec.step, device, 5))
            report.append(f"-- BatchTreeDecoder.step, batch {b}, 4 nodes: cProfile over {steps} steps\n"
                          + top_python(dec.step, steps))
    lines = [f"device: {res['machine'].get('gpu', 'CPU (dry run)')}, torch {res['machine']['torch']}",
             f"launch: {res['launch']['host_us_per_launch']} us host per tiny kernel launch "
             f"({res['launch']['total_us_per_launch']} us with the device's share)", "",
             "| step | wall ms | kernel ms | GPU busy | kernels | syncs/copies |", "|---|---|---|---|---|---|"]
    for k in ("plain_step", "verify_16", "batch1_step", "batch8_step"):
        r = res[k]
        lines.append(f"| {k} | {r['wall_ms']} | {r.get('kernel_ms', '-')} | {r.get('gpu_busy', '-')} | "
                     f"{r.get('kernels', '-')} | {r.get('syncs_or_copies', '-')} |")
    lines += ["", "scaled_dot_product_attention, one call alone (synced), and its first call's arguments:"]
    for k in ("plain_attention", "batch1_attention", "batch8_attention"):
        lines.append(f"- {k}: {res[k]['ms_per_call']} ms/call over {res[k]['calls']} calls; {res[k]['args']}")
    text = "\n".join(lines) + "\n\n" + "\n".join(report)
    (out / "profile.txt").write_text(text)
    (out / "profile.json").write_text(json.dumps(res, indent=2, default=str) + "\n")
    print(text)


if __name__ == "__main__":
    main()
