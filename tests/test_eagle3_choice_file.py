"""EAGLE-3 decoding settings on the command line: the tree fitted to the drafter when eagle_nodes /
eagle_depth are unset (``eagle3.fitted_tree``), and an evaluation's eagle_tree=auto choice saved for
medusa-generate (``evaluation/eagle3_choice_file.py``)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from conftest import DecodeCalled

from inference.errors import UserError
from inference.evaluation.eagle3_choice_file import read_choice, write_choices
from inference.methods.eagle3 import fitted_tree
from inference.methods.registry import options_from_keys


def _spec(num_heads, kind="eagle3", fingerprint="abc"):
    return SimpleNamespace(kind=kind, num_heads=num_heads, base_model_fingerprint=fingerprint)


@pytest.mark.parametrize("trained, topk, expected", [(1, 4, (4, 1)), (2, 4, (8, 2)), (3, 2, (8, 3)), (7, 4, (8, 4)),
                                                      (1, 2, (2, 1)), (2, 1, (2, 2))])
def test_fitted_tree_is_no_deeper_than_the_drafter_was_trained(trained, topk, expected):
    """Guards against the default tree drafting deeper than the drafter ever learned to (a one-step drafter's
    n8-d4-k4 decodes slower than plain decoding on a CPU) or holding more nodes than depth x top-k can."""
    assert fitted_tree(_spec(trained), None, None, topk) == expected


def test_fitted_tree_keeps_given_keys_and_leaves_bad_ones_to_the_options():
    """Guards against fitting overriding what the user set, and against a bad eagle_depth / eagle_topk being
    reported as a bad eagle_nodes (the options must name the key that is wrong)."""
    assert fitted_tree(_spec(1), 6, 2, 4) == (6, 2)
    assert fitted_tree(_spec(1), None, 3, 2) == (8, 3)
    assert fitted_tree(_spec(1), 3, None, 4) == (3, 1)
    assert fitted_tree(None, None, None, 4) == (8, 4)                  # no drafter known: the library's defaults
    assert fitted_tree(_spec(2, kind="medusa"), None, None, 4) == (8, 4)
    assert fitted_tree(_spec(1), None, 0, 4)[0] == 8
    assert fitted_tree(_spec(1), None, None, "x") == (8, 1)
    with pytest.raises(UserError, match="eagle_depth must be an integer in 1..32"):
        options_from_keys("eagle3", SimpleNamespace(eagle_nodes=8, eagle_depth=0, eagle_topk=4))


def test_eval_options_take_the_fitted_tree():
    """Guards against medusa-eval / medusa-generate decoding a one-step drafter with n8-d4-k4 when no
    eagle_* key is given, and against unset keys reaching the options as None."""
    import inference.cli as cli

    opts = cli._method_options(cli.EvalConfig(heads="h", eagle_tree="fixed"), ["eagle3", "eagle3_lookup"], _spec(1))
    assert (opts["eagle3"].nodes, opts["eagle3"].depth, opts["eagle3"].topk) == (4, 1, 4)
    assert (opts["eagle3_lookup"].nodes, opts["eagle3_lookup"].depth) == (4, 1)
    opts = cli._method_options(cli.EvalConfig(heads="h", eagle_depth=2, eagle_topk=2), ["eagle3"], _spec(1))
    assert (opts["eagle3"].nodes, opts["eagle3"].depth, opts["eagle3"].topk) == (6, 2, 2)
    assert options_from_keys("eagle3", cli.EvalConfig()).nodes is None   # unset, no drafter: fitted at load


def _report(method="eagle3", nodes=4):
    return {"method_options": {method: {"eagle_nodes": nodes, "eagle_depth": 1, "eagle_topk": 4,
                                        "eagle_min_prob": 0.0, "eagle_tree": "fixed", "schedule": None,
                                        **({"eagle_lookup_tokens": 12, "eagle_lookup_max_ngram": 3,
                                            "eagle_lookup_min_ngram": 2} if method == "eagle3_lookup" else {})},
                               "autoregressive": {}},
            f"{method}_tree": {"name": f"n{nodes}-d1-k4", "reason": "best measured tau / step time"}}


def test_choice_round_trip(tmp_path):
    """Guards against medusa-generate decoding with other settings than the evaluation measured: the file
    carries the method and every key of its setting (the looked-up branch's too), and nothing else."""
    paths = list(write_choices(tmp_path, _report("eagle3_lookup"), "abc").values())
    assert [p.name for p in paths] == ["eagle3_lookup_tree.json"]
    assert not list(tmp_path.glob("*.tmp"))
    choice = read_choice(str(paths[0]), _spec(1), ["eagle3", "eagle3_lookup"])
    assert choice.method == "eagle3_lookup" and choice.schedule is None and not choice.plain_alone
    assert choice.settings == {"eagle_nodes": 4, "eagle_depth": 1, "eagle_topk": 4, "eagle_min_prob": 0.0,
                    "eagle_lookup_tokens": 12, "eagle_lookup_max_ngram": 3, "eagle_lookup_min_ngram": 2}
    assert write_choices(tmp_path / "none", {"method_options": {"eagle3": {"eagle_nodes": 8}}}) == {}  # fixed


def test_choice_file_refusals(tmp_path):
    """Guards against a wrong eagle_tree= file decoding silently (or with a traceback): missing, not JSON,
    not a choice, a method these heads do not decode with, another backbone's drafter, unknown keys."""
    (path,) = write_choices(tmp_path, _report(), "abc").values()
    usable = ["eagle3", "eagle3_lookup"]
    with pytest.raises(UserError, match="no such file"):
        read_choice(str(tmp_path / "missing.json"), _spec(1), usable)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(UserError, match="not a readable JSON file"):
        read_choice(str(bad), _spec(1), usable)
    bad.write_text(json.dumps({"nodes": 4}))
    with pytest.raises(UserError, match="not an EAGLE-3 tree choice"):
        read_choice(str(bad), _spec(1), usable)
    with pytest.raises(UserError, match="which these heads do not decode with"):
        read_choice(str(path), _spec(1), ["medusa"])
    with pytest.raises(UserError, match="drafter of another backbone"):
        read_choice(str(path), _spec(1, fingerprint="other"), usable)
    record = json.loads(path.read_text())
    record["settings"]["tree"] = "auto"
    bad.write_text(json.dumps(record))
    with pytest.raises(UserError, match=r"unknown settings \['tree'\]"):
        read_choice(str(bad), _spec(1), usable)


@pytest.mark.parametrize("kind, value, match", [("eagle3", "auto", "chosen by an evaluation"),
                                                ("eagle3", "missing.json", "no such file"),
                                                ("medusa", "choice.json", "is for EAGLE-3 heads")])
def test_generate_refuses_a_bad_eagle_tree_before_loading(monkeypatch, kind, value, match):
    """Guards against medusa-generate loading the backbone (seconds to minutes) before refusing an eagle_tree=
    it cannot decode with: auto (an evaluation's choice), a missing file, a file given for Medusa heads."""
    import inference.cli as cli

    monkeypatch.setattr(cli, "heads_spec", lambda cfg: _spec(1, kind=kind))
    monkeypatch.setattr(cli, "_load", lambda cfg: pytest.fail("loaded the backbone before refusing"))
    with pytest.raises(UserError, match=match):
        cli.run_generate(cli.GenerateConfig(heads="h", prompt="hi", eagle_tree=value))


LOOKUP_KEYS = {"eagle_lookup_tokens": 12, "eagle_lookup_max_ngram": 3, "eagle_lookup_min_ngram": 2, "eagle_lookup_switch": 0}


def _batched_report(at_one=True):
    from inference.evaluation.eagle3_choice_file import schedule_settings
    from inference.methods.eagle3_lookup import Eagle3LookupOptions
    from inference.runtime.speculation import SpeculationSchedule

    lookup = dict(num_tokens=12, max_ngram=3, min_ngram=2)
    four, one = Eagle3LookupOptions(nodes=4, depth=1, topk=4, min_prob=0.1, **lookup), \
        Eagle3LookupOptions(nodes=1, depth=1, topk=1, **lookup)
    choices = {1: four if at_one else None, 2: one, 4: None}
    rates = {1: {four.label: 30.0, "plain": 22.0}, 2: {one.label: 41.0, "plain": 39.0}, 4: {"plain": 70.0}}
    schedule = SpeculationSchedule(choices, rates, 0.07)
    return {"method_options": {"eagle3_lookup": {"eagle_tree": "auto"}},
            "batched": {"speculation": {"eagle3_lookup": {"tree": "auto", "schedule": schedule.to_dict(),
                                                          "settings": schedule_settings(schedule)},
                                        "autoregressive": {"tree": "fixed", "schedule": {"1": "plain"}}}}}, schedule


@pytest.mark.parametrize("at_one", [True, False], ids=["speculates-alone", "plain-alone"])
def test_batched_choice_round_trip(tmp_path, at_one):
    """Guards against a batched evaluation's per-batch-size choice being lost (no file) or changed on the way
    to medusa-generate: every batch size's setting (plain ones too), the looked-up branch's keys, the rates
    and switch gain the decoder's hysteresis compares; one prompt alone decodes with the batch-1 choice, or
    plainly where the evaluation found plain decoding best there."""
    from inference.evaluation.eagle3_choice_file import eagle3_schedule

    report, schedule = _batched_report(at_one)
    (path,) = write_choices(tmp_path, report, "abc").values()
    assert path.name == "eagle3_lookup_tree.json"
    choice = read_choice(str(path), _spec(1), ["eagle3", "eagle3_lookup"])
    assert choice.method == "eagle3_lookup" and choice.plain_alone is (not at_one)
    first = {"eagle_nodes": 4, "eagle_depth": 1, "eagle_topk": 4, "eagle_min_prob": 0.1} if at_one else \
        {"eagle_nodes": 1, "eagle_depth": 1, "eagle_topk": 1, "eagle_min_prob": 0.0}
    assert choice.settings == {**first, **LOOKUP_KEYS}   # alone, or the first speculating size's (plain-alone)
    rebuilt = eagle3_schedule(choice.method, choice.schedule, SimpleNamespace(eagle_topk=4, eagle_lookup_tokens=6))
    assert rebuilt.to_dict() == schedule.to_dict() and rebuilt.rates == schedule.rates
    assert rebuilt.switch_gain == 0.07
    for b, c in schedule.choices.items():
        got = rebuilt.choices[b]
        assert (got is None) if c is None else (got.label == c.label and got.lookup == c.lookup and got.tree == "fixed")


def test_batched_choice_refuses_a_damaged_schedule(tmp_path):
    """Guards against a hand-edited or truncated batched choice file decoding with a traceback or with
    settings nobody measured: one line naming the file."""
    report, _ = _batched_report()
    (path,) = write_choices(tmp_path, report, "abc").values()
    for damage, match in ((lambda r: r["schedule"].pop("choices"), "schedule is damaged"),
                          (lambda r: r["schedule"]["choices"].update({"x": None}), "schedule is damaged"),
                          (lambda r: r["schedule"]["choices"]["2"].update({"tree": "auto"}), "unknown settings"),
                          (lambda r: r["schedule"].update({"choices": {"0": None}}), "no batch size >= 1"),
                          (lambda r: r["schedule"]["choices"].update({"2": [1, 2]}), "not a mapping")):
        record = json.loads(path.read_text())
        damage(record)
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps(record))
        with pytest.raises(UserError, match=match):
            read_choice(str(bad), _spec(1), ["eagle3", "eagle3_lookup"])


