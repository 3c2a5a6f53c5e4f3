"""Tree decoding on CUDA (skipped without a GPU): devices, half precision, CUDA generators."""

import pytest
import torch

from inference.methods import generate
from inference.runtime.verify import SamplingConfig

from runtime_support import random_heads, tiny_llama, wrap

pytestmark = pytest.mark.gpu
PROMPT = [5, 17, 3, 88, 41, 9]


def test_cuda_fp32_greedy_is_lossless():
    """Guards against CPU-only assumptions (host tensors in masks, indices or the cache) on CUDA."""
    model = tiny_llama(vocab=96, seed=0).to("cuda")
    m = wrap(model, random_heads(model, num_heads=4))
    ref = generate(m, PROMPT, "autoregressive", max_new_tokens=40).tokens
    for tree in ("tree8", "mc_sim_7b_63"):
        assert generate(m, PROMPT, tree=tree, max_new_tokens=40).tokens == ref


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_half_precision_runs_every_mode(dtype):
    """Guards against dtype mismatches (mask, heads, draft q) in half precision on CUDA."""
    model = tiny_llama(vocab=96, seed=0).to("cuda", dtype)
    m = wrap(model, random_heads(model, num_heads=3))
    for cfg in (SamplingConfig(), SamplingConfig(mode="typical", temperature=0.7),
                SamplingConfig(mode="sample", temperature=0.7, top_p=0.9),
                SamplingConfig(mode="sample", temperature=0.7, draft="sampled")):
        a = generate(m, PROMPT, tree="tree16", max_new_tokens=16, sampling=cfg, seed=3)
        b = generate(m, PROMPT, tree="tree16", max_new_tokens=16, sampling=cfg, seed=3)
        assert a.tokens == b.tokens and len(a.tokens) == 16
