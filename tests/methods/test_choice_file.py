"""The one choice file (``methods/choice_file.py``): what an evaluation chose for any method's speculation shape
(a Medusa tree, an EAGLE-3 setting, a chain length; per batch size), saved by medusa-eval and read by
medusa-eval and medusa-generate alike (``choice=<file>``); the files and keys it replaced refused in one line."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from conftest import DecodeCalled

import inference.cli_run as cli_run
from inference.errors import UserError
from inference.methods.choice_file import read_choice, write_choice
from inference.methods.eagle3_lookup import Eagle3LookupOptions
from inference.methods.medusa import MedusaOptions
from inference.methods.registry import make_options
from inference.methods.shape import Chosen
from inference.runtime.speculation import SpeculationSchedule
from inference.runtime.tree import MedusaTree, chain_tree, resolve_tree

LOOKUP = dict(num_tokens=12, max_ngram=3, min_ngram=2)


def _medusa_spec(num_heads=3, fingerprint="abc", outputs=100):
    return SimpleNamespace(kind="medusa", num_heads=num_heads, base_model_fingerprint=fingerprint,
                           output_size=outputs, vocab_size=outputs)


def _eagle_spec(num_heads=1, fingerprint="abc"):
    return SimpleNamespace(kind="eagle3", num_heads=num_heads, base_model_fingerprint=fingerprint)


def _medusa_chosen(at_one=True):
    tree4 = MedusaTree([[0], [1], [0, 0]], name="auto4")
    schedule = SpeculationSchedule({1: tree4 if at_one else None, 2: chain_tree(2), 8: None},
                                   {1: {"auto4": 30.0, "plain": 21.0}, 2: {"chain2": 40.0, "plain": 38.0},
                                    8: {"plain": 90.0}}, 0.06)
    return Chosen(MedusaOptions(tree=schedule), schedule, name="per batch size", reason="measured", measured=True)


def _eagle_chosen(at_one=True):
    four = Eagle3LookupOptions(nodes=4, depth=1, topk=4, min_prob=0.1, **LOOKUP)
    one = Eagle3LookupOptions(nodes=1, depth=1, topk=1, **LOOKUP)
    schedule = SpeculationSchedule({1: four if at_one else None, 2: one, 4: None},
                                   {1: {four.label: 30.0, "plain": 22.0}, 2: {one.label: 41.0, "plain": 39.0},
                                    4: {"plain": 70.0}}, 0.07)
    return Chosen(Eagle3LookupOptions(schedule=schedule, **LOOKUP), schedule, name="per batch size",
                  reason="measured", measured=True)


def _medusa_file(tmp_path, at_one=True):
    chosen = _medusa_chosen(at_one)
    return write_choice(tmp_path, "medusa", chosen, chosen.options, "abc"), chosen.schedule


def _eagle_file(tmp_path, at_one=True):
    chosen = _eagle_chosen(at_one)
    return write_choice(tmp_path, "eagle3_lookup", chosen, chosen.options, "abc"), chosen.schedule


def _medusa_options(method):
    return make_options(method)


def test_a_medusa_lookup_file_counts_the_grafted_chain_in_its_static_shapes(tmp_path):
    """Guards against a medusa_lookup choice file listing the tree's shape alone: its steps verify the looked-up chain
    grafted under the tree too (up to prompt_lookup_tokens more rows, as many levels deeper), the buckets a captured
    step of it fills."""
    from inference.methods.medusa_lookup import MedusaLookupOptions

    chosen = _medusa_chosen()
    options = MedusaLookupOptions(tree=chosen.schedule, num_tokens=5)
    record = json.loads(write_choice(tmp_path, "medusa_lookup", chosen, options, "abc").read_text())
    assert record["static_shapes"] == {"1": [9, 7], "2": [7, 6], "8": [1, 0]}


def test_medusa_round_trip_keeps_every_tree_and_the_hysteresis(tmp_path):
    """Guards against medusa-generate decoding batches with other trees than the batched evaluation chose:
    each batch size's tree (paths and name), the plain ones, the rates and switch gain its hysteresis uses;
    and against a file without the static shapes a captured step buckets on."""
    path, schedule = _medusa_file(tmp_path)
    assert path.name == "medusa_choice.json" and not list(tmp_path.glob("*.tmp"))
    record = json.loads(path.read_text())
    assert record["method"] == "medusa" and record["schedule"]["choices"]["1"] == {
        "tree": {"name": "auto4", "choices": [[0], [1], [0, 0]]}}
    assert record["static_shapes"] == {"1": [4, 2], "2": [2, 1], "8": [1, 0]}
    got = read_choice(str(path), _medusa_spec(), ["medusa", "medusa_lookup"], _medusa_options)
    assert got.method == "medusa" and not got.plain_alone
    assert got.schedule.to_dict() == schedule.to_dict() and got.schedule.rates == schedule.rates
    assert got.schedule.switch_gain == 0.06 and got.schedule.choices[1].paths == schedule.choices[1].paths


@pytest.mark.parametrize("at_one", [True, False], ids=["speculates-alone", "plain-alone"])
def test_eagle3_round_trip_keeps_every_setting_and_the_branch(tmp_path, at_one):
    """Guards against a batched evaluation's EAGLE-3 setting per batch size being changed on the way to
    medusa-generate: every batch size's setting (plain ones too), the looked-up branch's keys, the rates and
    switch gain; the file stores the method's own keys and nothing else."""
    path, schedule = _eagle_file(tmp_path, at_one)
    keys = json.loads(path.read_text())["schedule"]["choices"]["2"]
    assert keys == {"eagle_nodes": 1, "eagle_depth": 1, "eagle_topk": 1, "eagle_min_prob": 0.0,
                    "eagle_lookup_tokens": 12, "eagle_lookup_max_ngram": 3, "eagle_lookup_min_ngram": 2,
                    "eagle_lookup_switch": 0}
    got = read_choice(str(path), _eagle_spec(), ["eagle3", "eagle3_lookup"],
                      lambda method: make_options(method, None, topk=4, num_tokens=6))
    assert got.method == "eagle3_lookup" and got.plain_alone is (not at_one)
    assert got.schedule.to_dict() == schedule.to_dict() and got.schedule.rates == schedule.rates
    for b, c in schedule.choices.items():
        d = got.schedule.choices[b]
        assert (d is None) if c is None else (d.label == c.label and d.lookup == c.lookup and d.schedule is None)


