"""EAGLE-3 aux layers in the engines' order: vLLM and SGLang collect the listed target layers while walking
the layers, so ascending and each layer once, whatever order (or repeats) a config lists. Drafters trained,
loaded, imported and exported here use that order (fc's column blocks permuted to match when a user or a
checkpoint gives another one), and ids naming a layer twice are refused in one line wherever they enter."""

from __future__ import annotations

import json
import warnings
from types import SimpleNamespace

import pytest
import torch

from engine_specs import (eagle3_engine_forward, engine_aux_features, sglang_eagle3_aux_ids, sglang_eagle3_load,
                          sglang_eagle3_logits, vllm_eagle3_aux_ids, vllm_eagle3_load, vllm_eagle3_logits)
from inference.backbone import HiddenStateTap
from inference.errors import UserError
from inference.formats.export import ExportOptions, FormatWarning, export_heads
from inference.heads.eagle3 import Eagle3Drafter, default_aux_layers, draft_layer_config
from inference.heads.native import save_heads
from inference.heads.spec import HeadsSpec, backbone_fingerprint
from inference.loading import load_heads, read_heads_spec
from runtime_support import one_thread, tiny_llama  # noqa: F401  (one_thread: autouse fixture)

VOCAB, HIDDEN, LAYERS = 96, 64, 8
TOL = 1e-4  # fp32, features from a real backbone forward: the same math in another order


@pytest.fixture(scope="module")
def backbone():
    return tiny_llama(vocab=VOCAB, hidden=HIDDEN, layers=LAYERS, init=0.2)


def drafter(backbone, aux, seed=0) -> Eagle3Drafter:
    """Every weight random (a warm start's zeros would hide which layer fc reads), full vocabulary."""
    cfg = backbone.config
    spec = HeadsSpec(num_heads=2, num_layers=1, hidden_size=HIDDEN, vocab_size=VOCAB, base_model="org/tiny",
                     base_model_fingerprint=backbone_fingerprint(cfg), kind="eagle3", aux_layers=list(aux),
                     draft_layer=draft_layer_config(cfg))
    return randomized(Eagle3Drafter(spec), backbone, seed)


def randomized(d: Eagle3Drafter, backbone, seed=0) -> Eagle3Drafter:
    """``d`` with every weight random (norm weights around 1: ones would hide which block a norm scales), given
    the backbone's input embeddings, in eval mode."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in d.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5 + (1.0 if p.dim() == 1 else 0.0))
    d.attach_backbone(None, backbone.get_input_embeddings().weight)
    return d.eval()


def tokens(seed=1, t=7):
    return torch.randint(0, VOCAB, (t,), generator=torch.Generator().manual_seed(seed))


def our_logits(d: Eagle3Drafter, backbone, ids: torch.Tensor) -> torch.Tensor:
    """Our runtime's first drafter pass over a prompt, fed the features its tap reads (``spec.settings.aux_layers``
    in the spec's order): what decoding would draft from."""
    with HiddenStateTap(backbone, d.spec.settings.aux_layers) as tap, torch.no_grad():
        backbone(ids[None])
        aux = tap.features()
        normed, _, _ = d.forward_step(ids[1:][None], d.combine(aux[:, :-1]), torch.arange(len(ids) - 1)[None])
    return d.project(normed)[0]


def engine_logits(d_dir, backbone, ids: torch.Tensor, engine: str) -> torch.Tensor:
    """The same pass as a restated engine runs an export: its own aux capture from the target's layers."""
    load, layer, logits_fn, aux_ids = {
        "vllm": (vllm_eagle3_load, "model.layers.0.", vllm_eagle3_logits, vllm_eagle3_aux_ids),
        "sglang": (sglang_eagle3_load, "model.midlayer.", sglang_eagle3_logits, sglang_eagle3_aux_ids)}[engine]
    params, cfg, problems = load(d_dir, HIDDEN, VOCAB)
    assert problems == []
    with torch.no_grad():
        hs = backbone(ids[None], output_hidden_states=True).hidden_states
        aux = engine_aux_features([h[0, :-1] for h in hs], aux_ids(cfg, LAYERS))
        normed, _, _ = eagle3_engine_forward(params, cfg, layer, backbone.get_input_embeddings().weight, ids[1:],
                                             aux, torch.arange(len(ids) - 1))
    return logits_fn(params, cfg, normed)


def max_diff(a, b) -> float:
    return float((a.detach() - b.detach()).abs().max())


