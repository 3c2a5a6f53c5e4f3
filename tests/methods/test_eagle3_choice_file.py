"""EAGLE-3 decoding settings on the command line: the tree fitted to the drafter when eagle_nodes /
eagle_depth are unset (``eagle3.fitted_tree``). An evaluation's choice saved for medusa-generate is the one
choice file's (tests/methods/test_choice_file.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from inference.errors import UserError
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
    from inference.cli_checks import method_options

    cfg = cli.EvalConfig(heads="h", choice="fixed")
    opts = {x: method_options(cfg, x, _spec(1)) for x in ("eagle3", "eagle3_lookup")}
    assert (opts["eagle3"].nodes, opts["eagle3"].depth, opts["eagle3"].topk) == (4, 1, 4)
    assert (opts["eagle3_lookup"].nodes, opts["eagle3_lookup"].depth) == (4, 1)
    opts = method_options(cli.EvalConfig(heads="h", eagle_depth=2, eagle_topk=2), "eagle3", _spec(1))
    assert (opts.nodes, opts.depth, opts.topk) == (6, 2, 2)
    assert options_from_keys("eagle3", cli.EvalConfig()).nodes is None   # unset, no drafter: fitted at load
