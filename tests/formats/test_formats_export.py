"""``inference.formats`` export: each engine's layout checked against its loader's written spec,
round trips that give bit-identical head logits, and the refusals a format cannot avoid."""

from __future__ import annotations

import json
import types

import pytest
import torch

from engine_specs import (REFERENCE_HEADS, check_reference_medusa, check_tensorrt_llm, check_tgi, check_tree_file,
                          check_vllm, tensorrt_llm_convert, tensorrt_llm_flags, tensorrt_llm_llmapi_counts,
                          tgi_launcher_attention, tgi_layout)
from inference.errors import UserError
from inference.formats import FORMATS
from inference.formats import export as export_mod
from inference.formats.export import ExportOptions, export_heads, register_exporter
from inference.loading import load_heads, read_heads_spec
from inference.formats.reference import TREE_FILE
from inference.runtime.tree import MedusaTree
from runtime_support import one_thread, random_heads, tiny_llama  # noqa: F401  (one_thread: autouse fixture)

VOCAB, HIDDEN, TRUNC = 96, 64, 20


@pytest.fixture(scope="module")
def backbone():
    return tiny_llama(vocab=VOCAB, hidden=HIDDEN)


def make_heads(backbone, projection, num_layers=1, num_heads=3):
    heads = random_heads(backbone, num_heads=num_heads, num_layers=num_layers, projection=projection,
                         truncated=TRUNC if projection == "truncated" else None)
    heads.spec.base_model = "org/tiny-llama"
    if projection == "shared":
        heads.attach_lm_head(backbone.get_output_embeddings().weight)
    return heads


def options(backbone, **kw):
    return ExportOptions(lm_head=lambda: backbone.get_output_embeddings().weight, **kw)


def export(heads, fmt, out, backbone, **kw):
    return export_heads(heads, fmt, out, options=options(backbone, **kw))


def logits(heads, x):
    with torch.no_grad():
        return [heads.head_logits(x, k) for k in range(heads.spec.num_heads)]


def reload(path, backbone):
    return load_heads(path, backbone_config=backbone.config, lm_head_weight=backbone.get_output_embeddings().weight)


def hidden_states(n=7, seed=3):
    return torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(seed))


# -- written specs of the loaders -----------------------------------------------------------------
@pytest.mark.parametrize("projection", ["own", "shared", "truncated"])
@pytest.mark.parametrize("num_layers", [1, 2])
def test_vllm_export_matches_vllm_loader_spec(backbone, tmp_path, projection, num_layers):
    """Guards against: names, shapes, dtypes or config keys vLLM's Medusa loader would silently ignore or
    default (random heads, 0% acceptance), a lost bias (medusa_fc_bias), or a missing token_map."""
    heads = make_heads(backbone, projection, num_layers)
    r = export(heads, "vllm", tmp_path / "v", backbone)
    assert sorted(p.name for p in r.path.iterdir()) == ["config.json", "model.safetensors"]
    assert check_vllm(r.path, HIDDEN, VOCAB) == []
    cfg = json.loads((r.path / "config.json").read_text())
    assert cfg["medusa_fc_bias"] is True and cfg["base_model_name_or_path"] == "org/tiny-llama"
    assert cfg["original_lm_head"] is (projection == "shared")
    assert cfg["truncated_vocab_size"] == (TRUNC if projection == "truncated" else VOCAB)


@pytest.mark.parametrize("projection", ["own", "truncated"])
def test_vllm_export_names_the_releases_that_serve_it(backbone, tmp_path, projection):
    """Guards against: a serve command for vLLM with nothing said when every current release refuses it (0.33.0
    removed Medusa: "Unsupported speculative method"), or per-head truncated heads exported without saying that
    only releases up to 0.11.0 load them (0.11.1 made each head's lm_head full-vocabulary: a shape assertion)."""
    notes = export(make_heads(backbone, projection, 1), "vllm", tmp_path / "v", backbone).notes
    assert any("vllm<=0.32.0" in n and "0.33.0 removed" in n for n in notes)
    assert any("vllm<=0.11.0" in n for n in notes) == (projection == "truncated")