# -- item 1: out of order ------------------------------------------------------------------------------------
@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_a_drafter_with_aux_ids_out_of_order_is_served_as_it_drafts(backbone, tmp_path, engine):
    """Guards against: heads.aux_layers=[5,2,4] exported with fc's columns in that order while both engines
    capture the layers ascending ([2,4,5]): the served drafter fed each fc block another layer (max logit
    difference 7.6, another argmax) than the one it was trained on."""
    d = drafter(backbone, [5, 2, 4])
    r = export_heads(d, "eagle3", tmp_path / "e", options=ExportOptions())
    cfg = json.loads((r.path / "config.json").read_text())
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    ids = tokens()
    diff = max_diff(our_logits(d, backbone, ids), engine_logits(r.path, backbone, ids, engine))
    assert diff <= TOL, diff


def test_a_native_checkpoint_with_aux_ids_out_of_order_loads_in_the_engines_order(backbone, tmp_path):
    """Guards against: a drafter saved with aux ids [5,2,4] (trained before the order was canonical) loaded
    with its ids as they are, so the spec medusa-eval reports, the features cache and any export disagree
    with the engines' ascending capture; loaded, it must read [2,4,5] with fc permuted to draft the same."""
    d = drafter(backbone, [5, 2, 4], seed=2)
    src = save_heads(d, tmp_path / "heads")
    assert read_heads_spec(src).settings.aux_layers == [2, 4, 5]
    back = load_heads(src, backbone_config=backbone.config, input_embeddings=backbone.get_input_embeddings().weight)
    assert back.spec.settings.aux_layers == [2, 4, 5]
    ids = tokens(seed=3)
    assert max_diff(our_logits(d, backbone, ids), our_logits(back, backbone, ids)) <= 1e-5


def test_training_reads_the_users_aux_layers_in_the_engines_order():
    """Guards against: heads.aux_layers=[5,2,4] trained in that order (a fresh fc learns its blocks in the
    order it is fed), which no engine serves; the resolved spec must name the layers as they are read."""
    from medusa_train.families import backbone_layers, training_family

    cfg = tiny_llama(vocab=VOCAB, hidden=HIDDEN, layers=LAYERS).config
    heads = SimpleNamespace(kind="eagle3", aux_layers=[5, 2, 4])
    assert training_family("eagle3").spec_settings(heads, cfg).aux_layers == [2, 4, 5]
    assert backbone_layers(heads, cfg) == (2, 4, 5)  # what the feature cache and the batch sources tap


@pytest.mark.parametrize("engine, key, ids", [("sglang", "eagle_config", [4, 1, 3]),
                                               ("vllm", "eagle_aux_hidden_state_layer_ids", [5, 2, 4])])
def test_an_imported_config_listing_ids_out_of_order_runs_as_the_engines_run_it(backbone, tmp_path, engine, key,
                                                                                ids):
    """Guards against: a SpecForge config whose eagle_config ids are [4,1,3] (or top-level ids [5,2,4]) run
    here as layers [5,2,4] while the engines capture [2,4,5] (difference 9.1): medusa-eval would measure
    another drafter than the one vLLM / SGLang serve from the same directory."""
    d = tmp_path / "f"
    export_heads(drafter(backbone, [2, 4, 5], seed=4), "eagle3", d, options=ExportOptions())
    cfg = json.loads((d / "config.json").read_text())
    del cfg["medusa_train"], cfg["eagle_aux_hidden_state_layer_ids"], cfg["eagle_config"]
    cfg[key] = {"eagle_aux_hidden_state_layer_ids": ids} if key == "eagle_config" else ids
    (d / "config.json").write_text(json.dumps(cfg))
    with warnings.catch_warnings(record=True) as notes:
        warnings.simplefilter("always", FormatWarning)
        back = load_heads(d, backbone_config=backbone.config, input_embeddings=backbone.get_input_embeddings().weight)
    assert back.spec.settings.aux_layers == [2, 4, 5]
    assert any("out of order" in str(n.message) for n in notes)  # said once, on the load
    tok = tokens(seed=5)
    diff = max_diff(our_logits(back, backbone, tok), engine_logits(d, backbone, tok, engine))
    assert diff <= TOL, diff


