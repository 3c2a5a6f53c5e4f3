"""The PNGs of an evaluation's report (``evaluation.reports`` writes the files, names them and calls these):
the acceptance histogram, the heads' accuracy, the trade-off matrix's bars and a batched run's throughput
against batch size. Drawn from report.json's numbers only; matplotlib on the headless Agg backend.
"""

from __future__ import annotations

import zlib
from pathlib import Path

OTHER_COLORS = ("C8", "C9", "navy", "teal", "maroon")   # a name no registered method has
BASELINE_GREYS = ("0.2", "0.5", "0.7", "0.35", "0.6")


def method_color(name: str) -> str:
    """``name``'s colour, the same from run to run and from plot to plot (compare.png, throughput_vs_batch.png): by
    its place among the registered methods, never by its place in the run's ``methods=`` (which changes with it),
    the baselines in greys; a name no method has by a CRC of it (Python's ``hash`` of a str changes between
    processes, and so would the colour)."""
    from .methods import registry   # lazy: a report's numbers alone draw every other part of a plot

    known = registry.names()
    if name not in known:
        return OTHER_COLORS[zlib.crc32(name.encode()) % len(OTHER_COLORS)]
    baseline = registry.get(name).baseline
    same_kind = [m for m in known if registry.get(m).baseline == baseline]
    place = same_kind.index(name)
    return BASELINE_GREYS[place % len(BASELINE_GREYS)] if baseline else f"C{place % 8}"   # C8, C9: the others


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


def _n(count, word: str) -> str:
    """``count`` ``word``s, singular for one ("1 tokens max" read as a typo)."""
    return f"{count} {word}{'' if count == 1 else 's'}"


def integer_axis(axis) -> None:
    """Ticks on whole numbers only: the axis counts tokens, steps or training steps (no 1.5 tokens)."""
    from matplotlib.ticker import MaxNLocator   # lazy: matplotlib is imported once a plot is drawn

    axis.set_major_locator(MaxNLocator(integer=True))


def histogram_title(name: str, hist: dict) -> str:
    """The histogram's title: what it counts and its own mean. It counts the tokens each step's verification
    accepted (bonus included) before EOS / max_new_tokens cut a step, so its mean is not the report's tau (the
    tokens each step emitted); the title once paired it with tau. Two lines: one ran past the figure's edge."""
    steps = sum(hist.values())
    mean = sum(int(k) * v for k, v in hist.items()) / steps if steps else 0.0
    return f"{name}: tokens accepted per step (before the EOS / budget cut)\nmean {mean:.2f} over {_n(steps, 'step')}"


def plot_histogram(path: Path, name: str, hist: dict, depth: int = 0) -> Path:
    """``depth``: the draft tokens one step can have accepted along a path (the length of n_alpha; 0: unknown).
    The axis runs to depth + 1 (bonus included) so lengths no step reached show as empty slots: a histogram
    that stopped at its last bar hid how far short of the tree's depth the acceptance fell."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    lengths = [int(k) for k in hist]
    ax.bar(lengths, list(hist.values()))
    ax.set_xlim(0.5, max([depth + 1, *lengths]) + 0.5)
    integer_axis(ax.xaxis)
    integer_axis(ax.yaxis)
    ax.set(xlabel="tokens accepted per step (bonus included)", ylabel="steps")
    ax.set_title(histogram_title(name, hist), fontsize=9)
    return _save(plt, fig, path)


def plot_head_accuracy(path: Path, topk: list, measured_on: str | None = None) -> Path:
    """Each head's cumulative top-k accuracy (the backbone's greedy token among the head's k best), on a fixed
    0..1 scale: autoscaled, all-zero heads drew -0.05..0.05 and two runs' plots could not be compared."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.8))
    width = 0.8 / max(len(topk), 1)
    for k, row in enumerate(topk):
        ax.bar([j + k * width for j in range(min(5, len(row)))], row[:5], width, label=f"head {k + 1}")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(5)], [f"top-{j}" for j in range(1, 6)])
    ax.set_ylim(0, 1)
    title = "per-head cumulative top-k accuracy (greedy token among the head's k best)"
    ax.set_title(title + (f"\nmeasured on {measured_on}" if measured_on else ""), fontsize=9)
    ax.set(ylabel="accuracy vs backbone greedy")
    ax.legend(fontsize=8, loc="best")
    return _save(plt, fig, path)


