"""``inference.heads``: the head modules and the export format the trainer writes and the runtime loads."""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import LlamaConfig

from inference.heads import native as heads_mod
from inference.errors import IncompatibleHeadsError, UserError
from inference.heads.medusa import MedusaHeads
from inference.heads.native import EXPORT_FILES, save_heads
from inference.heads.spec import HeadsSpec, backbone_fingerprint
from inference.loading import load_heads, read_heads_spec

HIDDEN, VOCAB = 16, 40


def _backbone_config(**kw):
    base = dict(hidden_size=HIDDEN, vocab_size=VOCAB, intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    base.update(kw)
    return LlamaConfig(**base)


def _lm_head(seed=1):
    return torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(seed))


def _trained_heads(projection: str, num_layers: int = 2, seed: int = 0) -> MedusaHeads:
    """Heads with every parameter randomised (as after training), so a round trip checks real values."""
    cfg = _backbone_config()
    spec = HeadsSpec(num_heads=3, num_layers=num_layers, hidden_size=HIDDEN, vocab_size=VOCAB, projection=projection,
                     truncated_vocab_size=12 if projection == "truncated" else None, base_model="test/tiny",
                     base_model_fingerprint=backbone_fingerprint(cfg))
    token_map = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(5))[:12] if projection == "truncated" \
        else None
    heads = MedusaHeads.from_lm_head(spec, _lm_head(), token_map)
    g = torch.Generator().manual_seed(seed)
    for p in heads.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return heads


# -- modules -----------------------------------------------------------------------------------
def test_resblocks_are_distinct_per_layer_and_head():
    """Guards against: the reference Medusa bug `[ResBlock(h)] * L`, which repeats ONE block L times
    (shared weights), and heads sharing blocks with each other."""
    spec = HeadsSpec(num_heads=3, num_layers=2, hidden_size=HIDDEN, vocab_size=VOCAB, projection="own")
    heads = MedusaHeads(spec)
    linears = [blk.linear for head in heads.blocks for blk in head]
    assert len(linears) == 6
    assert len({id(l) for l in linears}) == 6
    assert len({l.weight.data_ptr() for l in linears}) == 6
    n_params = sum(p.numel() for p in heads.parameters())
    assert n_params == 3 * 2 * (HIDDEN * HIDDEN + HIDDEN) + 3 * VOCAB * HIDDEN  # nothing is shared
    with torch.no_grad():
        heads.blocks[0][0].linear.weight.fill_(1.0)
    assert not heads.blocks[0][1].linear.weight.any()
    assert not heads.blocks[1][0].linear.weight.any()


def test_fresh_heads_are_identity_then_base_lm_head():
    """Guards against: non-zero block init (fresh heads would start as noise instead of the base
    model's next-token distribution) and projections not initialised from the lm_head."""
    w = _lm_head()
    x = torch.randn(5, HIDDEN)
    for projection in ("own", "shared", "truncated"):
        spec = HeadsSpec(num_heads=2, num_layers=3, hidden_size=HIDDEN, vocab_size=VOCAB, projection=projection,
                         truncated_vocab_size=8 if projection == "truncated" else None)
        tm = torch.tensor([7, 3, 0, 39, 1, 2, 5, 4]) if projection == "truncated" else None
        heads = MedusaHeads.from_lm_head(spec, w, tm)
        for k in range(2):
            assert torch.equal(heads.head_hidden(x, k), x)
            expected = x @ w.T if projection != "truncated" else x @ w[tm].T
            assert torch.allclose(heads.head_logits(x, k), expected, atol=1e-6)
        if projection == "truncated":
            assert heads.to_vocab_ids(torch.tensor([0, 3])).tolist() == [7, 39]


def test_shared_heads_do_not_store_or_train_the_lm_head():
    """Guards against: shared heads exporting (or training) the backbone's lm_head matrix."""
    heads = MedusaHeads.from_lm_head(
        HeadsSpec(num_heads=2, num_layers=1, hidden_size=HIDDEN, vocab_size=VOCAB, projection="shared"), _lm_head())
    assert all(p.numel() == HIDDEN * HIDDEN or p.numel() == HIDDEN for p in heads.parameters())
    assert not any("shared" in k for k in heads.state_dict())
    assert not heads.shared_weight.requires_grad


