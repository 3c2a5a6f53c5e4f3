"""``format=eagle3``: EAGLE-3 drafters exported for vLLM and SGLang, run through both engines' loaders and
forward as ``tests/engine_specs.py`` restates them, and EAGLE-3 dirs imported back (ours and the layout
SpecForge / the EAGLE repo publish), with the refusals for a target they were not made for."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from engine_specs import (eagle3_engine_forward, sglang_eagle3_aux_ids, sglang_eagle3_load, sglang_eagle3_logits,
                          vllm_eagle3_aux_ids, vllm_eagle3_load, vllm_eagle3_logits)
from inference.errors import IncompatibleHeadsError, UserError
from inference.formats.export import ExportOptions, FormatWarning, export_heads
from inference.heads.eagle3 import Eagle3Drafter, default_aux_layers, draft_layer_config
from inference.heads.native import save_heads
from inference.heads.spec import HeadsSpec, backbone_fingerprint
from inference.loading import load_heads, read_heads_spec
from test_formats_cli import run  # in-process medusa-export: (code, stdout, stderr lines)
from runtime_support import one_thread, random_heads, tiny_llama  # noqa: F401  (one_thread: autouse fixture)

# 8 layers: the engines' default for a config naming no ids, (2, N//2, N-3) = (2, 4, 5), is three distinct
# layers (on 5 it is (2, 2, 2), which they cannot serve: refused)
VOCAB, HIDDEN, LAYERS, DRAFT_VOCAB = 96, 64, 8, 40
AUX = [1, 2, 4]
TOL = 1e-5  # fp32: the same math in another order


@pytest.fixture(scope="module")
def backbone():
    return tiny_llama(vocab=VOCAB, hidden=HIDDEN, layers=LAYERS)


def drafter(backbone, projection="truncated", aux=AUX, seed=0, draft_vocab=DRAFT_VOCAB) -> Eagle3Drafter:
    """A drafter with every weight random (the warm start's zero o_proj / down_proj would hide a
    mistake in attention or the MLP) and, when truncated, a token map in no particular order."""
    cfg = backbone.config
    spec = HeadsSpec(num_heads=3, num_layers=1, hidden_size=HIDDEN, vocab_size=VOCAB, projection=projection,
                     truncated_vocab_size=draft_vocab if projection == "truncated" else None,
                     base_model="org/tiny-llama", base_model_fingerprint=backbone_fingerprint(cfg), kind="eagle3",
                     aux_layers=list(aux), draft_layer=draft_layer_config(cfg))
    d = Eagle3Drafter(spec)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in d.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5 + (1.0 if p.dim() == 1 else 0.0))
        if projection == "truncated":
            d.token_map.copy_(torch.randperm(VOCAB, generator=g)[:draft_vocab])
    d.attach_backbone(None, backbone.get_input_embeddings().weight)
    return d.eval()


def export(heads, out, **kw):
    return export_heads(heads, "eagle3", out, options=ExportOptions(**kw))


def inputs(seed=1, t=6):
    g = torch.Generator().manual_seed(seed)
    start = int(torch.randint(0, 200, (1,), generator=g))
    return (torch.randint(0, VOCAB, (t,), generator=g), torch.randn(t, 3 * HIDDEN, generator=g),
            torch.arange(start, start + t), torch.randint(0, VOCAB, (2,), generator=g))


def runtime_logits(d: Eagle3Drafter, tokens, aux, positions, next_tokens):
    """Two passes of our drafter: the context rows (fed fc(aux)), then two rows continuing the chain from
    the last pre-norm state with the first pass's KV, as decoding runs it; target-vocab logits."""
    out = []
    with torch.no_grad():
        normed, pre, kv = d.forward_step(tokens[None], d.combine(aux)[None], positions[None])
        out.append(_scatter(d, d.project(normed)[0]))
        hidden = pre[:, -1:].expand(1, 2, HIDDEN)
        nxt = positions[-1] + 1 + torch.arange(2)
        normed, _, _ = d.forward_step(next_tokens[None], hidden, nxt[None], past=kv)
        out.append(_scatter(d, d.project(normed)[0]))
    return out