@pytest.mark.parametrize("at_one, prompts, method", [(True, "hi", "eagle3_lookup"), (False, "hi", "autoregressive"),
                                                     (False, ["a", "b"], "eagle3_lookup")],
                         ids=["alone", "alone-plain", "batch"])
def test_generate_decodes_a_batched_choice(tmp_path, generate_calls, capsys, at_one, prompts, method):
    """Guards against medusa-generate ignoring a batched evaluation's schedule (batches decoded at the batch-1
    setting) or speculating alone where that evaluation found plain decoding best at batch 1."""
    import inference.cli as cli

    report, schedule = _batched_report(at_one)
    (path,) = write_choices(tmp_path, report, "abc").values()
    generate_calls["spec"] = _spec(1)
    with pytest.raises(DecodeCalled):
        cli.run_generate(cli.GenerateConfig(heads="h", prompt=prompts, eagle_tree=str(path)))
    args = generate_calls["args"]
    used, options = (args[3], args[6]) if isinstance(prompts, list) else (args[2], generate_calls["kw"]["options"])
    assert used == method
    if method == "eagle3_lookup":
        assert options.schedule.to_dict() == schedule.to_dict() and options.lookup == schedule.choices[2].lookup
    assert "note:" not in capsys.readouterr().err
    if isinstance(prompts, list):   # batches without a batched evaluation's file: told how to get one
        with pytest.raises(DecodeCalled):
            cli.run_generate(cli.GenerateConfig(heads="h", prompt=prompts))
        assert "batch_size=[1,2,4,...] measures it per batch size" in capsys.readouterr().err
        assert generate_calls["args"][6].schedule is None