def test_chain_round_trip(tmp_path):
    """Guards against a chain method's length per batch size (new with the one choice file) being lost: its
    method key (draft_k) per batch size, plain where no length paid."""
    schedule = SpeculationSchedule({1: chain_tree(4), 4: None}, {1: {"chain4": 20.0, "plain": 10.0}})
    options = make_options("prompt_lookup")
    path = write_choice(tmp_path, "prompt_lookup", Chosen(options, schedule, measured=True), options)
    assert json.loads(path.read_text())["schedule"]["choices"]["1"] == {"prompt_lookup_tokens": 3}
    got = read_choice(str(path), None, ["prompt_lookup"], lambda method: make_options(method))
    assert got.schedule.choices[1].name == "chain4" and got.schedule.choices[4] is None


def test_refusals_name_the_file_and_what_to_run(tmp_path):
    """Guards against a choice file decoding with a traceback, with trees the heads cannot draft, for another
    backbone's heads or a method these heads do not decode with; a damaged or newer file."""
    path, _ = _medusa_file(tmp_path)
    usable = ["medusa", "medusa_lookup"]
    with pytest.raises(UserError, match="heads of another backbone.*rerun medusa-eval"):
        read_choice(str(path), _medusa_spec(fingerprint="other"), usable, _medusa_options)
    with pytest.raises(UserError, match="depth 2 but the heads only predict 1"):
        read_choice(str(path), _medusa_spec(num_heads=1), usable, _medusa_options)
    with pytest.raises(UserError, match="which these heads do not decode with"):
        read_choice(str(path), _eagle_spec(), ["eagle3"], _medusa_options)
    # an evaluation not asked for the file's method: the heads were blamed, which wrote that very file
    with pytest.raises(UserError, match=r"not among the methods evaluated here \(draft\): add it, "
                                        r"methods=\[draft,medusa\]"):
        read_choice(str(path), _medusa_spec(), ["draft"], _medusa_options, evaluated=True)
    # ... but not where adding it would be refused again for the heads
    with pytest.raises(UserError, match="which these heads do not decode with"):
        read_choice(str(_eagle_file(tmp_path)[0]), _medusa_spec(), ["medusa"], _medusa_options, evaluated=True)
    with pytest.raises(UserError, match="no such file"):
        read_choice(str(tmp_path / "missing.json"), _medusa_spec(), usable, _medusa_options)
    bad = tmp_path / "bad.json"
    for damage, match in ((lambda r: r["schedule"].pop("choices"), "schedule is damaged"),
                          (lambda r: r["schedule"]["choices"].update({"2": {"name": "x"}}), "schedule is damaged"),
                          (lambda r: r["schedule"]["choices"].update({"x": None}), "schedule is damaged"),
                          (lambda r: r["schedule"].update({"choices": {}}), "no batch size >= 1"),
                          (lambda r: r.update({"version": 99}), "newer medusa-train")):
        record = json.loads(path.read_text())
        damage(record)
        bad.write_text(json.dumps(record))
        with pytest.raises(UserError, match=match):
            read_choice(str(bad), _medusa_spec(), usable, _medusa_options)
    bad.write_text("{not json")
    with pytest.raises(UserError, match="not a readable JSON choice file"):
        read_choice(str(bad), _medusa_spec(), usable, _medusa_options)
    (tmp_path / "e").mkdir()
    epath, _ = _eagle_file(tmp_path / "e")
    record = json.loads(epath.read_text())
    record["schedule"]["choices"]["2"]["eagle_tree"] = "auto"
    bad.write_text(json.dumps(record))
    with pytest.raises(UserError, match="schedule is damaged"):
        read_choice(str(bad), _eagle_spec(), ["eagle3_lookup"], lambda m: make_options(m))


