"""``inference.formats`` export: each engine's layout checked against its loader's written spec,
round trips that give bit-identical head logits, and the refusals a format cannot avoid."""

from __future__ import annotations

import json
import types

import pytest
import torch

from engine_specs import check_reference_medusa, check_tensorrt_llm, check_tgi, check_vllm, tgi_layout
from inference.errors import UserError
from inference.formats import FORMATS
from inference.formats import export as export_mod
from inference.formats.export import ExportOptions, export_heads, register_exporter
from inference.loading import load_heads, read_heads_spec
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


@pytest.mark.parametrize("projection", ["own", "shared", "truncated"])
def test_tensorrt_llm_export_matches_its_loader_spec(backbone, tmp_path, projection):
    """Guards against: a layout load_medusa_hf cannot read (it needs {h}.{L}.weight per head), or a
    config without medusa_num_layers (TensorRT-LLM would assume 1)."""
    heads = make_heads(backbone, projection, num_layers=2)
    r = export(heads, "tensorrt_llm", tmp_path / "t", backbone, materialize=True)
    assert sorted(p.name for p in r.path.iterdir()) == ["config.json", "medusa_lm_head.safetensors"]
    assert check_tensorrt_llm(r.path, HIDDEN, VOCAB, num_medusa_heads=3) == []


@pytest.mark.parametrize("projection,num_layers,layout", [("own", 2, "v1"), ("shared", 1, "v2"),
                                                           ("shared", 2, "v1"), ("truncated", 1, "v1")])
def test_tgi_export_matches_its_loader_spec(backbone, tmp_path, projection, num_layers, layout):
    """Guards against: an 'architectures' key (TGI then silently drops the heads), shapes TGI cannot
    load, and shared one-layer heads not using TGI's compact v2 layout."""
    heads = make_heads(backbone, projection, num_layers)
    r = export(heads, "tgi", tmp_path / "g", backbone, materialize=True)
    assert check_tgi(r.path, HIDDEN, VOCAB) == []
    assert tgi_layout(r.path) == layout


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


def test_non_empty_out_is_refused_unless_overwrite(backbone, tmp_path):
    """Guards against: an export silently replacing a directory the user still needs."""
    heads = make_heads(backbone, "own")
    out = tmp_path / "x"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(UserError, match="overwrite=true"):
        export(heads, "vllm", out, backbone)
    assert (out / "keep.txt").read_text() == "mine"
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
    MLP-speculator heads export to vLLM only, see tests/test_dependent_heads.py)."""
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
