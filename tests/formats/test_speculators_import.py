"""vLLM ``speculators``-format EAGLE-3 drafters (``Eagle3Speculator``, as RedHatAI publishes them) imported as
vLLM serves them: the draft layer's config under ``transformer_layer_config``, ``layers.0.*`` weights, the base
model from ``speculators_config.verifier``, the proposal method's depth as the drafter's trained depth, and
one line naming the format and the flag for what the drafter does not compute."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from inference.errors import NeedsBackboneConfig, UserError
from inference.formats.export import FormatWarning
from inference.formats.importers import detect_layout
from inference.heads.eagle3 import default_aux_layers
from inference.loading import read_heads_spec
from inference.methods.eagle3 import fitted_tree
from runtime_support import one_thread, tiny_llama  # noqa: F401  (one_thread: autouse fixture)
from test_eagle3_format import (DRAFT_VOCAB, HIDDEN, LAYERS, VOCAB, drafter, export, inputs, load_with, max_diff,
                                runtime_logits)

pytestmark = pytest.mark.filterwarnings("ignore:.*embed_tokens.weight ignored")  # every dir here ships a copy
AUX = [1, 3, 6]
LAYER_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "hidden_act", "rms_norm_eps", "rope_theta", "max_position_embeddings", "vocab_size", "torch_dtype")


@pytest.fixture(scope="module")
def backbone():
    return tiny_llama(vocab=VOCAB, hidden=HIDDEN, layers=LAYERS)


def speculators_config(eagle_cfg: dict, **top) -> dict:
    """What ``Eagle3SpeculatorConfig`` serialises, with the draft layer of ``eagle_cfg`` (a LlamaForCausalLMEagle3
    config): the layer's Llama config nested, the EAGLE-3 keys and the proposal / verifier block on top."""
    layer = {"model_type": "llama", "num_hidden_layers": 1, **{k: eagle_cfg[k] for k in LAYER_KEYS},
             "tie_word_embeddings": False, "architectures": ["LlamaForCausalLM"]}
    cfg = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "model_type": "speculators",
           "speculators_version": "0.2.0", "draft_vocab_size": eagle_cfg["draft_vocab_size"],
           "norm_before_residual": False, "target_hidden_size": None, "embed_requires_grad": False,
           "eagle_aux_hidden_state_layer_ids": eagle_cfg["eagle_aux_hidden_state_layer_ids"],
           "transformer_layer_config": layer, "torch_dtype": "float32",
           "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                  "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3,
                                                        "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                                  "verifier": {"name_or_path": "org/tiny-llama-verifier",
                                               "architectures": ["LlamaForCausalLM"]}}}
    cfg.update(top)
    return cfg


def write_speculators(d, backbone, src, *, top=None, drop=(), shards=False, embed=True):
    """``src`` exported as EAGLE-3, then laid out as speculators saves it: ``layers.0.*`` (no ``midlayer.``), the
    target's ``embed_tokens`` copied in, its own config shape; ``shards``: two safetensors and an index."""
    e = export(src, d.parent / f"{d.name}-eagle3").path
    cfg = speculators_config(json.loads((e / "config.json").read_text()), **(top or {}))
    for key in drop:
        cfg.pop(key, None)
    t = {k.replace("midlayer.", "layers.0."): v for k, v in load_file(str(e / "model.safetensors")).items()}
    if embed:
        t["embed_tokens.weight"] = backbone.get_input_embeddings().weight.detach().clone()
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    if shards:
        names = sorted(t)
        parts = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
        for f, keys in parts.items():
            save_file({k: t[k] for k in keys}, str(d / f))
        index = {"metadata": {}, "weight_map": {k: f for f, keys in parts.items() for k in keys}}
        (d / "model.safetensors.index.json").write_text(json.dumps(index))
    else:
        save_file(t, str(d / "model.safetensors"))
    return d


def same_drafts(a, b, seed=3) -> bool:
    tokens, aux, positions, nxt = inputs(seed=seed)
    return all(max_diff(x, y) == 0.0 for x, y in zip(runtime_logits(a, tokens, aux, positions, nxt),
                                                      runtime_logits(b, tokens, aux, positions, nxt)))


