"""Tree structure, buffers, validation, JSON files and greedy tree growth (inference/tree.py)."""

import itertools
import json

import pytest
import torch

from inference.errors import UserError
from inference.runtime.tree import (MC_SIM_7B_63, MedusaTree, chain_tree, default_tree, expected_tau, grow_tree,
                            resolve_tree)

# Given unsorted on purpose: nodes must come out sorted by (depth, path).
CHOICES = [[1], [0], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


def test_buffers_of_a_hand_checked_tree():
    """Guards against wrong node order, ancestor masks, positions, retrieve rows or gather indices."""
    t = MedusaTree(CHOICES)
    assert t.paths == ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
    assert t.parent == [-1, 0, 0, 1, 1, 2, 3]
    b = t.buffers("cpu")
    visible = {0: {0}, 1: {0, 1}, 2: {0, 2}, 3: {0, 1, 3}, 4: {0, 1, 4}, 5: {0, 2, 5}, 6: {0, 1, 3, 6}}
    expected = torch.zeros(7, 7, dtype=torch.bool)
    for i, cols in visible.items():
        expected[i, list(cols)] = True
    assert torch.equal(b.tree_mask, expected)
    assert b.position_offsets.tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert b.parents.tolist() == [-1, 0, 0, 1, 1, 2, 3]
    assert b.retrieve_indices.tolist() == [[0, 1, 4, -1], [0, 2, 5, -1], [0, 1, 3, 6]]
    assert b.node_head.tolist() == [0, 0, 1, 1, 1, 2]
    assert b.node_rank.tolist() == [0, 1, 0, 1, 0, 0]
    assert b.node_slot.tolist() == [0, 1, 0, 1, 0, 0]
    assert b.children.tolist() == [[1, 2], [3, 4], [5, -1], [6, -1], [-1, -1], [-1, -1], [-1, -1]]
    assert b.topk_per_depth == (2, 2, 1)
    assert b.slots_per_depth == (2, 2, 1)


def test_additive_mask_shows_prefix_to_all_and_hides_other_branches():
    """Guards against a mask that hides the prefix, leaks siblings or has the wrong shape/dtype."""
    b = MedusaTree(CHOICES).buffers("cpu")
    m = b.additive_mask(past=3, dtype=torch.bfloat16)
    assert m.shape == (1, 1, 7, 10) and m.dtype == torch.bfloat16
    assert (m[0, 0, :, :3] == 0).all()
    lowest = torch.finfo(torch.bfloat16).min
    assert torch.equal(m[0, 0, :, 3:] == 0, b.tree_mask)
    assert (m[0, 0, :, 3:][~b.tree_mask] == lowest).all()


def test_root_only_tree_is_plain_decoding():
    """Guards against the 1-node tree (latency baseline) failing to build."""
    b = MedusaTree([]).buffers("cpu")
    assert b.num_nodes == 1 and b.max_depth == 0
    assert b.retrieve_indices.tolist() == [[0]]


@pytest.mark.parametrize("choices, fragment", [
    ([[0, 0]], "no parent"),
    ([[0], [1, 0], [0]], "appears twice"),
    ([[-1]], "non-negative"),
    ([[0.5]], "non-negative"),
    ([[True]], "non-negative"),
    ([[]], "must not be empty"),
    ("[[0]]", "list of paths"),
    ([5], "not a list of ranks"),
])
def test_invalid_trees_are_refused(choices, fragment):
    """Guards against accepting malformed choices that would build wrong masks silently."""
    with pytest.raises(UserError, match=fragment):
        MedusaTree(choices)


def test_tree_must_fit_the_heads():
    """Guards against a tree deeper than the heads or with ranks beyond the head vocabulary."""
    t = MedusaTree([[0], [0, 0], [0, 0, 0]])
    with pytest.raises(UserError, match="depth 3"):
        t.check_fits(num_heads=2, head_vocab=100)
    with pytest.raises(UserError, match="top-5"):
        MedusaTree([[4]]).check_fits(num_heads=1, head_vocab=4)
    t.check_fits(num_heads=3, head_vocab=1)


def test_greedy_growth_picks_the_hand_computed_nodes():
    """Guards against a growth rule that is not 'best product-of-accuracies frontier node'."""
    acc = [[0.6, 0.2, 0.1], [0.4, 0.2, 0.1]]
    # values: [0]=.6 [1]=.2 [2]=.1 [0,0]=.24 [0,1]=.12 [0,2]=.06 [1,0]=.08 [1,1]=.04 ...
    tree, tau = grow_tree(acc, 4)
    assert set(tree.paths) == {(0,), (0, 0), (1,), (0, 1)}
    assert tau == pytest.approx(1 + 0.6 + 0.24 + 0.2 + 0.12)
    tree5, tau5 = grow_tree(acc, 5)
    assert set(tree5.paths) == {(0,), (0, 0), (1,), (0, 1), (2,)}
    assert tau5 == pytest.approx(tau + 0.1)
    assert expected_tau(tree5, acc) == pytest.approx(tau5)


def test_greedy_growth_is_optimal_against_brute_force():
    """Guards against the greedy tree being worse than the best prefix-closed tree of its size."""
    acc = [[0.5, 0.3, 0.15], [0.1, 0.7, 0.05]]  # depth 2 prefers rank 1: not monotone in rank
    nodes = [p for d in (1, 2) for p in itertools.product(range(3), repeat=d)]
    for budget in (1, 3, 5, 8):
        best = 0.0
        for subset in itertools.combinations(nodes, budget):
            s = set(subset)
            if all(len(p) == 1 or p[:-1] in s for p in s):
                best = max(best, expected_tau(MedusaTree(subset), acc))
        _, tau = grow_tree(acc, budget)
        assert tau == pytest.approx(best)


def test_growth_stops_at_zero_value_and_validates_input():
    """Guards against padding trees with worthless nodes and accepting nonsense accuracies."""
    tree, tau = grow_tree([[0.5, 0.0], [0.0, 0.0]], 10)
    assert tree.paths == ((0,),) and tau == pytest.approx(1.5)
    with pytest.raises(UserError):
        grow_tree([[1.5]], 3)
    with pytest.raises(UserError):
        grow_tree([[0.5, 0.2], [0.1]], 3)


def test_json_round_trip_and_bare_lists(tmp_path):
    """Guards against trees that do not survive save/load, or Medusa's bare-list files being refused."""
    t = MedusaTree(CHOICES, name="mine")
    path = t.save(tmp_path / "t.json", expected_tau=2.5)
    assert json.loads(path.read_text())["expected_tau"] == 2.5
    back = MedusaTree.load(path)
    assert back.paths == t.paths and back.name == "mine"
    (tmp_path / "bare.json").write_text(json.dumps(CHOICES))
    assert MedusaTree.load(tmp_path / "bare.json").paths == t.paths
    assert resolve_tree(str(tmp_path / "bare.json"), 3).paths == t.paths
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        MedusaTree.load(tmp_path / "bad.json")
    (tmp_path / "other.json").write_text(json.dumps({"choices": [[0]]}))
    with pytest.raises(UserError, match="not a medusa-tree"):
        MedusaTree.load(tmp_path / "other.json")


@pytest.mark.parametrize("num_heads", [1, 3, 5])
def test_default_trees_have_their_advertised_sizes(num_heads):
    """Guards against default trees of the wrong size or deeper than the available heads."""
    for size in (1, 4, 8, 16, 32, 64):
        t = default_tree(f"tree{size}", num_heads)
        assert t.num_nodes == size and t.max_depth <= num_heads
    assert chain_tree(3).paths == ((0,), (0, 0))
    assert default_tree("chain2", num_heads).num_nodes == 2


def test_medusa_reference_tree():
    """Guards against a corrupted copy of Medusa's mc_sim_7b_63 or it being used with too few heads."""
    t = default_tree("mc_sim_7b_63", 4)
    assert t.num_nodes == 64 and len(MC_SIM_7B_63) == 63
    assert t.max_depth == 4 and max(t.topk_per_depth()) == 10
    with pytest.raises(UserError, match="needs 4 heads"):
        default_tree("mc_sim_7b_63", 3)
    with pytest.raises(UserError, match="unknown tree"):
        default_tree("bushy", 3)


def test_a_folder_is_no_tree_file_and_no_folder_hides_a_trees_name(tmp_path, monkeypatch):
    """Guards against tree=<folder> answered "unknown tree 'pdir'" (or "not found" for a path that is plainly
    there), and a folder named tree4 in the working directory taking tree=tree4 from the named tree."""
    from inference.errors import UserError
    from inference.runtime.tree import resolve_tree

    monkeypatch.chdir(tmp_path)
    (tmp_path / "tree4").mkdir()
    (tmp_path / "pdir").mkdir()
    assert resolve_tree("tree4", 3).name == "tree4"
    for given in ("pdir", str(tmp_path / "pdir")):
        with pytest.raises(UserError, match="pdir is a folder, not a tree file"):
            resolve_tree(given, 3)


@pytest.mark.parametrize("version", ["2", None, True, 1.5])
def test_a_tree_file_whose_version_is_no_integer_is_one_line(tmp_path, version):
    """Guards against: a tree file whose "version" is a string ("2"), null, a bool or a float crashing with a
    TypeError traceback (``"2" > 1``) instead of a one-line refusal, as a choice file's is refused."""
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"format": "medusa-tree", "version": version, "choices": [[0], [0, 0]]}))
    with pytest.raises(UserError, match=r"its version is .*, not a number") as e:
        resolve_tree(str(path), 3)
    assert "\n" not in str(e.value)


