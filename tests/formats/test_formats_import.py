"""``inference.formats`` import: reference Medusa, TGI-v2 and vLLM checkpoints (built here, in their
own layouts, never downloaded) load through ``load_medusa`` and decode."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from inference.methods import generate
from inference.errors import UserError
from inference.formats.export import FormatWarning
from inference.loading import load_heads, load_medusa, read_heads_spec
from runtime_support import one_thread, tiny_llama  # noqa: F401  (one_thread: autouse fixture)

VOCAB, HIDDEN = 96, 64


@pytest.fixture(scope="module")
def backbone():
    return tiny_llama(vocab=VOCAB, hidden=HIDDEN)


class RefResBlock(nn.Module):
    """The reference implementation's block, attribute names included (``linear``)."""

    def __init__(self, hidden):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        self.act = nn.SiLU()

    def forward(self, x):
        return x + self.act(self.linear(x))


def reference_medusa_head(num_heads, num_layers, seed=0, vocab=VOCAB):
    """FasterDecoding/Medusa's ``medusa_head`` exactly as it builds it, ``[ResBlock] * L`` (one block
    repeated) included, with random weights as after training."""
    torch.manual_seed(seed)
    head = nn.ModuleList(nn.Sequential(*([RefResBlock(HIDDEN)] * num_layers), nn.Linear(HIDDEN, vocab, bias=False))
                         for _ in range(num_heads))
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, HIDDEN ** -0.5)
    return head.eval()


def write_reference(d, head, config, as_pickle=True):
    d.mkdir(parents=True, exist_ok=True)
    if as_pickle:
        torch.save(head.state_dict(), d / "medusa_lm_head.pt")
    else:
        save_file({k: v.contiguous() for k, v in head.state_dict().items()}, str(d / "medusa_lm_head.safetensors"))
    if config is not None:
        (d / "config.json").write_text(json.dumps(config))
    return d


def x_states(n=5):
    return torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(7))


# -- reference Medusa -------------------------------------------------------------------------------
def test_reference_checkpoint_with_wrong_head_count_imports_warns_and_decodes(backbone, tmp_path):
    """Guards against: trusting the reference config's often-wrong medusa_num_heads (the published
    vicuna-7b heads say 2 and hold 4), and imported heads that do not decode losslessly."""
    ref = reference_medusa_head(num_heads=4, num_layers=1)
    d = write_reference(tmp_path / "ref", ref, {"medusa_num_heads": 2, "medusa_num_layers": 1,
                                                "base_model_name_or_path": "org/tiny"})
    with pytest.warns(FormatWarning, match="medusa_num_heads=2 but medusa_lm_head.pt holds 4"):
        spec = read_heads_spec(d)
    assert (spec.num_heads, spec.num_layers, spec.projection, spec.base_model) == (4, 1, "own", "org/tiny")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FormatWarning)
        m = load_medusa(d, backbone=backbone)
    x = x_states()
    with torch.no_grad():
        for k in range(4):
            assert torch.equal(m.heads.head_logits(x, k), ref[k](x))
    prompt = [5, 17, 33, 2, 41]
    out = generate(m, prompt, tree="tree8", max_new_tokens=12)
    assert out.tokens == generate(m, prompt, "autoregressive", max_new_tokens=12).tokens


def test_reference_tied_layers_import_as_what_the_reference_computes(backbone, tmp_path):
    """Guards against: mis-reading a reference L=2 checkpoint, whose ``[ResBlock] * L`` stores one block
    under two names; the import must compute exactly what the reference model computes."""
    ref = reference_medusa_head(num_heads=2, num_layers=2)
    d = write_reference(tmp_path / "ref", ref, {"medusa_num_heads": 2, "medusa_num_layers": 2})
    heads = load_heads(d, backbone_config=backbone.config)
    assert heads.spec.num_layers == 2
    x = x_states()
    with torch.no_grad():
        for k in range(2):
            assert torch.equal(heads.head_logits(x, k), ref[k](x))


def test_reference_safetensors_and_prefixed_keys_import(backbone, tmp_path):
    """Guards against: refusing the safetensors variant, or keys a trainer saved with a wrapper prefix."""
    ref = reference_medusa_head(num_heads=3, num_layers=1)
    d = tmp_path / "ref"
    d.mkdir()
    save_file({f"medusa_head.{k}": v.contiguous() for k, v in ref.state_dict().items()},
              str(d / "medusa_lm_head.safetensors"))
    (d / "config.json").write_text(json.dumps({"medusa_num_heads": 3, "medusa_num_layers": 1}))
    heads = load_heads(d, backbone_config=backbone.config)
    with torch.no_grad():
        assert torch.equal(heads.head_logits(x_states(), 2), ref[2](x_states()))


def test_pickle_that_needs_code_is_refused_with_why(tmp_path):
    """Guards against: running arbitrary code from a downloaded medusa_lm_head.pt (only
    ``torch.load(weights_only=True)`` is used; anything else is refused, naming the global)."""

    class Payload:
        def __reduce__(self):
            return (print, ("this would have run on load",))

    d = tmp_path / "evil"
    d.mkdir()
    torch.save({"0.0.linear.weight": Payload()}, d / "medusa_lm_head.pt")
    with pytest.raises(UserError) as e:
        read_heads_spec(d)
    msg = str(e.value)
    assert "needs arbitrary code to unpickle" in msg and "(print)" in msg and "\n" not in msg


