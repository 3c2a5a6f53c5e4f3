"""The EAGLE repository's own EAGLE-3 layout (eagle/traineagle3: ``architectures: ["LlamaForCausalLM"]``, a
one-layer Llama config with ``draft_vocab_size`` and no aux ids, fp16 ``pytorch_model.bin`` from DeepSpeed's
``save_16bit_model`` or safetensors) imported as vLLM serves it (it renames the architecture for method
eagle3): the target's default layers, the drafter's weights as they are; a ``.bin`` only through
``torch.load(weights_only=True)``; a one-layer Llama *target* is not taken for one."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from engine_specs import sglang_eagle3_load, vllm_eagle3_load
from inference.errors import UserError
from inference.formats.export import ExportOptions, export_heads
from inference.formats.importers import detect_layout
from inference.heads.eagle3 import Eagle3Drafter, default_aux_layers, draft_layer_config
from inference.heads.spec import HeadsSpec
from inference.loading import load_heads
from runtime_support import one_thread, tiny_llama  # noqa: F401  (one_thread: autouse fixture)
from test_formats_cli import run

VOCAB, HIDDEN, LAYERS, DRAFT_VOCAB = 96, 64, 8, 40


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab=VOCAB, hidden=HIDDEN, layers=LAYERS)


def source_drafter(target) -> Eagle3Drafter:
    """What the EAGLE trainer trained: the target's default layers, random weights, a draft vocabulary."""
    cfg = target.config
    spec = HeadsSpec(num_heads=2, num_layers=1, hidden_size=HIDDEN, vocab_size=VOCAB, projection="truncated",
                     truncated_vocab_size=DRAFT_VOCAB, kind="eagle3", aux_layers=default_aux_layers(LAYERS),
                     draft_layer=draft_layer_config(cfg))
    d = Eagle3Drafter(spec)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in d.parameters():  # fp16-exact values: the checkpoint holds them in fp16
            p.copy_((torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5 + (p.dim() == 1)).half().float())
        d.token_map.copy_(torch.randperm(VOCAB, generator=g)[:DRAFT_VOCAB].sort().values)
    d.attach_backbone(None, target.get_input_embeddings().weight)
    return d.eval()


def write_eagle_repo(d, target, src, weights="bin"):
    """The EAGLE repo's save: its config.json (eagle/traineagle3/config.json's keys) and the trainable
    parameters plus the d2t / t2d buffers in fp16, under the module's own names."""
    tmp = d.parent / f"{d.name}-export"
    export_heads(src, "eagle3", tmp, options=ExportOptions())
    from safetensors.torch import load_file, save_file

    exported = load_file(str(tmp / "model.safetensors"))
    tensors = {k: (v.half() if v.is_floating_point() else v) for k, v in exported.items()}
    cfg = target.config
    config = {"architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
              "hidden_size": HIDDEN, "initializer_range": 0.02, "intermediate_size": cfg.intermediate_size,
              "max_position_embeddings": cfg.max_position_embeddings, "model_type": "llama",
              "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
              "num_hidden_layers": 1, "pad_token_id": 0, "rms_norm_eps": cfg.rms_norm_eps,
              "tie_word_embeddings": False, "torch_dtype": "float16", "transformers_version": "4.28.1",
              "use_cache": True, "vocab_size": VOCAB, "draft_vocab_size": DRAFT_VOCAB}
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    if weights == "bin":
        torch.save(tensors, d / "pytorch_model.bin")
    else:
        save_file(tensors, str(d / "model.safetensors"))
    return d


def logits(d: Eagle3Drafter, seed=1, t=6):
    g = torch.Generator().manual_seed(seed)
    tokens, aux = torch.randint(0, VOCAB, (1, t), generator=g), torch.randn(1, t, 3 * HIDDEN, generator=g)
    with torch.no_grad():
        normed, _, _ = d.forward_step(tokens, d.combine(aux), torch.arange(t)[None])
        local = d.project(normed)
    full = local.new_full((1, t, VOCAB), float("-inf"))
    full[..., d.token_map] = local
    return full


@pytest.mark.parametrize("weights", ["bin", "safetensors"])
def test_the_eagle_repos_layout_imports_as_vllm_serves_it(target, tmp_path, weights):
    """Guards against: the EAGLE trainer's output (LlamaForCausalLM, fp16 pytorch_model.bin or safetensors)
    refused as "not a heads export" / "unknown keys" although vLLM serves it as is."""
    src = source_drafter(target)
    d = write_eagle_repo(tmp_path / "eagle", target, src, weights)
    assert detect_layout(d) == "eagle3"
    back = load_heads(d, backbone_config=target.config, input_embeddings=target.get_input_embeddings().weight)
    assert isinstance(back, Eagle3Drafter) and back.spec.settings.aux_layers == [2, 4, 5]  # the engines' default on 8
    a, b = logits(src), logits(back)
    assert torch.equal(torch.isfinite(a), torch.isfinite(b))
    assert float((a - b)[torch.isfinite(a)].abs().max()) <= 1e-5


def test_medusa_export_re_exports_it_for_both_engines(target, tmp_path, capsys):
    """Guards against: an EAGLE-repo drafter that cannot be brought to the directory both engines load."""
    d = write_eagle_repo(tmp_path / "eagle", target, source_drafter(target))
    target.config.save_pretrained(tmp_path / "target")
    out = tmp_path / "out"
    code, _, err = run([f"heads={d}", "format=eagle3", f"out={out}", f"backbone={tmp_path / 'target'}"], capsys)
    assert code == 0, err
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    for load in (vllm_eagle3_load, sglang_eagle3_load):
        assert load(out, HIDDEN, VOCAB)[2] == []


def test_a_pickle_that_needs_code_is_refused_not_run(target, tmp_path):
    """Guards against: unpickling an EAGLE-repo ``pytorch_model.bin`` with full pickle (arbitrary code)."""
    d = write_eagle_repo(tmp_path / "eagle", target, source_drafter(target))
    state = torch.load(d / "pytorch_model.bin", weights_only=True)
    state["args"] = argparse.Namespace(lr=1e-4)  # a global weights_only refuses
    torch.save(state, d / "pytorch_model.bin")
    with pytest.raises(UserError, match="weights_only=True"):
        load_heads(d, backbone_config=target.config, input_embeddings=target.get_input_embeddings().weight)


def test_a_one_layer_llama_target_is_not_taken_for_a_drafter(tmp_path):
    """Guards against: detecting the EAGLE layout by its architecture alone, which every Llama target has."""
    tiny_llama(vocab=VOCAB, hidden=HIDDEN, layers=1).save_pretrained(tmp_path / "llama1")
    assert detect_layout(tmp_path / "llama1") is None
