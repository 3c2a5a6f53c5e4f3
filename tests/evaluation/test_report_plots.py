"""What the plots and report lines a user reads after medusa-eval and training say (inference/report_plots.py,
evaluation/reports.py, evaluation/batch_reports.py, medusa_train/tracking.py's plot_curves): no plot of a run
that measured nothing, nothing unmeasured drawn as 0, titles that fit and say what was measured, stable colours,
fixed scales and the spread behind a figure. The reports are small dicts cut from real report.json files."""

from __future__ import annotations

import json

import pytest

from inference import report_plots
from inference.evaluation.batch_reports import batched_markdown
from inference.evaluation.reports import HISTOGRAM_PLOT, compare_markdown, markdown, plot_report

MACHINE = {"cpu": "x86_64", "threads": 1}
TREE = {"format": "medusa-tree", "version": 1, "name": "chain3", "num_nodes": 3, "choices": [[0], [0, 0]]}


@pytest.fixture
def figures(monkeypatch):
    """The figures the plot functions draw, kept open past their ``plt.close`` (the PNGs are written as ever)."""
    plt = report_plots.pyplot()
    drawn = []
    monkeypatch.setattr(plt, "close", drawn.append)
    yield drawn
    monkeypatch.undo()
    for fig in drawn:
        plt.close(fig)


def _row(tau=1.2, acceptance=0.1, hist=None, n_alpha=(0.2, 0.0), **extra) -> dict:
    return {"tokens_per_s": 6.4, "tau": tau, "acceptance_rate": acceptance, "proposed_per_step": 2.0,
            "n_alpha": list(n_alpha), "accept_length_histogram": hist if hist is not None else {"1": 23, "2": 7},
            "speedup_vs_autoregressive": 0.86, "per_prompt_speedup_vs_autoregressive": [0.77, 0.85, 0.92], **extra}


def _report(per: dict, max_new_tokens=24, num_samples=4, **extra) -> dict:
    per = {**per, "autoregressive": {"tokens_per_s": 7.5, "tau": 1.0, "speedup_vs_autoregressive": 1.0}}
    return {"settings": {"prompts": "embedded:mtbench", "max_new_tokens": max_new_tokens, "mode": "greedy"},
            "machine": MACHINE, "num_samples": num_samples, "methods": list(per),
            "tokens_per_s": {m: row["tokens_per_s"] for m, row in per.items()}, "per_method": per, **extra}


def _inside_figure(fig, artist) -> bool:
    fig.canvas.draw()
    box, page = artist.get_window_extent(), fig.bbox
    return page.x0 <= box.x0 and box.x1 <= page.x1 and page.y0 <= box.y0 and box.y1 <= page.y1


def test_no_acceptance_histogram_of_a_run_as_plain_decoding(tmp_path, figures):
    """Guards against acceptance_histogram.png drawn for a method that ran as plain decoding (tree "none",
    nothing proposed, acceptance rate null): one bar "mean 1.00 over 92 steps", read as "the heads never accept".
    A method that did propose is plotted instead; with none, no histogram."""
    plain = _row(tau=1.0, acceptance=None, hist={"1": 92}, n_alpha=(), ran_as_plain_decoding=True)
    assert plot_report(tmp_path, _report({"medusa": plain})) == []
    assert not (tmp_path / HISTOGRAM_PLOT).exists()
    paths = plot_report(tmp_path, _report({"medusa": plain, "draft": _row()}))
    assert [p.name for p in paths] == [HISTOGRAM_PLOT] and figures[-1].axes[0].get_title().startswith("draft:")


def test_histogram_title_fits_ticks_are_whole_and_axis_runs_to_depth_plus_one(tmp_path, figures):
    """Guards against the acceptance histogram's title clipped on the right, fractional ticks (1.5 tokens) on an
    integer count, and acceptance lengths no step reached (up to the tree's depth + 1) left off the axis: a
    depth-4 chain whose steps accepted 1 or 2 tokens showed an axis ending at 2."""
    r = _report({"medusa_lookup": _row(hist={"1": 5, "2": 1}, n_alpha=(0.2, 0.0, 0.0, 0.0))})
    plot_report(tmp_path, r)
    fig = figures[-1]
    ax = fig.axes[0]
    assert _inside_figure(fig, ax.title)
    assert ax.get_xlim() == (0.5, 5.5)
    ticks = [t for t in ax.get_xticks() if 0.5 <= t <= 5.5]
    assert ticks == [1, 2, 3, 4, 5]


