"""The trade-off matrix (inference/evaluate.py ``write_compare``, ``medusa-eval compare=true``):
every method in one interleaved run, its report files, the cost columns, the bundled code
prompts, and the bad-input paths of the method selection."""

from __future__ import annotations

import json
import subprocess
import sys
import types

import pytest

from inference.errors import UserError
from inference.evaluation.evaluate import evaluate
from inference.prompts import Prompt, load_prompts
from inference.evaluation.reports import COMPARE_FILES, write_compare, write_report
from inference.methods import get, names
from inference.methods.medusa_lookup import MedusaLookupOptions
from inference.methods.registry import kv_bytes_per_token
from inference.methods.lookahead import LookaheadSettings
from inference.runtime.model import MedusaModel
from inference.methods.prompt_lookup import PromptLookupSettings
from inference.methods.draft import DraftSettings

from runtime_support import one_thread, random_heads  # noqa: F401 (autouse fixture)

TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 320, "max_position_embeddings": 512}


@pytest.fixture(scope="module")
def backbone():
    from medusa_train.backbone import random_backbone

    return random_backbone(TINY, seed=0)


@pytest.fixture(scope="module")
def with_heads(backbone):
    return MedusaModel(model=backbone.model.eval(), tokenizer=backbone.tokenizer,
                       heads=random_heads(backbone.model, num_heads=2))


# every method Medusa heads decode with (eagle3 and eagle3_lookup need EAGLE-3 heads: their own files)
METHODS = tuple(x for x in names() if x not in ("eagle3", "eagle3_lookup"))
OPTIONS = {"draft": DraftSettings(draft="self:1", k=3), "lookahead": LookaheadSettings(window=3, ngram=3, guesses=3),
           "prompt_lookup": PromptLookupSettings(num_tokens=4), "medusa_lookup": MedusaLookupOptions(num_tokens=4)}


def test_compare_runs_every_method_and_writes_the_matrix(with_heads, tmp_path):
    """Guards against: a method missing from the matrix, a method losing greedy identity in the
    harness, cost columns not following their definitions, or a missing report file."""
    prompts = [Prompt(str(i), [f"repeat after me: abc abc abc {i}"]) for i in range(3)]
    settings = {"prompts": "tiny", "max_new_tokens": 10, "mode": "greedy", "backbone": "random:llama"}
    report = evaluate(with_heads, prompts, methods=list(METHODS), tree="chain3", max_new_tokens=10, progress=False,
                      log=lambda s: None, settings=settings, options=OPTIONS)
    assert report["methods"] == list(METHODS)
    for meth in METHODS:
        row = report["per_method"][meth]
        # compared with plain greedy decoding, which is not compared with itself (a check that could not fail)
        assert row.get("greedy_identical_fraction") == (None if meth == "autoregressive" else 1.0), meth
        assert {"tau", "tokens_per_s", "speedup_vs_autoregressive", "speedup_vs_hf_generate"} <= set(row), meth
        if not get(meth).baseline:   # the baselines (hf_generate_static too) have no acceptance rate
            assert 0 <= row["acceptance_rate"] <= 1 and row["tau"] >= 1.0, meth
    costs, per_token = report["costs"], kv_bytes_per_token(with_heads)
    assert costs["draft"]["extra_parameters"] == 0 and costs["draft"]["training"].startswith("none")
    assert costs["medusa"]["extra_parameters"] > 0 and costs["medusa"]["training"] == "heads"
    assert costs["prompt_lookup"]["extra_kv_cache_bytes"] == 5 * per_token
    assert costs["lookahead"]["extra_kv_cache_bytes"] == (1 + 2 * (3 + 3)) * per_token
    assert costs["draft"]["extra_kv_cache_bytes"] == 4 * per_token + (report["run_length"] + 5) * per_token // 2
    assert costs["autoregressive"]["extra_kv_cache_bytes"] == 0

    paths = write_report(tmp_path, report) + write_compare(tmp_path, report)
    assert {p.name for p in paths} >= {"report.json", "report.md", *COMPARE_FILES}
    assert all(p.is_file() and p.stat().st_size > 0 for p in paths)
    table = [line for line in (tmp_path / "compare.md").read_text().splitlines() if line.startswith("| ")]
    assert table[0].startswith("| method | tau | acceptance rate | tokens/s")
    assert [line.split("|")[1].strip() for line in table[1:]] == list(METHODS)
    assert all(line.rstrip(" |").endswith("reference" if line.startswith("| autoregressive ") else "yes")
               for line in table[1:])
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["per_method"]["lookahead"]["tau"] == report["per_method"]["lookahead"]["tau"]