def test_spec_validation():
    """Guards against: impossible head configs (bad projection, truncated size out of range) being accepted."""
    with pytest.raises(UserError, match="projection"):
        HeadsSpec(num_heads=1, num_layers=1, hidden_size=4, vocab_size=8, projection="tied")
    with pytest.raises(UserError, match="truncated_vocab_size"):
        HeadsSpec(num_heads=1, num_layers=1, hidden_size=4, vocab_size=8, projection="truncated", truncated_vocab_size=9)
    with pytest.raises(UserError, match="num_heads"):
        HeadsSpec(num_heads=0, num_layers=1, hidden_size=4, vocab_size=8)


# -- export round trip ------------------------------------------------------------------------------
def test_saved_heads_are_readable_by_other_users(tmp_path):
    """Guards against a heads export only its owner can read (``heads/`` 0700, its weights and an adapter's 0600,
    from mkdtemp and safetensors): an engine in a container, a colleague or a job running as another user could not
    load it. Every file and folder gets what a plain mkdir / open gives under the umask."""
    old = os.umask(0o022)
    try:
        def adapter(tmp):   # a Medusa-2 adapter folder written inside the same atomic save
            (tmp / "adapter").mkdir()
            from safetensors.torch import save_file
            save_file({"w": torch.zeros(2)}, str(tmp / "adapter" / "adapter_model.safetensors"))

        out = save_heads(_trained_heads("own"), tmp_path / "heads", extra=adapter)
    finally:
        os.umask(old)
    modes = {p.relative_to(tmp_path).as_posix(): p.stat().st_mode & 0o777 for p in [out, *out.rglob("*")]}
    assert modes == {"heads": 0o755, "heads/config.json": 0o644, "heads/model.safetensors": 0o644,
                     "heads/adapter": 0o755, "heads/adapter/adapter_model.safetensors": 0o644}, modes


@pytest.mark.parametrize("projection", ["own", "shared", "truncated"])
def test_save_load_round_trip_gives_identical_logits(projection, tmp_path):
    """Guards against: an export that reloads with different weights, a lost token map, or a layout
    (file set, config fields) the runtime cannot read."""
    heads = _trained_heads(projection)
    out = save_heads(heads, tmp_path / "heads")
    assert sorted(os.listdir(out)) == sorted(EXPORT_FILES) == ["config.json", "model.safetensors"]
    assert sorted(os.listdir(tmp_path)) == ["heads"]  # no temp dir left beside it
    config = json.loads((out / "config.json").read_text())
    assert config["projection"] == projection and config["num_heads"] == 3 and config["num_layers"] == 2
    assert config["hidden_size"] == HIDDEN and config["vocab_size"] == VOCAB
    assert config["base_model_fingerprint"] == backbone_fingerprint(_backbone_config())

    lm = _lm_head() if projection == "shared" else None
    loaded = load_heads(out, backbone_config=_backbone_config(), lm_head_weight=lm)
    assert not loaded.training
    x = torch.randn(7, HIDDEN)
    with torch.no_grad():
        for a, b in zip(heads(x), loaded(x)):
            assert torch.equal(a, b)
    if projection == "truncated":
        assert torch.equal(loaded.token_map, heads.token_map) and loaded.token_map.dtype == torch.long
        from safetensors.torch import load_file

        assert "token_map" in load_file(str(out / "model.safetensors"))  # where vLLM's loader reads it


def test_shared_heads_need_the_lm_head_to_load(tmp_path):
    """Guards against: shared heads loading without the backbone lm_head and failing later at decode time."""
    out = save_heads(_trained_heads("shared"), tmp_path / "h")
    with pytest.raises(UserError, match="lm_head"):
        load_heads(out)


