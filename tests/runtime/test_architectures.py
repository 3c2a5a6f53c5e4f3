"""The tree decoder on the chat-model families users bring (not only Llama): tiny random backbones of each family,
fp32, built from a config alone (``random_config``, the byte tokenizer's vocabulary).

For each family: the runtime's plain greedy loop is transformers' own greedy ``generate``; its logits are the ones the
backbone samples from; Medusa trees (random heads, and oracle heads that force long acceptances, so the tree mask,
the tree's position ids and the cache compaction all decide tokens), prompt lookup and, where the family allows its
Llama-style drafter layer, EAGLE-3 decode exactly the plain greedy tokens, at batch 1 and batched, with graphs off
and on the static-shape path (``graphs="uncaptured"``). Families whose layers attend otherwise than fully are
refused in one line. A family whose cache the static buffer cannot hold (DeepSeek's latent attention) decodes on
the dynamic cache, said once.
"""

from __future__ import annotations

import functools
import types
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM

from inference.errors import UserError
from inference.heads.drafting import IndependentDrafting
from inference.methods import generate, generate_batch
from inference.runtime.model import MedusaModel
from inference.runtime.static_steps import apply_graphs
from medusa_train.backbone import random_config
from runtime_support import one_thread, random_heads, wrap  # noqa: F401 (autouse fixture)
from test_eagle3_decoding import random_drafter

BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=320, max_position_embeddings=512)
HD = dict(head_dim=16)   # families whose default head_dim is not hidden / heads (Gemma's 256, Qwen3's 128)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
FULL = dict(layer_types=["full_attention"] * 2)
WINDOW = 40   # the sliding window of the families that have one: the longest prompt (13) + N (20) and a tree fit it

# family -> (config, attention implementation, EAGLE-3 drafter allowed)
ARCHS = {
    "llama": (dict(model_type="llama"), "sdpa", True),
    "llama3-rope": (dict(model_type="llama", rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16,
        rope_theta=500000.0)), "sdpa", True),
    "mistral": (dict(model_type="mistral", sliding_window=64), "sdpa", True),
    "qwen2": (dict(model_type="qwen2"), "sdpa", True),
    "qwen2-yarn": (dict(model_type="qwen2", rope_scaling=dict(rope_type="yarn", factor=4.0, rope_theta=10000.0,
                                                              original_max_position_embeddings=128)), "sdpa", True),
    "qwen3": (dict(model_type="qwen3", **HD), "sdpa", True),
    "qwen3_moe": (dict(model_type="qwen3_moe", **MOE, **HD), "sdpa", True),
    "gemma": (dict(model_type="gemma", **HD), "sdpa", False),
    "gemma2-full": (dict(model_type="gemma2", **FULL, **HD), "eager", False),   # soft caps; sdpa refused by HF
    "gemma3_text-full": (dict(model_type="gemma3_text", **FULL, **HD), "sdpa", False),
    "phi3": (dict(model_type="phi3"), "sdpa", True),
    "phi3-longrope": (dict(model_type="phi3", original_max_position_embeddings=24, rope_scaling=dict(
        rope_type="longrope", short_factor=[1.0 + 0.1 * i for i in range(8)],
        long_factor=[2.0 + 0.3 * i for i in range(8)])), "sdpa", True),
    "olmo2": (dict(model_type="olmo2"), "sdpa", True),
    "granite": (dict(model_type="granite", embedding_multiplier=12.0, logits_scaling=8.0, residual_multiplier=0.22,
                     attention_multiplier=0.0625), "sdpa", True),
    "granitemoe": (dict(model_type="granitemoe", logits_scaling=8.0, num_local_experts=4, num_experts_per_tok=2),
                   "sdpa", True),
    "hyperclovax": (dict(model_type="hyperclovax", logits_scaling=4.0), "sdpa", True),   # multiplies by it
    "minicpm3": (dict(model_type="minicpm3", kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                      q_lora_rank=None, dim_model_base=16, num_key_value_heads=4), "sdpa", True),
    # ^ divides its last state: logits / 4; latent attention's keys carry every head (as real checkpoints say: with
    # BASE's 2 kv heads a one-row batched step crashed in transformers' own attention, untested until then)
    "cohere": (dict(model_type="cohere", logit_scale=0.0625), "sdpa", True),
    "stablelm": (dict(model_type="stablelm"), "sdpa", False),
    "starcoder2": (dict(model_type="starcoder2"), "sdpa", False),
    "smollm3": (dict(model_type="smollm3"), "sdpa", True),
    "glm4": (dict(model_type="glm4", **HD), "sdpa", False),
    "gpt_oss-full": (dict(model_type="gpt_oss", num_local_experts=4, num_experts_per_tok=2, **FULL, **HD), "eager",
                     False),
    "deepseek_v3": (dict(model_type="deepseek_v3", n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                         q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                         first_k_dense_replace=1, n_group=1, topk_group=1, num_key_value_heads=4), "sdpa", True),
    "mixtral": (dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2), "sdpa", True),
    "phi": (dict(model_type="phi"), "sdpa", False),
    "falcon": (dict(model_type="falcon", num_kv_heads=2, new_decoder_architecture=True), "sdpa", False),
    # their defaults: sliding-window layers beside full ones, decoded within the window (every request here fits it)
    "gemma2": (dict(model_type="gemma2", sliding_window=WINDOW, **HD), "eager", False),
    "gemma3_text": (dict(model_type="gemma3_text", sliding_window=WINDOW, **HD), "sdpa", False),
    "gpt_oss": (dict(model_type="gpt_oss", num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW, **HD),
                "eager", False),
    "cohere2": (dict(model_type="cohere2", sliding_window=WINDOW), "sdpa", True),
    "olmo3": (dict(model_type="olmo3", sliding_window=WINDOW), "sdpa", True),
    "qwen2-sliding": (dict(model_type="qwen2", use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
                      "sdpa", True),
}

