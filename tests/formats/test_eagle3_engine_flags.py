"""EAGLE-3 config flags vLLM honours (``norm_before_residual``, ``norm_output``, ``logit_scale``, ``norm_before_fc``,
``fc_norm``) computed as vLLM computes them, on import and export; ``tie_word_embeddings`` with the checkpoint's own
lm_head loaded as vLLM loads it; the norms on fc's input named when only their tensors say so, run with ones when
only the config does; a legacy (non-zip) ``pytorch_model.bin`` still recognised."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_specs import sglang_eagle3_load, vllm_eagle3_load, vllm_eagle3_logits
from inference.errors import UserError
from inference.formats.export import FormatWarning
from inference.formats.importers import detect_layout
from inference.heads.eagle3 import Eagle3Drafter
from inference.loading import load_medusa
from inference.methods import generate
from runtime_support import one_thread, tiny_llama  # noqa: F401  (one_thread: autouse fixture)
from test_eagle3_format import (HIDDEN, LAYERS, TOL, VOCAB, drafter, engine_logits, export, inputs, load_with,
                                max_diff, runtime_logits, write_foreign)

FLAGS = [{"norm_before_residual": True}, {"norm_output": True}, {"logit_scale": 0.5},
         {"norm_before_residual": True, "norm_output": True, "logit_scale": 2.0},
         {"norm_before_fc": True}, {"fc_norm": True},
         {"norm_before_fc": True, "fc_norm": True, "norm_output": True}]   # what speculators trains by default: the 1st
FC_TENSORS = {"norm_before_fc": ["input_norm.weight"], "fc_norm": [f"fc_norm.{i}.weight" for i in range(3)]}
IDS = {"eagle_aux_hidden_state_layer_ids": [1, 2, 4]}
PROMPTS = ([5, 17, 3, 88, 41, 9], [60, 61, 7, 7, 30, 12, 95])


@pytest.fixture(scope="module")
def backbone():
    return tiny_llama(vocab=VOCAB, hidden=HIDDEN, layers=LAYERS)


def flagged(backbone, flags, seed=0) -> Eagle3Drafter:
    """``drafter`` with the flags set in its draft_layer (same weights as without them; the norms on fc's input
    they add random around 1)."""
    d = drafter(backbone, seed=seed)
    d.spec.settings.draft_layer.update(flags)
    out = Eagle3Drafter(d.spec)
    state = {**out.state_dict(), **d.state_dict()}
    state.update(norm_weights([n for n in state if n.startswith(("input_norm.", "fc_norm."))], seed))
    out.load_state_dict(state)
    out.attach_backbone(None, backbone.get_input_embeddings().weight)
    return out.eval()


def norm_weights(names, seed=11) -> dict:
    """Random RMSNorm weights around 1 for the norms on fc's input named (input_norm [3H], fc_norm.{i} [H])."""
    g = torch.Generator().manual_seed(seed)
    return {n: 1 + 0.5 * torch.randn(3 * HIDDEN if n.startswith("input_norm") else HIDDEN, generator=g)
            for n in names}


def add_tensors(path, tensors: dict) -> None:
    t = load_file(str(path))
    t.update(tensors)
    save_file(t, str(path))


def decodes_as_the_backbone(backbone, d) -> Eagle3Drafter:
    """The drafter in ``d`` loaded with ``load_medusa``, its greedy EAGLE-3 decoding checked token-identical to
    plain greedy decoding of the backbone; returns it."""
    m = load_medusa(d, backbone=backbone, kernels="stock")
    for p in PROMPTS:
        plain = generate(m, p, "autoregressive", max_new_tokens=24, eos_token_ids=()).tokens
        assert generate(m, p, "eagle3", max_new_tokens=24, eos_token_ids=()).tokens == plain, p
    return m.heads