# -- item 2: a layer named twice -----------------------------------------------------------------------------
def test_the_restated_engines_capture_each_layer_once_and_fail_on_a_repeated_id(backbone, tmp_path):
    """Guards against: tests/engine_specs.py restating the engines with the config's ids as listed, so an
    export whose fc blocks follow another order, or that names a layer twice, looked servable there: the
    engines capture ascending, each layer once, and fc then gets 2H and fails with a shape error."""
    assert vllm_eagle3_aux_ids({"eagle_aux_hidden_state_layer_ids": [5, 2, 4]}, LAYERS) == (2, 4, 5)
    assert sglang_eagle3_aux_ids({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [4, 1, 3]}}, LAYERS) == (2, 4, 5)
    assert vllm_eagle3_aux_ids({"eagle_aux_hidden_state_layer_ids": [3, 3, 5]}, LAYERS) == (3, 5)
    assert vllm_eagle3_aux_ids({}, 6) == (2, 3)  # the engines' default on a 6-layer target
    d = tmp_path / "e"
    export_heads(drafter(backbone, [1, 3, 5]), "eagle3", d, options=ExportOptions())
    cfg = json.loads((d / "config.json").read_text())
    cfg["eagle_aux_hidden_state_layer_ids"] = [3, 3, 5]  # what the exporter wrote for heads.aux_layers=[3,3,5]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(RuntimeError, match="fc expects 192 features, the target captured 128"):
        engine_logits(d, backbone, tokens(), "vllm")


def test_a_repeated_aux_layer_is_refused_in_one_line_wherever_ids_enter(backbone, tmp_path):
    """Guards against: heads.aux_layers=[3,3,5] (or a checkpoint naming a layer twice) trained, loaded,
    imported or exported, then failing at serve time with a shape error (fc gets 2H instead of 3H)."""
    from medusa_train.families import training_family

    eagle3 = training_family("eagle3")
    heads = SimpleNamespace(kind="eagle3", aux_layers=[3, 3, 5], draft_vocab_size=None, ttt_steps=None,
                            projection="own", num_layers=1, num_heads=3)
    errors = []
    for refuse in (lambda: eagle3.validate(SimpleNamespace(heads=heads, lora=SimpleNamespace(enabled=False))),
                   lambda: eagle3.spec_settings(heads, backbone.config)):
        with pytest.raises(UserError) as e:
            refuse()
        errors.append(str(e.value))
    d = drafter(backbone, [3, 3, 5])
    with pytest.raises(UserError) as e:  # export of heads built in Python: nothing written
        export_heads(d, "eagle3", tmp_path / "e", options=ExportOptions())
    errors.append(str(e.value))
    assert not (tmp_path / "e").exists()
    src = save_heads(d, tmp_path / "native")  # the runtime computes it; no engine can serve it
    embed = backbone.get_input_embeddings().weight
    for refuse in (lambda: read_heads_spec(src),
                   lambda: load_heads(src, backbone_config=backbone.config, input_embeddings=embed)):
        with pytest.raises(UserError) as e:
            refuse()
        errors.append(str(e.value))
    foreign = tmp_path / "f"
    export_heads(drafter(backbone, [1, 3, 5]), "eagle3", foreign, options=ExportOptions())
    cfg = json.loads((foreign / "config.json").read_text())
    cfg["eagle_aux_hidden_state_layer_ids"] = [3, 3, 5]
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 2, 4]
    (foreign / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError) as e:
        read_heads_spec(foreign)
    errors.append(str(e.value))
    for text in errors:
        assert "\n" not in text and "[3, 3, 5]" in text and "more than once" in text, text


@pytest.mark.parametrize("layers", range(4, 33))
def test_default_aux_layers_are_three_distinct_servable_ids(layers):
    """Guards against: the default (2, N//2, N-3) on targets of 6 layers or fewer ([2,3,3], [2,2,2],
    [2,2,1]) naming a layer twice, which trains and exports but cannot be served; deeper targets keep
    EAGLE-3's own choice."""
    ids = default_aux_layers(layers)
    assert ids == sorted(set(ids)) and len(ids) == 3 and 1 <= ids[0] and ids[-1] <= layers - 1
    eagle = [2, layers // 2, layers - 3]
    if len(set(eagle)) == 3:
        assert ids == sorted(eagle)


@pytest.mark.parametrize("layers", [1, 2, 3])
def test_a_target_too_shallow_for_three_distinct_layers_is_refused_before_loading(layers):
    """Guards against: an eagle3 run on a target with fewer than 4 layers (three distinct ids in 1..N-1 do
    not exist) training a drafter with a repeated layer instead of saying which families fit it."""
    from medusa_train.families import training_family

    cfg = tiny_llama(vocab=VOCAB, hidden=HIDDEN, layers=layers).config
    with pytest.raises(UserError) as e:
        training_family("eagle3").spec_settings(SimpleNamespace(kind="eagle3", aux_layers=None), cfg)
    assert f"this one has {layers} layer(s)" in str(e.value) and "heads.kind=hydra or medusa" in str(e.value)
