"""How the evaluation's numbers are computed and shown (inference/evaluation/): calibration prompts never scored,
a method that fell back to plain decoding never reported as measured, per-prompt timing and identity kept in
report.json, the spread behind a pooled speedup, the batched median, nothing-measured tau as null, the histogram's
own mean, and every timed decoder warmed up alike."""

from __future__ import annotations

import json
import types

import pytest

from inference.errors import UserError
from inference.evaluation import batch_eval
from inference.evaluation import evaluate as ev
from inference.evaluation.evaluate import Sample, evaluate, sample_records, summarize, warn_mismatches
from inference.prompts import Prompt, prompt_record, select_prompts, split_calibration
from inference.evaluation.reports import compare_markdown, markdown, print_per_method
from inference.methods import registry
from inference.runtime.decode import GenerationOutput
from inference.runtime.model import MedusaModel
from runtime_support import one_thread  # noqa: F401  (autouse fixture)

MACHINE = {"cpu": "x86_64", "threads": 1}


def _prompts(n: int) -> list[Prompt]:
    return [Prompt(str(i), [f"question {i}?"]) for i in range(n)]


def _gen(tokens, lengths, secs=1.0, prefill=0.0, proposed=()):
    g = GenerationOutput(tokens=list(tokens), prompt_tokens=3, finish_reason="length", accept_lengths=list(lengths),
                         proposed=list(proposed))
    g.decode_s, g.prefill_s = secs, prefill
    return g


def _sample(pid, outputs) -> Sample:
    s = Sample(pid, 1)
    s.outputs = outputs
    s.tokens = {k: list(v.tokens) for k, v in outputs.items()}
    return s


# -- 1: calibration prompts are never evaluated ----------------------------------------------------------------
def test_calibration_prompts_never_overlap_the_evaluated_ones():
    """Guards against choice=auto fitting its choice on prompts it is then scored on: num_prompts=80 of MT-Bench's
    80 calibrated on 8 of the evaluated prompts (num_prompts=20 of the code set's 20: 8 too). The last
    calibration_prompts are held out whatever num_prompts asks; fewer are evaluated when fewer remain."""
    for total, asked, evaluated in ((80, 80, 72), (20, 20, 12), (20, None, 12), (20, 5, 5), (10, 5, 2)):
        got, calib = select_prompts(_prompts(total), asked, 8)
        assert [p.id for p in calib] == [str(i) for i in range(total - 8, total)], (total, asked)
        assert len(got) == evaluated and not {p.id for p in got} & {p.id for p in calib}, (total, asked)


def test_too_few_prompts_are_refused_and_asking_too_many_is_said(capsys):
    """Guards against a set with no more prompts than calibration_prompts being calibrated and evaluated on the same
    prompts (it must be refused in one line), and against num_prompts above what remains evaluating fewer silently
    (one stderr line and report.json's prompts_note say so; the ids of both sets are recorded)."""
    for n in (3, 8):
        with pytest.raises(UserError, match=f"calibration_prompts=8 holds out all {n} prompts"):
            split_calibration(_prompts(n), 8)
    got, calib = select_prompts(_prompts(10), 10, 8)
    record = prompt_record(got, calib, 10)
    assert record["evaluated_prompt_ids"] == ["0", "1"] and record["calibration_prompt_ids"][0] == "2"
    assert "num_prompts=10" in record["prompts_note"] and "evaluating 2" in record["prompts_note"]
    assert capsys.readouterr().err.count("\n") == 1
    assert "prompts_note" not in prompt_record(got, calib, 2)
    with pytest.raises(UserError, match="also evaluated"):
        prompt_record(got + calib[:1], calib, None)


def test_asking_too_many_is_said_without_calibration_too(capsys):
    """Guards against choice=fixed (nothing held out to calibrate on) evaluating the 3 prompts of a file asked
    for num_prompts=10 without a word, where a calibrating run said so: the same note in every case."""
    got = _prompts(3)[:10]
    record = prompt_record(got, [], 10)
    assert record["prompts_note"] == "num_prompts=10 asked for more prompts than the 3 left to evaluate: evaluating 3"
    assert capsys.readouterr().err == f"note: {record['prompts_note']}\n"
    assert "prompts_note" not in prompt_record(got, [], 3) and "prompts_note" not in prompt_record(got, [], None)


