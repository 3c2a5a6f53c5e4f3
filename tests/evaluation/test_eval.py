"""Evaluation harness (inference/evaluate.py, inference/cli.py): metric definitions, prompt
loading, the interleaved end-to-end evaluation on a tiny model, and the CLIs' bad-input paths."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from inference.runtime.decode import GenerationOutput
from inference.errors import UserError
from inference.evaluation.evaluate import Sample, evaluate, summarize
from inference.prompts import Prompt, load_prompts
from inference.evaluation.reports import check_report_dir, write_report
from inference.runtime.model import MedusaModel
from runtime_support import one_thread, random_heads  # noqa: F401  (fixture)


def _gen(tokens, lengths, secs=1.0):
    g = GenerationOutput(tokens=list(tokens), prompt_tokens=3, finish_reason="length", accept_lengths=list(lengths))
    g.decode_s = secs
    return g


def test_summary_metrics_follow_the_documented_definitions():
    """Guards against: tau, acceptance rate or n-alpha computed differently from the field's
    definitions (tau counts the bonus token; a step proposes tree-depth tokens)."""
    s = Sample("1", 1)
    s.outputs = {"medusa": _gen(range(6), [3, 1, 2], secs=1.0), "autoregressive": _gen(range(6), [1] * 6, secs=2.0)}
    s.tokens = {k: list(v.tokens) for k, v in s.outputs.items()}
    r = summarize([s], ["medusa", "autoregressive"], {"medusa": 2})["per_method"]["medusa"]  # tree depth 2
    assert r["tau"] == pytest.approx(2.0)
    assert r["acceptance_rate"] == pytest.approx(3 / 6)
    assert r["n_alpha"] == pytest.approx([2 / 3, 1 / 2], abs=1e-4)
    assert r["speedup_vs_autoregressive"] == pytest.approx(2.0)
    assert r["greedy_identical_fraction"] == 1.0
    assert r["accept_length_histogram"] == {"1": 1, "2": 1, "3": 1}


def test_per_method_acceptance_uses_each_steps_proposed_tokens():
    """Guards against: the chain methods' acceptance rate computed against the tree depth (or the
    bonus counted as accepted) instead of accepted / proposed draft tokens per step."""
    s = Sample("1", 1)
    spec = GenerationOutput(tokens=list(range(9)), prompt_tokens=3, finish_reason="length",
                             accept_lengths=[3, 1, 5], proposed=[4, 0, 4])
    spec.decode_s = 1.0
    s.outputs = {"prompt_lookup": spec, "autoregressive": _gen(range(9), [1] * 9, secs=3.0)}
    s.tokens = {k: list(v.tokens) for k, v in s.outputs.items()}
    r = summarize([s], ["prompt_lookup", "autoregressive"], None)
    row = r["per_method"]["prompt_lookup"]
    assert row["tau"] == pytest.approx(3.0) and row["acceptance_rate"] == pytest.approx(6 / 8)
    assert row["speedup_vs_autoregressive"] == pytest.approx(3.0) and row["greedy_identical_fraction"] == 1.0
    assert "acceptance_rate" not in r["per_method"]["autoregressive"] and "medusa" not in r["per_method"]


def test_identity_fraction_counts_differing_outputs():
    """Guards against: reporting lossless output when Medusa's tokens differ from plain greedy."""
    a, b = Sample("1", 1), Sample("2", 1)
    for s, med in ((a, [1, 2, 3]), (b, [1, 2, 9])):
        s.outputs = {"medusa": _gen(med, [3]), "autoregressive": _gen([1, 2, 3], [1, 1, 1])}
        s.tokens = {k: list(v.tokens) for k, v in s.outputs.items()}
    r = summarize([a, b], ["medusa", "autoregressive"], {"medusa": 2})
    assert r["per_method"]["medusa"]["greedy_identical_fraction"] == 0.5


def test_prompt_forms_and_bad_prompt_files(tmp_path):
    """Guards against: a prompts file in another common form being misread, and an empty prompt,
    a bad line or a missing file crashing with a traceback instead of one clear error."""
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps(x) for x in [
        {"question_id": 7, "turns": ["first?", "second?"], "category": "x"},
        {"prompt": "plain"},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
    ]) + "\n")
    ps = load_prompts(str(f))
    assert [p.turns for p in ps] == [["first?", "second?"], ["plain"], ["hi"]]
    assert ps[0].id == "7" and load_prompts(str(f), limit=1)[0].id == "7"
    for bad in ('{"prompt": "  "}', "{not json", '{"other": 1}'):
        f.write_text(bad + "\n")
        with pytest.raises(UserError):
            load_prompts(str(f))
    with pytest.raises(UserError, match="not found"):
        load_prompts(str(tmp_path / "missing.jsonl"))