OLD_FILES = {
    "tree_schedule.json": {"format": "medusa-train tree schedule", "version": 1, "schedule": {"choices": {"1": None}}},
    "eagle3_tree.json": {"format": "medusa-train eagle3 tree choice", "method": "eagle3", "settings": {}},
    "eagle3_lookup_tree.json": {"format": "medusa-train eagle3 tree choice", "method": "eagle3_lookup",
                                "settings": {}},
}


@pytest.mark.parametrize("name", sorted(OLD_FILES))
def test_old_choice_files_are_refused_with_what_to_run(tmp_path, name):
    """Guards against a file of the three formats the one choice file replaced being read as something else
    (or with a traceback), as choice= and as tree=: one line naming it and saying to rerun medusa-eval."""
    path = tmp_path / name
    path.write_text(json.dumps(OLD_FILES[name]))
    with pytest.raises(UserError, match="format from before the one choice file.*rerun medusa-eval") as err:
        read_choice(str(path), _medusa_spec(), ["medusa", "eagle3", "eagle3_lookup"], _medusa_options)
    assert "\n" not in str(err.value)
    if name == "tree_schedule.json":
        with pytest.raises(UserError, match="from before the one choice file"):
            resolve_tree(str(path), 3)


def test_a_tree_file_and_a_choice_file_are_not_confused(tmp_path):
    """Guards against the old one-prompt tree.json given as choice= (it names one tree: tree=) or a choice file
    given as tree= being read as what it is not."""
    tree = tmp_path / "tree.json"
    MedusaTree([[0], [0, 0]], name="t").save(tree)
    with pytest.raises(UserError, match="is a Medusa tree, not a choice file: give it as tree="):
        read_choice(str(tree), _medusa_spec(), ["medusa"], _medusa_options)
    path, _ = _medusa_file(tmp_path)
    with pytest.raises(UserError, match="is a choice file written by medusa-eval: give it as choice="):
        resolve_tree(str(path), 3)


@pytest.mark.parametrize("at_one, prompts, method, tree", [(True, "hi", "medusa", "auto4"),
                                                           (False, "hi", "autoregressive", None),
                                                           (False, ["a", "b"], "medusa", "schedule")],
                         ids=["alone", "alone-plain", "batch"])
def test_generate_decodes_with_a_medusa_choice(tmp_path, generate_calls, at_one, prompts, method, tree):
    """Guards against medusa-generate refusing a batched evaluation's choice file, decoding batches with one
    tree for every batch size, or speculating alone where the evaluation found plain decoding best at
    batch 1; all decided before the backbone loads."""
    import inference.cli as cli

    path, schedule = _medusa_file(tmp_path, at_one)
    generate_calls["spec"] = _medusa_spec()
    with pytest.raises(DecodeCalled):
        cli_run.run_generate(cli.GenerateConfig(heads="h", prompt=prompts, choice=str(path)))
    args, kw = generate_calls["args"], generate_calls["kw"]
    used, options = (args[3], args[6]) if isinstance(prompts, list) else (args[2], kw.get("options"))
    assert used == method
    if tree == "schedule":
        assert isinstance(options.tree, SpeculationSchedule) and options.tree.to_dict() == schedule.to_dict()
    elif tree is None:
        assert options is None
    else:
        assert options.tree.name == tree and options.tree.paths == schedule.choices[1].paths