@pytest.mark.parametrize("projection", ["own", "shared", "truncated"])
def test_tensorrt_llm_export_matches_its_loader_spec(backbone, tmp_path, projection):
    """Guards against: a layout load_medusa_hf cannot read (it needs {h}.{L}.weight per head), or a
    config without medusa_num_layers (TensorRT-LLM would assume 1)."""
    heads = make_heads(backbone, projection, num_layers=2)
    r = export(heads, "tensorrt_llm", tmp_path / "t", backbone, materialize=True)
    assert sorted(p.name for p in r.path.iterdir()) == ["config.json", TREE_FILE, "medusa_lm_head.safetensors"]
    assert r.files == sorted(p.name for p in r.path.iterdir())
    assert check_tensorrt_llm(r.path, HIDDEN, VOCAB, num_medusa_heads=3, num_medusa_layers=2) == []


def serve_note(result) -> str:
    return next(n for n in result.notes if n.startswith("serve: "))


def test_tensorrt_llm_two_layer_heads_keep_both_layers_only_with_the_printed_flag(backbone, tmp_path):
    """Guards against: convert_checkpoint.py building the engine with its --num_medusa_layers default (1)
    before it reads the heads' config, so L=2 heads silently lose a layer unless the command passes it."""
    r = export(make_heads(backbone, "own", num_layers=2), "tensorrt_llm", tmp_path / "t", backbone)
    without = tensorrt_llm_convert(r.path, num_medusa_heads=3)
    assert (without["engine_layers"], without["loaded_layers"]) == (1, 2)
    assert any("silently drops" in p for p in check_tensorrt_llm(r.path, HIDDEN, VOCAB, num_medusa_heads=3))
    flags = tensorrt_llm_flags(serve_note(r))
    assert flags == {"num_medusa_heads": 3, "num_medusa_layers": 2}
    built = tensorrt_llm_convert(r.path, **flags)
    assert built == {"engine_heads": 3, "engine_layers": 2, "loaded_layers": 2}
    assert check_tensorrt_llm(r.path, HIDDEN, VOCAB, **flags) == []


def test_tensorrt_llm_config_has_the_head_count_key_its_llm_api_reads(backbone, tmp_path):
    """Guards against: the LLM API's MedusaConfig.from_hugging_face finding no num_medusa_heads
    (it reads that spelling, and medusa_num_layers) in the heads' config."""
    r = export(make_heads(backbone, "own", num_layers=2), "tensorrt_llm", tmp_path / "t", backbone)
    assert tensorrt_llm_llmapi_counts(r.path) == (3, 2)


@pytest.mark.parametrize("fmt", ["tensorrt_llm", "medusa_v1"])
@pytest.mark.parametrize("num_heads", [1, 2, 3, 4, 6])
def test_reference_layouts_ship_a_tree_no_deeper_than_the_heads(backbone, tmp_path, fmt, num_heads):
    """Guards against: engines falling back to their default trees (depth 4) when fewer heads were
    trained -- FasterDecoding builds 5 heads with strict=False, so the extra ones are random."""
    r = export(make_heads(backbone, "own", num_heads=num_heads), fmt, tmp_path / "x", backbone)
    tree = MedusaTree.load(r.path / TREE_FILE)
    cap = min(num_heads, REFERENCE_HEADS) if fmt == "medusa_v1" else num_heads
    assert tree.max_depth <= cap and tree.max_depth == min(cap, 4)
    assert check_tree_file(r.path / TREE_FILE, cap) == []
    assert any(TREE_FILE in n for n in r.notes) and TREE_FILE in serve_note(r)
    assert isinstance(json.loads((r.path / TREE_FILE).read_text()), list)  # the bare list both engines take