def test_load_with_dtype_keeps_token_map_integer(tmp_path):
    """Guards against: a dtype cast turning the token map into floats (wrong vocabulary ids)."""
    out = save_heads(_trained_heads("truncated"), tmp_path / "h")
    loaded = load_heads(out, dtype=torch.bfloat16)
    assert loaded.token_map.dtype == torch.long
    assert all(p.dtype == torch.bfloat16 for p in loaded.parameters())


@pytest.mark.parametrize("change, words", [
    ({"hidden_size": 32}, "hidden size"),
    ({"vocab_size": 41}, "vocab size"),
    ({"num_hidden_layers": 3}, "fingerprint"),
    pytest.param({"rope_theta": 5.0}, "fingerprint"),
])
def test_incompatible_backbone_is_refused_naming_the_mismatch(change, words, tmp_path):
    """Guards against: heads trained for one backbone silently attached to another (garbage drafts,
    or a shape error deep in decoding instead of a clear message)."""
    out = save_heads(_trained_heads("own"), tmp_path / "h")
    with pytest.raises(IncompatibleHeadsError, match=words):
        load_heads(out, backbone_config=_backbone_config(**change))
    assert issubclass(IncompatibleHeadsError, UserError)


def test_missing_export_files(tmp_path):
    """Guards against: a missing directory or file giving a raw FileNotFoundError / traceback."""
    with pytest.raises(UserError, match="not found"):
        load_heads(tmp_path / "nope")
    out = save_heads(_trained_heads("own"), tmp_path / "h")
    (out / "model.safetensors").unlink()
    with pytest.raises(UserError, match="model.safetensors"):
        load_heads(out)
    (tmp_path / "h2").mkdir()
    with pytest.raises(UserError, match="config.json"):
        load_heads(tmp_path / "h2")


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty"])
def test_corrupt_weights_are_a_user_error(damage, tmp_path):
    """Guards against: a corrupt or half-written model.safetensors raising a library error with a traceback."""
    out = save_heads(_trained_heads("own"), tmp_path / "h")
    f = out / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes({"garbage": b"\x00not safetensors at all" * 10, "truncated": data[: len(data) // 2],
                   "empty": b""}[damage])
    with pytest.raises(UserError, match="model.safetensors"):
        load_heads(out)


@pytest.mark.parametrize("damage, words", [
    ("token_map out of range", r"token_map holds ids outside the backbone's vocabulary 0\.\.39 \(\d+\.\.1000\d+\)"),
    ("token_map negative", "token_map holds ids outside the backbone's vocabulary"),
    ("token_map float", "token_map is stored as torch.float32, not integer token ids"),
    ("weight NaN", "holds NaN or infinite values"),
    ("weight int32", "is stored as torch.int32, not as a floating-point weight"),
])
def test_stored_values_the_heads_cannot_use_are_refused_at_load(damage, words, tmp_path):
    """Guards against: a token map with ids outside the vocabulary loaded (then an IndexError deep in torch at the
    first step, and exported to engines as it was), a float token map truncated to ids, NaN weights loaded (drafts
    never accepted: slow, silently) and float weights stored as integers."""
    from safetensors.torch import load_file, save_file

    out = save_heads(_trained_heads("truncated"), tmp_path / "h")
    tensors = load_file(str(out / "model.safetensors"))
    weight = next(k for k, t in tensors.items() if t.dtype.is_floating_point)
    if damage == "token_map out of range":
        tensors["token_map"] = tensors["token_map"] + 1_000_000
    elif damage == "token_map negative":
        tensors["token_map"] = tensors["token_map"] - 100
    elif damage == "token_map float":
        tensors["token_map"] = tensors["token_map"].float()
    elif damage == "weight NaN":
        tensors[weight] = tensors[weight].clone()
        tensors[weight].view(-1)[3] = float("nan")
    else:
        tensors[weight] = tensors[weight].to(torch.int32)
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(UserError, match=words):
        load_heads(out)


def test_mismatched_tensors_are_refused(tmp_path):
    """Guards against: non-strict loading (a missing / extra / mis-shaped tensor silently ignored or broadcast)."""
    from safetensors.torch import load_file, save_file

    out = save_heads(_trained_heads("own"), tmp_path / "h")
    tensors = load_file(str(out / "model.safetensors"))
    extra = dict(tensors, **{"blocks.9.0.linear.weight": torch.zeros(2)})
    save_file(extra, str(out / "model.safetensors"))
    with pytest.raises(UserError, match="unexpected"):
        load_heads(out)
    missing = {k: v for k, v in tensors.items() if not k.startswith("projections.2")}
    save_file(missing, str(out / "model.safetensors"))
    with pytest.raises(UserError, match="missing"):
        load_heads(out)
    reshaped = dict(tensors, **{"blocks.0.0.linear.bias": torch.zeros(HIDDEN + 1)})
    save_file(reshaped, str(out / "model.safetensors"))
    with pytest.raises(UserError, match="shape"):
        load_heads(out)


def test_bad_config_json(tmp_path):
    """Guards against: an invalid, foreign or newer-format config.json crashing with a traceback."""
    out = save_heads(_trained_heads("own"), tmp_path / "h")
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        read_heads_spec(out)
    (out / "config.json").write_text(json.dumps(dict(cfg, format_version=99)))
    with pytest.raises(UserError, match="newer"):
        read_heads_spec(out)
    (out / "config.json").write_text(json.dumps(dict(cfg, surprise=1)))
    with pytest.raises(UserError, match="surprise"):
        read_heads_spec(out)


@pytest.mark.parametrize("change, words", [
    ({"num_heads": "3"}, 'num_heads must be an integer, got "3"'),
    ({"num_layers": True}, "num_layers must be an integer, got true"),
    ({"truncated_vocab_size": 8.5}, "truncated_vocab_size must be an integer or null, got 8.5"),
    ({"kind": "mlp_speculator", "tie_weights": "false"}, 'tie_weights must be true or false, got "false"'),
])
def test_a_value_of_the_wrong_json_type_is_refused_naming_the_key(change, words, tmp_path):
    """Guards against: a hand-edited config.json with ``"num_heads": "3"`` refused as ``'<' not supported between
    instances of 'str' and 'int'`` (or a ``"tie_weights": "false"`` string read as true), not naming the key."""
    out = save_heads(_trained_heads("own"), tmp_path / "h")
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(dict(cfg, **change)))
    with pytest.raises(UserError, match=f"heads config {words}$"):
        read_heads_spec(out)


