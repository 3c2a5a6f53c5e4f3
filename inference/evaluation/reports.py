"""Writing what ``evaluate`` measured: report.json / report.md / PNGs, and the trade-off matrix
(compare.md + compare.png). The metric definitions live in ``evaluate``'s docstring; this module
only formats them. A batched evaluation's report (``batch_eval``) is formatted by ``batch_reports``.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from ..errors import UserError
from ..methods.choice_file import SUFFIX as CHOICE_SUFFIX
from .batch_reports import THROUGHPUT_PLOT, batched_markdown, plot_throughput, pyplot


# -- reports ---------------------------------------------------------------------------------
def check_report_dir(out_dir: Path) -> None:
    """Refuse, in one line, a report folder that cannot be written (a file, under a file, in a folder this
    user cannot write, where the file system refuses new entries: /proc), before the evaluation:
    ``write_report`` runs only after everything was measured. The folder is made and, if it was new,
    removed again (with the parents made for it), so a refused or failed evaluation leaves nothing."""
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"out={out_dir} is a file, not a folder")
    existing = next(p for p in (out_dir, *out_dir.absolute().parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"out={out_dir} cannot be created: {existing} is "
                        f"{'a file' if not existing.is_dir() else 'not writable'}")
    made = [p for p in (out_dir.absolute(), *out_dir.absolute().parents) if not p.exists()]
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=out_dir).close()   # an entry the folder really takes (gone on close)
    except OSError as e:
        raise UserError(f"out={out_dir} cannot be created ({e.strerror or e})") from None
    finally:
        for p in made:   # deepest first
            try:
                p.rmdir()
            except OSError:
                pass


HISTOGRAM_PLOT, HEAD_ACCURACY_PLOT = "acceptance_histogram.png", "head_accuracy.png"


def remove_stale_reports(out_dir: Path, written: list[Path]) -> list[str]:
    """Delete what an earlier evaluation into ``out_dir`` wrote and this one (``written``) did not: its plots, its
    trade-off matrix, its choice files would otherwise sit beside this report as if they were its own (another
    heads' choice file decodes wrong heads). Only the evaluation's own file names; returns the names removed."""
    ours = {"report.json", "report.md", HISTOGRAM_PLOT, HEAD_ACCURACY_PLOT, THROUGHPUT_PLOT, *COMPARE_FILES}
    keep = {p.name for p in written}
    stale = sorted(f.name for f in out_dir.iterdir() if f.is_file() and f.name not in keep
                   and (f.name in ours or f.name.endswith(CHOICE_SUFFIX)))
    for name in stale:
        (out_dir / name).unlink()
    return stale


def write_report(out_dir: Path, report: dict) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "report.json", out_dir / "report.md"]
    tmp = out_dir / ".report.json.tmp"
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(tmp, paths[0])
    batched = "batched" in report  # batch_eval's report: its own tables and the throughput plot
    paths[1].write_text(batched_markdown(report) if batched else markdown(report))
    paths += plot_report(out_dir, report)
    if batched:
        paths.append(plot_throughput(out_dir, report))
    return paths


def print_per_method(report: dict) -> None:
    """One line per method of a one-prompt-at-a-time evaluation: tokens/s, tau, speedups, greedy identity."""
    for meth, row in report.get("per_method", {}).items():
        parts = [f"{meth:>14}: {row['tokens_per_s']:8.2f} tok/s", f"tau {row['tau']:.3f}"]
        parts += [f"{row[key]:.2f}x vs {label}" for key, label in speedup_columns([row]) if key in row]
        if "greedy_identical_fraction" in row and meth != "autoregressive":
            parts.append(f"identical to greedy: {row['greedy_identical_fraction']}")
        print(" | ".join(parts))


SPEEDUP_LABELS = {"hf_generate": "HF generate", "hf_generate_static": "HF generate (static cache)"}


def speedup_columns(rows) -> list[tuple[str, str]]:
    """(report key, label) of the speedup columns of these per-method rows: over autoregressive and HF generate
    always (reports stay comparable), then every other ``speedup_vs_<baseline>`` a row has (hf_generate_static:
    CUDA runs), labelled by ``SPEEDUP_LABELS`` or the baseline's name."""
    keys = ["speedup_vs_autoregressive", "speedup_vs_hf_generate"]
    for row in rows:
        keys += [k for k in row if k.startswith("speedup_vs_") and k not in keys]
    return [(k, SPEEDUP_LABELS.get(k[len("speedup_vs_"):], k[len("speedup_vs_"):])) for k in keys]


def _speedup_header(cols) -> str:
    return "".join(f" speedup vs {label} |" for _, label in cols)


def _fmt(v, spec=".3f", default="-") -> str:
    return default if v is None else format(v, spec)


def _times(v) -> str:
    return "-" if v is None else f"{v:.2f}x"


def headline(r: dict) -> tuple[str, dict]:
    """The method the report is about: the first one with an acceptance rate (not a baseline)."""
    per = r.get("per_method") or {}
    name = next((m for m in r.get("methods", []) if "acceptance_rate" in per.get(m, {})), None)
    return name, per.get(name, {})


def markdown(r: dict) -> str:
    s = r.get("settings") or {}
    per = r.get("per_method") or {}
    cols = speedup_columns(per.values())
    title = f"Medusa evaluation: {s['heads']}" if s.get("heads") else f"Decoding evaluation: {s.get('backbone', '')}"
    lines = [f"# {title}", "",
             f"{r['num_samples']} samples from `{s.get('prompts', '?')}`, {s.get('max_new_tokens', '?')} new tokens "
             f"max, mode `{s.get('mode', 'greedy')}`, {r['machine'].get('gpu', r['machine']['cpu'])} "
             f"({r['machine']['threads']} threads), {s.get('dtype', '')}.", "",
             "| method | tau | acceptance rate | tokens/s |" + _speedup_header(cols), "|---" * (4 + len(cols)) + "|"]
    for meth, v in r["tokens_per_s"].items():
        row = per.get(meth, {})
        lines.append(f"| {meth} | {_fmt(row.get('tau'))} | {_fmt(row.get('acceptance_rate'))} | {v:.2f} |"
                     + "".join(f" {_times(row.get(k))} |" for k, _ in cols))
    name, row = headline(r)
    if name is not None:
        lines += ["", f"- {name} tau (tokens per verification step): **{row.get('tau', 1.0):.3f}**",
                  f"- acceptance rate: {row.get('acceptance_rate', 0):.3f}"
                  + (f"; n-alpha: {row['n_alpha']}" if "n_alpha" in row else "")]
        if row.get("greedy_identical_fraction") is not None:  # greedy mode only
            lines.append(f"- output identical to plain greedy: {row['greedy_identical_fraction']}")
    # the shared Medusa tree, then each method's own chosen tree setting (``<method>_tree``: there only when chosen)
    for key, what in [("tree", "tree")] + [(k, k[:-len("_tree")] + " tree") for k in r if k.endswith("_tree")]:
        choice = r.get(key) or {}
        if choice.get("nodes") or (key != "tree" and choice):
            lines.append(f"- {what}: {choice['name']}" + (f" ({choice['nodes']} nodes)" if choice.get("nodes") else "")
                         + f" — {choice['reason']}")
        timing = choice.get("timing")
        if timing:
            paired = " (each tree costed against the plain runs beside it)" if timing.get("paired") else ""
            lines.append(f"- {what} timing: {timing['rounds']} interleaved rounds{paired}"
                         + ("" if timing.get("stable", True) else " (winner not yet stable)")
                         + "; step ms median [min-max]: "
                         + ", ".join(f"{c['name']} {c['step_ms']:.1f} [{c['step_ms_min']:.1f}-{c['step_ms_max']:.1f}]"
                                     + (f" ({c['vs_plain_step']:.2f}x plain)" if "vs_plain_step" in c else "")
                                     for c in [{"name": "plain", **timing["autoregressive"]}, *choice["candidates"]]
                                     if "step_ms_min" in c))
            lines += [f"- warning: {w}" for w in timing.get("warnings", [])]
    acc = r.get("head_accuracy")
    if acc:
        lines += ["", "| head | " + " | ".join(f"top-{j}" for j in range(1, 6)) + " |", "|---" * 6 + "|"]
        for k, row in enumerate(acc["topk"], start=1):
            lines.append(f"| {k} | " + " | ".join(f"{v:.3f}" for v in row[:5]) + " |")
    return "\n".join(lines) + "\n"


def plot_report(out_dir: Path, r: dict) -> list[Path]:
    plt = pyplot()
    paths = []
    name, row = headline(r)
    hist = row.get("accept_length_histogram")
    if hist:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.bar([int(k) for k in hist], list(hist.values()))
        ax.set(xlabel="tokens accepted per step (bonus included)", ylabel="steps",
               title=f"{name}: acceptance length, tau = {row.get('tau', 1):.2f}")
        fig.tight_layout()
        paths.append(out_dir / HISTOGRAM_PLOT)
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    acc = r.get("head_accuracy")
    if acc:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        topk = acc["topk"]
        width = 0.8 / max(len(topk), 1)
        for k, row in enumerate(topk):
            ax.bar([j + k * width for j in range(min(5, len(row)))], row[:5], width, label=f"head {k + 1}")
        ax.set_xticks([j + 0.4 - width / 2 for j in range(5)], [f"top-{j}" for j in range(1, 6)])
        ax.set(ylabel="accuracy vs backbone greedy", title="per-head accuracy")
        ax.legend(fontsize=8)
        fig.tight_layout()
        paths.append(out_dir / HEAD_ACCURACY_PLOT)
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


# -- the trade-off matrix ----------------------------------------------------------------------
COMPARE_FILES = ("compare.md", "compare.png")


def _size(n: float, unit: str) -> str:
    for scale, prefix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {prefix}{unit}"
    return f"{n:.0f} {unit}".strip()


def compare_markdown(r: dict) -> str:
    """The trade-off matrix: one row per method (definitions: module docstring)."""
    s = r.get("settings") or {}
    per, costs, opts = r["per_method"], r.get("costs", {}), r.get("method_options", {})
    cols = speedup_columns(per.values())
    greedy = s.get("mode", "greedy") == "greedy"
    lines = [f"# Decoding methods compared: {s.get('backbone') or s.get('heads') or ''}", "",
             f"{r['num_samples']} samples from `{s.get('prompts', '?')}`, {s.get('max_new_tokens', '?')} new tokens "
             f"max, mode `{s.get('mode', 'greedy')}`, {r['machine'].get('gpu', r['machine']['cpu'])} "
             f"({r['machine']['threads']} threads), {s.get('dtype', '')}; methods interleaved per prompt.", "",
             "| method | tau | acceptance rate | tokens/s |" + _speedup_header(cols)
             + " extra parameters | extra KV cache | training needed | output = plain greedy |",
             "|---" * (8 + len(cols)) + "|"]
    for meth in r["methods"]:
        row, cost = per[meth], costs.get(meth, {})
        speedups = "".join(f" {_times(row.get(k))} |" for k, _ in cols)
        ident = row.get("greedy_identical_fraction")
        if not greedy:
            same = "n/a (sampling)"
        elif ident is None:
            same = "-"
        else:
            same = "yes" if ident == 1.0 else f"no ({ident:.0%} of prompts)"
        params = cost.get("extra_parameters", 0)
        p_txt = "0" if not params else f"{_size(params, '')} ({_size(cost.get('extra_parameter_bytes', 0), 'B')})"
        kv = cost.get("extra_kv_cache_bytes", 0)
        lines.append(f"| {meth} | {_fmt(row.get('tau'), '.2f')} | {_fmt(row.get('acceptance_rate'), '.3f')} | "
                     f"{row['tokens_per_s']:.2f} |{speedups} {p_txt} | {_size(kv, 'B') if kv else '0'} | "
                     f"{cost.get('training', 'none')} | {same} |")
    notes = [f"{meth}: " + ", ".join(f"{k} = {v}" for k, v in opts[meth].items())
             for meth in r["methods"] if opts.get(meth)]
    lines += ["", "Settings: " + "; ".join(notes) + "." if notes else "",
              "",
              "tau = tokens per verification step (bonus included; plain decoding 1.0); acceptance rate = accepted "
              "/ proposed draft tokens; tokens/s include prefill; speedups from the same run. Extra parameters: "
              "loaded beyond the backbone, tensors shared with it not counted. Extra KV cache: cache allocated "
              f"beyond plain decoding's, at {r.get('run_length', '?')} tokens (longest prompt + max_new_tokens)."]
    return "\n".join(lines) + "\n"


def plot_compare(path: Path, r: dict) -> Path:
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
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_compare(out_dir: Path, report: dict) -> list[Path]:
    """compare.md (the trade-off matrix) and compare.png (speedup, tau, tokens/s per method)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    md = out_dir / COMPARE_FILES[0]
    md.write_text(compare_markdown(report))
    return [md, plot_compare(out_dir / COMPARE_FILES[1], report)]
