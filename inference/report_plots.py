"""The PNGs of an evaluation's report (``evaluation.reports`` writes the files, names them and calls these):
the acceptance histogram, the heads' accuracy, the trade-off matrix's bars and a batched run's throughput
against batch size. Drawn from report.json's numbers only; matplotlib on the headless Agg backend.
"""

from __future__ import annotations

from pathlib import Path


def pyplot():
    """matplotlib's pyplot on the headless Agg backend, for the reports' PNGs."""
    import matplotlib   # lazy: 0.7 s to import, only once a report is plotted

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt   # lazy: after the headless backend is chosen

    return plt


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def histogram_title(name: str, hist: dict) -> str:
    """The histogram's title: what it counts and its own mean. It counts the tokens each step's verification
    accepted (bonus included) before EOS / max_new_tokens cut a step, so its mean is not the report's tau (the
    tokens each step emitted); the title once paired it with tau."""
    steps = sum(hist.values())
    mean = sum(int(k) * v for k, v in hist.items()) / steps if steps else 0.0
    return f"{name}: tokens accepted per step (before the EOS / budget cut), mean {mean:.2f} over {steps} steps"


def plot_histogram(path: Path, name: str, hist: dict) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar([int(k) for k in hist], list(hist.values()))
    ax.set(xlabel="tokens accepted per step (bonus included)", ylabel="steps")
    ax.set_title(histogram_title(name, hist), fontsize=9)
    return _save(plt, fig, path)


def plot_head_accuracy(path: Path, topk: list) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.8 / max(len(topk), 1)
    for k, row in enumerate(topk):
        ax.bar([j + k * width for j in range(min(5, len(row)))], row[:5], width, label=f"head {k + 1}")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(5)], [f"top-{j}" for j in range(1, 6)])
    ax.set(ylabel="accuracy vs backbone greedy", title="per-head accuracy")
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


def plot_compare(path: Path, r: dict) -> Path:
    """compare.png: speedup vs autoregressive, tau and tokens/s per method."""
    plt = pyplot()
    methods = r["methods"]
    per = r["per_method"]
    panels = [("speedup vs autoregressive", [per[m].get("speedup_vs_autoregressive") or 0 for m in methods]),
              ("tau (tokens / step)", [per[m].get("tau") or 0 for m in methods]),
              ("tokens/s", [per[m]["tokens_per_s"] for m in methods])]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6))
    for ax, (title, values) in zip(axes, panels):
        ax.bar(range(len(methods)), values, color=[f"C{i}" for i in range(len(methods))])
        ax.set_xticks(range(len(methods)), methods, rotation=30, ha="right", fontsize=8)
        ax.set_title(title, fontsize=10)
        if title.startswith("speedup"):
            ax.axhline(1.0, color="k", lw=0.8, ls="--")
    fig.suptitle(f"{r['settings'].get('prompts', '')}: {r['num_samples']} samples, "
                 f"{r['settings'].get('max_new_tokens', '')} tokens max", fontsize=10)
    return _save(plt, fig, path)


def plot_throughput(path: Path, r: dict) -> Path:
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
    return _save(plt, fig, path)
