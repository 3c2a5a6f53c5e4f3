"""Writing what ``evaluate`` measured: report.json / report.md / PNGs (drawn by ``inference.report_plots``), and
the trade-off matrix (compare.md + compare.png). The metric definitions live in ``evaluate``'s docstring; this
module only formats them. A batched evaluation's report (``batch_eval``) is formatted by ``batch_reports``.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from ..errors import UserError
from ..heads.native import open_permissions, swap_dir_into_place
from ..methods.choice_file import SUFFIX as CHOICE_SUFFIX
from ..report_plots import plot_compare, plot_head_accuracy, plot_histogram, plot_throughput
from .batch_reports import THROUGHPUT_PLOT, _fmt, _times, batched_markdown, caveats


# -- reports ---------------------------------------------------------------------------------
REPORT_ROOM = 16 << 20   # report.json with every sample's tokens, report.md and the plots: ~0.1 MiB per 10 prompts


def check_report_dir(out_dir: Path) -> None:
    """Refuse, in one line, a report folder that cannot be written (a file, under a file, in a folder this
    user cannot write, where the file system refuses new entries: /proc), before the evaluation:
    ``write_report`` runs only after everything was measured; so is a disk without ``REPORT_ROOM`` free. The
    folder is made and, if it was new, removed again (with the parents made for it), so a refused or failed
    evaluation leaves nothing."""
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"out={out_dir} is a file, not a folder")
    check_report_owner(out_dir)
    real = out_dir.resolve()
    here = Path.cwd().resolve()
    if real.exists() and real in (here, *here.parents):
        raise UserError(f"out={out_dir} holds the current folder, which the report would replace (it is written beside "
                        "out= and swapped in whole): run medusa-eval from outside it")
    if real.exists() and not os.access(real.parent, os.W_OK | os.X_OK):
        raise UserError(f"out={out_dir} cannot be replaced: {real.parent} is not writable (the report is written "
                        "beside out= and swapped in whole)")
    existing = next(p for p in (out_dir, *out_dir.absolute().parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"out={out_dir} cannot be created: {existing} is "
                        f"{'a file' if not existing.is_dir() else 'not writable'}")
    made = [p for p in (out_dir.absolute(), *out_dir.absolute().parents) if not p.exists()]
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=out_dir).close()   # an entry the folder really takes (gone on close)
        free = shutil.disk_usage(out_dir).free
        if free < REPORT_ROOM:   # found out only once everything was measured, the report then lost
            raise UserError(f"out={out_dir}: {free / 2**20:.1f} MiB free on its disk, and a report takes up to "
                            f"{REPORT_ROOM >> 20} MiB (written beside the earlier one, then swapped in): free some "
                            "space, or give out= on another disk")
    except OSError as e:
        raise UserError(f"out={out_dir} cannot be created ({e.strerror or e})") from None
    finally:
        for p in made:   # deepest first
            try:
                p.rmdir()
            except OSError:
                pass


REPORT_KEYS = {"settings", "machine", "num_samples", "methods"}   # in every report.json (evaluate's, batch_eval's)


def check_report_owner(out_dir: Path) -> None:
    """Refuse, in one line, a report folder that holds files but is no earlier evaluation's (no report.json with
    ``REPORT_KEYS``), or that holds heads or a model: the evaluation writes report.md, plots and choice files into
    it and drops what an earlier one wrote (``publish_reports``), so out=<heads folder> or a folder of the
    user's own with a report.md lost files. A rerun into an earlier evaluation's folder is taken."""
    if not out_dir.is_dir() or not any(not p.name.startswith(".") for p in out_dir.iterdir()):
        return
    if (out_dir / "config.json").exists() or any(out_dir.glob("*.safetensors")):
        raise UserError(f"out={out_dir} holds heads or a model (config.json, *.safetensors): give the report a "
                        "folder of its own")
    try:
        record = json.loads((out_dir / "report.json").read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        record = None
    if not (isinstance(record, dict) and REPORT_KEYS <= record.keys()):
        raise UserError(f"out={out_dir} holds files but no earlier evaluation's report.json (an evaluation writes "
                        "and removes report files there): give a new or empty folder")


HISTOGRAM_PLOT, HEAD_ACCURACY_PLOT = "acceptance_histogram.png", "head_accuracy.png"


def publish_reports(stage: Path, out_dir: Path, keep: list[Path]) -> list[str]:
    """Make ``stage`` (a folder beside ``out_dir`` holding every file this evaluation wrote) the new ``out_dir`` in one
    swap, with what ``out_dir`` holds besides an evaluation's files (the user's own, the ``keep`` files: the
    choice= file read) carried over. What an earlier evaluation wrote and this one did not (its plots, trade-off
    matrix, choice files: another heads' choice file decodes wrong heads) is left behind; returns those names.
    Written file by file into ``out_dir``, a kill left a new report.json beside the earlier run's plots and choice
    files, or a report without its plots (a half-written one among them), which a later run took as an evaluation."""
    ours = {"report.json", "report.md", HISTOGRAM_PLOT, HEAD_ACCURACY_PLOT, THROUGHPUT_PLOT, *COMPARE_FILES}
    open_permissions(stage)   # this evaluation's files (before the carried ones: a hard link shares its mode)
    written, kept = {p.name for p in stage.iterdir()}, {p.resolve() for p in keep}
    stale = []
    for entry in sorted(out_dir.iterdir()) if out_dir.is_dir() else []:
        if entry.name in written:
            continue
        if (entry.name in ours or entry.name.endswith(CHOICE_SUFFIX)) and entry.resolve() not in kept:
            stale.append(entry.name)
        elif entry.is_dir() and not entry.is_symlink():
            shutil.copytree(entry, stage / entry.name, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(entry, stage / entry.name)
    swap_dir_into_place(stage, out_dir)
    return stale


def _link_or_copy(src, dst) -> None:
    """A file carried into the new folder: a hard link (no bytes copied), a copy where the file system has none."""
    if os.path.islink(src):
        os.symlink(os.readlink(src), dst)
        return
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


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
        paths.append(plot_throughput(out_dir / THROUGHPUT_PLOT, report))
    return paths


def print_per_method(report: dict) -> None:
    """One line per method of a one-prompt-at-a-time evaluation: tokens/s, tau, speedups, greedy identity."""
    for meth, row in report.get("per_method", {}).items():
        parts = [f"{_method(meth, row):>14}: {row['tokens_per_s']:8.2f} tok/s", f"tau {_fmt(row.get('tau'))}"]
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


def _speedups(row: dict, cols) -> str:
    """The speedup cells: the pooled ratio, then the median [min-max] of the per-prompt ratios."""
    cells = []
    for key, _ in cols:
        spread = row.get(f"per_prompt_{key}")
        cells.append(_times(row.get(key)) + (f" ({spread[1]:.2f}x [{spread[0]:.2f}-{spread[2]:.2f}])" if spread
                                             else ""))
    return "".join(f" {c} |" for c in cells)


def _method(meth: str, row: dict) -> str:
    """A method's name, marked when it proposed nothing (it fell back to plain decoding: nothing was measured)."""
    return f"{meth} (ran as plain decoding)" if row.get("ran_as_plain_decoding") else meth


SPEEDUP_NOTE = ("Speedups: pooled (all tokens / all seconds), then the median [min-max] of each prompt's own ratio; "
                "tau and the acceptance rate are `-` where nothing was measured (no step verified, nothing proposed).")


def _choices(r: dict) -> list[str]:
    """One line per choice (the shared Medusa tree, then each ``<method>_tree``), plain decoding included."""
    lines = []
    for key, what in [("tree", "tree")] + [(k, k[:-len("_tree")] + " tree") for k in r if k.endswith("_tree")]:
        choice = r.get(key) or {}
        if choice:
            nodes = f" ({choice['nodes']} nodes)" if choice.get("nodes") else ""
            lines.append(f"- {what}: {choice.get('name')}{nodes}" + (f" — {choice['reason']}" if choice.get("reason")
                                                                      else ""))
        timing = choice.get("timing")
        if timing:
            paired = " (each tree costed against the plain runs beside it)" if timing.get("paired") else ""
            lines.append(f"- {what} timing: {timing['rounds']} interleaved rounds{paired}"
                         + ("" if timing.get("stable", True) else " (winner not yet stable)")
                         + "; step ms median [min-max]"
                         + (" (a tree's: its per-round ratio to the plain runs beside it x plain's median)" if paired
                            else "") + ": "
                         + ", ".join(f"{c['name']} {c['step_ms']:.1f} [{c['step_ms_min']:.1f}-{c['step_ms_max']:.1f}]"
                                     + (f" ({c['vs_plain_step']:.2f}x plain)" if "vs_plain_step" in c else "")
                                     for c in [{"name": "plain", **timing["autoregressive"]}, *choice["candidates"]]
                                     if "step_ms_min" in c))
            lines += [f"- warning: {w}" for w in timing.get("warnings", [])]
    return lines


def _prompts_lines(r: dict) -> list[str]:
    """The prompts-held-out note and the prompts whose greedy output differs, per method."""
    lines = [f"- note: {r['prompts_note']}"] if r.get("prompts_note") else []
    if r.get("calibration_prompt_ids"):
        lines.append(f"- calibration prompts (held out, never evaluated): {', '.join(r['calibration_prompt_ids'])}")
    return lines + [f"- **output differs from plain greedy** ({meth}) on prompts: {', '.join(ids)}"
                    for meth, ids in (r.get("greedy_mismatches") or {}).items()]


def headline(r: dict, measured: bool = False) -> tuple[str, dict]:
    """The method the report is about: the first one with an acceptance rate (not a baseline); ``measured``: the
    first whose acceptance rate is not null (it proposed draft tokens, it did not run as plain decoding)."""
    per = r.get("per_method") or {}
    name = next((m for m in r.get("methods", []) if "acceptance_rate" in per.get(m, {})
                 and not (measured and per[m]["acceptance_rate"] is None)), None)
    return name, per.get(name, {})


def _intro(r: dict, s: dict) -> str:
    return (f"{r['num_samples']} samples from `{s.get('prompts', '?')}`, {s.get('max_new_tokens', '?')} new tokens "
            f"max, mode `{s.get('mode', 'greedy')}`, {r['machine'].get('gpu', r['machine']['cpu'])} "
            f"({r['machine']['threads']} threads), {s.get('dtype', '')}")


def markdown(r: dict) -> str:
    s = r.get("settings") or {}
    per = r.get("per_method") or {}
    cols = speedup_columns(per.values())
    title = f"Medusa evaluation: {s['heads']}" if s.get("heads") else f"Decoding evaluation: {s.get('backbone', '')}"
    lines = [f"# {title}", "", _intro(r, s) + ".", "",
             "| method | tau | acceptance rate | tokens/s |" + _speedup_header(cols), "|---" * (4 + len(cols)) + "|"]
    for meth, v in r["tokens_per_s"].items():
        row = per.get(meth, {})
        lines.append(f"| {_method(meth, row)} | {_fmt(row.get('tau'))} | {_fmt(row.get('acceptance_rate'))} | "
                     f"{v:.2f} |" + _speedups(row, cols))
    lines += ["", SPEEDUP_NOTE, *caveats(r)]
    name, row = headline(r)
    if name is not None:
        lines += ["", f"- {_method(name, row)} tau (tokens per verification step): **{_fmt(row.get('tau'))}**",
                  f"- acceptance rate: {_fmt(row.get('acceptance_rate'))}"
                  + (f"; n-alpha: {row['n_alpha']}" if row.get("n_alpha") and row.get("acceptance_rate") is not None
                     else "")]   # nothing proposed (no step: max_new_tokens=1): its zeros measured nothing
        if row.get("greedy_identical_fraction") is not None:  # greedy mode only
            lines.append(f"- output identical to plain greedy: {row['greedy_identical_fraction']}")
    lines += _choices(r) + _prompts_lines(r)
    acc = r.get("head_accuracy")
    if acc:
        lines += ["", "| head | " + " | ".join(f"top-{j}" for j in range(1, 6)) + " |", "|---" * 6 + "|"]
        for k, row in enumerate(acc["topk"], start=1):
            lines.append(f"| {k} | " + " | ".join(f"{v:.3f}" for v in row[:5]) + " |")
    return "\n".join(lines) + "\n"


def plot_report(out_dir: Path, r: dict) -> list[Path]:
    """acceptance_histogram.png (what verification accepted, its own mean in the title) and head_accuracy.png.
    No histogram of a method that ran as plain decoding: its one bar at 1 read as "the heads never accept"."""
    name, row = headline(r, measured=True)
    paths = [plot_histogram(out_dir / HISTOGRAM_PLOT, name, row["accept_length_histogram"],
                            len(row.get("n_alpha") or []))] if row.get("accept_length_histogram") else []
    if r.get("head_accuracy"):
        acc = r["head_accuracy"]
        paths.append(plot_head_accuracy(out_dir / HEAD_ACCURACY_PLOT, acc["topk"], acc.get("measured_on")))
    return paths


# -- the trade-off matrix ----------------------------------------------------------------------
COMPARE_FILES = ("compare.md", "compare.png")


def _size(n: float, unit: str) -> str:
    for scale, prefix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {prefix}{unit}"
    return f"{n:.0f} {unit}".strip()


def _same(row: dict, greedy: bool, method: str = "") -> str:
    ident = row.get("greedy_identical_fraction")
    if not greedy:
        return "n/a (sampling)"
    if method == "autoregressive":   # what the others are compared with
        return "reference"
    return "-" if ident is None else "yes" if ident == 1.0 else f"no ({ident:.0%} of prompts)"


def _option(v) -> str:
    """A method option as the matrix shows it: a tree file's contents by its name and size (its raw dict, every
    path of the tree, filled the settings line), anything else as it is."""
    if isinstance(v, dict) and "choices" in v:
        return f"{v.get('name', 'tree')} ({v.get('num_nodes', len(v['choices']) + 1)} nodes)"
    return str(v)


def compare_markdown(r: dict) -> str:
    """The trade-off matrix: one row per method (definitions: module docstring)."""
    s = r.get("settings") or {}
    per, costs, opts = r["per_method"], r.get("costs", {}), r.get("method_options", {})
    cols = speedup_columns(per.values())
    greedy = s.get("mode", "greedy") == "greedy"
    lines = [f"# Decoding methods compared: {s.get('backbone') or s.get('heads') or ''}", "",
             _intro(r, s) + "; methods interleaved per prompt.", "",
             "| method | tau | acceptance rate | tokens/s |" + _speedup_header(cols)
             + " extra parameters | extra KV cache | training needed | output = plain greedy |",
             "|---" * (8 + len(cols)) + "|"]
    for meth in r["methods"]:
        row, cost = per[meth], costs.get(meth, {})
        params = cost.get("extra_parameters", 0)
        p_txt = "0" if not params else f"{_size(params, '')} ({_size(cost.get('extra_parameter_bytes', 0), 'B')})"
        kv = cost.get("extra_kv_cache_bytes", 0)
        lines.append(f"| {_method(meth, row)} | {_fmt(row.get('tau'), '.2f')} | "
                     f"{_fmt(row.get('acceptance_rate'), '.3f')} | {row['tokens_per_s']:.2f} |{_speedups(row, cols)} "
                     f"{p_txt} | {_size(kv, 'B') if kv else '0'} | {cost.get('training', 'none')} | "
                     f"{_same(row, greedy, meth)} |")
    notes = [f"{_method(meth, per[meth])}: " + ", ".join(f"{k} = {_option(v)}" for k, v in opts[meth].items())
             for meth in r["methods"] if opts.get(meth)]
    lines += ["", "Settings: " + "; ".join(notes) + "." if notes else "", *_prompts_lines(r), "", SPEEDUP_NOTE,
              *caveats(r), "",
              "tau = tokens per verification step (bonus included; plain decoding 1.0); acceptance rate = accepted "
              "/ proposed draft tokens; tokens/s include prefill; speedups from the same run. Extra parameters: "
              "loaded beyond the backbone, tensors shared with it not counted. Extra KV cache: cache allocated "
              f"beyond plain decoding's, at {r.get('run_length', '?')} tokens (longest prompt + max_new_tokens)."]
    return "\n".join(lines) + "\n"


def write_compare(out_dir: Path, report: dict) -> list[Path]:
    """compare.md (the trade-off matrix) and compare.png (speedup, tau, tokens/s per method)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    md = out_dir / COMPARE_FILES[0]
    md.write_text(compare_markdown(report))
    return [md, plot_compare(out_dir / COMPARE_FILES[1], report)]