def test_openai_content_parts_are_read_as_text(tmp_path):
    """Guards against a messages record written as OpenAI's chat API writes it (content a list of text parts) being
    refused as "an empty or missing prompt", and an image part being called empty instead of not text."""
    parts = [{"type": "text", "text": "Describe"}, {"type": "text", "text": "the sea."}]
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"messages": [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                                          {"role": "user", "content": parts}]}) + "\n")
    p = load_prompts(str(f))[0]
    assert p.turns == ["Describe\nthe sea."] and p.system == "Be brief."
    f.write_text(json.dumps({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x.png"}}]}]}) + "\n")
    with pytest.raises(UserError, match="content is not text"):
        load_prompts(str(f))


def test_two_prompts_sharing_an_id_are_refused_naming_both_lines(tmp_path):
    """Guards against: two prompts of one file given the same id (an ``"id": "5"`` and line 5 without one, which is
    numbered by its line; one id twice; ``question_id`` 81 and ``"81"``, both read as "81"): report.json's
    ``evaluated_prompt_ids`` named two prompts at once, and ``prompt_record`` refused a calibration prompt that is
    not an evaluated one as "also evaluated"."""
    f = tmp_path / "prompts.jsonl"
    cases = {"line number": ([{"prompt": f"q{i}"} for i in range(1, 5)] + [{"prompt": "q5"}, {"prompt": "q6"},
                                                                            {"id": "5", "prompt": "q7"}], 7, "5", 5),
             "same id": ([{"id": "a", "prompt": "x"}, {"prompt": "y"}, {"id": "a", "prompt": "z"}], 3, "a", 1),
             "number and text": ([{"question_id": 81, "turns": ["x"]}, {"question_id": "81", "turns": ["y"]}], 2,
                                 "81", 1)}
    for name, (records, line, pid, first) in cases.items():
        f.write_text("\n".join(json.dumps(x) for x in records) + "\n")
        with pytest.raises(UserError) as e:
            load_prompts(str(f))
        assert str(e.value).startswith(f"{f}:{line} repeats the id {pid!r} of line {first}"), (name, str(e.value))
        assert str(e.value).endswith("give each prompt its own id") and "\n" not in str(e.value), name
    distinct = [{"id": "x", "prompt": "a"}, {"prompt": "b"}, {"id": 1, "prompt": "c"}, {"prompt": "d"}]
    f.write_text("\n".join(json.dumps(x) for x in distinct) + "\n")
    assert [p.id for p in load_prompts(str(f))] == ["x", "2", "1", "4"]   # different ids: read as before
    nulls = [{"id": None, "prompt": "a"}, {"question_id": None, "id": None, "prompt": "b"}, {"id": "c", "prompt": "c"}]
    f.write_text("\n".join(json.dumps(x) for x in nulls) + "\n")
    assert [p.id for p in load_prompts(str(f))] == ["1", "2", "c"]   # null is no id: refused as repeating 'None'
    for bundled in ("embedded:mtbench", "code"):   # the sets shipped with the package give each prompt its own id
        ids = [p.id for p in load_prompts(bundled)]
        assert len(set(ids)) == len(ids), bundled


@pytest.fixture(scope="module")
def tiny_medusa():
    from medusa_train.backbone import random_backbone

    bb = random_backbone({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                          "vocab_size": 320, "max_position_embeddings": 512}, seed=0)
    heads = random_heads(bb.model, num_heads=2)
    return MedusaModel(model=bb.model.eval(), tokenizer=bb.tokenizer, heads=heads)


def test_end_to_end_evaluation_on_a_tiny_model(tiny_medusa, tmp_path):
    """Guards against: the interleaved evaluation losing greedy identity, omitting report keys the
    README promises, or failing to write its files; and tree=auto crashing on weak heads."""
    prompts = [Prompt(str(i), [f"question number {i}?", "and then?"]) for i in range(5)]
    report = evaluate(tiny_medusa, prompts, choice="auto", max_new_tokens=12, calibration_prompts=2,
                      calibration_tokens=8, budgets=[1, 2, 4], turns="both", progress=False, log=lambda s: None)
    medusa = report["per_method"]["medusa"]
    for key in ("tau", "acceptance_rate", "tokens_per_s", "speedup_vs_autoregressive", "speedup_vs_hf_generate",
                "greedy_identical_fraction", "n_alpha"):
        assert key in medusa, key
    for key in ("tokens_per_s", "tree", "head_accuracy", "per_method", "costs"):
        assert key in report, key
    assert report["num_samples"] == 3 * 2  # 2 of 5 prompts held out for calibration, both turns
    assert medusa["greedy_identical_fraction"] == 1.0
    assert report["hf_generate_identical_fraction"] == 1.0
    paths = write_report(tmp_path, report)
    assert {p.name for p in paths} >= {"report.json", "report.md", "head_accuracy.png"}
    assert json.loads((tmp_path / "report.json").read_text())["per_method"]["medusa"]["tau"] == medusa["tau"]
    check_report_dir(tmp_path)   # an earlier evaluation's folder: a rerun into it is taken


def test_an_out_folder_that_is_no_evaluations_is_refused_and_left_as_it_was(tmp_path):
    """Guards against: medusa-eval out=<a heads folder, an export or a folder of the user's> writing its report
    there and deleting files with the evaluation's names (a user's own report.md, a choice file) as an earlier
    evaluation's leftovers (``publish_reports``): refused before anything loads; a new or empty folder and
    one holding an earlier evaluation's report.json (its keys: ``REPORT_KEYS``) are taken."""
    (tmp_path / "heads").mkdir()
    (tmp_path / "heads" / "model.safetensors").write_bytes(b"")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "report.md").write_text("my notes")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "report.json").write_text('{"settings": {}}')
    for name, words in (("heads", "holds heads or a model"), ("mine", "no earlier evaluation's report.json"),
                        ("other", "no earlier evaluation's report.json")):
        with pytest.raises(UserError, match=words):
            check_report_dir(tmp_path / name)
    assert (tmp_path / "mine" / "report.md").read_text() == "my notes"
    (tmp_path / "empty").mkdir()
    for name in ("empty", "new"):
        check_report_dir(tmp_path / name)


def test_report_folder_on_a_full_disk_is_refused_before_the_evaluation(tmp_path, monkeypatch):
    """Guards against an evaluation on a disk with no room for its report measuring for its whole run (tens of
    minutes on MT-Bench) and then failing at the write, the measurements lost: refused in one line before
    anything loads, and the folder made for it (with its parents) removed again."""
    import shutil

    from inference.evaluation import reports

    for free in (3 << 20, reports.REPORT_ROOM - 1):
        monkeypatch.setattr(reports.shutil, "disk_usage",
                            lambda path, free=free: shutil._ntuple_diskusage(10 << 30, 10 << 30, free))
        with pytest.raises(UserError, match=r"out=.*/a/eval: \d+\.\d MiB free on its disk, and a report takes up"):
            check_report_dir(tmp_path / "a" / "eval")
        assert not (tmp_path / "a").exists()
    monkeypatch.setattr(reports.shutil, "disk_usage",
                        lambda path: shutil._ntuple_diskusage(10 << 30, 10 << 30, 3 << 20))
    with pytest.raises(UserError, match=r"3\.0 MiB free on its disk, and a report takes up to 16 MiB"):
        check_report_dir(tmp_path / "a" / "eval")
    monkeypatch.setattr(reports.shutil, "disk_usage",
                        lambda path: shutil._ntuple_diskusage(10 << 30, 10 << 30, reports.REPORT_ROOM))
    check_report_dir(tmp_path / "a" / "eval")


def test_fixed_tree_and_sampling_mode_run(tiny_medusa):
    """Guards against: a given tree or the exact-sampling mode breaking the harness (hf_generate
    is greedy-only and must be refused in sample mode with a clear error)."""
    from inference.runtime.verify import SamplingConfig

    prompts = [Prompt("a", ["hello there"])]
    r = evaluate(tiny_medusa, prompts, methods=["medusa", "autoregressive"], tree="chain3", max_new_tokens=8,
                 sampling=SamplingConfig(mode="sample", temperature=0.8), progress=False, log=lambda s: None)
    assert r["tree"]["name"] == "chain3" and r["per_method"]["medusa"]["tau"] >= 1.0
    with pytest.raises(UserError, match="greedy"):
        evaluate(tiny_medusa, prompts, methods=["hf_generate"], tree="chain3", max_new_tokens=4,
                 sampling=SamplingConfig(mode="sample", temperature=0.8), progress=False, log=lambda s: None)
    with pytest.raises(UserError, match="max_new_tokens"):
        evaluate(tiny_medusa, prompts, tree="chain3", max_new_tokens=0, progress=False, log=lambda s: None)
    with pytest.raises(UserError, match="unknown method"):
        evaluate(tiny_medusa, prompts, methods=["nope"], tree="chain3", progress=False, log=lambda s: None)


def test_calibrated_budget_keeps_its_tree_whatever_its_speed(tiny_medusa):
    """Guards against comparing head families at different tree sizes: tree=calibrated:N must
    grow an N-node tree from the heads' own accuracy and decode with it (never fall back), and
    a bad N is one clear error."""
    prompts = [Prompt(str(i), [f"question {i}?"]) for i in range(4)]
    r = evaluate(tiny_medusa, prompts, methods=["medusa", "autoregressive"], tree="calibrated:4", max_new_tokens=8,
                 calibration_prompts=2, calibration_tokens=8, progress=False, log=lambda s: None)
    assert r["tree"]["nodes"] == 4 and r["tree"]["name"] == "calibrated4"
    assert r["per_method"]["medusa"]["greedy_identical_fraction"] == 1.0
    with pytest.raises(UserError, match="calibrated:N"):
        evaluate(tiny_medusa, prompts, tree="calibrated:1", max_new_tokens=4, progress=False, log=lambda s: None)


@pytest.mark.parametrize("cmd, args, words", [
    ("eval_main", ["heads=/nonexistent/heads"], "not found"),
    ("eval_main", ["heads=/x", "nope=1"], "nope"),
    ("eval_main", ["heads=/x", "max_new_tokens=abc"], "max_new_tokens"),
    ("eval_main", ["heads"], "key=value"),
    ("generate_main", ["heads=/x", "prompt="], "prompt"),
])
def test_cli_bad_input_is_one_line_and_exit_2(cmd, args, words):
    """Guards against: user mistakes on medusa-eval / medusa-generate ending in a traceback or a
    zero exit status."""
    code = f"import sys; from inference.cli import {cmd}; {cmd}(sys.argv[1:])"
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and words in lines[0], proc.stderr


def test_sample_mode_reports_no_greedy_identity(tiny_medusa, tmp_path):
    """Guards against: sample-mode reports saying "identical to greedy: 0.0" (sampled outputs differ from
    greedy by design, so the number means nothing there): report.json omits the key in sample mode,
    report.md and the trade-off matrix do not claim it; greedy mode still reports it."""
    from inference.evaluation.reports import compare_markdown, markdown
    from inference.runtime.verify import SamplingConfig

    prompts = [Prompt("a", ["hello there"]), Prompt("b", ["and you?"])]
    r = evaluate(tiny_medusa, prompts, methods=["medusa", "autoregressive"], tree="chain3", max_new_tokens=6,
                 sampling=SamplingConfig(mode="sample", temperature=0.8), progress=False, log=lambda s: None,
                 settings={"mode": "sample"})
    for meth, row in r["per_method"].items():
        assert "greedy_identical_fraction" not in row, meth
    assert "hf_generate_identical_fraction" not in r
    write_report(tmp_path, r)
    assert "greedy_identical" not in (tmp_path / "report.json").read_text()
    assert "identical to plain greedy" not in markdown(r)
    assert "| n/a (sampling) |" in compare_markdown(r)
    g = evaluate(tiny_medusa, prompts, methods=["medusa", "autoregressive"], tree="chain3", max_new_tokens=6,
                 progress=False, log=lambda s: None, settings={"mode": "greedy"})
    assert g["per_method"]["medusa"]["greedy_identical_fraction"] == 1.0
    assert "output identical to plain greedy: 1.0" in markdown(g)


def test_a_prompts_file_with_a_byte_order_mark_is_read(tmp_path):
    """Guards against: a UTF-8 prompts file saved with a byte-order mark (Windows editors) refused as "line 1 is
    not valid JSON" (the training data readers take them)."""
    f = tmp_path / "bom.jsonl"
    f.write_text('{"prompt": "Hi there"}\n{"prompt": "Bye"}\n', encoding="utf-8-sig")
    assert [p.turns for p in load_prompts(str(f))] == [["Hi there"], ["Bye"]]


def test_a_prompt_with_a_lone_surrogate_is_refused_in_one_line(tmp_path):
    """Guards against: a prompts line whose JSON escapes half a UTF-16 pair ("\\ud800") read as text and ending in
    the tokenizer's 41-line TypeError traceback after the backbone loaded; a whole pair (an emoji) is text."""
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "ok \\ud83d\\ude00"}\n{"prompt": "bad \\ud800"}\n')
    with pytest.raises(UserError, match=r"p.jsonl:2 holds a lone surrogate"):
        load_prompts(str(f))
    f.write_text('{"prompt": "ok \\ud83d\\ude00"}\n')
    assert load_prompts(str(f))[0].turns == ["ok \U0001f600"]


def test_a_prompts_file_of_one_json_array_says_so(tmp_path):
    """Guards against: a prompts file holding a JSON array (a list of prompts on one line) refused as "an empty or
    missing prompt", which sends the user looking for an empty prompt."""
    f = tmp_path / "p.jsonl"
    f.write_text('[{"prompt": "a"}, {"prompt": "b"}]\n')
    with pytest.raises(UserError, match=r":1 is a JSON array: a prompts file holds one JSON object"):
        load_prompts(str(f))