def test_compare_plot_marks_nothing_measured_plain_runs_and_spread(tmp_path, figures):
    """Guards against compare.png drawing a null tau as a bar of 0 (read as measured and zero), a method that ran
    as plain decoding unmarked, speedups without the per-prompt [min, median, max] spread report.json has, and
    a title of "1 tokens max" naming neither the mode nor the device."""
    plain = _row(tau=None, acceptance=None, hist={}, ran_as_plain_decoding=True)
    r = _report({"medusa": plain, "draft": _row()}, max_new_tokens=1, num_samples=1)
    report_plots.plot_compare(tmp_path / "compare.png", r)
    fig = figures[-1]
    speed, tau, _ = fig.axes
    assert len(tau.patches) == 2 and [t.get_text() for t in tau.texts] == ["n/a"]   # draft, autoregressive
    assert "medusa (ran as plain decoding)" in [t.get_text() for t in tau.get_xticklabels()]
    caps = [line for line in speed.lines if line.get_marker() == "_"]   # the error bars' caps
    assert sorted(round(y, 2) for line in caps for y in line.get_ydata()) == [0.77, 0.77, 0.92, 0.92]
    title = fig._suptitle.get_text()
    assert "1 new token max" in title and "1 sample," in title and "mode greedy" in title and "x86_64" in title


def test_head_accuracy_is_on_0_to_1_and_says_cumulative_and_measured_on(tmp_path, figures):
    """Guards against head_accuracy.png autoscaling (all-zero accuracies drew -0.05..0.05) and a title saying
    neither that the accuracy is cumulative top-k nor on how many calibration prompts it was measured."""
    acc = {"topk": [[0.0] * 10, [0.0] * 10], "measured_on": "8 calibration prompts (backbone greedy tokens)"}
    plot_report(tmp_path, {**_report({}), "head_accuracy": acc})
    ax = figures[-1].axes[0]
    assert ax.get_ylim() == (0.0, 1.0)
    assert "cumulative top-k" in ax.get_title() and "8 calibration prompts" in ax.get_title()


def _batched(methods: list, tps: dict, plain_at=()) -> dict:
    """A batched report: ``tps`` per method per batch size (1, 2, 4); runs spread +-10%."""
    sizes = [1, 2, 4]
    per_size = {str(s): {"tokens_per_s": {m: tps[m][i] for m in methods},
                         "speculation": {m: "plain" if s in plain_at else "chain3" for m in methods
                                         if m not in ("autoregressive", "hf_generate")},
                         "per_method": {m: {"tokens_per_s": tps[m][i],
                                            "tokens_per_s_runs": [tps[m][i] * 0.9, tps[m][i], tps[m][i] * 1.1]}
                                        for m in methods}}
                for i, s in enumerate(sizes)}
    return {"settings": {"prompts": "p", "max_new_tokens": 24}, "machine": MACHINE, "num_samples": 5,
            "methods": methods, "batched": {"batch_sizes": sizes, "num_prompts": 5, "methods": methods,
                                            "per_batch_size": per_size, "speculation_stops_paying": {}}}


def test_throughput_plot_from_zero_stable_colours_spread_and_plain_points(tmp_path, figures):
    """Guards against throughput_vs_batch.png's y-axis starting near the lowest point (a few percent looked like a
    multiple), colours that follow the method's place in the list (the baseline changed colour between runs),
    no error bars for the spread of several runs, and points where a method ran as plain decoding unmarked."""
    tps = {"medusa": [100, 180, 300], "autoregressive": [110, 190, 320], "hf_generate": [105, 185, 310]}
    colours = []
    for methods in (["medusa", "autoregressive", "hf_generate"], ["autoregressive", "hf_generate"]):
        report_plots.plot_throughput(tmp_path / "t.png", _batched(methods, tps, plain_at=(2,)))
        ax = figures[-1].axes[0]
        colours.append({line.get_label(): line.get_color() for line in ax.lines if line.get_linestyle() == "--"})
    assert colours[0] == colours[1]
    assert ax.get_ylim()[0] == 0
    ax = (report_plots.plot_throughput(tmp_path / "t.png", _batched(list(tps), tps, plain_at=(2,))),
          figures[-1].axes[0])[1]
    assert len(ax.containers) == 3   # one set of min..max error bars per method
    assert [list(c.get_offsets()[0]) for c in ax.collections if c.get_label() == "ran as plain decoding"] == [[2, 180]]


