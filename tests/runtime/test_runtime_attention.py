"""The decoding attention (inference/runtime/attention.py): transformers' SDPA with grouped-query attention
in the kernel for masked multi-row calls on CPU and folded into query rows on CUDA, installed by MedusaModel."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from inference.methods import generate
from inference.runtime import attention
from inference.runtime.model import MedusaModel
from inference.runtime.tree import tree_buffers

from runtime_support import OracleHeads, one_thread, random_heads, tiny_llama, wrap  # noqa: F401


class _Module:
    """What transformers' attention functions read from the attention module."""

    def __init__(self, groups: int):
        self.num_key_value_groups = groups
        self.is_causal = True
        self.training = False


def _qkv(batch=2, q_heads=6, kv_heads=2, rows=5, context=40, dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, q_heads, rows, dim, generator=g)
    k = torch.randn(batch, kv_heads, context, dim, generator=g)
    v = torch.randn(batch, kv_heads, context, dim, generator=g)
    return q, k, v


def _tree_mask(batch, rows, context, bool_mask: bool):
    """A tree-shaped mask over the last ``rows`` positions (each row sees the prefix, the root and itself),
    with the second sequence's first 3 positions padded away."""
    visible = torch.ones(batch, 1, rows, context, dtype=torch.bool)
    visible[..., context - rows:] = torch.eye(rows, dtype=torch.bool)
    visible[..., context - rows] = True
    visible[1, :, :, :3] = False
    if bool_mask:
        return visible
    return torch.zeros(visible.shape).masked_fill_(~visible, torch.finfo(torch.float32).min)


@pytest.mark.parametrize("bool_mask", [False, True])
def test_masked_rows_equal_transformers_sdpa(bool_mask):
    """Guards against the in-kernel GQA path computing anything but what transformers' repeat-K/V SDPA
    computes (wrong head grouping, mask broadcast or output layout would change the verified logits)."""
    q, k, v = _qkv()
    mask = _tree_mask(2, 5, 40, bool_mask)
    module = _Module(groups=3)
    ours, _ = attention.decoding_attention_forward(module, q, k, v, mask, scaling=0.25)
    ref, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.25)
    assert ours.shape == ref.shape == (2, 5, 6, 16)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-6)


@pytest.mark.parametrize("bool_mask", [False, True])
@pytest.mark.parametrize("rows, batch", [(1, 2), (5, 2), (5, 1), (16, 1), (70, 2)])
def test_folded_groups_equal_repeated_keys_and_values(rows, batch, bool_mask):
    """Guards against the CUDA path's folding (G query heads as G*n rows of their key/value head) pairing a query
    head with another head's keys, or a row with another row's mask (the row order inside a fold, a one-row
    mask broadcast): it equals attention over repeated keys and values (``repeat_kv``) for one and many rows,
    one and two sequences, float and boolean masks. The function is device-agnostic; CUDA picks it."""
    from transformers.models.llama.modeling_llama import repeat_kv

    q, k, v = _qkv(batch=batch, q_heads=8, kv_heads=2, rows=rows, context=80)
    mask = _tree_mask(2, rows, 80, bool_mask)[:batch]
    mask[:, :, 0, 5] = False if bool_mask else torch.finfo(torch.float32).min    # the first row's prefix differs
    ours = attention.folded_attention(q, k, v, mask, scaling=0.25)
    ref = torch.nn.functional.scaled_dot_product_attention(q, repeat_kv(k, 4), repeat_kv(v, 4), attn_mask=mask,
                                                           scale=0.25).transpose(1, 2)
    assert ours.shape == (batch, rows, 8, 16)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-6)