def test_reference_loader_without_a_tree_would_consult_random_heads(backbone, tmp_path):
    """Guards against: a medusa_v1 export with fewer than 5 heads and no shallow tree (the restated
    loader flags it), and a tree deeper than the trained heads."""
    r = export(make_heads(backbone, "own", num_heads=2), "medusa_v1", tmp_path / "m", backbone)
    assert check_reference_medusa(r.path, HIDDEN, VOCAB) == []
    (r.path / TREE_FILE).write_text(json.dumps([[0], [0, 0], [0, 0, 0]]))
    assert any("random heads" in p for p in check_reference_medusa(r.path, HIDDEN, VOCAB))
    (r.path / TREE_FILE).unlink()
    assert any("default trees" in p for p in check_reference_medusa(r.path, HIDDEN, VOCAB))


def _tgi_backbone_config(head_dim=None, heads=1, **kw):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_attention_heads=heads, num_key_value_heads=heads,
                       intermediate_size=2 * HIDDEN, num_hidden_layers=2, head_dim=head_dim, **kw)


@pytest.mark.parametrize("projection,num_layers,layout", [("own", 2, "v1"), ("shared", 1, "v2")])
def test_tgi_launcher_keeps_prefix_caching_with_the_backbone_head_size(backbone, tmp_path, projection, num_layers,
                                                                      layout):
    """Guards against: TGI's launcher reading no head size in the Medusa dir's config.json and forcing
    its fallback attention with prefix caching off -- while keeping Medusa detection intact."""
    heads = make_heads(backbone, projection, num_layers)
    bare = export(heads, "tgi", tmp_path / "bare", backbone, materialize=layout == "v1")
    assert tgi_launcher_attention(bare.path) == ("0", "flashdecoding")  # the defect, as TGI resolves it
    assert any("ATTENTION" in n for n in bare.notes)
    r = export(heads, "tgi", tmp_path / "g", backbone, materialize=layout == "v1",
               backbone_config=lambda: _tgi_backbone_config())  # head size 64 / 1 = 64
    cfg = json.loads((r.path / "config.json").read_text())
    assert (cfg["head_dim"], cfg["num_attention_heads"]) == (HIDDEN, 1)
    # TGI's launcher reads its position limit from this dir (absent: 4,096, beyond a shorter backbone's)
    assert cfg["max_position_embeddings"] == _tgi_backbone_config().max_position_embeddings
    assert "model_type" not in cfg and "architectures" not in cfg
    assert tgi_launcher_attention(r.path) == ("true", "flashinfer")
    assert check_tgi(r.path, HIDDEN, VOCAB) == [] and tgi_layout(r.path) == layout


def test_tgi_head_size_comes_from_the_backbone_and_falcon_keeps_tgis_own_choice(backbone, tmp_path):
    """Guards against: a computed head size overriding the backbone's explicit head_dim, a wrong backbone
    passing silently, and writing a head size for model types TGI routes by model_type."""
    heads = make_heads(backbone, "own")
    r = export(heads, "tgi", tmp_path / "g", backbone,
               backbone_config=lambda: _tgi_backbone_config(head_dim=128, heads=4))
    assert json.loads((r.path / "config.json").read_text())["head_dim"] == 128
    assert tgi_launcher_attention(r.path) == ("true", "flashinfer")
    falcon = {"model_type": "falcon", "hidden_size": HIDDEN, "num_attention_heads": 1}
    r = export(heads, "tgi", tmp_path / "f", backbone, backbone_config=lambda: falcon)
    assert "head_dim" not in json.loads((r.path / "config.json").read_text())
    assert any("falcon" in n for n in r.notes)
    with pytest.raises(UserError, match="wrong backbone"):
        export(heads, "tgi", tmp_path / "w", backbone,
               backbone_config=lambda: {"hidden_size": 2 * HIDDEN, "num_attention_heads": 1})