# model types whose KV cache is not [kv_heads, positions, head_dim] per layer: the static path falls back, said once
OWN_CACHE = {"deepseek_v3", "minicpm3"}   # multi-head latent attention

# Prompt 0 repeats itself (prompt lookup accepts), 2 is long enough for phi3-longrope to cross its
# 24 original positions and llama3-rope its 16 while decoding.
PROMPTS = [[5, 17, 3, 88, 41, 9, 5, 17, 3, 88], [1, 2, 3, 4], [60, 61, 7, 7, 7, 30, 12, 95, 44, 200, 13, 7, 7]]
N = 20


def params(graphs=("off", "uncaptured")):
    return [pytest.param(arch, g, id=f"{arch}-{g}") for arch in ARCHS for g in graphs]


@functools.lru_cache(maxsize=None)
def family(arch: str):
    """(plain MedusaModel, transformers' own greedy continuation of each prompt, transformers' logits of prompt 2).
    The references are taken before ``MedusaModel`` switches the attention to the runtime's own."""
    spec, attn, _ = ARCHS[arch]
    cfg = random_config({**BASE, **spec})
    cfg.eos_token_id, cfg.bos_token_id, cfg.pad_token_id = None, None, 0
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).eval()
    with torch.inference_mode():
        ref = [model.generate(torch.tensor([p]), max_new_tokens=N, min_new_tokens=N, do_sample=False, eos_token_id=None,
                              pad_token_id=0, attention_mask=torch.ones(1, len(p), dtype=torch.long))[0, len(p):]
               for p in PROMPTS]
        ref = [r.tolist() for r in ref]
        logits = model(input_ids=torch.tensor([PROMPTS[2]])).logits[0]
    return MedusaModel(model=model, tokenizer=None, heads=None), ref, logits


@functools.lru_cache(maxsize=None)
def plain(arch: str) -> list[list[int]]:
    m = family(arch)[0]
    return [generate(m, p, "autoregressive", max_new_tokens=N, eos_token_ids=()).tokens for p in PROMPTS]


