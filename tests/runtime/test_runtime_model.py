"""Loading backbone + heads for decoding, and refusing what does not belong together (model.py)."""

import dataclasses

import pytest
import torch

from inference.methods import generate
from inference.errors import IncompatibleHeadsError, UserError
from inference.heads.native import save_heads
from inference.heads.spec import backbone_fingerprint
from inference.loading import load_medusa
from inference.runtime.model import MedusaModel

from runtime_support import one_thread, random_heads, tiny_llama, wrap  # noqa: F401

PROMPT = [5, 17, 3, 88, 41, 9]


@pytest.fixture()
def export(tmp_path):
    """A heads export for tiny_llama(seed=0), saved the way the trainer saves it."""
    model = tiny_llama(vocab=96, seed=0)
    heads = random_heads(model, num_heads=3, seed=1)
    heads.spec.base_model_fingerprint = backbone_fingerprint(model.config)
    return save_heads(heads, tmp_path / "heads"), heads


def test_round_trip_decodes_like_the_in_memory_heads(export):
    """Guards against an export that loads but decodes differently (lost weights, wrong dtype)."""
    path, heads = export
    m = load_medusa(path, backbone=tiny_llama(vocab=96, seed=0))
    ref = wrap(tiny_llama(vocab=96, seed=0), heads)
    a = generate(m, PROMPT, tree="tree16", max_new_tokens=16)
    b = generate(ref, PROMPT, tree="tree16", max_new_tokens=16)
    assert a.tokens == b.tokens and a.accept_lengths == b.accept_lengths
    assert m.heads.spec == heads.spec and m.device.type == "cpu" and m.dtype == torch.float32


def test_random_backbone_must_be_passed(export):
    """Guards against trying (and failing obscurely) to rebuild a random test backbone by name."""
    path, _ = export
    with pytest.raises(UserError, match="random test model"):
        load_medusa(path)


@pytest.mark.parametrize("other, fragment", [
    (dict(hidden=32), "hidden size 64"),
    (dict(vocab=128), "vocab size 96"),
    (dict(layers=3), "fingerprint"),
])
def test_heads_for_another_backbone_are_refused(export, other, fragment):
    """Guards against silently decoding with heads trained for a different model."""
    path, _ = export
    with pytest.raises(IncompatibleHeadsError, match=fragment):
        load_medusa(path, backbone=tiny_llama(**{"vocab": 96, **other}))


def test_missing_and_corrupt_files_are_refused(export, tmp_path):
    """Guards against tracebacks (or garbage heads) from missing or damaged export files."""
    path, _ = export
    model = tiny_llama(vocab=96, seed=0)
    with pytest.raises(UserError, match="not found"):
        load_medusa(tmp_path / "nowhere", backbone=model)
    weights = path / "model.safetensors"
    blob = weights.read_bytes()
    weights.write_bytes(blob[: len(blob) // 2])
    with pytest.raises(UserError, match="corrupt"):
        load_medusa(path, backbone=model)
    weights.unlink()
    with pytest.raises(UserError, match="missing model.safetensors"):
        load_medusa(path, backbone=model)


def test_backbone_by_path_and_bad_paths(export, tmp_path):
    """Guards against the recorded base_model not being resolved, and bad paths not being UserErrors."""
    from medusa_train.backbone import byte_tokenizer

    path, heads = export
    model_dir = tmp_path / "backbone"
    tiny_llama(vocab=96, seed=0).save_pretrained(model_dir)
    byte_tokenizer().save_pretrained(model_dir)
    spec = dataclasses.replace(heads.spec, base_model=str(model_dir))
    heads.spec = spec
    save_heads(heads, path)
    m = load_medusa(path)
    assert m.model.config._attn_implementation == "medusa_sdpa" and m.tokenizer is not None   # sdpa, switched
    text = m.tokenizer.decode(m.encode_chat("hi"))
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(UserError, match="cannot load backbone"):
        load_medusa(path, backbone=str(tmp_path / "no-such-model"))
    # a blank prompt rendered an empty user turn (the commands refuse a blank prompt=); a tokenizer that is not
    # one (a path) failed at the first prompt as "the tokenizer has no chat template"
    for blank in ("", "  \n", []):
        with pytest.raises(UserError, match="the prompt is empty"):
            m.encode_chat(blank)
    with pytest.raises(UserError, match="tokenizer must be a transformers tokenizer .*got str"):
        load_medusa(path, tokenizer=str(model_dir))


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(device="cuda:7" if torch.cuda.is_available() else "cuda"), "CUDA|GPU"),
    (dict(device="tpu"), "device"),
    (dict(dtype="int8"), "dtype"),
    *([(dict(device=0), "device")] if not torch.cuda.is_available() else []),   # 0 was read as "no device": CPU
])
def test_bad_device_or_dtype(export, kwargs, fragment):
    """Guards against impossible device/dtype requests failing deep inside torch, and ``device=0`` (falsy) loading
    silently on the CPU."""
    path, _ = export
    with pytest.raises(UserError, match=fragment):
        load_medusa(path, backbone=tiny_llama(vocab=96, seed=0), **kwargs)


def test_dtype_is_applied_to_backbone_and_heads(export):
    """Guards against heads left in fp32 next to a bf16 backbone (a dtype error at the first step)."""
    path, _ = export
    m = load_medusa(path, backbone=tiny_llama(vocab=96, seed=0), dtype="bfloat16")
    assert m.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in m.heads.parameters())
    assert len(generate(m, PROMPT, tree="tree8", max_new_tokens=6).tokens) == 6


def test_a_backbone_attending_within_a_window_decodes_only_within_it():
    """Guards against a Mistral-style backbone (no ``layer_types``, every layer within ``sliding_window``) decoded
    past its window: the tree decoder's masks and cache give every layer every position, so its output there is no
    longer the backbone's. Requests are kept within the window (refused past it, as past the positions), where the
    decode equals transformers' own windowed greedy decoding; a window the positions never exceed never bites."""
    from transformers import AutoModelForCausalLM, MistralConfig

    from inference.runtime.model import attention_kinds

    def mistral(window):
        torch.manual_seed(0)
        cfg = MistralConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                            sliding_window=window)
        return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")

    windowed = MedusaModel(model=mistral(16), tokenizer=None, heads=None)
    assert windowed.max_positions == 16 and attention_kinds(windowed.config) == {"full_attention"}
    ids = [5, 17, 33, 2, 60, 41]
    out = generate(windowed, ids, "autoregressive", max_new_tokens=10, eos_token_ids=())
    want = windowed.model.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                                   pad_token_id=0, min_new_tokens=10)[0, len(ids):].tolist()
    assert out.tokens == want
    with pytest.raises(UserError, match=r"exceeds the backbone's 16-token sliding window"):
        generate(windowed, ids, "autoregressive", max_new_tokens=11)
    for window in (64, None):
        assert MedusaModel(model=mistral(window), tokenizer=None, heads=None).max_positions == 64


def test_attention_that_ignores_tree_masks_is_refused():
    """Guards against flash-attention backbones, which would ignore the tree mask and decode wrongly."""
    model = tiny_llama(vocab=96, seed=0)
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(UserError, match="ignores tree masks"):
        MedusaModel(model=model, tokenizer=None, heads=None)