# -- atomic replacement -----------------------------------------------------------------------------
def _logits(heads, x):
    with torch.no_grad():
        return [t.clone() for t in heads(x)]


def test_save_over_existing_export_replaces_it(tmp_path):
    """Guards against: a re-export mixing old and new files, or leaving temp / old directories behind."""
    x = torch.randn(3, HIDDEN)
    save_heads(_trained_heads("own", seed=0), tmp_path / "heads")
    new = _trained_heads("own", seed=1)
    save_heads(new, tmp_path / "heads")
    assert sorted(os.listdir(tmp_path)) == ["heads"]
    assert sorted(os.listdir(tmp_path / "heads")) == ["config.json", "model.safetensors"]
    for a, b in zip(_logits(new, x), _logits(load_heads(tmp_path / "heads"), x)):
        assert torch.equal(a, b)


def test_failed_write_keeps_previous_export(tmp_path, monkeypatch):
    """Guards against: a crash while writing a new export (disk full, kill) destroying the previous
    good export or leaving a half-written directory in its place."""
    import safetensors.torch

    x = torch.randn(3, HIDDEN)
    old = _trained_heads("own", seed=0)
    save_heads(old, tmp_path / "heads")

    def boom(*a, **k):
        raise OSError("No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", boom)
    with pytest.raises(OSError):
        save_heads(_trained_heads("own", seed=1), tmp_path / "heads")
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["heads"]
    for a, b in zip(_logits(old, x), _logits(load_heads(tmp_path / "heads"), x)):
        assert torch.equal(a, b)