def test_a_medusa_lookup_choice_without_a_tree_decodes_its_lookup(tmp_path, generate_calls):
    """Guards against medusa-generate decoding plainly from a medusa_lookup choice whose batch-1 tree is none: the
    evaluation ran (and reported) that method as prompt lookup alone, its looked-up chain with no tree, which
    reached tau 1.95 on a prompt where the plain decoding generate ran gave 1.00."""
    import inference.cli as cli
    from inference.methods.medusa_lookup import MedusaLookupOptions

    chosen = _medusa_chosen(at_one=False)
    path = write_choice(tmp_path, "medusa_lookup", chosen, MedusaLookupOptions(tree=chosen.schedule, num_tokens=5),
                        "abc")
    generate_calls["spec"] = _medusa_spec()
    with pytest.raises(DecodeCalled):
        cli_run.run_generate(cli.GenerateConfig(heads="h", prompt="hi", choice=str(path)))
    args, kw = generate_calls["args"], generate_calls["kw"]
    assert args[2] == "medusa_lookup" and kw["options"].tree is None and kw["options"].num_tokens > 0


@pytest.mark.parametrize("at_one, prompts, method", [(True, "hi", "eagle3_lookup"), (False, "hi", "autoregressive"),
                                                     (False, ["a", "b"], "eagle3_lookup")],
                         ids=["alone", "alone-plain", "batch"])
def test_generate_decodes_an_eagle3_choice(tmp_path, generate_calls, capsys, at_one, prompts, method):
    """Guards against medusa-generate ignoring a batched evaluation's schedule (batches decoded at the batch-1
    setting) or speculating alone where that evaluation found plain decoding best at batch 1."""
    import inference.cli as cli

    path, schedule = _eagle_file(tmp_path, at_one)
    generate_calls["spec"] = _eagle_spec()
    with pytest.raises(DecodeCalled):
        cli_run.run_generate(cli.GenerateConfig(heads="h", prompt=prompts, choice=str(path)))
    args = generate_calls["args"]
    used, options = (args[3], args[6]) if isinstance(prompts, list) else (args[2], generate_calls["kw"]["options"])
    assert used == method
    if isinstance(prompts, list):
        assert options.schedule.to_dict() == schedule.to_dict() and options.lookup == schedule.choices[2].lookup
    elif at_one:
        assert options.label == schedule.choices[1].label and options.schedule is None
    assert "note:" not in capsys.readouterr().err
    if isinstance(prompts, list):   # batches without a batched evaluation's file: told how to get one
        with pytest.raises(DecodeCalled):
            cli_run.run_generate(cli.GenerateConfig(heads="h", prompt=prompts))
        assert "batch_size=[1,2,4,...] measures it per batch size" in capsys.readouterr().err
        assert generate_calls["args"][6].schedule is None


@pytest.mark.parametrize("kind, value, match", [("eagle3", "auto", "choice=auto is made by an evaluation"),
                                                ("eagle3", "missing.json", "no such file"),
                                                ("medusa", "eagle", "which these heads do not decode with")])
def test_generate_refuses_a_bad_choice_before_loading(tmp_path, monkeypatch, kind, value, match):
    """Guards against medusa-generate loading the backbone (seconds to minutes) before refusing a choice= it
    cannot decode with: auto (an evaluation's to make), a missing file, an EAGLE-3 file for Medusa heads."""
    import inference.cli as cli

    if value == "eagle":
        value = str(_eagle_file(tmp_path)[0])
    spec = _eagle_spec() if kind == "eagle3" else _medusa_spec()
    monkeypatch.setattr(cli_run, "heads_spec", lambda cfg: spec)
    monkeypatch.setattr(cli_run, "_load", lambda cfg: pytest.fail("loaded the backbone before refusing"))
    with pytest.raises(UserError, match=match):
        cli_run.run_generate(cli.GenerateConfig(heads="h", prompt="hi", choice=value))