class SequenceOracle(IndependentDrafting, torch.nn.Module):
    """Stub heads that know every prompt's greedy future (at batch 1 and batched): a hidden state is matched to its
    (sequence, position) by nearest neighbour among the full sequences' states; head k ranks the token at
    position + k + 2 first, so trees accept long runs and every accepted token passed through the tree mask."""

    def __init__(self, m: MedusaModel, sequences: list[list[int]], num_heads: int = 3):
        super().__init__()
        self.spec = types.SimpleNamespace(num_heads=num_heads, output_size=m.vocab_size)
        self.vocab, self.where = m.vocab_size, []
        with torch.inference_mode():
            states = [m.body(input_ids=torch.tensor([s])).last_hidden_state[0] for s in sequences]
        self.reference = torch.cat(states)
        self.where = [(s, t) for s, seq in enumerate(sequences) for t in range(len(seq))]
        self.seqs = sequences

    def head_logits(self, hidden, k):
        flat = hidden.reshape(-1, hidden.shape[-1])
        out = torch.zeros(flat.shape[0], self.vocab)
        for i, j in enumerate(torch.cdist(flat, self.reference).argmin(-1).tolist()):
            s, t = self.where[j]
            if t + k + 2 < len(self.seqs[s]):
                out[i, self.seqs[s][t + k + 2]] = 10.0
        return out.reshape(*hidden.shape[:-1], self.vocab)

    def to_vocab_ids(self, ids):
        return ids


@functools.lru_cache(maxsize=None)
def decoders(arch: str) -> list[tuple[str, MedusaModel, dict]]:
    """(method, model, options) of every drafting method the family decodes with."""
    m, _, _ = family(arch)
    oracle = SequenceOracle(m, [p + t for p, t in zip(PROMPTS, plain(arch))])
    out = [("medusa", wrap(m.model, random_heads(m.model, num_heads=3, seed=1)), dict(tree="tree16")),
           ("medusa", MedusaModel(model=m.model, tokenizer=None, heads=oracle), dict(tree="tree16")),
           ("prompt_lookup", m, {})]
    if ARCHS[arch][2]:
        out.append(("eagle3", random_drafter(m.model), {}))
    return out


def decoded(mm, graphs, fn):
    apply_graphs(mm, graphs, log=lambda line: None)
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            out = fn()
        fell_back = [w for w in seen if "KV cache holds" in str(w.message)]
        assert len(fell_back) == (graphs != "off" and mm.config.model_type in OWN_CACHE), [str(w.message) for w in seen]
        return out
    finally:
        mm.static = None


