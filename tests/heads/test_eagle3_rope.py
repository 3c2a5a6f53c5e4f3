"""EAGLE-3 drafters for targets with scaled RoPE (Llama-3's llama3, linear, dynamic, YaRN, longrope) and for
Qwen2- / Qwen3-shaped targets: the drafter rotates as the target's own rotary embedding does, trains,
decodes greedy-identically, and exports a config vLLM and SGLang turn into the same rotation.

Tiny random targets built here; ``engine_specs`` restates the engines' loaders and their ``get_rope``."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import transformers

from engine_specs import (eagle3_engine_forward, sglang_eagle3_load, sglang_eagle3_logits, vllm_eagle3_load,
                          vllm_eagle3_logits)
from inference.errors import UserError
from inference.formats.export import ExportOptions, export_heads
from inference.heads.eagle3 import DraftKV, Eagle3Drafter, default_aux_layers, draft_layer_config
from inference.heads.registry import init_heads
from inference.heads.spec import HeadsSpec, backbone_fingerprint
from inference.loading import load_heads
from inference.methods import generate
from inference.loading import attach_heads
from medusa_train import trainer as T
from medusa_train.backbone import keep_random_backbone, random_backbone

from conftest import losses
from runtime_support import one_thread  # noqa: F401  (autouse fixture)

VOCAB, HIDDEN, LAYERS = 96, 64, 4
OMAX = 64  # original_max_position_embeddings of the scaled targets: positions past it are exercised
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": OMAX}
# name -> (config class, extra config fields); head_dim 16 unless said (Qwen3: 32 != hidden / heads)
TARGETS = {
    "llama3": (transformers.LlamaConfig, dict(rope_theta=500000.0, rope_scaling=LLAMA3)),
    "linear": (transformers.LlamaConfig, dict(rope_scaling={"rope_type": "linear", "factor": 4.0})),
    "dynamic": (transformers.LlamaConfig, dict(max_position_embeddings=OMAX,
                                               rope_scaling={"rope_type": "dynamic", "factor": 2.0})),
    "yarn-qwen2": (transformers.Qwen2Config, dict(rope_theta=1000000.0, rope_scaling={
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": OMAX})),
    "longrope": (transformers.LlamaConfig, dict(rope_scaling={
        "rope_type": "longrope", "original_max_position_embeddings": OMAX,
        "short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [1.0 + 2.0 * i for i in range(8)]})),
    "qwen3": (transformers.Qwen3Config, dict(head_dim=32, rope_theta=1000000.0)),
}
MODELS = {transformers.LlamaConfig: transformers.LlamaForCausalLM,
          transformers.Qwen2Config: transformers.Qwen2ForCausalLM,
          transformers.Qwen3Config: transformers.Qwen3ForCausalLM}


def target(name: str):
    cls, extra = TARGETS[name]
    fields = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4 * OMAX,
                  tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    cfg = cls(**{**fields, **copy.deepcopy(extra)})  # transformers fills the rope dict it is given in
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return MODELS[cls]._from_config(cfg, attn_implementation="sdpa").eval()


def drafter(model, seed: int = 0) -> Eagle3Drafter:
    """Every weight random (a warm start's zero o_proj would hide the rotation), full draft vocabulary."""
    cfg = model.config
    spec = HeadsSpec(num_heads=2, num_layers=1, hidden_size=HIDDEN, vocab_size=VOCAB, kind="eagle3",
                     base_model="org/tiny", base_model_fingerprint=backbone_fingerprint(cfg),
                     aux_layers=default_aux_layers(LAYERS), draft_layer=draft_layer_config(cfg))
    d = init_heads(spec, model.lm_head.weight, model.get_input_embeddings().weight)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in d.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5 + (1.0 if p.dim() == 1 else 0.0))
    return d.eval()


def reference_cos_sin(model, positions: torch.Tensor):
    """The target's own rotary embedding, fresh (transformers' dynamic RoPE keeps state across calls). For
    longrope, as transformers rotates these positions in a call reaching past original_max_position_embeddings
    (the drafter uses the long factors at every position: heads/rope.py says why)."""
    rotary = type(model.model.rotary_emb)(model.config)
    n = len(positions)
    if model.config.rope_parameters["rope_type"] == "longrope":
        positions = torch.cat([positions, torch.tensor([OMAX])])
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions[None])
    return cos[:, :n], sin[:, :n]


