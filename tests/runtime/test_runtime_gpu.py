"""Tree decoding on CUDA (skipped without a GPU): devices, half precision, CUDA generators, tree verification vs
sequential decoding in fp32/bf16/fp16, greedy identity, the KV cache and its compaction."""

import pytest
import torch

from conftest import GPU_TIER_DEVICE as DEV
from inference.methods import generate
from inference.methods.medusa import TreeDecoder
from inference.runtime.model import MedusaModel
from inference.runtime.tree import MedusaTree, default_tree
from inference.runtime.verify import SamplingConfig

from runtime_support import FixedHeads, random_heads, tiny_llama, wrap

pytestmark = pytest.mark.gpu
PROMPT = [5, 17, 3, 88, 41, 9]


def test_cuda_fp32_greedy_is_lossless():
    """Guards against CPU-only assumptions (host tensors in masks, indices or the cache) on CUDA."""
    model = tiny_llama(vocab=96, seed=0).to(DEV)
    m = wrap(model, random_heads(model, num_heads=4))
    ref = generate(m, PROMPT, "autoregressive", max_new_tokens=40).tokens
    for tree in ("tree8", "mc_sim_7b_63"):
        assert generate(m, PROMPT, tree=tree, max_new_tokens=40).tokens == ref


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_half_precision_runs_every_mode(dtype):
    """Guards against dtype mismatches (mask, heads, draft q) in half precision on CUDA."""
    model = tiny_llama(vocab=96, seed=0).to(DEV, dtype)
    m = wrap(model, random_heads(model, num_heads=3))
    for cfg in (SamplingConfig(), SamplingConfig(mode="typical", temperature=0.7),
                SamplingConfig(mode="sample", temperature=0.7, top_p=0.9),
                SamplingConfig(mode="sample", temperature=0.7, draft="sampled")):
        a = generate(m, PROMPT, tree="tree16", max_new_tokens=16, sampling=cfg, seed=3)
        b = generate(m, PROMPT, tree="tree16", max_new_tokens=16, sampling=cfg, seed=3)
        assert a.tokens == b.tokens and len(a.tokens) == 16


# -- tree verification, KV cache and compaction on CUDA ------------------------------------------------------
V = 96
# nodes: 0 root, 1 [0], 2 [1], 3 [0,0], 4 [0,1], 5 [1,0], 6 [0,0,0]
TREE = MedusaTree([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 8e-2), (torch.float16, 1e-2)],
                         ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("tree", [TREE, default_tree("mc_sim_7b_63", 4)], ids=["7-nodes", "mc_sim_7b_63"])
def test_cuda_tree_verification_equals_sequential_decoding(tree, dtype, tol):
    """Guards against wrong tree masks / positions / cache rows on CUDA and in half precision: every
    node's logits equal running prompt + its root-to-node path as an ordinary sequence (same dtype;
    the tolerance is the rounding of that dtype, ||got - ref|| / ||ref||)."""
    model = tiny_llama(vocab=V, seed=0, init=0.2).to(DEV, dtype)
    m = wrap(model, random_heads(model, num_heads=4))
    tokens = torch.randint(0, V, (tree.num_nodes,), generator=torch.Generator().manual_seed(0)).to(DEV)
    buf = tree.buffers(DEV)
    cache = m.new_cache(64 + tree.num_nodes)
    past = len(PROMPT)
    with torch.inference_mode():
        m.hidden(torch.tensor([PROMPT], device=DEV), torch.arange(past, device=DEV)[None], cache)
        h = m.hidden(tokens[None], (buf.position_offsets + past)[None], cache, buf.additive_mask(past, dtype))
        got = m.logits(h[0])
        assert got.device.type == DEV and got.dtype == dtype and cache.length == past + tree.num_nodes
        for i in range(tree.num_nodes):
            seq = torch.tensor([PROMPT + tokens[tree.ancestors(i)].tolist()], device=DEV)
            ref = m.model(input_ids=seq).logits[0, -1]
            assert _rel(got[i], ref) < tol, (i, _rel(got[i], ref))


def test_cuda_greedy_identity_fp32_all_trees():
    """Greedy Medusa on CUDA in fp32 is token-identical to the plain loop and to transformers' generate."""
    model = tiny_llama(vocab=V, seed=0).to(DEV)
    m = wrap(model, random_heads(model, num_heads=4))
    ref = generate(m, PROMPT, "autoregressive", max_new_tokens=40).tokens
    hf = model.generate(torch.tensor([PROMPT], device=DEV), max_new_tokens=40, do_sample=False, pad_token_id=0)
    assert hf[0, len(PROMPT):].tolist() == ref
    for tree in ("chain4", "tree4", "tree16", "tree64"):
        assert generate(m, PROMPT, tree=tree, max_new_tokens=40).tokens == ref, tree


def _cuda_sequential_kv(m, tokens):
    cache = m.new_cache(len(tokens))
    with torch.inference_mode():
        for i, t in enumerate(tokens):
            m.hidden(torch.tensor([[t]], device=DEV), torch.tensor([[i]], device=DEV), cache)
    return [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]