@pytest.mark.parametrize("shards", [False, True], ids=["one-file", "sharded"])
def test_a_published_speculators_dir_imports_as_vllm_serves_it(backbone, tmp_path, shards):
    """Guards against: a speculators-format EAGLE-3 dir (what RedHatAI publishes) read by the native loader
    ("config.json is not a heads config"), or imported with other weights, aux layers, base model or depth
    than vLLM serves it with; and its sharded form (model.safetensors.index.json) not read."""
    src = drafter(backbone, aux=AUX, seed=5)
    d = write_speculators(tmp_path / "s", backbone, src, shards=shards)
    assert detect_layout(d) == "speculators"
    spec = read_heads_spec(d)  # its aux ids are recorded: no backbone needed for the spec
    assert spec.kind == "eagle3" and spec.settings.aux_layers == AUX and spec.truncated_vocab_size == DRAFT_VOCAB
    assert spec.base_model == "org/tiny-llama-verifier" and spec.num_heads == 3  # speculative_tokens
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", FormatWarning)
        back = load_with(backbone, d)
    assert any("embed_tokens.weight ignored" in str(w.message) for w in caught)
    assert same_drafts(src, back)
    assert fitted_tree(back.spec, None, None, 4)[1] == 3  # decoding's tree depth follows the proposal method


def test_it_loads_as_the_same_drafter_as_the_eagle3_dir_it_came_from(backbone, tmp_path):
    """Guards against: the two layouts of one drafter (the LlamaForCausalLMEagle3 dir our export writes and its
    speculators form) loading as different drafters (a renamed weight, a size or id read from the wrong level)."""
    src = drafter(backbone, aux=AUX, seed=7)
    d = write_speculators(tmp_path / "s", backbone, src)
    native, spec = load_with(backbone, tmp_path / "s-eagle3"), load_with(backbone, d)
    assert native.spec.settings == spec.spec.settings and same_drafts(native, spec)


def test_no_aux_ids_reads_the_targets_default_layers_with_the_backbone(backbone, tmp_path):
    """Guards against: a speculators dir naming no aux layers read with other layers than the engines' default
    (2, N//2, N-3), or without the target (whose depth those defaults need) instead of asking for it."""
    src = drafter(backbone, aux=default_aux_layers(LAYERS), seed=2)
    d = write_speculators(tmp_path / "s", backbone, src, drop=("eagle_aux_hidden_state_layer_ids",))
    with pytest.raises(NeedsBackboneConfig, match="names no aux layer ids"):
        read_heads_spec(d)
    back = load_with(backbone, d)
    assert back.spec.settings.aux_layers == default_aux_layers(LAYERS) and same_drafts(src, back)


def test_norm_before_residual_absent_is_read_as_vllm_reads_it(backbone, tmp_path):
    """Guards against: a speculators config without norm_before_residual drafted with the residual taken before
    hidden_norm while vLLM (``update_eagle3``: absent = true) takes it after, and without a word; an explicit
    true refused or ignored."""
    src = drafter(backbone, aux=AUX, seed=4)
    d = write_speculators(tmp_path / "s", backbone, src, drop=("norm_before_residual",))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", FormatWarning)
        back = load_with(backbone, d)
    assert any("norm_before_residual" in str(w.message) for w in caught)
    assert back.norm_before_residual and not same_drafts(src, back)
    explicit = write_speculators(tmp_path / "t", backbone, src, top={"norm_before_residual": True})
    assert same_drafts(back, load_with(backbone, explicit))


@pytest.mark.parametrize("method, depth", [
    ({"proposal_type": "greedy", "speculative_tokens": 5}, 5),
    ({"proposal_type": "dynamic_tree", "speculative_tokens": 48, "expansion_factor": 10, "depth": 2}, 2),
    ({"proposal_type": "static_tree", "initial_branching_factor": 4, "branching_factor": 2, "depth": 1}, 1),
])
def test_the_proposal_methods_depth_sets_the_decoding_depth(backbone, tmp_path, method, depth):
    """Guards against: the depth a speculators drafter was made to propose (greedy speculative_tokens = its TTT
    steps; a tree's depth) ignored, so decoding drafts deeper (or shallower) than it learned to."""
    spec_cfg = {"algorithm": "eagle3", "default_proposal_method": method["proposal_type"],
                "proposal_methods": [{"proposal_type": "sampling", "speculative_tokens": 7}, method],
                "verifier": {"name_or_path": "org/v", "architectures": ["LlamaForCausalLM"]}}
    d = write_speculators(tmp_path / "s", backbone, drafter(backbone, aux=AUX), top={"speculators_config": spec_cfg})
    spec = read_heads_spec(d)
    assert spec.num_heads == depth and fitted_tree(spec, None, None, 2)[1] == min(depth, 4)


def test_a_lossy_acceptance_is_ignored_with_a_warning(backbone, tmp_path):
    """Guards against: verifier_accept_k > 1 (accept a draft within the verifier's top k: lossy) silently
    dropped, so the user believes the outputs follow that policy."""
    spec_cfg = {"algorithm": "eagle3", "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3, "verifier_accept_k": 5,
                                      "accept_tolerance": 1.5}],
                "verifier": {"name_or_path": "org/v", "architectures": ["LlamaForCausalLM"]}}
    d = write_speculators(tmp_path / "s", backbone, drafter(backbone, aux=AUX), top={"speculators_config": spec_cfg})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", FormatWarning)
        read_heads_spec(d)
    assert any("verifier_accept_k=5" in str(w.message) for w in caught)