def _scatter(d, logits):
    if d.token_map is None:
        return logits
    full = logits.new_full((logits.shape[0], VOCAB), float("-inf"))
    full[:, d.token_map] = logits
    return full


def engine_logits(params, cfg, layer, logits_fn, embed, tokens, aux, positions, next_tokens):
    """The same two passes through a restated engine (KV as [S, kv_heads, D])."""
    normed, pre, (k, v) = eagle3_engine_forward(params, cfg, layer, embed, tokens, aux, positions)
    first = logits_fn(params, cfg, normed)
    nxt = positions[-1] + 1 + torch.arange(2)
    normed, _, _ = eagle3_engine_forward(params, cfg, layer, embed, next_tokens, pre[-1:].expand(2, HIDDEN), nxt,
                                         past=(k, v))
    return [first, logits_fn(params, cfg, normed)]


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max |a - b| over the finite entries, after checking both put -inf at the same target ids."""
    assert torch.equal(torch.isfinite(a), torch.isfinite(b))
    fin = torch.isfinite(a)
    return float((a[fin] - b[fin]).abs().max())


# -- export checked against both engines -------------------------------------------------------------
@pytest.mark.parametrize("projection", ["truncated", "own"])
def test_both_engines_load_the_export_and_compute_our_drafts(backbone, tmp_path, projection):
    """Guards against: a weight vLLM or SGLang would not load where it belongs (KeyError / random init),
    a d2t whose rows do not match the lm_head rows (an unsorted token map written as is), q/k/v or
    gate/up in the wrong stacking order, RoPE or norm placement that differs from the engines: any of
    them makes the served drafter propose other tokens than the one we trained and measured."""
    d = drafter(backbone, projection)
    r = export(d, tmp_path / "e")
    assert sorted(p.name for p in r.path.iterdir()) == ["config.json", "model.safetensors"]
    embed = backbone.get_input_embeddings().weight.detach()
    tokens, aux, positions, nxt = inputs()
    ours = runtime_logits(d, tokens, aux, positions, nxt)
    for load, layer, logits_fn in ((vllm_eagle3_load, "model.layers.0.", vllm_eagle3_logits),
                                   (sglang_eagle3_load, "model.midlayer.", sglang_eagle3_logits)):
        params, cfg, problems = load(r.path, HIDDEN, VOCAB)
        assert problems == []
        theirs = engine_logits(params, cfg, layer, logits_fn, embed, tokens, aux, positions, nxt)
        diffs = [max_diff(a, b) for a, b in zip(ours, theirs)]
        print(f"{load.__name__} {projection}: max |logit diff| {max(diffs):.2e}")
        assert max(diffs) <= TOL, diffs


def test_config_holds_what_vllm_and_sglang_read(backbone, tmp_path):
    """Guards against: the engines capturing other backbone layers than the drafter was trained on (vLLM
    reads the top-level ids as layer inputs, SGLang eagle_config's ids + 1), SGLang falling back to the
    target's lm_head (no draft_vocab_size) or to lm_head = embeddings (tie_word_embeddings), and a d2t
    that is not sorted by target id as published drafters have it."""
    d = drafter(backbone)
    cfg = json.loads((export(d, tmp_path / "e").path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 1 and cfg["tie_word_embeddings"] is False
    assert cfg["norm_before_residual"] is False
    assert (cfg["vocab_size"], cfg["draft_vocab_size"], cfg["hidden_size"]) == (VOCAB, DRAFT_VOCAB, HIDDEN)
    assert "target_hidden_size" not in cfg
    layer = draft_layer_config(backbone.config)
    for key in ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size", "rms_norm_eps",
                "rope_theta", "max_position_embeddings", "hidden_act"):
        assert cfg[key] == layer[key], key
    assert cfg["eagle_config"]["use_aux_hidden_state"] is True
    assert vllm_eagle3_aux_ids(cfg, LAYERS) == tuple(AUX)
    assert sglang_eagle3_aux_ids(cfg, LAYERS) == tuple(AUX)
    from safetensors.torch import load_file

    t = load_file(str(tmp_path / "e" / "model.safetensors"))
    ids = torch.arange(DRAFT_VOCAB) + t["d2t"]
    assert t["d2t"].dtype == torch.int64 and torch.equal(ids, d.token_map.sort().values)
    assert t["t2d"].dtype == torch.bool and t["t2d"].sum() == DRAFT_VOCAB and t["t2d"][ids].all()
    assert "embed_tokens.weight" not in t  # both engines then use the target's, as our drafter does


def test_dtype_option_casts_weights_not_the_vocab_map(backbone, tmp_path):
    """Guards against: d2t cast to a float dtype (vLLM's draft_id_to_target_id is a long parameter)."""
    r = export(drafter(backbone), tmp_path / "e", dtype=torch.bfloat16)
    from safetensors.torch import load_file

    t = load_file(str(r.path / "model.safetensors"))
    assert t["fc.weight"].dtype == torch.bfloat16 and t["d2t"].dtype == torch.int64
    assert json.loads((r.path / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_refusals_write_nothing(backbone, tmp_path):
    """Guards against: a drafter reading the embeddings (aux id 0; both engines add a None residual
    there) exported anyway, EAGLE-3 heads written in a Medusa layout or Medusa heads in the EAGLE-3
    one, and a refused export leaving a directory behind."""
    out = tmp_path / "e"
    with pytest.raises(UserError, match="aux layer 0"):
        export(drafter(backbone, aux=[0, 2, 4]), out)
    with pytest.raises(UserError, match="format vllm has no exporter for heads of kind 'eagle3'"):
        export_heads(drafter(backbone), "vllm", out)
    with pytest.raises(UserError, match="format eagle3 has no exporter for heads of kind 'medusa'"):
        export(random_heads(backbone), out)
    assert not out.exists() and not list(tmp_path.iterdir())


# -- import ------------------------------------------------------------------------------------------
def load_with(backbone, d):
    return load_heads(d, backbone_config=backbone.config, input_embeddings=backbone.get_input_embeddings().weight)


@pytest.mark.parametrize("projection", ["truncated", "own"])
def test_export_imports_back_to_the_same_drafter(backbone, tmp_path, projection):
    """Guards against: an import that reads the rows in another order than d2t says, loses the aux ids,
    the TTT depth or the fingerprint, or needs a config the export does not write."""
    d = drafter(backbone, projection)
    r = export(d, tmp_path / "e")
    back = load_with(backbone, r.path)
    assert isinstance(back, Eagle3Drafter)
    assert back.spec.settings == d.spec.settings   # aux_layers, draft_layer
    for f in ("num_heads", "base_model_fingerprint", "projection", "vocab_size"):
        assert getattr(back.spec, f) == getattr(d.spec, f), f
    assert read_heads_spec(r.path).settings.aux_layers == AUX  # without the backbone too
    tokens, aux, positions, nxt = inputs(seed=5)
    for a, b in zip(runtime_logits(d, tokens, aux, positions, nxt), runtime_logits(back, tokens, aux, positions, nxt)):
        assert max_diff(a, b) == 0.0


def test_a_draft_vocabulary_as_large_as_the_targets_writes_no_maps(backbone, tmp_path):
    """Guards against a truncated drafter whose draft vocabulary is the whole target vocabulary exporting an
    all-zero d2t and a t2d: TensorRT-LLM declares d2t only for a smaller draft vocabulary (an unexpected tensor
    in its checkpoint), and the maps say nothing; its rows are still put in id order, so it decodes the same."""
    from safetensors.torch import load_file

    d = drafter(backbone, "truncated", draft_vocab=VOCAB)
    r = export(d, tmp_path / "e")
    t = load_file(str(r.path / "model.safetensors"))
    assert "d2t" not in t and "t2d" not in t and t["lm_head.weight"].shape[0] == VOCAB
    assert json.loads((r.path / "config.json").read_text())["draft_vocab_size"] == VOCAB
    back = load_with(backbone, r.path)
    tokens, aux, positions, nxt = inputs(seed=5)
    for a, b in zip(runtime_logits(d, tokens, aux, positions, nxt), runtime_logits(back, tokens, aux, positions, nxt)):
        assert max_diff(a, b) == 0.0


def test_importer_refuses_a_drafter_made_for_another_target(backbone, tmp_path):
    """Guards against: an EAGLE-3 checkpoint loaded on a backbone it was not trained for (aux layers the
    backbone does not have, another width or vocabulary) and then drafting garbage instead of saying so."""
    r = export(drafter(backbone), tmp_path / "e")
    shallow = tiny_llama(vocab=VOCAB, hidden=HIDDEN, layers=3)
    with pytest.raises(IncompatibleHeadsError) as e:
        load_with(shallow, r.path)
    assert "aux layers [1, 2, 4]" in str(e.value) and "\n" not in str(e.value)
    cfg = json.loads((r.path / "config.json").read_text())
    del cfg["medusa_train"]  # a foreign dir: no fingerprint, so the sizes must be what refuses
    (r.path / "config.json").write_text(json.dumps(cfg))
    for other in (tiny_llama(vocab=VOCAB + 4, hidden=HIDDEN, layers=LAYERS),
                  tiny_llama(vocab=VOCAB, hidden=2 * HIDDEN, layers=LAYERS)):
        with pytest.raises(IncompatibleHeadsError) as e:
            load_with(other, r.path)
        assert "\n" not in str(e.value)


def write_foreign(d, backbone, *, config_extra=None, pickle=False, d2t=True, embed=False, draft_vocab=DRAFT_VOCAB):
    """A drafter dir as SpecForge / the EAGLE repo publish it: their names, no medusa_train key, no aux ids
    unless given (the engines then use the target's defaults), d2t sorted by target id."""
    src = drafter(backbone, "truncated" if draft_vocab < VOCAB else "own", aux=default_aux_layers(LAYERS), seed=3)
    export(src, d)
    cfg = json.loads((d / "config.json").read_text())
    for k in ("medusa_train", "eagle_aux_hidden_state_layer_ids", "eagle_config"):
        del cfg[k]
    if draft_vocab == VOCAB:
        del cfg["draft_vocab_size"]  # vLLM: absent = the target's vocabulary
    cfg["architectures"] = ["Eagle3LlamaForCausalLM"]
    cfg.update(config_extra or {})
    (d / "config.json").write_text(json.dumps(cfg))
    from safetensors.torch import load_file

    t = load_file(str(d / "model.safetensors"))
    if not d2t:
        t.pop("d2t", None)
    if embed:
        t["embed_tokens.weight"] = backbone.get_input_embeddings().weight.detach().clone()
    if pickle:
        (d / "model.safetensors").unlink()
        torch.save(t, d / "pytorch_model.bin")
    else:
        from safetensors.torch import save_file

        save_file(t, str(d / "model.safetensors"))
    return src


def test_foreign_layout_loads_with_the_engines_defaults(backbone, tmp_path):
    """Guards against: a published drafter (pytorch_model.bin, no aux ids, no draft_vocab_size, an
    embed_tokens copy) refused or read differently from the engines: no ids = the target's default
    layers, no draft_vocab_size = the full vocabulary, embed_tokens = the target's (a note says so)."""
    d = tmp_path / "f"
    src = write_foreign(d, backbone, pickle=True, d2t=False, embed=True, draft_vocab=VOCAB)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", FormatWarning)
        back = load_with(backbone, d)
    assert any("embed_tokens.weight ignored" in str(w.message) for w in caught)
    assert back.spec.settings.aux_layers == default_aux_layers(LAYERS) and back.spec.projection == "own"
    tokens, aux, positions, nxt = inputs(seed=7)
    for a, b in zip(runtime_logits(src, tokens, aux, positions, nxt),
                    runtime_logits(back, tokens, aux, positions, nxt)):
        assert max_diff(a, b) == 0.0
    with pytest.raises(UserError, match="names no aux layer ids"):
        read_heads_spec(d)  # without the target its default layers are unknown


def test_a_drafter_that_names_no_aux_layers_loads_onto_the_backbone_given_or_recorded(backbone, tmp_path, capsys):
    """Guards against: a published drafter without aux ids (what the EAGLE repository and SpecForge
    publish) refused by load_medusa, medusa-eval / medusa-generate and medusa-export even when the backbone
    is given, with an error asking for exactly that: its spec must be read with the target's config
    (the config file, not the weights), from backbone= or from the target the directory records."""
    from inference.errors import NeedsBackboneConfig
    from inference.loading import load_medusa, read_heads_spec_for, spec_with_target

    d, target = tmp_path / "f", tmp_path / "target"
    write_foreign(d, backbone, draft_vocab=VOCAB)
    cfg = json.loads((d / "config.json").read_text())
    cfg.pop("base_model_name_or_path", None)
    (d / "config.json").write_text(json.dumps(cfg))
    backbone.config.save_pretrained(target)  # a config-only target folder: enough for the spec
    with pytest.raises(NeedsBackboneConfig, match="load it with its backbone"):
        read_heads_spec_for(d)  # no backbone given, none recorded
    assert read_heads_spec_for(d, target).settings.aux_layers == default_aux_layers(LAYERS)
    assert spec_with_target(d, target)[1].num_hidden_layers == LAYERS
    m = load_medusa(d, backbone=backbone, kernels="stock")  # a model object: its own config
    assert m.heads.spec.settings.aux_layers == default_aux_layers(LAYERS)
    (d / "config.json").write_text(json.dumps({**cfg, "base_model_name_or_path": str(target)}))
    assert read_heads_spec_for(d).settings.aux_layers == default_aux_layers(LAYERS)  # the recorded target
    code, _, err = run([f"heads={d}", "format=eagle3", f"out={tmp_path / 'e'}", f"backbone={target}"], capsys)
    assert code == 0, err
    assert json.loads((tmp_path / "e" / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == \
        default_aux_layers(LAYERS)


def test_sglang_style_ids_are_read_as_sglang_reads_them(backbone, tmp_path):
    """Guards against: eagle_config ids (layer outputs, SGLang adds one) taken as vLLM's layer inputs,
    which feeds the drafter hidden states one layer too early."""
    d = tmp_path / "f"
    write_foreign(d, backbone, config_extra={"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 3]}})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", FormatWarning)
        back = load_with(backbone, d)
    assert back.spec.settings.aux_layers == [1, 2, 4] and back.spec.projection == "truncated"
    assert any("only in eagle_config" in str(w.message) for w in caught)


@pytest.mark.parametrize("extra, words", [
    ({"parallel_drafting": True}, "parallel_drafting=true"),
    ({"eagle_config": {"parallel_drafting": True}}, "parallel_drafting=true"),
    ({"num_hidden_layers": 2}, "one decoder layer"),
    ({"target_hidden_size": 2 * HIDDEN}, "target_hidden_size"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope type 'llama3'"),
    ({"draft_vocab_size": VOCAB + 4}, "draft_vocab_size 100 exceeds vocab_size 96"),
    ({"num_attention_heads": 8, "num_key_value_heads": 8}, "has shape"),
])
def test_importer_refuses_what_the_drafter_does_not_compute_in_one_line(backbone, tmp_path, extra, words):
    """Guards against: loading a checkpoint whose math differs from ours (P-EAGLE's parallel drafting, more layers,
    another feature width, scaled RoPE, head sizes its weights contradict) and drafting silently wrong
    tokens, or a traceback instead of one line (naming the flag, not only a tensor it adds)."""
    d = tmp_path / "f"
    write_foreign(d, backbone, config_extra={"eagle_aux_hidden_state_layer_ids": AUX, **extra})
    with pytest.raises(UserError) as e:
        load_with(backbone, d)
    assert words in str(e.value) and "\n" not in str(e.value)


# -- medusa-export ---------------------------------------------------------------------------------------


def test_cli_exports_eagle3_and_refuses_the_wrong_kind(backbone, tmp_path, capsys):
    """Guards against: medusa-export failing on EAGLE-3 heads (they borrow the backbone's embeddings,
    which no export needs), printing no serve command, or writing a Medusa layout for them / an EAGLE-3
    one for Medusa heads instead of one line and nothing on disk."""
    src = save_heads(drafter(backbone), tmp_path / "heads")
    code, out, err = run([f"heads={src}", "format=eagle3", f"out={tmp_path / 'e'}"], capsys)
    assert code == 0, err
    assert "\"method\": \"eagle3\"" in out and "--speculative-algorithm EAGLE3" in out and "wrote" in out
    for load in (vllm_eagle3_load, sglang_eagle3_load):
        assert load(tmp_path / "e", HIDDEN, VOCAB)[2] == []
    # and an EAGLE-3 dir re-exports (the importer path, no backbone)
    code, _, err = run([f"heads={tmp_path / 'e'}", "format=eagle3", f"out={tmp_path / 'e2'}"], capsys)
    assert code == 0, err
    assert json.loads((tmp_path / "e2" / "config.json").read_text()) == \
        json.loads((tmp_path / "e" / "config.json").read_text())
    medusa = save_heads(random_heads(backbone), tmp_path / "medusa")
    for heads, fmt, kind in ((src, "vllm", "eagle3"), (medusa, "eagle3", "medusa")):
        out_dir = tmp_path / f"refused-{fmt}"
        code, _, err = run([f"heads={heads}", f"format={fmt}", f"out={out_dir}"], capsys)
        assert code == 2 and len(err) == 1 and f"heads of kind '{kind}'" in err[0], err
        assert not out_dir.exists()


@pytest.mark.parametrize("architecture, refused", [
    ("LlamaForCausalLM", set()), ("Qwen3ForCausalLM", set()), ("Olmo2ForCausalLM", {"SGLang"}),
    ("GraniteForCausalLM", {"SGLang"}), ("MixtralForCausalLM", {"vLLM", "SGLang"}), (None, set())])
def test_serve_commands_only_for_engines_that_run_eagle3_on_the_target(backbone, tmp_path, architecture, refused):
    """Guards against: an EAGLE-3 export for an OLMo-2 or Granite target printing an SGLang command that stops at
    start-up (SGLang's class for it cannot capture the aux hidden states: ValueError), or a Mixtral one printing a
    vLLM command its engine refuses, with nothing said; an unknown architecture (config unreadable) keeps both."""
    import types

    config = types.SimpleNamespace(architectures=[architecture]) if architecture else None
    notes = export(drafter(backbone), tmp_path / "e", backbone_config=lambda: config).notes
    commands = {"vLLM": "vllm serve", "SGLang": "sglang.launch_server"}
    for engine, command in commands.items():
        assert any(command in n for n in notes) == (engine not in refused), (engine, notes)
        said = [n for n in notes if n.startswith("note:") and f"{engine} " in n and "refuse" in n]
        assert len(said) == (engine in refused) and all(architecture in n for n in said)


@pytest.mark.parametrize("model_type, releases", [
    ("mistral", "0.9.0-0.21.0"), ("phi3", "0.9.0-0.21.0"), ("qwen3", "0.9.0-0.10.0"), ("gemma4_text", "0.9.0-0.19.0"),
    ("llama", None), (None, None)])
def test_vllm_releases_that_gate_on_the_targets_model_type_are_named(backbone, tmp_path, model_type, releases):
    """Guards against an EAGLE-3 export for a Mistral or Phi-3 target printing a vLLM command that vLLM 0.9.0-0.21.0
    refuse at start-up ("eagle3 is only supported for [...] models": they test the target's text-config model_type
    against a list of substrings) with nothing said; the releases are named from the model_type of the text config
    (Gemma's multimodal class: gemma4_text), none for a type every release takes."""
    import types

    text = types.SimpleNamespace(model_type=model_type)
    config = types.SimpleNamespace(architectures=["LlamaForCausalLM"], model_type=model_type and "outer",
                                   get_text_config=lambda: text)
    notes = export(drafter(backbone), tmp_path / "e", backbone_config=lambda: config).notes
    gated = [n for n in notes if "model_type" in n]
    assert any("vllm serve" in n for n in notes)   # the current release serves it
    if releases is None:
        assert gated == []
    else:
        assert len(gated) == 1 and f"vLLM {releases} refuse" in gated[0] and repr(model_type) in gated[0], gated
        assert "0.22.0" in gated[0]