def vllm_logits(d, backbone, seed):
    """The two passes of ``runtime_logits`` as the restated vLLM runs the dir ``d`` (its loader must not object)."""
    params, cfg, problems = vllm_eagle3_load(d, HIDDEN, VOCAB)
    assert problems == []
    tokens, aux, positions, nxt = inputs(seed=seed)
    embed = backbone.get_input_embeddings().weight.detach()
    return engine_logits(params, cfg, "model.layers.0.", vllm_eagle3_logits, embed, tokens, aux, positions, nxt)


@pytest.mark.parametrize("flags", FLAGS, ids=lambda f: "+".join(f))
def test_flags_vllm_honours_export_and_run_as_vllm_runs_them(backbone, tmp_path, flags):
    """Guards against: a drafter whose config asks vLLM for the residual after hidden_norm, the post-norm state
    fed back (EAGLE-3.1), scaled logits or norms on fc's input (one over the 3H concat, one per aux layer),
    drafted here without them (other drafts than vLLM serves), exported without them or their weights, or exported
    for SGLang (which computes none) without a word."""
    d = flagged(backbone, flags)
    r = export(d, tmp_path / "e")
    cfg = json.loads((r.path / "config.json").read_text())
    assert all(cfg[k] == v for k, v in flags.items())
    assert any("SGLang does not" in n for n in r.notes)
    params, cfg, problems = vllm_eagle3_load(r.path, HIDDEN, VOCAB)
    assert problems == []
    added = sorted(n for f in flags for n in FC_TENSORS.get(f, ()))
    sglang = sglang_eagle3_load(r.path, HIDDEN, VOCAB)[2]  # it skips the norms' weights and computes no flag
    assert sorted(p.split(":")[0] for p in sglang if ":" in p) == sorted(flags)
    assert sorted(p.split(" ")[0] for p in sglang if ":" not in p) == added
    tokens, aux, positions, nxt = inputs(seed=2)
    embed = backbone.get_input_embeddings().weight.detach()
    theirs = engine_logits(params, cfg, "model.layers.0.", vllm_eagle3_logits, embed, tokens, aux, positions, nxt)
    ours = runtime_logits(d, tokens, aux, positions, nxt)
    assert max(max_diff(a, b) for a, b in zip(ours, theirs)) <= TOL
    back = load_with(backbone, r.path)
    assert back.spec.settings == d.spec.settings
    assert all(max_diff(a, b) == 0.0 for a, b in zip(ours, runtime_logits(back, tokens, aux, positions, nxt)))


def test_imported_flags_change_the_drafts_as_they_should(backbone, tmp_path):
    """Guards against: ``norm_output`` / ``logit_scale`` / ``norm_before_residual`` in a published config accepted
    and then ignored (the review found both of the first accepted silently, drafting as if absent)."""
    tokens, aux, positions, nxt = inputs(seed=4)
    write_foreign(tmp_path / "plain", backbone)
    plain = runtime_logits(load_with(backbone, tmp_path / "plain"), tokens, aux, positions, nxt)
    runs = {}
    for name, extra in (("out", {"norm_output": True}), ("scale", {"logit_scale": 0.5}),
                        ("residual", {"norm_before_residual": True})):
        write_foreign(tmp_path / name, backbone, config_extra=extra)
        runs[name] = runtime_logits(load_with(backbone, tmp_path / name), tokens, aux, positions, nxt)
    # norm_output: the first depth (fed the backbone's features) is unchanged, the continuation is not
    assert max_diff(runs["out"][0], plain[0]) == 0.0 and max_diff(runs["out"][1], plain[1]) > 1e-3
    for a, b in zip(runs["scale"], plain):  # logit_scale: every draft logit halved (greedy order unchanged)
        assert max_diff(a, 0.5 * b) <= 1e-6
    assert max_diff(runs["residual"][0], plain[0]) > 1e-3