def test_training_free_methods_run_without_heads(backbone):
    """Guards against: the harness requiring heads for methods that need none, and method medusa
    without heads failing late or with a traceback instead of one clear error."""
    bare = MedusaModel(model=backbone.model.eval(), tokenizer=backbone.tokenizer, heads=None)
    prompts = [Prompt("a", ["hello there"])]
    r = evaluate(bare, prompts, methods=["lookahead", "prompt_lookup", "draft", "autoregressive"], max_new_tokens=6,
                 progress=False, log=lambda s: None, options=OPTIONS)
    assert r["per_method"]["draft"]["greedy_identical_fraction"] == 1.0 and "medusa" not in r["per_method"]
    with pytest.raises(UserError, match="heads"):
        evaluate(bare, prompts, methods=["medusa", "autoregressive"], progress=False, log=lambda s: None)
    for bad, words in ((["beam"], "unknown method"), (["draft", "draft"], "twice")):
        with pytest.raises(UserError, match=words):
            evaluate(bare, prompts, methods=bad, progress=False, log=lambda s: None)


def test_code_prompt_set_is_bundled():
    """Guards against the code / structured-output prompt set missing from the package."""
    prompts = load_prompts("code")
    assert len(prompts) >= 20 and all(p.turns[0].strip() for p in prompts)
    assert len({p.id for p in prompts}) == len(prompts)
    assert load_prompts("embedded:code", limit=3)[2].id == prompts[2].id


def _eval_cli(args, timeout=180):
    code = "import sys; from inference.cli import eval_main; eval_main(sys.argv[1:])"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("args, words", [
    (["methods=[beam]"], "unknown method"),
    (["methods=[draft]", "draft_k=0"], "draft_k"),
    (["methods=[lookahead]", "lookahead_window=1"], "window"),
    (["methods=[lookahead]", "lookahead_ngram=1"], "ngram"),
    (["methods=[draft]", "draft=self:x"], "self:N"),
    (["methods=[medusa]"], "heads"),
    ([], "heads="),
    (["compare=true", "methods=[draft]"], "one of"),
    (["method=draft"], "methods=["),
])
def test_cli_method_selection_errors_are_one_line_and_exit_2(args, words):
    """Guards against bad method names or settings ending in a traceback, a zero exit status, or
    only after minutes of model loading (they are checked first)."""
    proc = _eval_cli(args)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and words in lines[0] and "Traceback" not in proc.stderr, proc.stderr


