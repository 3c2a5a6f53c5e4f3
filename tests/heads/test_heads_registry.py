"""The head-family and format registries: a new family or layout plugs in without touching other files."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from inference.errors import UserError
from inference.formats import importers, load_builtin_formats
from inference.formats.export import exporter_for
from inference.formats.importers import detect_layout, importer_for, register_importer
from inference.heads import KINDS, registry
from inference.heads.drafting import ContextDrafting, IndependentDrafting, PathDrafting
from inference.heads.medusa import MedusaHeads
from inference.heads.native import heads_state_dict, save_heads
from inference.heads.projection import ProjectedHeads
from inference.heads.registry import HeadFamily, family, init_heads, register_family
from inference.heads.spec import HeadsSpec, backbone_fingerprint
from inference.loading import load_heads, load_medusa, read_heads_spec
from inference.methods import generate
from inference.runtime.tree import MedusaTree

from runtime_support import one_thread, tiny_llama  # noqa: F401

V, H = 96, 64
PROMPT = [5, 17, 3, 88, 41, 9]
TREE = MedusaTree([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])


# -- a toy family: everything a new family has to write ------------------------------------------
class ToyHeads(IndependentDrafting, ProjectedHeads):
    """Head k = projection of tanh(scale_k * h_t)."""

    def __init__(self, spec):
        super().__init__()
        self.scales = nn.Parameter(torch.ones(spec.num_heads))
        self._init_projection(spec, spec.hidden_size)

    def head_logits(self, hidden, k):
        return self.project(torch.tanh(self.scales[k] * hidden), k)


def register_toy():
    register_family(HeadFamily("toy", ToyHeads, IndependentDrafting))
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def fresh_registry(monkeypatch):
    """Families registered by a test vanish after it (the built-in ones are registered first, so
    they are not lost with the copy)."""
    for kind in KINDS:
        family(kind)
    monkeypatch.setattr(registry, "_FAMILIES", dict(registry._FAMILIES))


def test_a_family_registered_in_one_call_is_built_saved_loaded_and_drafts(fresh_registry, tmp_path):
    """Guards against generic code (spec validation, init, native save/load, load_medusa, tree
    drafting) that still names the built-in families, so a new family needs edits elsewhere."""
    register_toy()
    model = tiny_llama(vocab=V, hidden=H, seed=0)
    spec = HeadsSpec(num_heads=3, num_layers=0, hidden_size=H, vocab_size=V, kind="toy", base_model="random:llama",
                     base_model_fingerprint=backbone_fingerprint(model.config))
    heads = init_heads(spec, model.lm_head.weight, model.get_input_embeddings().weight)
    assert isinstance(heads, ToyHeads) and torch.equal(heads.projections[1].weight, model.lm_head.weight)
    with torch.no_grad():
        heads.scales.copy_(torch.tensor([0.5, 2.0, -1.0]))
    save_heads(heads, tmp_path / "toy")
    assert json.loads((tmp_path / "toy" / "config.json").read_text())["kind"] == "toy"
    assert read_heads_spec(tmp_path / "toy") == spec
    back = load_heads(tmp_path / "toy", backbone_config=model.config)
    x = torch.randn(4, H)
    for k in range(3):
        assert torch.equal(back.head_logits(x, k), heads.head_logits(x, k))
    m = load_medusa(tmp_path / "toy", backbone=model)
    assert isinstance(m.heads, ToyHeads) and not m.heads.sequential
    ref = generate(m, PROMPT, "autoregressive", max_new_tokens=16).tokens
    out = generate(m, PROMPT, "medusa", tree=TREE, max_new_tokens=16)
    assert out.tokens == ref


# -- a toy foreign layout: everything a new format's importer has to write --------------------------
def register_toy_layout():
    def read_spec(d):
        return HeadsSpec.from_dict(json.loads((d / "toy.json").read_text()))

    def load(d, spec):
        heads = MedusaHeads(spec)
        heads.load_state_dict(load_file(str(d / "toy.safetensors")), strict=True)
        return heads, None

    register_importer("toy", detect=lambda d: (d / "toy.json").is_file(), read_spec=read_spec, load=load)
# ------------------------------------------------------------------------------------------------


def test_a_layout_registered_in_one_call_loads_through_load_heads_and_load_medusa(monkeypatch, tmp_path):
    """Guards against a loader that still dispatches foreign layouts through a fixed table, so a
    new engine layout needs edits in the core loader."""
    load_builtin_formats()  # registered before the copy below, so they outlive this test
    monkeypatch.setattr(importers, "_IMPORTERS", dict(importers._IMPORTERS))
    register_toy_layout()
    model = tiny_llama(vocab=V, hidden=H, seed=0)
    spec = HeadsSpec(num_heads=2, num_layers=1, hidden_size=H, vocab_size=V, base_model="random:llama")
    heads = init_heads(spec, model.lm_head.weight)
    d = tmp_path / "toy"
    d.mkdir()
    (d / "toy.json").write_text(json.dumps(spec.to_dict()))
    save_file(heads_state_dict(heads), str(d / "toy.safetensors"))
    assert detect_layout(d) == "toy" and read_heads_spec(d) == spec
    x = torch.randn(3, H)
    assert torch.equal(load_heads(d, backbone_config=model.config).head_logits(x, 1), heads.head_logits(x, 1))
    assert torch.equal(load_medusa(d, backbone=model).heads.head_logits(x, 0), heads.head_logits(x, 0))


def test_unknown_kind_is_refused_in_one_line_listing_the_kinds(tmp_path):
    """Guards against a typo in a kind surfacing as a KeyError traceback (or a multi-line error)
    from deep inside loading instead of a one-line message naming the valid kinds."""
    for call in (lambda: family("hydar"), lambda: HeadsSpec(num_heads=2, num_layers=1, hidden_size=8,
                                                             vocab_size=16, kind="hydar")):
        with pytest.raises(UserError) as e:
            call()
        assert "\n" not in str(e.value) and "'hydar'" in str(e.value)
        assert all(k in str(e.value) for k in KINDS)
    d = tmp_path / "heads"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"num_heads": 2, "num_layers": 1, "hidden_size": 8,
                                              "vocab_size": 16, "kind": "hydar"}))
    (d / "model.safetensors").write_bytes(b"")
    with pytest.raises(UserError, match="heads kind must be one of"):
        read_heads_spec(d)


def test_unknown_format_or_layout_is_refused_in_one_line():
    """Guards against an unknown export format or import layout failing with a KeyError."""
    for call, name in ((lambda: exporter_for("onnx", "medusa"), "unknown format 'onnx'"),
                       (lambda: importer_for("onnx"), "unknown heads layout 'onnx'")):
        with pytest.raises(UserError) as e:
            call()
        assert "\n" not in str(e.value) and name in str(e.value) and "vllm" in str(e.value)


def test_every_kind_has_a_registered_family_with_its_drafting_mixin(fresh_registry):
    """Guards against the list of kinds and the registered families drifting apart, and against a
    family whose module lacks the drafting interface the decoders call."""
    for kind in KINDS:
        fam = family(kind)
        assert fam.kind == kind and issubclass(fam.module, fam.drafting)
        assert fam.drafting in (IndependentDrafting, PathDrafting, ContextDrafting)
    with pytest.raises(TypeError, match="drafting mixin"):
        register_family(HeadFamily("broken", ProjectedHeads, IndependentDrafting))


def test_each_family_describes_its_own_shape_for_the_training_log():
    """Guards against the trainer's first line calling an EAGLE-3 drafter "3 heads x 1 layers" (its
    num_heads counts unrolled training-time-test steps, not heads), an MLP speculator the same (it stacks no
    layers), while other families keep the
    "K heads x L layers" wording."""
    medusa = HeadsSpec(kind="medusa", num_heads=3, num_layers=2, hidden_size=H, vocab_size=V)
    assert family("medusa").shape(medusa) == "3 heads x 2 layers"
    from inference.heads.eagle3 import draft_layer_config

    cfg = tiny_llama().config
    eagle = HeadsSpec(kind="eagle3", num_heads=3, num_layers=1, hidden_size=cfg.hidden_size,
                      vocab_size=cfg.vocab_size, aux_layers=[0, 1, 1], draft_layer=draft_layer_config(cfg))
    text = family("eagle3").shape(eagle)
    assert "heads x" not in text and "[0, 1, 1]" in text and "3 training-time-test steps" in text
    # an MLP speculator has no residual layers: it said "3 heads x 1 layers"
    mlp = HeadsSpec(kind="mlp_speculator", num_heads=3, num_layers=1, hidden_size=H, vocab_size=V, inner_dim=32,
                    tie_weights=True)
    assert family("mlp_speculator").shape(mlp) == "MLP speculator: 3 steps of width 32, weights tied after the first"


def test_kinds_are_importable_without_torch():
    """Guards against the trainer's config validation (which reads ``inference.heads.KINDS``)
    paying for a torch import before anything heavy is needed."""
    code = "import sys; from inference.heads import KINDS; assert KINDS and 'torch' not in sys.modules, sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
    # nor the training config schema, which asks the families (their registries) for the kinds and their keys
    code = ("import sys; from medusa_train.config import RecipeConfig; from medusa_train.families import family_kinds; "
            "assert family_kinds() and 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