@pytest.mark.parametrize("arch", ARCHS)
def test_plain_greedy_is_transformers_greedy(arch):
    """Guards against: the runtime's own forward (decoder body + lm_head at the last position, its attention function,
    position ids, KV cache) decoding otherwise than transformers' ``generate`` for a family: RoPE variants (llama3,
    YaRN, LongRoPE's switch to long factors, partial rotary), q/k norms, soft caps, embedding multipliers, MoE routing,
    parallel blocks, multi-head latent attention."""
    _, ref, _ = family(arch)
    assert plain(arch) == ref


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_are_the_backbones_own(arch):
    """Guards against: verification, sampling and the heads' teacher reading another distribution than the one the
    backbone samples from: a logit scale (Cohere), a final soft-cap (Gemma-2) or divisor (Granite) left out."""
    m, _, want = family(arch)
    with torch.inference_mode():
        got = m.logits(m.body(input_ids=torch.tensor([PROMPTS[2]])).last_hidden_state)[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch, graphs", params())
def test_tree_decoding_is_plain_greedy_at_batch_1(arch, graphs):
    """Guards against: a family whose tree verification is not token-identical to plain greedy decoding: the 4D
    tree mask or the tree's position ids ignored or mis-applied by its attention or rotary embedding, accepted
    entries compacted wrongly in its cache (oracle heads force long acceptances), or the static-shape step's
    buffer laid out for another cache shape than the family's (DeepSeek-V3's latent cache: a shape-mismatch
    traceback; now it decodes on the dynamic cache with one warning)."""
    want = plain(arch)
    for method, mm, kw in decoders(arch):
        for p, w in zip(PROMPTS, want):
            out = decoded(mm, graphs, lambda: generate(mm, p, method, max_new_tokens=N, eos_token_ids=(), **kw))
            assert out.tokens == w, (method, p)
    oracle = decoders(arch)[1][1]
    out = decoded(oracle, graphs, lambda: generate(oracle, PROMPTS[2], "medusa", tree="tree16", max_new_tokens=N,
                                                   eos_token_ids=()))
    assert sum(out.accept_lengths) / len(out.accept_lengths) > 3   # the tree really decided tokens


@pytest.mark.parametrize("arch, graphs", params())
def test_tree_decoding_is_plain_greedy_batched(arch, graphs):
    """Guards against: a family whose batched decoding (ragged rows of different prompt lengths, left-aligned
    per-row positions and masks, compaction per row) leaks between rows or shifts a row's positions, so a row
    is not its prompt's plain greedy decoding."""
    want = plain(arch)
    for method, mm, kw in decoders(arch):
        out = decoded(mm, graphs, lambda: generate_batch(mm, PROMPTS, method, max_new_tokens=N, eos_token_ids=(),
                                                         **kw))
        assert [r.tokens for r in out.rows] == want, method


@pytest.mark.parametrize("arch", [a for a in ARCHS if not ARCHS[a][2]])
def test_eagle3_drafter_for_a_family_without_its_layer_is_refused_in_one_line(arch):
    """Guards against: an EAGLE-3 drafter for a family whose layer it cannot copy (gelu MLPs, partial rotary) or whose
    hidden states it cannot tap (Falcon's ``h`` has no ``layers`` list) failing with a traceback, or drafting from
    the wrong features: refused in one line, when the drafter is built or when it first decodes."""
    m, _, _ = family(arch)
    with pytest.raises(UserError) as e:
        generate(random_drafter(m.model), PROMPTS[1], "eagle3", max_new_tokens=4, eos_token_ids=())
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("arch", ["gemma2", "gpt_oss", "qwen2-sliding"])
def test_a_request_past_a_sliding_window_is_refused(arch):
    """Guards against: a family with sliding-window layers (Gemma-2/3, gpt-oss, Command-R7B, OLMo-3, Qwen2 with
    use_sliding_window) decoding a request longer than its window: the tree decoder's masks and cache give every layer
    every position, so past the window its output is no longer the backbone's. Within it (the other tests of this
    module) sliding and full attention agree; past it, one line."""
    m = family(arch)[0]
    with pytest.raises(UserError, match=rf"exceeds the backbone's {WINDOW}-token sliding window") as e:
        generate(m, PROMPTS[2], "autoregressive", max_new_tokens=WINDOW - len(PROMPTS[2]) + 1, eos_token_ids=())
    assert "\n" not in str(e.value)
    assert len(generate(m, PROMPTS[2], "autoregressive", max_new_tokens=WINDOW - len(PROMPTS[2]),
                        eos_token_ids=()).tokens) == WINDOW - len(PROMPTS[2])


@pytest.mark.parametrize("layer_types, window, words", [
    (["sliding_attention", "full_attention"], None, "has sliding_attention layers"),   # a window nobody knows
    (["chunked_attention", "full_attention"], 8, "has chunked_attention layers"),      # Llama-4's chunks
    (["full_attention", "linear_attention"], None, "has linear_attention layers"),     # Qwen3-Next's
])
def test_layers_attending_otherwise_are_refused_in_one_line(layer_types, window, words):
    """Guards against: a layer that attends otherwise than fully or within a known sliding window decoded by the tree
    decoder, whose masks and cache give every layer every position: refused in one line naming the layers."""
    from inference.runtime.model import check_backbone_config

    cfg = types.SimpleNamespace(model_type="llama", layer_types=layer_types, sliding_window=window)
    with pytest.raises(UserError, match=rf"^backbone 'b' {words}, which the tree decoder does not support \(full or "
                                        r"sliding-window attention only\)$"):
        check_backbone_config(cfg, "b")


def test_a_logits_scaling_of_unknown_direction_is_said():
    """Guards against: a config's ``logits_scaling`` read silently one way for a model type whose forward was never
    seen (transformers' Granite divides by it, HyperCLOVA X multiplies): left unapplied, with one warning."""
    from inference.backbone import logit_scaling

    cfg = random_config({**BASE, "model_type": "llama"})
    cfg.logits_scaling = 4.0
    model = types.SimpleNamespace(config=cfg)
    with pytest.warns(UserWarning, match=r"logits_scaling=4.0, which no known forward of this model type reads"):
        assert logit_scaling(model) == (None, None)


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3", "minicpm3"])
def test_kv_bytes_per_token_is_what_the_cache_holds(arch):
    """Guards against: the KV bytes per token (batch memory sizing, each method's reported KV cost) counted from
    the config as keys + values per KV head, which latent attention (DeepSeek-V3, MiniCPM3) does not store: it
    caches one compressed latent and a shared rotary key per layer, a fraction of that figure."""
    from inference.runtime.model import kv_bytes_per_token

    m = family(arch)[0]
    cache = m.new_cache(64)
    with torch.inference_mode():
        m.body_hidden(torch.tensor([PROMPTS[2]]), torch.arange(len(PROMPTS[2]))[None], cache)
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    assert kv_bytes_per_token(m) * len(PROMPTS[2]) == held
    cfg = m.config
    per_head = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4
    assert (kv_bytes_per_token(m) < per_head) == (arch in OWN_CACHE)


@pytest.mark.parametrize("arch", ["gemma2-full", "gpt_oss-full"])
def test_a_backbone_class_without_sdpa_loads_by_path_and_decodes(arch, tmp_path):
    """Guards against: a backbone whose transformers class refuses sdpa (Gemma-2 with full attention, gpt-oss)
    refused by every decoding command and by export ("does not support attn_implementation='sdpa'", no key to change
    it): such a class loads eager and decodes through the runtime's own attention, token for token as transformers'
    greedy generate."""
    from inference.heads.native import save_heads
    from inference.loading import load_medusa
    from medusa_train.backbone import byte_tokenizer

    spec, attn, _ = ARCHS[arch]
    cfg = random_config({**BASE, **spec})
    with torch.random.fork_rng():
        torch.manual_seed(0)   # family()'s weights: its transformers reference applies
        AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).save_pretrained(tmp_path / "backbone")
    byte_tokenizer().save_pretrained(tmp_path / "backbone")
    reference, want = family(arch)[0], family(arch)[1][1]
    heads = random_heads(reference.model, num_heads=3, seed=1)
    heads.spec.base_model = str(tmp_path / "backbone")
    save_heads(heads, tmp_path / "heads")
    m = load_medusa(tmp_path / "heads", kernels="stock", graphs="off")
    assert m.model.config._attn_implementation != "sdpa"
    for method, kw in (("autoregressive", {}), ("medusa", {"tree": "tree8"})):
        assert generate(m, PROMPTS[1], method, max_new_tokens=N, eos_token_ids=(), **kw).tokens == want, method


