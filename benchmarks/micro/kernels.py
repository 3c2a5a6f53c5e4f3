"""What a verification forward costs per number of tree nodes, with stock vs routed linear kernels.

    python scripts/bench.py kernels [--heads runs/medusa1_smollm2/heads] [--rounds 5] [--threads 2]

One model (the heads' backbone, or embedded SmolLM2), one prompt in the KV cache; for each node
count n the timed call is what a tree step runs: the decoder body over n new tokens with a
tree-shaped 4D mask and explicit positions, then the lm_head on those n rows. ``stock`` runs
transformers' ``F.linear``; ``routed`` lets ``inference.linear_kernels`` pick the product per
(weight shape, n); ``unpacked`` is routed with the same timings but without the prepacked-weight
product (what routing chose before it existed). The three are interleaved call by call, ``--rounds``
x 10 calls each. Prints a Markdown table of medians relative to a stock 1-token step, then the
minimum and median of the routed arms: on a host whose speed changes from second to second the
minimum is the cost, the median shows the noise.
"""

from __future__ import annotations

import statistics
import time

from benchmarks.options import Parser, directory, dtype, nonnegative_int, positive_int

NODES = (1, 2, 3, 4, 5, 6, 8, 12, 16, 32)


def main(argv: list[str] | None = None) -> None:
    ap = Parser(prog="bench.py kernels", description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=directory, default=None,
                    help="a heads export (its backbone is used); default: embedded SmolLM2")
    ap.add_argument("--rounds", type=positive_int, default=5)
    ap.add_argument("--threads", type=nonnegative_int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--dtype", type=dtype, default="float32")
    args = ap.parse_args(argv)
    # imported once the options are known good: a mistaken one is refused before torch and a model load
    import torch

    from inference.backbone import load_backbone
    from inference.loading import load_medusa
    from inference.runtime.linear_kernels import PACKED, route_linear_kernels, routing_summary, stock_kernels
    from inference.runtime.model import MedusaModel

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.heads:
        m = load_medusa(args.heads, dtype=args.dtype, kernels="stock")
    else:
        model, tok, _ = load_backbone("embedded:smollm2", dtype=args.dtype)
        m = MedusaModel(model=model, tokenizer=tok, heads=None)
    plans = route_linear_kernels(m.model)
    prompt = m.encode_chat("Explain how a hash map works, with an example.")
    past = len(prompt)
    cache = m.new_cache(past + max(NODES) + 1)
    with torch.inference_mode():
        m.hidden(torch.tensor([prompt]), torch.arange(past)[None], cache)
    times: dict[tuple[int, str], list[float]] = {}

    def forward(n: int) -> float:
        tokens = torch.full((1, n), 100)
        pos = (torch.arange(n) + past)[None]
        mask = torch.zeros(1, 1, n, past + n, dtype=m.dtype)
        mask[..., past:] = torch.triu(torch.full((n, n), float("-inf"), dtype=m.dtype), 1)
        t = time.perf_counter()
        with torch.inference_mode():
            m.logits(m.hidden(tokens, pos, cache, mask)[0])
        dt = time.perf_counter() - t
        cache.truncate(past)
        return dt

    routed = {id(p): p.choice for p in plans}
    unpacked = {id(p): {r: p.pick({k: v for k, v in t.items() if k != PACKED}) for r, t in p.timings.items()}
                for p in plans}

    def timed(n: int, arm: str) -> None:
        for p in plans:
            p.choice = (unpacked if arm == "unpacked" else routed)[id(p)]
        if arm == "stock":
            with stock_kernels():
                times.setdefault((n, arm), []).append(forward(n))
        else:
            times.setdefault((n, arm), []).append(forward(n))

    arms = ("stock", "unpacked", "routed")
    for n in NODES:  # warm-up of each row count and arm; not timed below
        for arm in arms:
            timed(n, arm)
    times.clear()
    for _ in range(args.rounds):
        for n in NODES:
            for _ in range(10):
                for arm in arms:
                    timed(n, arm)
    for p in plans:
        p.choice = routed[id(p)]
    base = statistics.median(times[(1, "stock")])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}, context {past} tokens\n")
    print("| nodes | stock (ms) | routed (ms) | stock / 1-token step | routed / 1-token step | routed speedup |")
    print("|---|---|---|---|---|---|")
    for n in NODES:
        s, r = statistics.median(times[(n, "stock")]), statistics.median(times[(n, "routed")])
        print(f"| {n} | {s * 1e3:.1f} | {r * 1e3:.1f} | {s / base:.2f} | {r / base:.2f} | {s / r:.2f}x |")
    print("\n| nodes | unpacked min (ms) | routed min (ms) | unpacked median | routed median |")
    print("|---|---|---|---|---|")
    for n in NODES:
        u, r = times[(n, "unpacked")], times[(n, "routed")]
        print(f"| {n} | {min(u) * 1e3:.1f} | {min(r) * 1e3:.1f} | {statistics.median(u) * 1e3:.1f} | "
              f"{statistics.median(r) * 1e3:.1f} |")
    print("\nrouted (row counts through (W @ x^T)^T and the prepacked weight):", routing_summary(plans))


if __name__ == "__main__":
    main()