def test_imported_heads_without_a_recorded_backbone_ask_for_one(tmp_path):
    """Guards against: guessing a backbone for a reference checkpoint whose config names none."""
    d = write_reference(tmp_path / "ref", reference_medusa_head(2, 1), None)
    with pytest.raises(UserError, match="do not record their backbone; pass backbone="):
        load_medusa(d)


def test_heads_made_for_another_backbone_are_refused(tmp_path):
    """Guards against: imported heads silently attached to a backbone of another hidden/vocab size."""
    d = write_reference(tmp_path / "ref", reference_medusa_head(2, 1, vocab=VOCAB + 4), {})
    with pytest.raises(UserError, match="vocab size"):
        load_medusa(d, backbone=tiny_llama(vocab=VOCAB, hidden=HIDDEN))


def test_tgi_v2_dir_without_projections_uses_the_backbone_lm_head(backbone, tmp_path):
    """Guards against: TGI-v2 checkpoints (blocks only, the base lm_head) being unreadable, or read with
    a vocabulary that is not the backbone's."""
    ref = reference_medusa_head(num_heads=2, num_layers=1)
    blocks_only = {k: v.contiguous() for k, v in ref.state_dict().items() if ".linear." in k}
    d = tmp_path / "tgi2"
    d.mkdir()
    save_file(blocks_only, str(d / "medusa_lm_head.safetensors"))
    (d / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 1}))
    m = load_medusa(d, backbone=backbone)
    assert m.heads.spec.projection == "shared" and m.heads.spec.vocab_size == VOCAB
    x = x_states()
    with torch.no_grad():
        want = backbone.get_output_embeddings()(ref[1][0](x))
        assert torch.equal(m.heads.head_logits(x, 1), want)


# -- vLLM -------------------------------------------------------------------------------------------
def test_vllm_dir_from_elsewhere_imports(backbone, tmp_path):
    """Guards against: vLLM Medusa dirs made by other tools being unreadable: no biases
    (medusa_fc_bias unset), the ``medusa_heads.`` prefix vLLM strips, a config with wrong counts."""
    g = torch.Generator().manual_seed(2)
    t = {}
    for h in range(3):
        t[f"medusa_heads.blocks.{h}.layers.0.weight"] = torch.randn(HIDDEN, HIDDEN, generator=g) * 0.1
        t[f"medusa_heads.lm_heads.{h}.weight"] = torch.randn(VOCAB, HIDDEN, generator=g) * 0.1
    d = tmp_path / "vllm"
    d.mkdir()
    save_file(t, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({"model_type": "medusa", "hidden_size": HIDDEN, "vocab_size": VOCAB,
                                               "num_heads": 5, "num_hidden_layers": 1}))
    with pytest.warns(FormatWarning, match="num_heads=5 but the weights hold 3"):
        heads = load_heads(d, backbone_config=backbone.config)
    x = x_states()
    with torch.no_grad():
        h1 = x + torch.nn.functional.silu(x @ t["medusa_heads.blocks.1.layers.0.weight"].T)
        assert torch.equal(heads.head_logits(x, 1), h1 @ t["medusa_heads.lm_heads.1.weight"].T)


def test_dir_of_no_known_layout_keeps_the_native_error(tmp_path):
    """Guards against: the foreign-layout dispatch swallowing the native loader's own messages."""
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(UserError, match="is not a heads export: missing model.safetensors"):
        read_heads_spec(tmp_path)
    with pytest.raises(UserError, match="heads directory not found"):
        read_heads_spec(tmp_path / "nope")
    with pytest.raises(UserError, match="is a file, not a heads directory"):   # it was "not found" too
        read_heads_spec(tmp_path / "config.json")


@pytest.mark.parametrize("layout", ["vllm", "native"])
@pytest.mark.parametrize("damage, phrase", [
    (lambda m: torch.cat([m[:1], m[:1], m[2:]]), "token_map maps two rows onto one token id"),
    (lambda m: m.to(torch.float32), "token_map is stored as torch.float32, not integer token ids"),
])
def test_a_token_map_with_repeated_or_non_integer_ids_is_refused(backbone, tmp_path, layout, damage, phrase):
    """Guards against: a Medusa token_map naming one token id twice accepted by the native and vLLM loaders (an
    export to tgi materialize=true then silently kept one of the two rows), and the vLLM importer casting a float
    token_map to ids without a word: one line each, through the loaders' one shared check."""
    from safetensors.torch import load_file

    from inference.formats.export import ExportOptions, export_heads
    from inference.heads.native import save_heads
    from runtime_support import random_heads

    heads = random_heads(backbone, projection="truncated", truncated=20)
    if layout == "vllm":
        path = export_heads(heads, "vllm", tmp_path / "v", options=ExportOptions()).path
        weights = path / "model.safetensors"
    else:
        path = save_heads(heads, tmp_path / "n")
        weights = next(path.glob("*.safetensors"))
    tensors = load_file(str(weights))
    name = next(k for k in tensors if k.endswith("token_map"))
    tensors[name] = damage(tensors[name])
    save_file(tensors, str(weights), metadata={"format": "pt"})
    with pytest.raises(UserError, match=phrase) as e:
        load_heads(path, backbone_config=backbone.config)
    assert "\n" not in str(e.value)
