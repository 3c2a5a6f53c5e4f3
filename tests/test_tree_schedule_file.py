"""A batched evaluation's Medusa trees per batch size, saved for medusa-generate
(``evaluation/tree_schedule_file.py``) and decoded with from the command line."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from conftest import DecodeCalled

from inference.errors import UserError
from inference.evaluation.tree_schedule_file import (is_tree_schedule, read_tree_schedule, schedule_trees,
                                                     write_tree_schedule)
from inference.runtime.speculation import SpeculationSchedule
from inference.runtime.tree import MedusaTree, chain_tree, resolve_tree


def _spec(num_heads=3, fingerprint="abc", outputs=100):
    return SimpleNamespace(kind="medusa", num_heads=num_heads, base_model_fingerprint=fingerprint,
                           output_size=outputs, vocab_size=outputs)


def _report(at_one=True):
    tree4 = MedusaTree([[0], [1], [0, 0]], name="auto4")
    choices = {1: tree4 if at_one else None, 2: chain_tree(2), 8: None}
    schedule = SpeculationSchedule(choices, {1: {"auto4": 30.0, "plain": 21.0}, 2: {"chain2": 40.0, "plain": 38.0},
                                             8: {"plain": 90.0}}, 0.06)
    sized = {"tree": "auto", "schedule": schedule.to_dict(), "trees": schedule_trees(schedule)}
    return {"batched": {"speculation": {"medusa": sized, "autoregressive": {"tree": "given"}}}}, schedule


def test_round_trip_keeps_every_tree_and_the_hysteresis(tmp_path):
    """Guards against medusa-generate decoding batches with other trees than the batched evaluation chose:
    each batch size's tree (paths and name), the plain ones, the rates and switch gain its hysteresis uses."""
    report, schedule = _report()
    path = write_tree_schedule(tmp_path, report, "abc")
    assert path.name == "tree_schedule.json" and not list(tmp_path.glob("*.tmp"))
    assert is_tree_schedule(str(path)) and not is_tree_schedule(str(tmp_path / "tree.json"))
    got = read_tree_schedule(str(path), _spec())
    assert got.to_dict() == schedule.to_dict() and got.rates == schedule.rates and got.switch_gain == 0.06
    assert got.choices[1].paths == schedule.choices[1].paths and got.choices[8] is None
    assert write_tree_schedule(tmp_path / "none", {"batched": {"speculation": {"medusa": {"tree": "given"}}}}) is None


def test_refusals_name_the_file(tmp_path):
    """Guards against a schedule file decoding with a traceback, with trees the heads cannot draft, or for
    another backbone's heads; and against giving it where one tree is expected (medusa-eval tree=)."""
    report, _ = _report()
    path = write_tree_schedule(tmp_path, report, "abc")
    with pytest.raises(UserError, match="heads of another backbone"):
        read_tree_schedule(str(path), _spec(fingerprint="other"))
    with pytest.raises(UserError, match="depth 2 but the heads only predict 1"):
        read_tree_schedule(str(path), _spec(num_heads=1))
    with pytest.raises(UserError, match="holds a tree per batch size"):
        resolve_tree(str(path), 3)
    bad = tmp_path / "bad.json"
    for damage, match in ((lambda r: r["schedule"].pop("choices"), "schedule is damaged"),
                          (lambda r: r["schedule"]["choices"].update({"2": {"name": "x"}}), "schedule is damaged"),
                          (lambda r: r["schedule"].update({"choices": {}}), "no batch size >= 1"),
                          (lambda r: r.update({"version": 99}), "newer medusa-train")):
        record = json.loads(path.read_text())
        damage(record)
        bad.write_text(json.dumps(record))
        with pytest.raises(UserError, match=match):
            read_tree_schedule(str(bad), _spec())


@pytest.mark.parametrize("at_one, prompts, method, tree", [(True, "hi", "medusa", "auto4"),
                                                           (False, "hi", "autoregressive", None),
                                                           (False, ["a", "b"], "medusa", "schedule")],
                         ids=["alone", "alone-plain", "batch"])
def test_generate_decodes_with_the_schedule(tmp_path, generate_calls, at_one, prompts, method, tree):
    """Guards against medusa-generate refusing a batched evaluation's tree_schedule.json, decoding batches
    with one tree for every batch size, or speculating alone where the evaluation found plain decoding
    best at batch 1; all decided before the backbone loads."""
    import inference.cli as cli

    report, schedule = _report(at_one)
    path = write_tree_schedule(tmp_path, report, "abc")
    generate_calls["spec"] = _spec()
    with pytest.raises(DecodeCalled):
        cli.run_generate(cli.GenerateConfig(heads="h", prompt=prompts, tree=str(path)))
    args, kw = generate_calls["args"], generate_calls["kw"]
    used, given = (args[3], args[9].get("tree")) if isinstance(prompts, list) else (args[2], kw.get("tree"))
    assert used == method
    if tree == "schedule":
        assert isinstance(given, SpeculationSchedule) and given.to_dict() == schedule.to_dict()
    elif tree is None:
        assert given is None
    else:
        assert given.name == tree and given.paths == schedule.choices[1].paths


def test_eval_measures_a_schedule_again_batched_only(tmp_path, monkeypatch):
    """Guards against medusa-eval taking a tree_schedule.json as one tree (a traceback, or the batch-1 tree
    silently) where one prompt at a time is evaluated, and against a batched evaluation ignoring it."""
    import inference.cli as cli

    report, schedule = _report()
    path = write_tree_schedule(tmp_path, report, "abc")
    monkeypatch.setattr(cli, "heads_spec", lambda cfg: _spec())
    cfg = cli.EvalConfig(heads="h", tree=str(path))
    with pytest.raises(UserError, match="evaluate it batched"):
        cli._eval_tree_schedule(cfg, None)
    assert cli._eval_tree_schedule(cfg, [1, 2]).to_dict() == schedule.to_dict()
    assert cli._eval_tree_schedule(cli.EvalConfig(heads="h", tree="chain2"), [1, 2]) is None