@pytest.mark.parametrize("extra, names", [
    ({"norm_before_fc": True}, FC_TENSORS["norm_before_fc"]),
    ({"eagle_config": {"norm_before_fc": True}}, FC_TENSORS["norm_before_fc"]),  # NVIDIA's place; vLLM reads it first
    ({"fc_norm": True}, FC_TENSORS["fc_norm"]),
    ({"norm_before_fc": True, "fc_norm": True}, FC_TENSORS["norm_before_fc"] + FC_TENSORS["fc_norm"]),
], ids=["norm_before_fc", "eagle_config", "fc_norm", "both"])
def test_a_dir_with_norms_on_fcs_input_drafts_as_vllm_and_decodes_greedy_identical(backbone, tmp_path, extra, names):
    """Guards against: an EAGLE-3 dir asking for an RMSNorm over the concatenated aux states (gpt-oss style, at the
    top level or in eagle_config) or one per aux state (EAGLE-3.1's fc_norm) refused (the drafter did not compute
    them), loaded without applying them (drafts other than vLLM serves), or breaking decoding; and the export of
    what was loaded losing them."""
    write_foreign(tmp_path / "plain", backbone, config_extra=IDS)
    d = tmp_path / "f"
    write_foreign(d, backbone, config_extra={**IDS, **extra})
    add_tensors(d / "model.safetensors", norm_weights(names))
    heads = decodes_as_the_backbone(backbone, d)
    tokens, aux, positions, nxt = inputs(seed=8)
    ours = runtime_logits(heads, tokens, aux, positions, nxt)
    plain = runtime_logits(load_with(backbone, tmp_path / "plain"), tokens, aux, positions, nxt)
    assert all(max_diff(a, b) > 1e-3 for a, b in zip(ours, plain))  # the same weights without the norms
    assert max(max_diff(a, b) for a, b in zip(ours, vllm_logits(d, backbone, seed=8))) <= TOL
    r = export(heads, tmp_path / "e")
    assert all(json.loads((r.path / "config.json").read_text())[f] is True for f in FC_TENSORS if f in str(extra))
    back = load_with(backbone, r.path)
    assert back.spec.settings == heads.spec.settings
    assert all(max_diff(a, b) == 0.0 for a, b in zip(ours, runtime_logits(back, tokens, aux, positions, nxt)))


@pytest.mark.parametrize("flag", ["norm_before_fc", "fc_norm"])
def test_a_set_flag_without_its_weights_runs_with_ones_as_vllm_does(backbone, tmp_path, flag):
    """Guards against: a config setting norm_before_fc / fc_norm whose checkpoint lacks the norm's weights (vLLM and
    speculators then keep the RMSNorm's ones: speculators lists input_norm.weight as allowed missing) refused, run
    without the norm, or run with ones without a word."""
    d, ones = tmp_path / "f", tmp_path / "ones"
    write_foreign(d, backbone, config_extra={**IDS, flag: True})
    write_foreign(ones, backbone, config_extra={**IDS, flag: True})
    add_tensors(ones / "model.safetensors", {n: torch.ones(3 * HIDDEN if n.startswith("input_norm") else HIDDEN)
                                             for n in FC_TENSORS[flag]})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", FormatWarning)
        back = load_with(backbone, d)
    assert any(f"{flag}=true but no {FC_TENSORS[flag][0]}" in str(w.message) for w in caught)
    tokens, aux, positions, nxt = inputs(seed=9)
    ours = runtime_logits(back, tokens, aux, positions, nxt)
    assert all(max_diff(a, b) == 0.0 for a, b in zip(ours, runtime_logits(load_with(backbone, ones), tokens, aux,
                                                                           positions, nxt)))
    problems = vllm_eagle3_load(d, HIDDEN, VOCAB)[2]
    assert problems and all("vLLM keeps its init (ones)" in p for p in problems)