@pytest.mark.parametrize("top, words", [
    ({"speculators_model_type": "eagle"}, "speculators_model_type 'eagle'"),
    ({"parallel_drafting": True}, "parallel_drafting=true"),
    ({"target_hidden_size": 2 * HIDDEN}, "target_hidden_size"),
    ({"transformer_layer_config": {"hidden_size": HIDDEN}}, "missing or bad"),
])
def test_what_the_drafter_does_not_compute_is_refused_in_one_line(backbone, tmp_path, top, words):
    """Guards against: a speculators dir this runtime does not compute (another speculator type, P-EAGLE's parallel
    drafting, another feature width, a layer config it cannot read) loaded wrong or failing with a traceback or the
    native loader's message instead of one line naming the format and the flag."""
    d = write_speculators(tmp_path / "s", backbone, drafter(backbone, aux=AUX), top=top)
    assert detect_layout(d) == "speculators"
    with pytest.raises(UserError) as e:
        load_with(backbone, d)
    assert words in str(e.value) and "speculators" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("flags", [{"norm_before_fc": True, "norm_output": True}, {"fc_norm": True},
                                   {"norm_before_fc": True, "fc_norm": True}], ids=lambda f: "+".join(f))
def test_norms_on_fcs_input_load_decode_greedy_identical_and_export(backbone, tmp_path, capsys, flags):
    """Guards against: a speculators drafter trained with the trainer's eagle3 defaults (norm_before_fc: one RMSNorm
    over the concatenated aux states, ``input_norm.weight``; norm_output) or EAGLE-3.1's per-layer ``fc_norm.{i}``
    refused (every newly trained one was), loaded without its norms (other drafts than vLLM serves), breaking
    decoding, or re-exported by medusa-export without them."""
    from engine_specs import vllm_eagle3_load
    from test_eagle3_engine_flags import decodes_as_the_backbone, flagged
    from test_formats_cli import run

    src = flagged(backbone, flags, seed=6)  # drafter(seed=6)'s weights, and the norms
    d = write_speculators(tmp_path / "s", backbone, src, top=flags)
    plain = write_speculators(tmp_path / "p", backbone, drafter(backbone, seed=6))  # the same without them
    back = decodes_as_the_backbone(backbone, d)
    assert back.spec.settings == src.spec.settings and same_drafts(src, back)
    assert not same_drafts(back, load_with(backbone, plain))
    code, _, err = run([f"heads={d}", "format=eagle3", f"out={tmp_path / 'e'}"], capsys)
    assert code == 0, err
    assert vllm_eagle3_load(tmp_path / "e", HIDDEN, VOCAB)[2] == []
    assert same_drafts(back, load_with(backbone, tmp_path / "e"))


def test_the_norm_before_fc_tensor_is_named_when_the_config_is_silent(backbone, tmp_path):
    """Guards against: ``input_norm.weight`` (speculators' norm_before_fc) held by a dir whose config does not set
    the flag refused as an unexpected tensor only, without naming the flag to set."""
    d = write_speculators(tmp_path / "s", backbone, drafter(backbone, aux=AUX))
    t = load_file(str(d / "model.safetensors"))
    t["input_norm.weight"] = torch.ones(3 * HIDDEN)
    save_file(t, str(d / "model.safetensors"))
    with pytest.raises(UserError) as e:
        load_with(backbone, d)
    assert "norm_before_fc=true" in str(e.value) and "speculators" in str(e.value) and "\n" not in str(e.value)


def test_medusa_export_brings_it_to_the_dir_both_engines_load(backbone, tmp_path, capsys):
    """Guards against: a speculators drafter that medusa-export cannot re-export for SGLang (which reads only the
    LlamaForCausalLMEagle3 layout), or re-exports with other aux ids or weights than it was read with."""
    from engine_specs import sglang_eagle3_load, vllm_eagle3_load
    from test_formats_cli import run

    d = write_speculators(tmp_path / "s", backbone, drafter(backbone, aux=AUX))
    code, out, err = run([f"heads={d}", "format=eagle3", f"out={tmp_path / 'e'}"], capsys)
    assert code == 0, err
    cfg = json.loads((tmp_path / "e" / "config.json").read_text())
    assert cfg["eagle_aux_hidden_state_layer_ids"] == AUX
    assert cfg["base_model_name_or_path"] == "org/tiny-llama-verifier"
    assert "\"num_speculative_tokens\": 3" in out
    for load in (vllm_eagle3_load, sglang_eagle3_load):
        assert load(tmp_path / "e", HIDDEN, VOCAB)[2] == []
    assert same_drafts(load_with(backbone, d), load_with(backbone, tmp_path / "e"))
