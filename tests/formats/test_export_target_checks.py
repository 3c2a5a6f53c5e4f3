"""``medusa-export`` checks the heads against their target before writing: backbone= (or the base model the
heads record) is read as a config, and heads made for another hidden size, vocabulary, depth (EAGLE-3 aux
layers) or config fingerprint are refused in one line with nothing written, whatever the family; an output
folder that cannot be created is one line too. medusa-generate's refusal of such heads is one line, with
no Python warnings before it."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from conftest import call_main
from inference.formats.export import ExportOptions, FormatWarning, export_heads
from inference.heads.eagle3 import Eagle3Drafter, draft_layer_config
from inference.heads.native import save_heads
from inference.heads.spec import HeadsSpec, backbone_fingerprint
from runtime_support import one_thread, random_heads, tiny_llama  # noqa: F401  (one_thread: autouse fixture)
from test_formats_cli import assert_one_line_error, run

VOCAB, HIDDEN, LAYERS = 96, 64, 8


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab=VOCAB, hidden=HIDDEN, layers=LAYERS)


@pytest.fixture(scope="module")
def targets(target, tmp_path_factory):
    """Config-only target folders (all an export reads): the heads' own, and one per way to differ."""
    root = tmp_path_factory.mktemp("targets")
    kinds = {"own": target.config,
             "hidden": tiny_llama(vocab=VOCAB, hidden=2 * HIDDEN, layers=LAYERS).config,
             "vocab": tiny_llama(vocab=VOCAB + 8, hidden=HIDDEN, layers=LAYERS).config,
             "shallow": tiny_llama(vocab=VOCAB, hidden=HIDDEN, layers=4).config}
    other = tiny_llama(vocab=VOCAB, hidden=HIDDEN, layers=LAYERS).config
    other.intermediate_size *= 2  # same sizes and depth, another architecture: only the fingerprint differs
    kinds["fingerprint"] = other
    for name, cfg in kinds.items():
        cfg.save_pretrained(root / name)
    return root


def eagle3(target, tmp_path, aux=(2, 4, 6), fingerprint=True):
    spec = HeadsSpec(num_heads=2, num_layers=1, hidden_size=HIDDEN, vocab_size=VOCAB, base_model="random:llama",
                     base_model_fingerprint=backbone_fingerprint(target.config) if fingerprint else "", kind="eagle3",
                     aux_layers=list(aux), draft_layer=draft_layer_config(target.config))
    return save_heads(Eagle3Drafter(spec), tmp_path / "eagle3-heads")


@pytest.mark.parametrize("other, words", [
    ("hidden", "hidden size 64, the backbone has 128"),
    ("vocab", "vocab size 96, the backbone has 104"),
    ("shallow", "aux layers [2, 4, 6]"),
    ("fingerprint", "config fingerprint"),
])
@pytest.mark.parametrize("layout", ["native", "eagle3"])
def test_an_eagle3_drafter_is_refused_for_another_target(target, targets, tmp_path, capsys, other, words, layout):
    """Guards against: medusa-export heads=<EAGLE-3 drafter naming its aux ids> backbone=<another target>
    exiting 0 and writing an export for another hidden size, vocabulary, depth or fingerprint (the target
    was read only when the config named no aux ids)."""
    src = eagle3(target, tmp_path, fingerprint=other != "shallow")  # a depth the fingerprint would also refuse
    if layout == "eagle3":  # the engines' directory, re-exported
        src = export_heads(load_native_drafter(src, target), "eagle3", tmp_path / "engine-dir",
                           options=ExportOptions()).path
    out = tmp_path / "out"
    code, _, err = run([f"heads={src}", "format=eagle3", f"out={out}", f"backbone={targets / other}"], capsys)
    assert_one_line_error(code, err, words)
    assert not out.exists()
    code, _, err = run([f"heads={src}", "format=eagle3", f"out={out}", f"backbone={targets / 'own'}"], capsys)
    assert code == 0, err


def load_native_drafter(src, target):
    from inference.loading import load_heads

    return load_heads(src, backbone_config=target.config, input_embeddings=target.get_input_embeddings().weight)


def test_medusa_heads_of_another_width_are_refused_not_ignored(target, targets, tmp_path, capsys):
    """Guards against: backbone= silently ignored for Medusa heads with their own projections (the export
    never needs the backbone's weights), so heads of another width were written for it without a word."""
    src = save_heads(random_heads(target), tmp_path / "medusa")
    out = tmp_path / "out"
    for other, words in (("hidden", "hidden size 64"), ("vocab", "vocab size 96")):
        code, _, err = run([f"heads={src}", "format=vllm", f"out={out}", f"backbone={targets / other}"], capsys)
        assert_one_line_error(code, err, words)
        assert not out.exists()
    code, _, err = run([f"heads={src}", "format=vllm", f"out={out}", f"backbone={targets / 'own'}"], capsys)
    assert code == 0, err


def test_the_recorded_base_model_is_checked_too(target, targets, tmp_path, capsys):
    """Guards against: heads whose recorded base model is readable (a local target) exported without the
    check, when the folder at that path now holds another model."""
    heads = random_heads(target)
    heads.spec.base_model = str(targets / "hidden")
    src = save_heads(heads, tmp_path / "medusa")
    code, _, err = run([f"heads={src}", "format=vllm", f"out={tmp_path / 'out'}"], capsys)
    assert_one_line_error(code, err, "hidden size 64, the backbone has 128")
    assert not (tmp_path / "out").exists()


def test_an_output_folder_that_cannot_be_created_is_one_line(target, tmp_path, capsys):
    """Guards against: out= under /proc (or below a file) ending in a FileNotFoundError traceback instead of
    one line and exit 2, with nothing written."""
    src = save_heads(random_heads(target), tmp_path / "medusa")
    (tmp_path / "a-file").write_text("not a folder")
    for out in ("/proc/medusa-export-test/out", str(tmp_path / "a-file" / "out")):
        code, _, err = run([f"heads={src}", "format=vllm", f"out={out}"], capsys)
        assert_one_line_error(code, err, f"out={out} cannot be created")
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())


def test_medusa_generate_refuses_a_foreign_drafter_for_another_target_in_one_line(target, tmp_path, capsys):
    """Guards against: medusa-generate printing the layout's notes twice (two-line Python warnings, once per
    spec read) before refusing heads made for another target: a refusal is one line on its own."""
    from inference.cli import generate_main
    from medusa_train.backbone import byte_tokenizer

    backbone = tmp_path / "backbone"  # another width, with a tokenizer: what medusa-generate loads
    tiny_llama(vocab=259, hidden=32, layers=LAYERS).save_pretrained(backbone)
    byte_tokenizer().save_pretrained(backbone)
    src = export_heads(load_native_drafter(eagle3(target, tmp_path), target), "eagle3", tmp_path / "e",
                       options=ExportOptions()).path
    cfg = json.loads((src / "config.json").read_text())
    del cfg["eagle_aux_hidden_state_layer_ids"], cfg["medusa_train"]  # SGLang-style ids only: a note on load
    (src / "config.json").write_text(json.dumps(cfg))
    capsys.readouterr()  # the saves' progress bars
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code, _, err = call_main(generate_main, [f"heads={src}", f"backbone={backbone}", "prompt=hi",
                                                 "max_new_tokens=2", "kernels=stock"], capsys)
    err = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1 and "hidden size 64, the backbone has 32" in err[0], err
    assert not [w for w in caught if issubclass(w.category, FormatWarning)]
    torch.set_num_threads(1)  # medusa-generate set its own thread count