@pytest.mark.parametrize("projection,num_layers,layout", [("own", 2, "v1"), ("shared", 1, "v2"),
                                                           ("shared", 2, "v1"), ("truncated", 1, "v1")])
def test_tgi_export_matches_its_loader_spec(backbone, tmp_path, projection, num_layers, layout):
    """Guards against: an 'architectures' key (TGI then silently drops the heads), shapes TGI cannot
    load, and shared one-layer heads not using TGI's compact v2 layout."""
    heads = make_heads(backbone, projection, num_layers)
    r = export(heads, "tgi", tmp_path / "g", backbone, materialize=layout == "v1")
    assert check_tgi(r.path, HIDDEN, VOCAB) == []
    assert tgi_layout(r.path) == layout


@pytest.mark.parametrize("fmt,projection", [("vllm", "shared"), ("vllm", "truncated"), ("tgi", "shared")])
def test_materialize_writes_full_per_head_projections_for_vllm_and_tgi(backbone, tmp_path, fmt, projection):
    """Guards against: materialize=true silently ignored by format=vllm (truncated heads written in the layout vLLM
    0.11.1 and later refuse, byte-identical with and without the key) and by format=tgi for shared one-layer heads
    (layout v2 written anyway): each head gets its full-vocabulary projection, the size cost is noted, and the
    reloaded heads give the same logits on the mapped tokens."""
    heads = make_heads(backbone, projection)
    plain = export(heads, fmt, tmp_path / "plain", backbone)
    r = export(heads, fmt, tmp_path / "full", backbone, materialize=True)
    assert r.weight_bytes > plain.weight_bytes   # a projection per head, where one (or none) was written
    assert any(n.startswith("materialised for") for n in r.notes)
    if fmt == "vllm":
        assert check_vllm(r.path, HIDDEN, VOCAB) == []
        cfg = json.loads((r.path / "config.json").read_text())
        assert cfg["truncated_vocab_size"] == VOCAB and cfg["original_lm_head"] is False
        assert not any("0.11.0" in n for n in r.notes)
    else:
        assert check_tgi(r.path, HIDDEN, VOCAB) == [] and tgi_layout(r.path) == "v1"
    back = reload(r.path, backbone)
    assert back.spec.projection == "own"
    x = hidden_states()
    columns = heads.token_map if projection == "truncated" else slice(None)
    for a, b in zip(logits(heads, x), logits(back, x)):
        torch.testing.assert_close(b[:, columns], a, rtol=1e-6, atol=1e-6)


def test_eagle3_refuses_materialize_it_does_not_read():
    """Guards against: format=eagle3 writing the same bytes with and without materialize=true, so the key looked
    honoured; refused in one line, by the command before anything loads and by the exporter."""
    from inference.export_cli import ExportConfig, check_keys
    from inference.formats.eagle3 import export_eagle3

    cfg = ExportConfig(heads="h", format="eagle3", out="o", materialize=True)
    with pytest.raises(UserError, match="materialize= is not read by format=eagle3") as e:
        check_keys(cfg)
    assert "\n" not in str(e.value)
    heads = types.SimpleNamespace(spec=types.SimpleNamespace(kind="eagle3"))
    with pytest.raises(UserError, match="materialize= is not read by format=eagle3"):
        export_eagle3(heads, ExportOptions(materialize=True))
    check_keys(ExportConfig(heads="h", format="eagle3", out="o"))
    check_keys(ExportConfig(heads="h", format="vllm", out="o", materialize=True))