def test_cli_refuses_a_set_calibration_would_empty_before_loading(tmp_path, monkeypatch, capsys):
    """Guards against medusa-eval loading the backbone (minutes on a large model) before finding that the
    calibration prompts would leave nothing to evaluate: one line, exit 2, nothing loaded."""
    import inference.cli_run
    from inference.cli import eval_main

    def loaded(*args, **kwargs):
        raise AssertionError("the backbone was loaded before the refusal")

    monkeypatch.setattr(inference.cli_run, "_load_eval", loaded)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("Hi.", "Yes?", "No.")))
    with pytest.raises(SystemExit) as exit_:
        eval_main([f"prompts={prompts}", "methods=[prompt_lookup]", "batch_size=[1,2]", f"out={tmp_path / 'o'}"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert exit_.value.code == 2 and len(lines) == 1 and "holds out all 3 prompts" in lines[0]


# -- 3, 4, 9: what a report says of each method -----------------------------------------------------------------
def _report(samples, methods, proposed, **extra) -> dict:
    r = {"settings": {"mode": "greedy"}, "machine": MACHINE, "num_samples": len(samples), "methods": methods,
         **summarize(samples, methods, proposed), **extra}
    r["samples"] = sample_records(samples, {x: registry.get(x) for x in methods}, proposed, True)
    return r


def test_plain_decoding_fallback_is_not_reported_as_measured(capsys):
    """Guards against a method whose choice fell back to plain decoding being shown as measured: acceptance rate
    0.000 instead of null / "-", no choice line (it was printed only for a tree with nodes), "tree = None" in the
    trade-off matrix with nothing saying the row ran plain; and tau 1.0 for a run with no verified step."""
    samples = [_sample(str(i), {"medusa": _gen(range(4), [1, 1, 1, 1]), "autoregressive": _gen(range(4), [1] * 4),
                                "prompt_lookup": _gen([7], [])}) for i in range(2)]
    tree = {"name": "none (plain decoding)", "nodes": 0, "reason": "no tree beats plain decoding"}
    r = _report(samples, ["medusa", "prompt_lookup", "autoregressive"], {"medusa": 0}, tree=tree,
                method_options={"medusa": {"tree": None}})
    row = r["per_method"]["medusa"]
    assert row["acceptance_rate"] is None and row["ran_as_plain_decoding"] is True and row["tau"] == 1.0
    assert r["per_method"]["prompt_lookup"]["tau"] is None and r["samples"][0]["prompt_lookup_tau"] is None
    md, cmp = markdown(r), compare_markdown(r)
    assert "| medusa (ran as plain decoding) | 1.000 | - |" in md and "- tree: none (plain decoding) —" in md
    assert "| medusa (ran as plain decoding) | 1.00 | - |" in cmp and "0.000" not in cmp
    print_per_method(r)
    assert "tau -" in capsys.readouterr().out


def test_per_prompt_timing_identity_and_speedup_spread(capsys):
    """Guards against report.json keeping only pooled figures: speedups that cannot be recomputed and have no spread,
    and a greedy mismatch visible only as a fraction. Each sample must carry every method's prefill / decode
    seconds, tokens, accepted / proposed and identity to greedy; each speedup the [min, median, max] of the
    per-prompt ratios; a mismatch a loud stderr line naming the prompt, listed in report.md."""
    a = _sample("a", {"medusa": _gen(range(6), [3, 3], secs=1.0, prefill=0.5, proposed=[2, 2]),
                      "autoregressive": _gen(range(6), [1] * 6, secs=3.0)})
    b = _sample("b", {"medusa": _gen([9] * 6, [3, 3], secs=2.0, proposed=[2, 2]),
                      "autoregressive": _gen(range(6), [1] * 6, secs=2.0)})
    c = _sample("c", {"medusa": _gen(range(6), [2, 2, 2], secs=1.0, proposed=[2, 2, 2]),
                      "autoregressive": _gen(range(6), [1] * 6, secs=4.0)})
    r = _report([a, b, c], ["medusa", "autoregressive"], {})
    row = r["per_method"]["medusa"]
    assert row["speedup_vs_autoregressive"] == pytest.approx(9 / 4.5, abs=1e-4)
    assert row["per_prompt_speedup_vs_autoregressive"] == [1.0, 2.0, 4.0]
    assert r["greedy_mismatches"] == {"medusa": ["b"]}
    first = r["samples"][0]
    assert first["medusa_prefill_s"] == 0.5 and first["medusa_decode_s"] == 1.0
    assert first["autoregressive_decode_s"] == 3.0
    assert first["medusa_accepted"] == 4 and first["medusa_proposed"] == 4 and first["medusa_tokens"] == 6
    assert [s["medusa_identical_to_greedy"] for s in r["samples"]] == [True, False, True]
    warn_mismatches(r["greedy_mismatches"])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "WARNING" in err and "medusa on prompt b" in err
    md = markdown(r)
    assert "2.00x (2.00x [1.00-4.00])" in md and "output differs from plain greedy** (medusa) on prompts: b" in md


# -- 5, 9: the batched numbers ---------------------------------------------------------------------------------
def test_batched_median_is_the_median_and_no_steps_is_no_tau():
    """Guards against the batched "median" of the single runs' tokens/s being the upper middle element (runs of 1,
    2, 3, 4 tok/s reported 3, not 2.5), and against tau 1.0 for rows that verified no step."""
    rows = [_gen([5], [])]
    runs = [types.SimpleNamespace(rows=rows, tokens_per_s=v, new_tokens=1, prefill_s=0.0, decode_s=1.0 / v)
            for v in (4.0, 1.0, 3.0, 2.0)]
    out = batch_eval.method_summary("autoregressive", {"autoregressive": runs}, {"autoregressive": 2.0}, None,
                                    greedy=False)
    assert out["tokens_per_s_runs"] == [1.0, 2.5, 4.0]
    assert out["tau"] is None and out["tau_per_row"] == [None] * 4


def test_a_candidate_with_no_steps_measures_no_tau(monkeypatch):
    """Guards against an EAGLE-3 candidate whose calibration verified no step being given tau 1.0 (so it could
    tie plain decoding) where GenerationOutput.tau says 0.0: the two agree, and such a candidate cannot win."""
    from inference.methods import eagle3_choice

    monkeypatch.setattr(eagle3_choice, "generate", lambda *a, **k: _gen([3], []))
    assert eagle3_choice.measure_eagle3_tau(None, [[1, 2]], (4, 1, 4), max_new_tokens=1) == 0.0 == _gen([3], []).tau


# -- 7: the histogram's title ----------------------------------------------------------------------------------
def test_histogram_title_gives_its_own_mean():
    """Guards against the acceptance histogram's title pairing it with the emitted tau: the histogram counts what
    verification accepted before the EOS / budget cut, so its title must say so and give that count's own mean."""
    from inference.report_plots import histogram_title

    title = histogram_title("medusa", {"1": 2, "4": 2})
    assert "accepted" in title and "before the EOS / budget cut" in title and "mean 2.50" in title


# -- the warm-up, alike for every timed decoder ----------------------------------------------------------------
@pytest.fixture(scope="module")
def bare():
    from medusa_train.backbone import random_backbone

    bb = random_backbone({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 320,
                          "max_position_embeddings": 512}, seed=0)
    return MedusaModel(model=bb.model.eval(), tokenizer=bb.tokenizer, heads=None)


def test_every_timed_decoder_gets_one_untimed_warm_up(bare, monkeypatch):
    """Guards against an asymmetric warm-up without captured steps: calibration warmed the runtime's methods while
    transformers' generate had its first-call setup timed on the first prompt. Every method gets one short
    untimed call before its timed ones, one prompt at a time and batched."""
    calls = []
    real = registry.generate

    def spy(m, ids, method, **kw):
        calls.append((method, kw["max_new_tokens"]))
        return real(m, ids, method, **kw)

    monkeypatch.setattr(ev.registry, "generate", spy)
    evaluate(bare, _prompts(2), methods=["prompt_lookup", "autoregressive", "hf_generate"], choice="fixed",
             max_new_tokens=12, progress=False, log=lambda s: None)
    assert calls[:3] == [(x, ev.WARMUP_TOKENS) for x in ("prompt_lookup", "autoregressive", "hf_generate")]
    assert sorted(calls[3:]) == sorted([(x, 12) for x in ("prompt_lookup", "autoregressive", "hf_generate")] * 2)

    batched, real_run = [], batch_eval.run_method
    monkeypatch.setattr(batch_eval, "run_method", lambda m, x, rows, o, n, *a: batched.append((x, len(rows), n))
                        or real_run(m, x, rows, o, n, *a))
    batch_eval.evaluate_batched(bare, _prompts(2), methods=["prompt_lookup"], batch_sizes=[2], choice="fixed",
                                max_new_tokens=12, progress=False, log=lambda s: None)
    assert batched[:3] == [(x, 2, ev.WARMUP_TOKENS) for x in ("prompt_lookup", "autoregressive", "hf_generate")]
    assert len(batched) == 6