WIDE = [[r] for r in range(300)]   # 301 nodes: beyond the 256 named trees and budgets may have


@pytest.mark.parametrize("given", ["file", "bare_file", "list", "tree"])
def test_trees_given_any_way_keep_the_node_cap(tmp_path, given):
    """Guards against: a tree file, a bare choices file, an inline list or a built tree bypassing the 256-node cap
    that named trees and budgets have (a 16,512-node tree file decoded at 0.2 tok/s), refused in one line."""
    from inference.runtime.tree import MAX_TREE_NODES

    path = tmp_path / "wide.json"
    if given == "file":
        path.write_text(json.dumps({"format": "medusa-tree", "version": 1, "choices": WIDE}))
    elif given == "bare_file":
        path.write_text(json.dumps(WIDE))
    tree = {"file": str(path), "bare_file": str(path), "list": WIDE, "tree": MedusaTree(WIDE, name="wide")}[given]
    with pytest.raises(UserError, match=f"301 nodes .*more than {MAX_TREE_NODES}") as e:
        resolve_tree(tree, 3)
    assert "\n" not in str(e.value)
    assert resolve_tree(WIDE[:MAX_TREE_NODES - 1], 3).num_nodes == MAX_TREE_NODES   # the cap itself is taken


@pytest.mark.parametrize("given", ["chain1", [], ()])
def test_a_named_tree_of_the_root_alone_is_refused_as_an_empty_list_is(given):
    """Guards against: tree=chain1 (the root alone) decoding as plain decoding with the heads' cost, reported as
    medusa with tau 1.0, where tree=[] was already refused."""
    with pytest.raises(UserError, match="has no draft node"):
        resolve_tree(given, 3)
    assert resolve_tree("chain2", 3).num_nodes == 2