@pytest.mark.parametrize("case", ["all", "none", "rank1-branch", "stop-at-depth-2"])
def test_cuda_kv_cache_compaction(case):
    """Guards against a compacted KV cache on CUDA that differs from feeding prompt + accepted tokens
    one by one (stale or misordered tree rows, host index tensors), and against wrong acceptance."""
    model = tiny_llama(vocab=V, seed=0).to(DEV)
    g = generate(MedusaModel(model=model, tokenizer=None, heads=None), PROMPT, "autoregressive",
                 max_new_tokens=16).tokens
    w = lambda t, k=1: (t + k) % V  # noqa: E731
    ranked = {"all": ([g[1], w(g[1])], [g[2], w(g[2])], [g[3]]),
              "none": ([w(g[1]), w(g[1], 2)], [g[2], w(g[2])], [g[3]]),
              "rank1-branch": ([w(g[1]), g[1]], [g[2], w(g[2])], [g[3]]),
              "stop-at-depth-2": ([g[1], w(g[1])], [w(g[2]), w(g[2], 2)], [g[3]])}[case]
    path = {"all": [0, 1, 3, 6], "none": [0], "rank1-branch": [0, 2, 5], "stop-at-depth-2": [0, 1]}[case]
    m = wrap(model, FixedHeads(V, [list(r) for r in ranked]))
    dec = TreeDecoder(m, TREE)
    assert dec.prefill(torch.tensor([PROMPT], device=DEV), max_new_tokens=12) == g[0]
    new, _ = dec.step()
    n = len(path)
    assert dec.last_path == path and new == g[1:1 + n]
    assert dec.cache.length == dec.past == len(PROMPT) + n
    for layer, (k, v) in zip(dec.cache.layers, _cuda_sequential_kv(m, PROMPT + g[:n])):
        assert layer.keys.device.type == DEV
        torch.testing.assert_close(layer.keys, k, atol=1e-5, rtol=0)
        torch.testing.assert_close(layer.values, v, atol=1e-5, rtol=0)
    assert dec.root == g[n] and dec.step()[0][0] == g[n + 1]  # decoding continues from the compacted cache


def test_cuda_decoding_attention_runs_without_cudnn(monkeypatch):
    """Guards against the decoding loop (plain, tree and batched) reaching torch's cuDNN SDPA backend on CUDA:
    it plans a graph per new key length, which made a batched step on an H200 3x slower (benchmarks/history.md
    "GPU check"). Every delegated attention call sees the flag off on CUDA; it is back on afterwards."""
    from inference.methods import generate_batch
    from inference.runtime import attention

    real = attention._sdpa_forward()
    seen = []

    def watch(*a, **kw):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return real(*a, **kw)

    monkeypatch.setattr(attention, "_sdpa_forward", lambda: watch)
    torch.backends.cuda.enable_cudnn_sdp(True)
    model = tiny_llama(vocab=96, seed=0).to(DEV, torch.bfloat16)
    m = wrap(model, random_heads(model, num_heads=3))
    generate(m, PROMPT, "autoregressive", max_new_tokens=4)
    generate(m, PROMPT, tree="tree8", max_new_tokens=4)
    generate_batch(m, [PROMPT, PROMPT[:3]], tree="tree8", max_new_tokens=4)
    assert seen and set(seen) == {DEV != "cuda"}
    assert torch.backends.cuda.cudnn_sdp_enabled()


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_cuda_folded_grouped_query_attention_equals_repeated(monkeypatch, dtype, tol):
    """Guards against the CUDA path that folds grouped-query heads into query rows (no repeat_kv copy) picking
    another kernel's wrong layout or a mask broadcast CUDA's kernels treat otherwise: a tree verification forward
    and greedy tree decoding with folding on equal them with it off (transformers' repeat), within the dtype."""
    from inference.runtime import attention

    model = tiny_llama(vocab=96, seed=0).to(DEV, dtype)
    m = wrap(model, random_heads(model, num_heads=3).to(DEV, dtype))
    outs, tokens = [], []
    for fold in (True, False):
        monkeypatch.setattr(attention, "FOLD_GROUPS", fold)
        buf = default_tree("tree16", 3).buffers(torch.device(DEV))
        cache = m.new_cache(len(PROMPT) + buf.num_nodes)
        with torch.inference_mode():
            m.hidden(torch.tensor([PROMPT], device=DEV), torch.arange(len(PROMPT), device=DEV)[None], cache)
            ids = torch.arange(buf.num_nodes, device=DEV)[None] % 96
            outs.append(m.hidden(ids, (buf.position_offsets + len(PROMPT))[None], cache,
                                 buf.additive_mask(len(PROMPT), m.dtype)).float())
        if dtype == torch.float32:
            tokens.append(generate(m, PROMPT, tree="tree16", max_new_tokens=24, eos_token_ids=()).tokens)
    torch.testing.assert_close(outs[0], outs[1], rtol=tol, atol=tol)
    assert tokens[:1] == tokens[1:]