def test_batched_report_never_says_stops_paying_when_it_never_paid():
    """Guards against the batched report.md saying "speculation stops paying at batch size 1" of a method that was
    never faster than plain decoding at any batch size (it never paid), and against hiding a later batch size
    where it was faster after all."""
    tps = {"medusa": [100, 180, 300], "autoregressive": [110, 190, 320], "hf_generate": [105, 185, 310]}
    r = _batched(list(tps), tps)
    r["batched"]["speculation_stops_paying"] = {"medusa": 1}
    md = batched_markdown(r)
    assert "- medusa: never faster than plain decoding" in md and "stops paying" not in md
    r["batched"]["per_batch_size"]["4"]["tokens_per_s"]["medusa"] = 330
    md = batched_markdown(r)
    assert "- medusa: not faster than the plain batched loop at batch size 1; faster at batch size 4" in md


def test_compare_settings_name_the_tree_instead_of_dumping_it():
    """Guards against compare.md's "Settings:" line printing the raw tree dict ({'format': 'medusa-tree', ...,
    'choices': [[0], [1], ...]}) instead of the tree's name and node count."""
    cmp = compare_markdown(_report({"medusa": _row()}, method_options={"medusa": {"tree": TREE}}))
    assert "medusa: tree = chain3 (3 nodes)." in cmp and "choices" not in cmp


def test_no_n_alpha_when_nothing_was_proposed():
    """Guards against report.md printing "n-alpha: [0.0, 0.0]" for a run that proposed nothing (max_new_tokens=1:
    no verification step), as if two depths had been measured at zero acceptance."""
    plain = _row(tau=None, acceptance=None, hist={}, n_alpha=(0.0, 0.0), ran_as_plain_decoding=True)
    md = markdown(_report({"medusa": plain}, max_new_tokens=1))
    assert "n-alpha" not in md and "- acceptance rate: -" in md
    assert "n-alpha: [0.2, 0.0]" in markdown(_report({"medusa": _row()}))


def test_reports_say_when_speedups_measure_a_prefill_or_a_single_prompt():
    """Guards against report.md and compare.md printing speedups of a max_new_tokens=1 run (each method's one token
    from the prompt's forward, no draft verified) as decoding speedups, and a single prompt's "median [min-max]" as
    if it were a spread across prompts (also under turns=both, where the one prompt's two turns made num_samples 2 and
    the note never came); the batched report's ranges are over batches: no one-prompt note there."""
    one = _report({"medusa": _row()}, max_new_tokens=1, num_samples=1)
    for md in (markdown(one), compare_markdown(one)):
        assert "max_new_tokens=1: each method's one token comes from the prompt's forward" in md
        assert "one prompt evaluated" in md
    for md in (markdown(_report({"medusa": _row()})), compare_markdown(_report({"medusa": _row()}))):
        assert "max_new_tokens=1" not in md and "one prompt evaluated" not in md
    two_turns = _report({"medusa": _row()}, num_samples=2, evaluated_prompt_ids=["81"])   # turns=both
    for md in (markdown(two_turns), compare_markdown(two_turns)):
        assert "one prompt evaluated: each median [min-max] is over its 2 turns alone, no spread across prompts" in md
    batched = {"batch_sizes": [1], "num_prompts": 1, "per_batch_size": {}}
    md = batched_markdown({**_report({}, max_new_tokens=1, num_samples=1), "batched": batched})
    assert "compare prefills" in md and "one prompt evaluated" not in md


def test_training_curves_show_eval_loss_legend_off_the_lines_whole_steps(tmp_path, monkeypatch):
    """Guards against training_curves.png leaving out the held-out (eval) loss the final table prints, a legend
    drawn over the curves, and fractional step ticks (step 2.5) on a short run."""
    from medusa_train.tracking import plot_curves

    plt = report_plots.pyplot()
    drawn = []
    monkeypatch.setattr(plt, "close", drawn.append)
    head = {"head1/loss": 4.0, "head1/top1": 0.1, "head2/loss": 4.2, "head2/top1": 0.05}
    records = [{"step": s, "kind": "train", "loss": 8.0, **head} for s in (1, 2, 3)]
    records.append({"step": 3, "kind": "eval", "loss": 8.5, **{k: v + 0.3 for k, v in head.items()}})
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert plot_curves(metrics, tmp_path / "curves.png") is not None
    fig = drawn[-1]
    ax_loss = fig.axes[0]
    assert [line.get_ydata()[0] for line in ax_loss.lines if "eval" in line.get_label()] == [4.3, 4.5]
    fig.canvas.draw()
    for ax in fig.axes:
        legend = ax.get_legend().get_window_extent()
        assert not legend.overlaps(ax.get_window_extent())
        assert all(float(t).is_integer() for t in ax.get_xticks())
    monkeypatch.undo()
    plt.close(fig)