# -- the rotation -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", TARGETS)
def test_drafter_rotation_equals_the_targets_rope(name):
    """Guards against: an EAGLE-3 drafter refused for a Llama-3 (or YaRN / longrope / dynamic / linear)
    target, or one that rotates with other frequencies or another cos/sin scale than transformers does for
    that target (short and long positions, past original_max_position_embeddings and max_position_embeddings)."""
    model = target(name)
    rotary = drafter(model).midlayer.self_attn.rotary
    for positions in (torch.arange(0, 40), torch.arange(50, 90), torch.arange(200, 240)):
        cos, sin = rotary.cos_sin(positions[None], torch.float32)
        ref_cos, ref_sin = reference_cos_sin(model, positions)
        torch.testing.assert_close(cos, ref_cos, rtol=0, atol=2e-6)
        torch.testing.assert_close(sin, ref_sin, rtol=0, atol=2e-6)


def test_heads_config_records_the_rope_scaling_and_old_configs_stay_plain():
    """Guards against: the scaling lost when the heads are saved (the runtime would rebuild plain RoPE) and
    heads saved before scaling existed (no rope_scaling key) refused or rotated differently."""
    layer = draft_layer_config(target("llama3").config)
    assert layer["rope_scaling"] == LLAMA3 and layer["rope_theta"] == 500000.0
    assert "rope_scaling" not in draft_layer_config(target("qwen3").config)
    plain = target("qwen3")
    old = dict(draft_layer_config(plain.config))
    spec = HeadsSpec(num_heads=2, num_layers=1, hidden_size=HIDDEN, vocab_size=VOCAB, kind="eagle3",
                     aux_layers=[1, 2, 3], draft_layer=old)
    positions = torch.arange(100, 130)[None]
    cos, _ = Eagle3Drafter(spec).midlayer.self_attn.rotary.cos_sin(positions, torch.float32)
    assert torch.equal(cos, reference_cos_sin(plain, positions[0])[0])