def test_eval_measures_a_choice_file_again(tmp_path, monkeypatch):
    """Guards against medusa-eval ignoring choice=<file> (the file's method must decode with its schedule,
    batched, or its batch-1 choice one prompt at a time, at choice fixed), or taking it for another method."""
    import inference.cli as cli

    path, schedule = _medusa_file(tmp_path)
    cfg = cli.EvalConfig(heads="h", choice=str(path))
    options, modes, _ = cli_run.eval_choices(cfg, ["medusa", "autoregressive"], _medusa_spec(), [1, 2])
    assert options["medusa"].tree.to_dict() == schedule.to_dict() and modes == {"medusa": "fixed"}
    options, _, _ = cli_run.eval_choices(cfg, ["medusa", "autoregressive"], _medusa_spec(), None)
    assert options["medusa"].tree.name == "auto4"
    with pytest.raises(UserError, match="is for method 'medusa'"):
        cli_run.eval_choices(cfg, ["medusa_lookup", "autoregressive"], _medusa_spec(), None)


def test_the_prompts_a_choice_was_measured_on_travel_with_it(tmp_path):
    """Guards against an evaluation given a choice file scoring the choice on the very prompts it was measured on
    (they once were: nothing recorded them): the file keeps their digests, an unrecorded file (written before) reads
    as None so the evaluation can say so, and a damaged list is refused in one line."""
    from inference.prompts import Prompt, hold_out, prompt_digest

    chosen = _medusa_chosen(True)
    calib = [Prompt("q7", ["Name a colour."]), Prompt("q8", ["Count to three."], system="Be brief.")]
    path = write_choice(tmp_path, "medusa", chosen, chosen.options, "abc", [prompt_digest(p) for p in calib])
    got = read_choice(str(path), _medusa_spec(), ["medusa"], _medusa_options)
    assert got.chosen_on == tuple(prompt_digest(p) for p in calib)
    # the same prompt under another id is held out; one with another system message is not
    prompts = [Prompt("a", ["Say hello."]), Prompt("b", ["Name a colour."], replies=[None]),   # a messages record
               Prompt("c", ["Count to three."])]
    assert [[p.id for p in part] for part in hold_out(prompts, got.chosen_on)] == [["a", "c"], ["b"]]
    record = json.loads(path.read_text())
    del record["chosen_on_prompts"]
    path.write_text(json.dumps(record))
    assert read_choice(str(path), _medusa_spec(), ["medusa"], _medusa_options).chosen_on is None
    path.write_text(json.dumps({**record, "chosen_on_prompts": "q7"}))
    with pytest.raises(UserError, match="chosen_on_prompts is damaged"):
        read_choice(str(path), _medusa_spec(), ["medusa"], _medusa_options)


def _file_with_tree(tmp_path, method, choices):
    record = {"format": "medusa-train speculation choice", "version": 2, "method": method,
              "schedule": {"choices": {"1": {"tree": {"name": "given", "choices": choices}}}}}
    path = tmp_path / f"{method}_choice.json"
    path.write_text(json.dumps(record))
    return str(path)


def test_a_choice_files_tree_without_draft_nodes_or_beyond_the_cap_is_refused(tmp_path):
    """Guards against: a medusa choice file whose tree has no draft node decoding plainly under medusa's name (tau 1.0
    with the heads' cost), and a choice file's tree bypassing the 256-node cap. A medusa_lookup file's empty tree is
    kept: its looked-up chain still drafts (as its "none (no tree)" choice does)."""
    usable = ["medusa", "medusa_lookup"]
    with pytest.raises(UserError, match="its tree given has no draft node") as e:
        read_choice(_file_with_tree(tmp_path, "medusa", []), _medusa_spec(), usable, _medusa_options)
    assert "\n" not in str(e.value) and "choice=" in str(e.value)
    with pytest.raises(UserError, match="its tree given has 301 nodes"):
        read_choice(_file_with_tree(tmp_path, "medusa", [[r] for r in range(300)]), _medusa_spec(outputs=400),
                    usable, _medusa_options)
    got = read_choice(_file_with_tree(tmp_path, "medusa_lookup", []), _medusa_spec(), usable, _medusa_options)
    assert got.schedule.choices[1].num_nodes == 1