ALIBI = {   # family -> (config, attention implementation its class has)
    "bloom": (dict(model_type="bloom", n_layer=2, n_head=4), "eager"),
    "falcon-rw": (dict(model_type="falcon", alibi=True, new_decoder_architecture=False, multi_query=False,
                       num_kv_heads=4, parallel_attn=False, bias=True), "sdpa"),
    "mpt": (dict(model_type="mpt", d_model=64, n_heads=4, n_layers=2, expansion_ratio=2, max_seq_len=512), "eager"),
}


@pytest.mark.parametrize("arch", ALIBI)
def test_alibi_backbones_are_refused_in_one_line(arch):
    """Guards against: a backbone positioned by ALiBi biases, which transformers builds from each key's index in the
    sequence and not from the position ids a draft node gets: MPT's trees decoded other tokens than its plain loop
    without a word, Bloom and Falcon-RW crashed in transformers ("too many values to unpack"). Refused from the config
    alone (the commands, before any weight loads) and as a model object."""
    from inference.runtime.model import check_backbone_config

    spec, attn = ALIBI[arch]
    cfg = random_config({**BASE, **spec})
    with pytest.raises(UserError, match=r"^backbone 'b' positions its tokens by ALiBi biases, which the tree decoder "
                                        r"does not support \(.*\)$"):
        check_backbone_config(cfg, "b")
    with pytest.raises(UserError, match="ALiBi"):
        MedusaModel(model=AutoModelForCausalLM.from_config(cfg, attn_implementation=attn), tokenizer=None, heads=None)


def test_a_decoder_without_position_ids_is_refused():
    """Guards against: a decoder body whose forward takes no position ids (MPT with ALiBi turned off) decoding trees
    with every draft node at its index's position instead of its depth's: other tokens than plain decoding."""
    spec, attn = ALIBI["mpt"]
    cfg = random_config({**BASE, **spec, "attn_config": {"alibi": False}})
    with pytest.raises(UserError, match="^MptModel takes no position ids, which the tree decoder gives every draft "
                                        "node: this backbone cannot be tree-decoded$"):
        MedusaModel(model=AutoModelForCausalLM.from_config(cfg, attn_implementation=attn), tokenizer=None, heads=None)
