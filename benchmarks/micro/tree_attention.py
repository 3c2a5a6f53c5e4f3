"""A verification forward with transformers' sdpa against the decoding attention (``runtime/attention.py``).

    python scripts/bench.py tree-attention [--contexts 250 1000] [--rounds 20] [--backbone embedded:smollm2]

For each context length: a prefill of random token ids, then a tree-shaped verification forward (the root
and rows - 1 children, tree mask, explicit positions; decoder body only, routed linear kernels) over 1, 2, 4
and 8 rows, the two attention implementations alternated call by call ``rounds`` times; the cache is cut
back after every call so every call sees the same context. Prints the medians, what the decoding attention
saves, and whether the two gave identical hidden states. Run it alone (benchmarks/history.md, "Grouped-query
attention in the verification forward").
"""

from __future__ import annotations

import statistics
import time

from benchmarks.options import Parser, backbone as backbone_name, positive_int


def main(argv: list[str] | None = None) -> None:
    ap = Parser(prog="bench.py tree-attention", description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=positive_int, nargs="+", default=[250, 1000])
    ap.add_argument("--rounds", type=positive_int, default=20)
    ap.add_argument("--backbone", type=backbone_name, default="embedded:smollm2")
    a = ap.parse_args(argv)
    compare(a.contexts, a.rounds, a.backbone)


def compare(contexts: list[int], rounds: int, backbone: str) -> None:
    # imported here, after main's checks: a mistaken option is refused before torch and the model load
    import torch

    with torch.inference_mode():
        _compare(contexts, rounds, backbone)


def _compare(contexts: list[int], rounds: int, backbone: str) -> None:
    import torch

    from inference.backbone import load_backbone
    from inference.runtime.attention import NAME
    from inference.runtime.model import MedusaModel
    from inference.runtime.tree import tree_buffers

    model, tok, _ = load_backbone(backbone, device="cpu", dtype="float32")
    m = MedusaModel(model=model, tokenizer=tok, heads=None)
    m.route_kernels()
    g = torch.Generator().manual_seed(0)
    print(f"{backbone}: {rounds} rounds, threads {torch.get_num_threads()}")
    print("| context | rows | sdpa (ms) | decoding attention (ms) | saved | identical |")
    print("|---|---|---|---|---|---|")
    for past in contexts:
        prompt = torch.randint(100, m.vocab_size, (1, past), generator=g)
        cache = m.new_cache(past + 16)
        m.hidden(prompt, torch.arange(past)[None], cache)
        for rows in (1, 2, 4, 8):
            parents = torch.tensor([-1] + [0] * (rows - 1))
            depths = torch.tensor([0] + [1] * (rows - 1))
            mask = tree_buffers(parents, depths, int(depths.max())).additive_mask(past, m.dtype)
            ids, pos = torch.full((1, rows), 7), (depths + past)[None]

            def run(impl: str) -> torch.Tensor:
                model.config._attn_implementation = impl
                h = m.hidden(ids, pos, cache, mask)
                cache.truncate(past)
                return h

            same = torch.equal(run("sdpa"), run(NAME))
            times = {"sdpa": [], NAME: []}
            for _ in range(rounds):
                for impl in times:
                    t = time.perf_counter()
                    run(impl)
                    times[impl].append(time.perf_counter() - t)
            a, b = (statistics.median(times[k]) * 1e3 for k in ("sdpa", NAME))
            print(f"| {past} | {rows} | {a:.1f} | {b:.1f} | {a - b:+.1f} ms ({(a - b) / a:+.1%}) | {same} |",
                  flush=True)
    model.config._attn_implementation = NAME


if __name__ == "__main__":
    main()