@pytest.mark.parametrize("fmt", ["vllm", "tensorrt_llm"])
def test_a_weight_float16_cannot_hold_is_refused_before_writing(backbone, tmp_path, fmt):
    """Guards against: dtype=float16 silently writing inf weights where an fp32 weight overflows float16 (the
    engine computes NaN logits; the project's own loader refuses the export): one line naming the tensor and the
    range, nothing written; bfloat16 holds the same value."""
    heads = make_heads(backbone, "own")
    with torch.no_grad():
        heads.blocks[1][0].linear.weight[0, 0] = 1e5
    with pytest.raises(UserError, match=r"dtype=float16 cannot hold tensor \S*1\.\S*0\.\S*weight: .*65504") as e:
        export(heads, fmt, tmp_path / "x", backbone, dtype=torch.float16)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "x").exists()
    export(heads, fmt, tmp_path / "b", backbone, dtype=torch.bfloat16)


@pytest.mark.parametrize("projection", ["own", "shared", "truncated"])
def test_medusa_v1_export_matches_reference_config(backbone, tmp_path, projection):
    """Guards against: a config MedusaConfig would fill with its defaults (4 heads, vicuna-7b), or keys its
    strict=False loading would silently skip."""
    heads = make_heads(backbone, projection)
    r = export(heads, "medusa_v1", tmp_path / "m", backbone, materialize=True)
    assert check_reference_medusa(r.path, HIDDEN, VOCAB) == []
    cfg = json.loads((r.path / "config.json").read_text())
    assert cfg["base_model_name_or_path"] == "org/tiny-llama"


def test_export_dtype_casts_floats_but_not_the_token_map(backbone, tmp_path):
    """Guards against: dtype=float16 turning the token map into floats (vLLM indexes logits with it)."""
    heads = make_heads(backbone, "truncated")
    r = export(heads, "vllm", tmp_path / "v", backbone, dtype=torch.float16)
    assert check_vllm(r.path, HIDDEN, VOCAB) == []
    from safetensors.torch import load_file

    t = load_file(str(r.path / "model.safetensors"))
    assert t["token_map"].dtype == torch.int64 and t["lm_heads.0.weight"].dtype == torch.float16
    assert json.loads((r.path / "config.json").read_text())["torch_dtype"] == "float16"


# -- round trips ----------------------------------------------------------------------------------
ROUND_TRIPS = [("vllm", "own", False), ("vllm", "shared", False), ("vllm", "truncated", False),
               ("tensorrt_llm", "own", False), ("tensorrt_llm", "shared", True),
               ("tgi", "own", False), ("tgi", "shared", False), ("medusa_v1", "own", False),
               ("medusa_v1", "shared", True)]


@pytest.mark.parametrize("fmt,projection,materialize", ROUND_TRIPS)
def test_round_trip_gives_bit_identical_logits(backbone, tmp_path, fmt, projection, materialize):
    """Guards against: any export -> import path changing a single logit (transposed or swapped heads,
    a dropped bias, layers out of order, a token map lost or reordered)."""
    heads = make_heads(backbone, projection, num_layers=1 if fmt == "tgi" else 2)
    export(heads, fmt, tmp_path / "x", backbone, materialize=materialize)
    back = reload(tmp_path / "x", backbone)
    x = hidden_states()
    for a, b in zip(logits(heads, x), logits(back, x)):
        assert torch.equal(a, b)
    if projection == "truncated":
        assert torch.equal(back.token_map, heads.token_map)
    assert read_heads_spec(tmp_path / "x").base_model == "org/tiny-llama"


@pytest.mark.parametrize("fmt", ["tensorrt_llm", "medusa_v1", "tgi"])
def test_materialised_truncated_heads_keep_mapped_logits_and_zero_elsewhere(backbone, tmp_path, fmt):
    """Guards against: a materialised truncated projection putting rows at the wrong token ids.
    Tokens outside the map get logit exactly 0 (these layouts have no bias to say -inf)."""
    heads = make_heads(backbone, "truncated")
    r = export(heads, fmt, tmp_path / "x", backbone, materialize=True)
    assert any("logit 0" in n for n in r.notes)
    back = reload(tmp_path / "x", backbone)
    assert back.spec.projection == "own"
    x = hidden_states()
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[heads.token_map] = False
    for a, b in zip(logits(heads, x), logits(back, x)):
        torch.testing.assert_close(b[:, heads.token_map], a, rtol=1e-6, atol=1e-6)
        assert not b[:, outside].any()


