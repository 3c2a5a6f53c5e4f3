"""Hydra heads and their loss against zankner/Hydra: ``hydra/model/hydra_heads/mlp_head.py`` (``HydraMLP.forward``:
head i reads cat([h_t, roll(e, -1), ..., roll(e, -(i+1))]), the backbone's own input embeddings) and
``hydra/train/train.py`` (``_score_preds``: head i at t scored on labels[t+2+i], the teacher term a soft-target CE
against softmax(orig_logits[t+1+i]) at the non-ignored positions, ``lm_loss_weight`` / ``teacher_loss_weight``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from inference.heads.registry import init_heads
from inference.heads.spec import HeadsSpec
from medusa_train.losses import future_tokens, heads_loss

from runtime_support import tiny_llama

I = -100
V, H, K = 96, 64, 3


@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab=V, hidden=H, layers=2, seed=0)


def _hydra(model):
    spec = HeadsSpec(num_heads=K, num_layers=1, hidden_size=H, vocab_size=V, projection="own", kind="hydra")
    heads = init_heads(spec, model.lm_head.weight, model.get_input_embeddings().weight, None)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return heads


def _reference_features(heads, model, hidden, ids):
    """``HydraMLP.forward``'s inputs: the embeddings rolled back i+1 places for head i, concatenated after h_t."""
    emb = model.get_input_embeddings()(ids)
    inputs = [hidden] + [torch.roll(emb, shifts=-(i + 1), dims=1) for i in range(K)]
    return [heads.blocks[i](heads.inputs[i](torch.cat(inputs[:i + 2], dim=-1))) for i in range(K)]


@pytest.mark.parametrize("w", [0.0, 0.5, 1.0])
def test_hydra_loss_is_the_reference_lm_and_teacher_loss(model, w):
    """Guards against a Hydra head fed other path tokens than the reference's (head i: x_{t+1..t+i+1}), scored
    against another label (x_{t+i+2}) or another teacher position (the backbone's distribution at t+i+1, the one
    that guesses the same token), or a teacher term taken over other positions than the labelled ones; ``w`` is
    Hydra++'s teacher_loss_weight with lm_loss_weight = 1 - w (Hydra++ trains w = 1). The heads' own per-head
    weights are the reference's (1 each) here; this project's default decays them (heads.loss_decay)."""
    heads = _hydra(model)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, V, (2, 18), generator=g)
    labels = ids.clone()
    labels[0, :5] = I
    labels[1, 7:10] = I
    doc = torch.ones_like(ids)
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state
    got = heads_loss(heads, hidden, labels, doc, [1.0] * K, None, input_ids=ids, teacher_weight=w,
                     lm_head_weight=model.lm_head.weight)

    ours = heads.teacher_forced_features(hidden, future_tokens(ids, K))
    ref = _reference_features(heads, model, hidden, ids)
    teacher_probs = F.softmax(model.lm_head(hidden), dim=-1)
    want = 0.0
    for i in range(K):
        shift = 2 + i
        torch.testing.assert_close(ours[i][:, :-shift], ref[i][:, :-shift])  # the roll wraps at the end only
        logits = heads.project(ref[i], i)[:, :-shift].reshape(-1, V)
        tgt = labels[:, shift:].reshape(-1)
        teacher = teacher_probs[:, shift - 1:-1].reshape(-1, V)
        keep = tgt != I
        lm = F.cross_entropy(logits, tgt, ignore_index=I)
        soft = F.cross_entropy(logits[keep], teacher[keep])
        want = want + (1 - w) * lm + w * soft
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
