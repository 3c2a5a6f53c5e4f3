"""Writing what ``batch_eval`` measured: the batched report.md and ``throughput_vs_batch.png``.

The metric definitions live in ``batch_eval``'s docstring; this module only formats them.
"""

from __future__ import annotations

from pathlib import Path

THROUGHPUT_PLOT = "throughput_vs_batch.png"


def _times(v) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _identity(row: dict) -> str:
    checks = row.get("identical_to_plain_batched", []) + row.get("identical_to_batch1", [])
    if "greedy_identical" not in row:
        return "n/a (sampling)"
    return "yes" if row["greedy_identical"] else f"no ({checks.count(False)} row checks differ)"


def batched_markdown(r: dict) -> str:
    """report.md of a batched evaluation: one row per (batch size, method)."""
    s, b = r.get("settings") or {}, r["batched"]
    title = f"Batched evaluation: {s['heads']}" if s.get("heads") else f"Batched evaluation: {s.get('backbone', '')}"
    lines = [f"# {title}", "",
             f"{b['num_prompts']} prompts from `{s.get('prompts', '?')}` in batches of {b['batch_sizes']}, "
             f"{s.get('max_new_tokens', '?')} new tokens max, mode `{s.get('mode', 'greedy')}`, "
             f"{r['machine'].get('gpu', r['machine']['cpu'])} ({r['machine']['threads']} threads), "
             f"{s.get('dtype', '')}; methods interleaved batch by batch.", "",
             "| batch size | method | speculation | tokens/s | tau | speedup vs plain batched loop "
             "| speedup vs HF batched generate | output = greedy |",
             "|---|---|---|---|---|---|---|---|"]
    for size, entry in b["per_batch_size"].items():
        for meth, row in entry["per_method"].items():
            spec = (entry.get("speculation") or {}).get(meth, "-")
            lines.append(f"| {size} | {meth} | {spec} | {row['tokens_per_s']:.2f} | {row['tau']:.3f} | "
                         f"{_times(row.get('speedup_vs_autoregressive'))} | {_times(row.get('speedup_vs_hf_generate'))} "
                         f"| {_identity(row)} |")
    lines.append("")
    for meth, size in b.get("speculation_stops_paying", {}).items():
        lines.append(f"- {meth}: " + (f"speculation stops paying at batch size {size}" if size is not None
                                      else "faster than the plain batched loop at every batch size measured"))
    for meth, spec in (b.get("speculation") or {}).items():
        how = spec.get("tree") or spec.get("chain")
        lines.append(f"- {meth}: speculation per batch size ({how}): "
                     + ", ".join(f"{k}: {v}" for k, v in spec["schedule"].items()))
    if b.get("greedy_reference"):
        lines.append(f"- greedy identity: each row against the plain batched loop's row and against "
                     f"{b['greedy_reference']}")
    lines += ["", "tokens/s = new tokens of all rows / wall time of all batched runs (prefill included); tau = "
                  "tokens per row-step (bonus included; plain decoding 1.0)."]
    return "\n".join(lines) + "\n"


def pyplot():
    """matplotlib's pyplot on the headless Agg backend, for the reports' PNGs."""
    import matplotlib   # lazy: 0.7 s to import, only once a report is plotted

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt   # lazy: after the headless backend is chosen

    return plt


def plot_throughput(out_dir: Path, r: dict) -> Path:
    """tokens/s against batch size: the plain batched loop, HF's batched generate, each method."""
    plt = pyplot()
    b = r["batched"]
    sizes = b["batch_sizes"]
    labels = {"autoregressive": "plain batched loop", "hf_generate": "HF batched generate"}
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, meth in enumerate(b["methods"]):
        ys = [b["per_batch_size"][str(s)]["tokens_per_s"][meth] for s in sizes]
        ax.plot(sizes, ys, marker="o", color=f"C{i}", label=labels.get(meth, meth),
                ls="--" if meth in labels else "-")
    if len(sizes) > 1 and sizes[-1] / sizes[0] >= 4:
        ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.set(xlabel="batch size", ylabel="tokens/s (all rows, prefill included)", title="throughput vs batch size")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / THROUGHPUT_PLOT
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def print_batched(b: dict) -> None:
    """One line per batch size: each method's tokens/s and speedup over the plain batched loop."""
    for size, entry in b["per_batch_size"].items():
        parts = [f"batch {size:>3}"]
        for meth, row in entry["per_method"].items():
            vs = row.get("speedup_vs_autoregressive")
            parts.append(f"{meth} {row['tokens_per_s']:.1f} tok/s" + (f" ({vs:.2f}x)" if vs is not None else ""))
        if entry.get("speculation"):
            parts.append("speculation " + ", ".join(f"{x} {v}" for x, v in entry["speculation"].items()))
        print(" | ".join(parts))
    for meth, size in b["speculation_stops_paying"].items():
        print(f"{meth}: " + (f"speculation stops paying at batch size {size}" if size is not None
                             else "faster than the plain batched loop at every batch size"))
    for meth, same in (b.get("greedy_identical") or {}).items():
        if meth != "hf_generate":
            print(f"{meth}: every row identical to greedy: {same}")