@pytest.mark.parametrize("rope, words", [
    ({"rope_type": "mrope", "mrope_section": [2, 3, 3]}, "rope type 'mrope' is not supported"),
    ({"rope_type": "llama3", "factor": 8.0}, "missing low_freq_factor, high_freq_factor"),
    ({"rope_type": "yarn", "factor": 4.0, "attention_factor": 2.0}, "cos/sin scale of 2"),
    ({"rope_type": "yarn", "factor": 4.0, "truncate": False}, "truncate=false"),
    ({"rope_type": "default", "partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
])
def test_rope_the_drafter_cannot_compute_is_refused_in_one_line(rope, words):
    """Guards against: a drafter trained with a rotation it does not compute (or one the engines would not
    reproduce) instead of a one-line refusal before anything heavy runs."""
    cfg = {**transformers.LlamaConfig(hidden_size=HIDDEN, num_attention_heads=4).to_dict(), "rope_parameters": rope}
    with pytest.raises(UserError) as e:
        draft_layer_config(cfg)
    assert words in str(e.value) and "\n" not in str(e.value)


# -- training and decoding ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["llama3", "yarn-qwen2"])
def test_training_time_test_equals_decoding_past_the_original_length(name):
    """Guards against: training (ttt_features) and decoding (forward_step + DraftKV) rotating a scaled-RoPE
    drafter differently, e.g. depth j placed at another position or scaled frequencies in one path only."""
    model = target(name)
    d = drafter(model)
    torch.manual_seed(1)
    pos = torch.arange(OMAX - 10, OMAX + 10)[None]         # crosses original_max_position_embeddings
    tokens = torch.randint(0, VOCAB, (1, 20, 2))
    aux = torch.randn(1, 20, 3 * HIDDEN)
    causal = torch.full((20, 20), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        feats = d.ttt_features(aux, tokens, pos, causal, steps=2)
        for t in (3, 12, 19):
            normed, pre, (k, v) = d.forward_step(tokens[:, :t + 1, 0], d.combine(aux[:, :t + 1]), pos[:, :t + 1])
            torch.testing.assert_close(normed[0, -1], feats[0][0, t], rtol=0, atol=1e-5)
            kv = DraftKV(32)
            kv.append(k, v)
            n2, _, _ = d.forward_step(tokens[:, t:t + 1, 1], pre[:, -1:], pos[:, t:t + 1] + 1, past=kv.view())
            torch.testing.assert_close(n2[0, 0], feats[1][0, t], rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ["llama3", "yarn-qwen2", "longrope", "qwen3"])
def test_greedy_decoding_with_the_drafter_is_plain_greedy(name):
    """Guards against: eagle3 decoding failing or changing greedy output on Llama-3-rope, Qwen2 (YaRN),
    longrope and Qwen3-shaped (head_dim != hidden / heads, q/k norms) targets, past the original length."""
    model = target(name)
    m = attach_heads(model, drafter(model, seed=2))
    prompt = [int(t) for t in torch.randint(0, VOCAB, (OMAX - 8,), generator=torch.Generator().manual_seed(3))]
    plain = generate(m, prompt, "autoregressive", max_new_tokens=24, eos_token_ids=()).tokens
    out = generate(m, prompt, "eagle3", max_new_tokens=24, eos_token_ids=(), nodes=8, depth=3, topk=2)
    assert out.tokens == plain


def test_trains_on_a_llama3_rope_target(compose_tiny, tmp_path):
    """Guards against: medusa-train refusing (or crashing on) an eagle3 drafter for a Llama-3.x target, or
    saving heads that do not record the target's rope scaling. The target is a saved checkpoint, as a real
    Llama-3.1 is (backbone.name_or_path)."""
    rope = {**LLAMA3, "original_max_position_embeddings": 32}  # data rows run past it
    llama = random_backbone(dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                                 num_key_value_heads=2, max_position_embeddings=512, rope_theta=500000.0,
                                 rope_scaling=dict(rope)))
    folder = keep_random_backbone(llama, tmp_path / "llama3")
    out = tmp_path / "r"
    T.run(compose_tiny("trainer.max_steps=3", "trainer.log_every=1", "trainer.save_every=0", "logger.plot=false",
                       "heads.kind=eagle3", f"backbone.name_or_path={folder}", "backbone.random_init=null", out=out))
    layer = json.loads((out / "heads" / "config.json").read_text())["draft_layer"]
    assert layer["rope_scaling"] == rope and layer["rope_theta"] == 500000.0
    run = losses(out, "train")
    assert len(run) == 3 and all(torch.isfinite(torch.tensor(run)))


# -- export, engines, import --------------------------------------------------------------------------------
def our_logits(d, tokens, aux, positions, nxt):
    """The context rows, then two rows continuing the chain with their KV: as decoding runs the drafter."""
    with torch.no_grad():
        normed, pre, kv = d.forward_step(tokens[None], d.combine(aux)[None], positions[None])
        first = d.project(normed)[0]
        more = positions[-1] + 1 + torch.arange(2)
        normed, _, _ = d.forward_step(nxt[None], pre[:, -1:].expand(1, 2, HIDDEN), more[None], past=kv)
    return [first, d.project(normed)[0]]


def engine_logits(d_path, load, layer, logits_fn, embed, tokens, aux, positions, nxt):
    params, cfg, problems = load(d_path, HIDDEN, VOCAB)
    assert problems == []
    normed, pre, kv = eagle3_engine_forward(params, cfg, layer, embed, tokens, aux, positions)
    first = logits_fn(params, cfg, normed)
    more = positions[-1] + 1 + torch.arange(2)
    normed, _, _ = eagle3_engine_forward(params, cfg, layer, embed, nxt, pre[-1:].expand(2, HIDDEN), more, past=kv)
    return [first, logits_fn(params, cfg, normed)]


ENGINES = ((vllm_eagle3_load, "model.layers.0.", vllm_eagle3_logits),
           (sglang_eagle3_load, "model.midlayer.", sglang_eagle3_logits))


def assert_engines_compute(d, path, model, starts):
    embed = model.get_input_embeddings().weight.detach()
    g = torch.Generator().manual_seed(5)
    for start in starts:
        tokens, nxt = torch.randint(0, VOCAB, (6,), generator=g), torch.randint(0, VOCAB, (2,), generator=g)
        aux, positions = torch.randn(6, 3 * HIDDEN, generator=g), torch.arange(start, start + 6)
        ours = our_logits(d, tokens, aux, positions, nxt)
        for load, layer, logits_fn in ENGINES:
            theirs = engine_logits(path, load, layer, logits_fn, embed, tokens, aux, positions, nxt)
            for a, b in zip(ours, theirs):
                torch.testing.assert_close(a, b, rtol=0, atol=2e-5, msg=f"{load.__name__} from {start}")


# positions of the two passes: below original_max_position_embeddings, then past it (never ending exactly at
# it, where the engines' longrope switch differs by one position); dynamic: below max_position_embeddings
STARTS = {"dynamic": (3, 50)}


@pytest.mark.parametrize("name", TARGETS)
def test_engines_compute_the_exported_drafters_rotation(name, tmp_path):
    """Guards against: an export without the rope scaling (the engines would serve plain RoPE and propose
    other tokens than the drafter we trained and measured) or with fields vLLM's / SGLang's get_rope read
    differently (longrope's scale, YaRN's original length), and an import that loses it again."""
    model = target(name)
    d = drafter(model)
    path = export_heads(d, "eagle3", tmp_path / "e", options=ExportOptions()).path
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["rope_theta"] == d.spec.settings.draft_layer["rope_theta"]
    if name == "llama3":  # what the published Llama-3.x drafters ship
        assert cfg["rope_scaling"] == LLAMA3
    assert_engines_compute(d, path, model, STARTS.get(name, (3, 100)))
    back = load_heads(path, backbone_config=model.config, input_embeddings=model.get_input_embeddings().weight)
    if name != "dynamic":  # exported as plain RoPE (the engines' dynamic differs): equal below max_position
        assert back.spec.settings.draft_layer == d.spec.settings.draft_layer
    assert_engines_compute(back, path, model, STARTS.get(name, (3, 100)))


@pytest.mark.parametrize("rope_scaling", [
    {**LLAMA3, "original_max_position_embeddings": 32},                      # SpecForge's 70B drafter: its own omax
    {"rope_type": "longrope", "short_factor": [4.0] * 8, "long_factor": [4.0] * 8,
     "original_max_position_embeddings": OMAX, "short_mscale": 1.25, "long_mscale": 1.25},
    {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": OMAX, "beta_fast": 16, "beta_slow": 2},
])
def test_published_rope_scaling_imports_as_the_engines_compute_it(rope_scaling, tmp_path):
    """Guards against: a published drafter's rope_scaling (its own original length, the engines' longrope
    mscale keys, the legacy "type" key) refused on import or read into another rotation than both engines'."""
    model = target("llama3")
    path = export_heads(drafter(model), "eagle3", tmp_path / "e", options=ExportOptions()).path
    cfg = json.loads((path / "config.json").read_text())
    cfg["rope_scaling"] = rope_scaling
    del cfg["medusa_train"]
    (path / "config.json").write_text(json.dumps(cfg))
    back = load_heads(path, backbone_config=model.config, input_embeddings=model.get_input_embeddings().weight)
    assert_engines_compute(back, path, model, (3, 100))


@pytest.mark.parametrize("rope_scaling, words", [
    ({"rope_type": "dynamic", "factor": 2.0}, "rope type 'dynamic' is not supported on import"),
    ({"rope_type": "yarn", "factor": 4.0, "attn_factor": 2.0}, "cos/sin scale"),
    ({"rope_type": "longrope", "short_factor": [2.0] * 8, "long_factor": [2.0] * 8, "short_mscale": 1.0,
      "long_mscale": 1.2}, "short_mscale 1.0 != long_mscale 1.2"),
    ({"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}, "short_factor != long_factor"),
    ({"rope_type": "su", "factor": 2.0}, "rope type 'su' is not supported"),
])
def test_importer_refuses_rope_it_would_compute_differently_in_one_line(rope_scaling, words, tmp_path):
    """Guards against: importing a drafter whose rotation the engines compute differently from us (dynamic
    NTK at a fixed base, a YaRN scale multiplier, two longrope scales or factor lists, which vLLM and SGLang
    switch between differently) and drafting silently other tokens."""
    model = target("llama3")
    path = export_heads(drafter(model), "eagle3", tmp_path / "e", options=ExportOptions()).path
    cfg = json.loads((path / "config.json").read_text())
    cfg["rope_scaling"] = rope_scaling
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError) as e:
        load_heads(path, backbone_config=model.config, input_embeddings=model.get_input_embeddings().weight)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_trtllm_longrope_scale_it_ignores_is_noted():
    """Guards against: an EAGLE-3 export for a LongRoPE target whose cos/sin scale is its own (``short_mscale`` /
    ``long_mscale``, ``attention_factor``, or a ``factor`` other than positions / original: Phi-3.5-MoE's 1.243)
    served on TensorRT-LLM without a word: its PyTorch backend reads none of those keys and derives
    sqrt(1 + ln(max_pos / omax) / ln(omax)), so its attention logits differ by the squared ratio. The derived
    scale (Phi-3-mini-128k's) says nothing."""
    import math

    from inference.formats.eagle3 import trtllm_unhonoured

    derived = math.sqrt(1 + math.log(512 / 128) / math.log(128))
    layer = {"max_position_embeddings": 512, "rope_scaling": {
        "rope_type": "longrope", "long_factor": [1.0] * 8, "original_max_position_embeddings": 128,
        "attention_factor": derived}}
    assert trtllm_unhonoured(layer) == []
    layer["rope_scaling"]["attention_factor"] = 1.243
    (note,) = trtllm_unhonoured(layer)
    assert f"scaled by {derived:.6g}" in note and "not the drafter's 1.243" in note
