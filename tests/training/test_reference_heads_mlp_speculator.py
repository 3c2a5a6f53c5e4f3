"""The MLP speculator in training against IBM's trainer: fms-extras ``fms_extras/models/speculator.py``
(``MLPSpeculator.forward``, the teacher-forced pass: head i at t reads ``inds[:, t+i]`` with ``inds = input[:, 1:]``;
weight tying: one emb/ln/head for every head, proj[i >= 2] = proj[1]) and fms-fsdp
``speculator/train_speculator_utils.py`` (``stage1_loss``: head i's target ``input[:, i+2:]``)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from inference.heads.registry import init_heads
from inference.heads.spec import HeadsSpec
from medusa_train.losses import future_tokens, head_targets

V, H, K, T = 96, 64, 3, 16


def _speculator(tied: bool, scale_input: bool, inner: int | None):
    spec = HeadsSpec(num_heads=K, num_layers=0, hidden_size=H, vocab_size=V, projection="own", kind="mlp_speculator",
                     tie_weights=tied, scale_input=scale_input, inner_dim=inner)
    g = torch.Generator().manual_seed(7)
    heads = init_heads(spec, torch.randn(V, H, generator=g), torch.randn(V, H, generator=g), None)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return heads


def _fms_forward(sd, state, inds, tied: bool, scale_input: bool, inner: int):
    """fms-extras ``MLPSpeculator.forward`` over this state dict (the tied modules resolved as fms ties them)."""
    def rms(x, w=None, b=None):
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)   # LayerNormParameterized, use_mean=False
        return x if w is None else w * x + b

    state_weight = 0.5 ** (0.5 / K)
    emb_weight = math.sqrt((1 - state_weight ** 2) * (inner / 2))
    if scale_input:
        state = rms(state) / 2 ** 0.5
    out = []
    for i in range(K):
        e, p, h = (0, min(i, 1), 0) if tied else (i, i, i)
        z = F.embedding(inds[:, i:i + state.size(1)], sd[f"emb.{e}.weight"])
        state = state @ sd[f"proj.{p}.weight"].T
        state = state + z * (emb_weight / state_weight)
        state = F.gelu(rms(state, sd[f"ln.{e}.weight"], sd[f"ln.{e}.bias"]))
        out.append(state @ sd[f"head.{h}.weight"].T)
    return out


@pytest.mark.parametrize("tied, scale_input, inner", [(False, False, None), (True, True, None), (False, True, 48)])
def test_teacher_forced_heads_and_targets_are_ibms_stage_one(tied, scale_input, inner):
    """Guards against the speculator trained on other inputs or targets than IBM's: head i (0-based) at t fed the
    true token x_{t+1+i} after the state of head i-1, scored on x_{t+i+2}; against the tying or the input
    scaling of fms-extras differing from ours (vLLM loads both the same way)."""
    heads = _speculator(tied, scale_input, inner)
    g = torch.Generator().manual_seed(8)
    ids = torch.randint(0, V, (2, T), generator=g)
    n = T - K - 1                                   # stage1_loss: embeds of the first T - n_predict - 1 positions
    hidden = torch.randn(2, T, H, generator=g)
    ref = _fms_forward(heads.state_dict(), hidden[:, :n], ids[:, 1:], tied, scale_input, inner or H)
    feats = heads.teacher_forced_features(hidden, future_tokens(ids, K))
    doc = torch.ones_like(ids)
    for i in range(K):
        torch.testing.assert_close(heads.project(feats[i], i)[:, :n], ref[i], atol=1e-5, rtol=1e-5)
        assert torch.equal(head_targets(ids, doc, i + 1)[:, :n], ids[:, i + 2:n + i + 2])