def test_long_calls_do_not_repeat_the_mask(monkeypatch):
    """Guards against a prompt's first forward through a static buffer copying its full-capacity mask once per
    query group (B x G x n x capacity per layer: ~2 GB at Llama-3.1-8B's shape, 32 rows of 2,000 tokens): calls
    longer than a tree are handed to SDPA with the mask as given, one call per group."""
    from inference import attention_backends

    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kwargs):
        seen.append(attn_mask.numel())
        return sdpa(q, k, v, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(attention_backends.F, "scaled_dot_product_attention", spy)
    rows = attention_backends.FOLDED_ROWS + 1
    q, k, v = _qkv(batch=2, q_heads=8, kv_heads=2, rows=rows, context=rows + 8)
    mask = _tree_mask(2, rows, rows + 8, bool_mask=True)
    attention.folded_attention(q, k, v, mask, scaling=0.25)
    assert seen == [mask.numel()] * 4


@pytest.mark.parametrize("case", ["one row", "no mask", "no groups", "softcap"])
def test_other_calls_go_to_transformers(monkeypatch, case):
    """Guards against the fast path taking calls it was not checked for (one-row decoding, causal prefill
    without a mask, models without GQA, soft-capped attention), which must stay transformers' own."""
    calls = []

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return sdpa_attention_forward(*args, **kwargs)

    monkeypatch.setattr(attention, "_sdpa_forward", lambda: spy)
    rows = 1 if case == "one row" else 4
    q, k, v = _qkv(rows=rows, kv_heads=6 if case == "no groups" else 2)
    mask = None if case == "no mask" else _tree_mask(2, rows, 40, bool_mask=False)
    kwargs = {"softcap": 30.0} if case == "softcap" else {}
    module = _Module(groups=1 if case == "no groups" else 3)
    if case == "softcap":
        with pytest.raises(ValueError, match="softcap"):
            attention.decoding_attention_forward(module, q, k, v, mask, **kwargs)
    else:
        attention.decoding_attention_forward(module, q, k, v, mask, **kwargs)
    assert len(calls) == 1


def test_medusa_model_installs_it_and_leaves_eager_alone():
    """Guards against an sdpa backbone decoding without the fast path (the KV-cache copy per layer and step
    it removes), and against the switch touching an eager backbone (whose math it would change)."""
    model = tiny_llama(vocab=96, seed=0)
    MedusaModel(model=model, tokenizer=None, heads=None)
    assert model.config._attn_implementation == attention.NAME
    MedusaModel(model=model, tokenizer=None, heads=None)          # wrapping again is fine
    assert model.config._attn_implementation == attention.NAME
    eager = tiny_llama(vocab=96, seed=0)
    eager.config._attn_implementation = "eager"
    MedusaModel(model=eager, tokenizer=None, heads=None)
    assert eager.config._attn_implementation == "eager"


@torch.inference_mode()
def test_tree_verification_forward_is_unchanged():
    """Guards against the switch changing a verification forward: a tree step over a cached prefix gives the
    same hidden states through the decoding attention as through transformers' sdpa (the tiny backbone has
    4 query / 2 key-value heads, so the fast path runs in every layer)."""
    model = tiny_llama(vocab=96, seed=0)
    m = MedusaModel(model=model, tokenizer=None, heads=None)
    prefix = torch.arange(3, 33)[None]
    parents = torch.tensor([-1, 0, 0, 1, 2, 3])
    depths = torch.tensor([0, 1, 1, 2, 2, 3])
    mask = tree_buffers(parents, depths, 3).additive_mask(30, m.dtype)
    ids, pos = torch.tensor([[5, 9, 11, 13, 17, 19]]), (depths + 30)[None]
    out = {}
    for impl in ("sdpa", attention.NAME):
        model.config._attn_implementation = impl
        cache = m.new_cache(64)
        m.hidden(prefix, torch.arange(30)[None], cache)
        out[impl] = m.hidden(ids, pos, cache, mask)
    torch.testing.assert_close(out[attention.NAME], out["sdpa"], rtol=0, atol=1e-6)


@pytest.mark.parametrize("perfect", [False, True])
def test_tree_decoding_output_is_unchanged(perfect):
    """Guards against greedy tree decoding drifting from plain decoding once the decoding attention is in,
    with wrong guesses (rows rejected) and with perfect ones (long accepted paths, KV compaction)."""
    model = tiny_llama(vocab=96, seed=0)
    m = wrap(model, random_heads(model, num_heads=3))
    assert model.config._attn_implementation == attention.NAME
    prompt = [1, 5, 9, 17, 33, 2, 7]
    plain = generate(m, prompt, "autoregressive", max_new_tokens=24)
    if perfect:
        m = wrap(model, OracleHeads(m, prompt + generate(m, prompt, "autoregressive", max_new_tokens=40).tokens,
                                    num_heads=3))
    tree = generate(m, prompt, tree="tree8", max_new_tokens=24)
    assert tree.tokens == plain.tokens
    assert (tree.tau > 2.5) == perfect


def test_generate_baseline_attends_with_transformers_sdpa(monkeypatch):
    """Guards against transformers' ``generate`` baseline (hf_generate) being timed with the runtime's own
    attention instead of what a transformers user gets, and against the switch not being restored after."""
    model = tiny_llama(vocab=96, seed=0)
    m = MedusaModel(model=model, tokenizer=None, heads=None, eos_token_ids=[0])
    seen = []
    original = model.generate

    def spy(*args, **kwargs):
        seen.append(model.config._attn_implementation)
        return original(*args, **kwargs)

    monkeypatch.setattr(model, "generate", spy)
    out = generate(m, [1, 5, 9, 17], "hf_generate", max_new_tokens=4)
    assert seen == ["sdpa"] and len(out.tokens) >= 1
    assert model.config._attn_implementation == attention.NAME