def test_full_size_truncated_map_is_written_in_vocab_order_for_vllm(backbone, tmp_path):
    """Guards against: vLLM ignoring token_map when truncated_vocab_size == vocab_size, which would
    run a permuted projection as if it were in vocabulary order."""
    heads = random_heads(backbone, projection="truncated", truncated=VOCAB)
    r = export(heads, "vllm", tmp_path / "v", backbone)
    assert check_vllm(r.path, HIDDEN, VOCAB) == []
    back = reload(r.path, backbone)
    x = hidden_states()
    for k in range(3):
        want = torch.empty(x.shape[0], VOCAB)
        want[:, heads.token_map] = heads.head_logits(x, k).detach()
        assert torch.equal(back.head_logits(x, k).detach(), want)


# -- refusals -------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt,projection,num_layers,why", [
    ("tensorrt_llm", "shared", 1, "materialize=true"), ("tensorrt_llm", "truncated", 1, "materialize=true"),
    ("medusa_v1", "truncated", 1, "materialize=true"), ("tgi", "truncated", 1, "materialize=true"),
    ("tgi", "shared", 2, "exactly one layer")])
def test_formats_that_cannot_hold_the_heads_refuse_with_the_reason(backbone, tmp_path, fmt, projection,
                                                                    num_layers, why):
    """Guards against: silently writing a checkpoint the engine cannot run (TensorRT-LLM needs a
    projection per head, TGI v2 one layer) instead of saying why and how to materialise."""
    heads = make_heads(backbone, projection, num_layers)
    with pytest.raises(UserError) as e:
        export(heads, fmt, tmp_path / "x", backbone)
    assert why in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "x").exists()


def test_materialising_prints_the_size_cost(backbone, tmp_path):
    """Guards against: materialisation multiplying the checkpoint size without telling the user."""
    heads = make_heads(backbone, "shared")
    r = export(heads, "tensorrt_llm", tmp_path / "x", backbone, materialize=True)
    note = next(n for n in r.notes if n.startswith("materialised"))
    assert f"+{export_mod.megabytes(3 * VOCAB * HIDDEN * 4)}" in note


@pytest.mark.parametrize("fmt, kind, projection, names, materialize", [
    ("tensorrt_llm", "medusa", "truncated", r"\d\.1\.weight", True),
    ("medusa_v1", "medusa", "shared", r"\d\.1\.weight", True),
    ("vllm", "mlp_speculator", "truncated", r"head\.\d\.weight", True),
    ("vllm", "medusa", "shared", r"lm_heads\.0\.weight", False),   # vLLM's one lm_head copy
    ("vllm", "medusa", "shared", r"lm_heads\.\d\.weight", True),
    ("vllm", "medusa", "truncated", r"lm_heads\.\d\.weight", True),
])
@pytest.mark.parametrize("dtype", [None, torch.float16])
def test_size_notes_count_the_bytes_written(backbone, tmp_path, fmt, kind, projection, names, materialize, dtype):
    """Guards against: materialize=true dtype=float16 printing the projections' size in the heads' own float32 (2x
    what was written: the note was computed before ``plan_export`` casts), and vLLM's lm_head copy note alike."""
    import re

    from safetensors.torch import load_file

    from inference.heads.registry import build_heads
    from inference.heads.spec import HeadsSpec

    if kind == "mlp_speculator":
        spec = HeadsSpec(num_heads=2, num_layers=0, hidden_size=HIDDEN, vocab_size=VOCAB, kind=kind,
                         projection=projection, truncated_vocab_size=TRUNC, base_model="org/base")
        heads = build_heads(spec)
        heads.token_map.copy_(torch.randperm(VOCAB)[:TRUNC])
    else:
        heads = make_heads(backbone, projection)
    r = export(heads, fmt, tmp_path / "x", backbone, materialize=materialize, dtype=dtype)
    written = {k: t for f in r.path.glob("*.safetensors") for k, t in load_file(str(f)).items()}
    size = sum(t.numel() * t.element_size() for k, t in written.items() if re.fullmatch(names, k))
    assert size and all(t.dtype == (dtype or torch.float32) for k, t in written.items() if re.fullmatch(names, k))
    note = next(n for n in r.notes if n.startswith(("materialised", "vLLM needs its own copy")))
    assert f"-> {export_mod.megabytes(size)} " in note or f"lm_head ({export_mod.megabytes(size)})" in note, note