def test_a_flag_said_differently_in_two_places_is_refused_in_one_line(backbone, tmp_path):
    """Guards against: norm_before_fc true at the top level and false in eagle_config (vLLM reads eagle_config
    first, speculators' converter takes either) silently read one way, drafting what one reader would not."""
    d = tmp_path / "f"
    write_foreign(d, backbone, config_extra={**IDS, "norm_before_fc": True, "eagle_config": {"norm_before_fc": False}})
    add_tensors(d / "model.safetensors", norm_weights(FC_TENSORS["norm_before_fc"]))
    with pytest.raises(UserError) as e:
        load_with(backbone, d)
    assert "norm_before_fc" in str(e.value) and "eagle_config" in str(e.value) and "\n" not in str(e.value)


def test_tie_word_embeddings_with_an_own_lm_head_loads_it_as_vllm_does(backbone, tmp_path):
    """Guards against: a drafter whose config says tie_word_embeddings=true but which ships its own lm_head
    refused (vLLM loads that lm_head regardless), or loaded without saying SGLang would serve another head;
    and one with no lm_head at all loaded (the embedding table as lm_head is not computed here)."""
    tokens, aux, positions, nxt = inputs(seed=6)
    write_foreign(tmp_path / "plain", backbone)
    plain = runtime_logits(load_with(backbone, tmp_path / "plain"), tokens, aux, positions, nxt)
    d = tmp_path / "tied"
    write_foreign(d, backbone, config_extra={"tie_word_embeddings": True})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", FormatWarning)
        back = load_with(backbone, d)
    assert any("tie_word_embeddings=true" in str(w.message) and "SGLang" in str(w.message) for w in caught)
    assert all(max_diff(a, b) == 0.0 for a, b in zip(plain, runtime_logits(back, tokens, aux, positions, nxt)))
    t = load_file(str(d / "model.safetensors"))
    del t["lm_head.weight"]
    save_file(t, str(d / "model.safetensors"))
    with pytest.raises(UserError) as e:
        load_with(backbone, d)
    assert "tie_word_embeddings=true" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("tensor, flag", [("input_norm.weight", "norm_before_fc=true"),
                                          ("fc_norm.0.weight", "fc_norm=true"),
                                          ("midlayer.self_attn.q_norm.weight", "Qwen3-style")])
def test_a_tensor_of_an_unsupported_flag_names_the_flag(backbone, tmp_path, tensor, flag):
    """Guards against: a checkpoint holding the norm before fc (``input_norm.weight``) or EAGLE-3.1's per-layer
    ``fc_norm`` while its config does not set the flag (vLLM would skip or refuse them), or a Qwen3 layer's q/k
    norms, refused only as "unexpected [...]" instead of naming the flag."""
    d = tmp_path / "f"
    write_foreign(d, backbone, config_extra={"eagle_aux_hidden_state_layer_ids": [1, 2, 4]})
    t = load_file(str(d / "model.safetensors"))
    t[tensor] = torch.ones(3 * HIDDEN if tensor == "input_norm.weight" else HIDDEN)
    save_file(t, str(d / "model.safetensors"))
    with pytest.raises(UserError) as e:
        load_with(backbone, d)
    assert flag in str(e.value) and tensor in str(e.value) and "\n" not in str(e.value)


def test_a_legacy_pickle_bin_is_still_recognised(backbone, tmp_path):
    """Guards against: the EAGLE repository's layout (``LlamaForCausalLM``, recognised by its weight names when
    the config has no draft_vocab_size) missed when its ``pytorch_model.bin`` is a legacy (non-zip) torch.save,
    which ``torch.load(mmap=True)`` refuses: the native loader's unrelated error followed."""
    d = tmp_path / "f"
    write_foreign(d, backbone, config_extra={"architectures": ["LlamaForCausalLM"],
                                             "eagle_aux_hidden_state_layer_ids": [1, 2, 4]}, pickle=True)
    state = torch.load(d / "pytorch_model.bin", weights_only=True)
    torch.save(state, d / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["draft_vocab_size"]
    (d / "config.json").write_text(json.dumps(cfg))
    assert detect_layout(d) == "eagle3"