def test_failed_final_rename_keeps_previous_export(tmp_path, monkeypatch):
    """Guards against: the window between moving the old export aside and renaming the new one in,
    where a failure leaves no export at the path (the docstring promises old-or-new, never neither)."""
    x = torch.randn(3, HIDDEN)
    old = _trained_heads("own", seed=0)
    save_heads(old, tmp_path / "heads")
    real_replace = os.replace

    def failing_replace(src, dst):
        if ".tmp-" in os.path.basename(str(src)):
            raise OSError("simulated crash renaming the new export into place")
        return real_replace(src, dst)

    monkeypatch.setattr(heads_mod.os, "replace", failing_replace)
    with pytest.raises(OSError):
        save_heads(_trained_heads("own", seed=1), tmp_path / "heads")
    monkeypatch.undo()
    for a, b in zip(_logits(old, x), _logits(load_heads(tmp_path / "heads"), x)):
        assert torch.equal(a, b)


# config.json as format 1 has always written it: every built-in family's settings for every kind, in this order.
FORMAT1_KEYS = ["num_heads", "num_layers", "hidden_size", "vocab_size", "projection", "truncated_vocab_size",
                "base_model", "base_model_fingerprint", "kind", "inner_dim", "tie_weights", "scale_input",
                "backbone_adapter", "aux_layers", "draft_layer", "format_version"]


def _family_specs() -> dict:
    from inference.heads.eagle3 import draft_layer_config

    common = dict(num_layers=1, hidden_size=HIDDEN, vocab_size=VOCAB, projection="truncated", truncated_vocab_size=8)
    return {
        "medusa": HeadsSpec(num_heads=3, **common, backbone_adapter="adapter"),
        "hydra": HeadsSpec(num_heads=3, kind="hydra", **common),
        "mlp_speculator": HeadsSpec(num_heads=3, kind="mlp_speculator", inner_dim=32, tie_weights=True, **common),
        "eagle3": HeadsSpec(num_heads=2, kind="eagle3", aux_layers=[1, 2, 3],
                            draft_layer=draft_layer_config(_backbone_config(num_hidden_layers=6)), **common),
    }


def test_config_json_keeps_its_layout_for_every_family():
    """Guards against: moving the family settings off HeadsSpec changing the bytes of config.json (a key dropped,
    reordered or renamed), which readers, diffs and hashes of exports depend on; and the settings not coming
    back from it as the family's own."""
    specs = _family_specs()
    for kind, spec in specs.items():
        d = spec.to_dict()
        assert list(d) == FORMAT1_KEYS, kind
        assert HeadsSpec.from_dict(json.loads(json.dumps(d))) == spec, kind
    medusa = specs["medusa"].to_dict()
    assert {k: medusa[k] for k in FORMAT1_KEYS[9:15]} == {
        "inner_dim": None, "tie_weights": False, "scale_input": False, "backbone_adapter": "adapter",
        "aux_layers": None, "draft_layer": None}
    mlp = specs["mlp_speculator"]
    assert (mlp.settings.inner_dim, mlp.settings.tie_weights, mlp.to_dict()["aux_layers"]) == (32, True, None)
    assert specs["eagle3"].to_dict()["aux_layers"] == [1, 2, 3] and specs["eagle3"].settings.aux_layers == [1, 2, 3]


def test_a_setting_of_another_family_is_refused_in_one_line():
    """Guards against: a config.json (or a spec built in Python) giving a family a setting it does not read
    (an eagle3 key on medusa heads) loading silently as before, when every kind carried every field."""
    for build in (lambda: HeadsSpec.from_dict({**_family_specs()["medusa"].to_dict(), "aux_layers": [1, 2, 3]}),
                  lambda: HeadsSpec(num_heads=2, num_layers=1, hidden_size=HIDDEN, vocab_size=VOCAB, inner_dim=8)):
        with pytest.raises(UserError) as e:
            build()
        assert "\n" not in str(e.value) and "unknown keys" in str(e.value) and "'medusa' has no settings" in str(e.value)