def test_cli_compare_end_to_end_on_a_local_tiny_backbone(backbone, tmp_path):
    """Guards against the compare command failing to wire backbone=, the method settings, the
    prompts and the output files together (a saved random model: no network, no heads)."""
    model_dir = tmp_path / "tiny"
    backbone.model.save_pretrained(model_dir)
    backbone.tokenizer.save_pretrained(model_dir)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"say {w} {w} {w}"}) for w in ("one", "two")) + "\n")
    out = tmp_path / "cmp"
    proc = _eval_cli([f"backbone={model_dir}", f"prompts={prompts}", "compare=true", "max_new_tokens=6",
                      "draft=self:1", "draft_k=2", "lookahead_window=2", "lookahead_ngram=2", "threads=1",
                      "progress_bar=false", f"out={out}"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {p.name for p in out.iterdir()} >= {"report.json", "report.md", *COMPARE_FILES}
    report = json.loads((out / "report.json").read_text())
    assert report["methods"] == ["draft", "lookahead", "prompt_lookup", "autoregressive", "hf_generate"]
    opts = report["method_options"]
    assert opts["draft"]["draft"] == "self:1" and opts["lookahead"]["lookahead_window"] == 2


def test_an_evaluation_into_an_earlier_ones_folder_leaves_none_of_its_files(tmp_path):
    """Guards against: two evaluations mixed in one out= folder. The second one's report.json sat beside the
    first one's head_accuracy.png, trade-off matrix and choice files (another heads' choice file, offered to
    medusa-generate as if it were this report's). Files an evaluation never writes are kept."""
    from inference.evaluation.reports import publish_reports

    out, stage = tmp_path / "eval", tmp_path / ".eval.tmp-1"
    out.mkdir()
    stage.mkdir()
    for name in ("report.json", "report.md", "head_accuracy.png", "compare.md", "compare.png",
                 "medusa_choice.json", "throughput_vs_batch.png", "notes.txt", "my_plot.png"):
        (out / name).write_text("earlier")
    (out / "mine").mkdir()
    (out / "mine" / "a.txt").write_text("mine")
    for name in ("report.json", "report.md", "eagle3_choice.json"):   # this evaluation's files
        (stage / name).write_text("new")
    removed = publish_reports(stage, out, keep=[])
    assert removed == ["compare.md", "compare.png", "head_accuracy.png", "medusa_choice.json",
                       "throughput_vs_batch.png"]
    assert sorted(f.name for f in out.iterdir()) == ["eagle3_choice.json", "mine", "my_plot.png", "notes.txt",
                                                     "report.json", "report.md"]
    assert (out / "report.json").read_text() == "new" and (out / "notes.txt").read_text() == "earlier"
    assert (out / "mine" / "a.txt").read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == ["eval"]


def test_an_evaluation_that_fails_while_writing_leaves_the_earlier_one_whole(tmp_path, monkeypatch, capsys):
    """Guards against: a report folder written file by file, so an evaluation killed or failing halfway left its
    new report.json beside the earlier run's plots and choice files, or a report without its plots (one cut short),
    which a later run took as an evaluation. The new files appear together or not at all."""
    import inference.cli as cli
    from inference import cli_run

    for name in ("report.json", "report.md", "head_accuracy.png"):
        (tmp_path / name).write_text("earlier")
    before = {p.name: p.read_text() for p in tmp_path.iterdir()}

    def fails_halfway(out, report):
        (out / "compare.md").write_text("new")
        raise OSError("disk full")

    monkeypatch.setattr(cli_run, "write_report", lambda out, report: [out / "report.json"])
    monkeypatch.setattr(cli_run, "write_compare", fails_halfway)
    cfg = cli.EvalConfig(heads="h", compare=True, out=str(tmp_path))
    with pytest.raises(OSError):
        cli_run.write_eval(cfg, types.SimpleNamespace(heads=None), tmp_path, {}, {}, batched=False)
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == before
    assert not [p for p in tmp_path.parent.iterdir() if p.name.startswith(f".{tmp_path.name}.")]


def test_an_evaluation_keeps_the_choice_file_it_measured_again(tmp_path, monkeypatch, capsys):
    """Guards against: medusa-eval choice=<out>/medusa_choice.json (measured again at fixed, so no choice file is
    written) deleting that very file as an earlier evaluation's leftover: the file users decode with, which may
    have taken hours to measure."""
    import inference.cli as cli
    from inference import cli_run

    given = tmp_path / "medusa_choice.json"
    given.write_text("{}")
    (tmp_path / "eagle3_choice.json").write_text("{}")   # another evaluation's: removed
    monkeypatch.setattr(cli_run, "write_report", lambda out, report: [out / "report.json"])
    monkeypatch.setattr(cli_run, "print_per_method", lambda report: None)
    cfg = cli.EvalConfig(heads="h", choice=str(given), out=str(tmp_path))
    cli_run.write_eval(cfg, types.SimpleNamespace(heads=None), tmp_path, {}, {}, batched=False)
    assert given.exists() and not (tmp_path / "eagle3_choice.json").exists()


def test_a_report_folder_given_by_a_link_or_as_the_current_folder(tmp_path, monkeypatch, capsys):
    """Guards against: the report folder swapped in whole failing after the whole evaluation ran, its report lost to
    a traceback and an empty ``.old-*`` folder left: out= a symbolic link to an earlier evaluation's folder (the
    link cannot be renamed onto a folder) or out=. from inside it (the folder in use cannot be renamed)."""
    import inference.cli as cli
    from inference import cli_run
    from inference.cli_checks import eval_out_dir
    from inference.errors import UserError

    real = tmp_path / "eval"
    real.mkdir()
    record = json.dumps({"settings": {}, "machine": {}, "num_samples": 0, "methods": ["new"]})
    (real / "report.json").write_text(record.replace("new", "earlier"))
    link = tmp_path / "link"
    link.symlink_to(real)
    cfg = cli.EvalConfig(heads="h", out=str(link))
    out = eval_out_dir(cfg)
    monkeypatch.setattr(cli_run, "write_report", lambda o, report: [o / "report.json"]
                        if (o / "report.json").write_text(record) else [])
    cli_run.write_eval(cfg, types.SimpleNamespace(heads=None), out, {}, {}, batched=False)
    assert (link / "report.json").read_text() == record and link.is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval", "link"]
    monkeypatch.chdir(real)
    with pytest.raises(UserError, match="holds the current folder"):
        eval_out_dir(cli.EvalConfig(heads="h", out="."))
