"""Writing what ``batch_eval`` measured: the batched report.md (``throughput_vs_batch.png`` is drawn by
``inference.report_plots``). The metric definitions live in ``batch_eval``'s docstring; this module only formats
them.
"""

from __future__ import annotations

THROUGHPUT_PLOT = "throughput_vs_batch.png"


def _times(v) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _ratio(row: dict, key: str) -> str:
    """The pooled ratio with the batch-by-batch median [min-max] beside it."""
    spread = row.get(f"{key}_runs")
    return _times(row.get(key)) + (f" ({spread[1]:.2f}x [{spread[0]:.2f}-{spread[2]:.2f}])" if spread else "")


def _fmt(v, spec=".3f", default="-") -> str:
    return default if v is None else format(v, spec)


def _identity(row: dict) -> str:
    checks = row.get("identical_to_plain_batched", []) + row.get("identical_to_batch1", [])
    if "greedy_identical" not in row:
        return "n/a (sampling)"
    return "yes" if row["greedy_identical"] else f"no ({checks.count(False)} row checks differ)"


def caveats(r: dict, per_prompt: bool = True) -> list[str]:
    """Notes for figures that cannot mean what they seem to: with ``max_new_tokens=1`` every method's one token
    comes from the prompt's forward (no draft is verified: speedups of prefills); with one prompt a per-prompt
    median [min-max] is that prompt's single ratio, or the spread of its turns (``turns=both``) and none across
    prompts (``per_prompt``: the report's ranges are over prompts and turns)."""
    lines = []
    if (r.get("settings") or {}).get("max_new_tokens") == 1:
        lines.append("- note: max_new_tokens=1: each method's one token comes from the prompt's forward and no draft "
                     "is verified, so the speedups compare prefills, not decoding")
    ids = r.get("evaluated_prompt_ids")
    prompts = len(ids) if isinstance(ids, list) else r.get("num_samples")
    if per_prompt and prompts == 1:
        samples = r.get("num_samples") or 1
        lines.append("- note: one prompt evaluated: each median [min-max] is " +
                     ("that prompt's ratio alone, no spread" if samples == 1 else
                      f"over its {samples} turns alone, no spread across prompts"))
    return lines


def paying(b: dict, meth: str, size) -> str:
    """Where speculation paid, from ``size`` (``batch_eval.stops_paying``: the smallest batch size where it was not
    faster than the plain batched loop). "Stops paying at batch size 1" said it had paid before, when it never
    had; a size where it was faster again is named too."""
    if size is None:
        return "faster than the plain batched loop at every batch size measured"
    faster = [s for s in b["batch_sizes"] if b["per_batch_size"][str(s)]["tokens_per_s"][meth]
              > b["per_batch_size"][str(s)]["tokens_per_s"]["autoregressive"]]
    if not faster:
        return "never faster than plain decoding (the plain batched loop) at any batch size measured"
    text = (f"speculation stops paying at batch size {size}" if faster[0] < size
            else f"not faster than the plain batched loop at batch size {size}")
    later = [str(s) for s in faster if s > size]
    again = " again" if faster[0] < size else ""
    return text + (f"; faster{again} at batch size {', '.join(later)}" if later else "")


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
            lines.append(f"| {size} | {meth} | {spec} | {row['tokens_per_s']:.2f} | {_fmt(row.get('tau'))} | "
                         f"{_ratio(row, 'speedup_vs_autoregressive')} | "
                         f"{_ratio(row, 'speedup_vs_hf_generate')} "
                         f"| {_identity(row)} |")
    lines.append("")
    lines += [f"- {meth}: {paying(b, meth, size)}" for meth, size in b.get("speculation_stops_paying", {}).items()]
    for meth, spec in (b.get("speculation") or {}).items():
        how = spec.get("tree") or spec.get("chain")
        lines.append(f"- {meth}: speculation per batch size ({how}): "
                     + ", ".join(f"{k}: {v}" for k, v in spec["schedule"].items()))
    if b.get("greedy_reference"):
        lines.append(f"- greedy identity: each row against the plain batched loop's row and against "
                     f"{b['greedy_reference']}")
    lines += [f"- **output differs from greedy** ({meth}) on prompts: {', '.join(map(str, ids))}"
              for meth, ids in (b.get("greedy_mismatches") or {}).items()]
    lines += [f"- note: {r['prompts_note']}"] if r.get("prompts_note") else []
    lines += caveats(r, per_prompt=False)
    lines += ["", "tokens/s = new tokens of all rows / wall time of all batched runs (prefill included); tau = "
                  "tokens per row-step (bonus included; plain decoding 1.0); speedups pooled (all tokens / all "
                  "seconds), with the median [min-max] of the ratio batch by batch beside them."]
    return "\n".join(lines) + "\n"


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
        print(f"{meth}: {paying(b, meth, size)}")
    for meth, same in (b.get("greedy_identical") or {}).items():
        if meth != "hf_generate":
            print(f"{meth}: every row identical to greedy: {same}")