def test_non_empty_out_is_refused_unless_overwrite(backbone, tmp_path):
    """Guards against: an export silently replacing a directory the user still needs, and overwrite=True
    deleting a folder that is no previous export (files without a config.json, subfolders)."""
    heads = make_heads(backbone, "own")
    out = tmp_path / "x"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(UserError, match="overwrite=true"):
        export(heads, "vllm", out, backbone)
    with pytest.raises(UserError, match="is not an export"):
        export_heads(heads, "vllm", out, overwrite=True, options=options(backbone))
    assert (out / "keep.txt").read_text() == "mine"
    (out / "keep.txt").unlink()
    export(heads, "tgi", out, backbone)   # a previous export, which overwrite=True replaces
    export_heads(heads, "vllm", out, overwrite=True, options=options(backbone))
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left behind


def test_a_failed_write_keeps_the_previous_directory(backbone, tmp_path, monkeypatch):
    """Guards against: a crash mid-export leaving a half-written engine checkpoint in place."""
    heads = make_heads(backbone, "own")
    out = tmp_path / "x"
    export(heads, "vllm", out, backbone)
    before = (out / "model.safetensors").read_bytes()

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr("safetensors.torch.save_file", boom)
    with pytest.raises(OSError):
        export_heads(heads, "tgi", out, overwrite=True, options=options(backbone))
    assert (out / "model.safetensors").read_bytes() == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_unknown_format_is_refused_by_name(backbone, tmp_path):
    """Guards against: a typo in format= producing a traceback or a default format."""
    with pytest.raises(UserError, match="unknown format 'vllm2'"):
        export(make_heads(backbone, "own"), "vllm2", tmp_path / "x", backbone)


@pytest.mark.parametrize("fmt", FORMATS)
def test_other_head_kinds_are_refused_per_format(tmp_path, fmt):
    """Guards against: Hydra heads exported as if they were Medusa heads (no engine holds them;
    MLP-speculator heads export to vLLM only, see tests/heads/test_dependent_heads.py)."""
    stub = types.SimpleNamespace(spec=types.SimpleNamespace(kind="hydra"))
    with pytest.raises(UserError) as e:
        export_heads(stub, fmt, tmp_path / "x")
    assert f"format {fmt} has no exporter for heads of kind 'hydra'" in str(e.value)


def test_registry_takes_an_exporter_for_a_new_kind(tmp_path, monkeypatch):
    """Guards against: the registry being closed, so a teammate's mlp_speculator -> vLLM exporter
    would have to edit the Medusa exporters to plug in."""
    monkeypatch.setattr(export_mod, "_EXPORTERS", dict(export_mod._EXPORTERS))

    @register_exporter("vllm", "test_kind")
    def fake(heads, opts):
        return export_mod.ExportPlan(config={"model_type": "test"}, weights_file="model.safetensors",
                                     tensors={"w": torch.zeros(2)})

    stub = types.SimpleNamespace(spec=types.SimpleNamespace(kind="test_kind"))
    r = export_heads(stub, "vllm", tmp_path / "x")
    assert json.loads((r.path / "config.json").read_text()) == {"model_type": "test"}