def run_title(r: dict) -> str:
    """What a plot's numbers come from: prompts, samples, token budget, mode and the machine, as far as the
    report says them (a plot copied out of its folder is read without report.md)."""
    s, machine = r.get("settings") or {}, r.get("machine") or {}
    parts = [_n(r.get("num_samples", 0), "sample")]
    if s.get("max_new_tokens") is not None:
        parts.append(f"{_n(s['max_new_tokens'], 'new token')} max")
    if s.get("mode"):
        parts.append(f"mode {s['mode']}")
    device = machine.get("gpu") or machine.get("cpu")
    if device:
        parts.append(f"on {device}")
    return f"{s.get('prompts', '')}: " + ", ".join(parts)


def _bars(ax, methods: list, values: list, spreads: list) -> None:
    """One bar per measured value; a null (nothing measured) gets "n/a" and no bar: drawn as 0 it read as
    measured and zero. ``spreads``: [min, median, max] per method or None, drawn as min..max error bars."""
    for i, (meth, v, spread) in enumerate(zip(methods, values, spreads)):
        if v is None:
            ax.annotate("n/a", (i, 0), ha="center", va="bottom", fontsize=8)
            continue
        ax.bar(i, v, color=method_color(meth))
        if spread:
            ax.errorbar(i, v, yerr=[[max(v - spread[0], 0)], [max(spread[2] - v, 0)]], fmt="none", ecolor="k",
                        capsize=3, lw=0.8)


def plot_compare(path: Path, r: dict) -> Path:
    """compare.png: speedup vs autoregressive (error bars: the per-prompt ratios' min..max), tau and tokens/s per
    method; a method that ran as plain decoding is marked so in its label."""
    plt = pyplot()
    methods = r["methods"]
    per = r["per_method"]
    labels = [f"{m} (ran as plain decoding)" if per[m].get("ran_as_plain_decoding") else m for m in methods]
    panels = [("speedup vs autoregressive", "speedup_vs_autoregressive"), ("tau (tokens / step)", "tau"),
              ("tokens/s", "tokens_per_s")]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.9))
    for ax, (title, key) in zip(axes, panels):
        _bars(ax, methods, [per[m].get(key) for m in methods], [per[m].get(f"per_prompt_{key}") for m in methods])
        ax.set_xlim(-0.6, len(methods) - 0.4)
        ax.set_xticks(range(len(methods)), labels, rotation=30, ha="right", fontsize=8)
        ax.set_title(title, fontsize=10)
        if key == "speedup_vs_autoregressive":
            ax.axhline(1.0, color="k", lw=0.8, ls="--")
    fig.suptitle(run_title(r), fontsize=10)
    return _save(plt, fig, path)


def plot_throughput(path: Path, r: dict) -> Path:
    """tokens/s against batch size: the plain batched loop, HF's batched generate, each method; error bars: the
    single runs' min..max where there were several; a hollow marker: the method ran as plain decoding there."""
    plt = pyplot()
    b = r["batched"]
    sizes = b["batch_sizes"]
    entries = [b["per_batch_size"][str(s)] for s in sizes]
    labels = {"autoregressive": "plain batched loop", "hf_generate": "HF batched generate"}
    fig, ax = plt.subplots(figsize=(6, 4))
    plain_label = "ran as plain decoding"
    for meth in b["methods"]:
        color, ys = method_color(meth), [e["tokens_per_s"][meth] for e in entries]
        ax.plot(sizes, ys, marker="o", color=color, label=labels.get(meth, meth), ls="--" if meth in labels else "-")
        runs = [e["per_method"].get(meth, {}).get("tokens_per_s_runs") for e in entries]
        if any(run and run[2] > run[0] for run in runs):   # several runs: how far apart they were
            low = [max(y - run[0], 0) if run else 0 for y, run in zip(ys, runs)]
            high = [max(run[2] - y, 0) if run else 0 for y, run in zip(ys, runs)]
            ax.errorbar(sizes, ys, yerr=[low, high], fmt="none", ecolor=color, capsize=3, lw=0.8)
        plain = [(s, y) for s, y, e in zip(sizes, ys, entries) if (e.get("speculation") or {}).get(meth) == "plain"]
        if plain:
            ax.scatter(*zip(*plain), s=80, facecolors="white", edgecolors=color, zorder=3, label=plain_label)
            plain_label = "_nolegend_"   # one legend entry for every method's plain points
    if len(sizes) > 1 and sizes[-1] / sizes[0] >= 4:
        ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.set_ylim(bottom=0)   # from 0: an autoscaled axis made a few percent look like a multiple
    ax.set(xlabel="batch size", ylabel="tokens/s (all rows, prefill included)", title="throughput vs batch size")
    ax.legend(fontsize=8, loc="best")
    return _save(plt, fig, path)
