"""Medusa-2 (medusa_train/lora.py) against the reference trainer: FasterDecoding/Medusa's axolotl fork,
``src/axolotl/monkeypatch/medusa_utils.py`` (``replace_compute_loss``: logits[0] is the backbone's lm_head,
logits[i >= 1] head i; loss = loss_0 + sum_i loss_i * decay**i * heads_coefficient * scheduler)."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from inference.heads.medusa import MedusaHeads
from inference.heads.spec import HeadsSpec
from medusa_train import lora
from medusa_train import trainer as T
from medusa_train.losses import vocab_to_local

from runtime_support import tiny_llama

I = -100
RUN = ["trainer.save_every=0", "logger.plot=false"]


def test_stage_two_maps_targets_through_the_token_map_of_the_heads_it_loaded(compose_tiny, tmp_path):
    """Guards against stage 2 (``lora.init_heads``) of truncated heads computing its CE targets with the
    inverse of the token map *its own* data scan chose while the heads carry stage 1's map: the shipped pair
    (``medusa1_smollm2_distilled`` at max_length 1024, ``medusa2_smollm2`` at 512) scans different token counts
    (on ShareGPT 8,165 of the 8,192 ranks differ), so nearly every label was mapped to the local index of an
    unrelated token, which the export then decodes through stage 1's map."""
    T.run(compose_tiny(*RUN, "trainer.max_steps=1", "data.vocab_scan_conversations=3", out=tmp_path / "s1"))
    stage1 = tmp_path / "s1" / "heads"
    trainer = T.MedusaTrainer(compose_tiny(*RUN, "lora.enabled=true", "trainer.max_steps=1",
                                           f"lora.init_heads={stage1}", out=tmp_path / "s2"))
    trainer.setup()
    try:
        scanned = trainer._token_map(trainer.spec.vocab_size, trainer.spec.truncated_vocab_size)
        heads = trainer.module.heads
        assert not torch.equal(scanned, heads.token_map.cpu()), "the two scans must pick different maps here"
        want = vocab_to_local(heads.token_map, trainer.spec.vocab_size)
        assert torch.equal(trainer.module.inv_map.cpu(), want.cpu())
    finally:
        trainer.cleanup(plot=False)


def _joint(backbone_loss: str, decay: float = 0.8, coefficient: float = 0.2, heads_n: int = 3,
           checkpointing: bool = True, dropout: float = 0.0):
    model = tiny_llama(vocab=96, hidden=64, layers=2, seed=0)
    lcfg = types.SimpleNamespace(load_in_bits=0, r=4, alpha=8, dropout=dropout, target_modules=["q_proj", "v_proj"],
                                 backbone_loss=backbone_loss, backbone_weight=1.0, heads_coefficient=coefficient,
                                 heads_warmup_steps=0, gradient_checkpointing=checkpointing)
    peft_model = lora.apply_lora(model, lcfg)
    torch.manual_seed(1)
    with torch.no_grad():  # a non-trivial adapter: B starts at zero, so the tuned model would equal the base
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)
    spec = HeadsSpec(num_heads=heads_n, num_layers=1, hidden_size=64, vocab_size=96, projection="own")
    heads = MedusaHeads.from_lm_head(spec, model.lm_head.weight.detach().clone())
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    body = peft_model.get_base_model().model
    weights = [decay ** k for k in range(1, heads_n + 1)]
    joint = lora.JointWithLoss(peft_model, body, model.lm_head, heads, weights, None, lcfg)
    return joint, peft_model, model, heads


def _batch(t: int = 20):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 96, (2, t), generator=g)
    labels = ids.clone()
    labels[0, :6] = I    # a user turn: no labels
    labels[1, :3] = I
    labels[1, 11:14] = I
    doc = torch.ones_like(ids)
    pos = torch.arange(t).expand(2, t)
    mask = torch.ones_like(ids)
    return ids, pos, mask, labels, doc


@pytest.mark.parametrize("backbone_loss", ["ce", "kl"])
def test_gradient_checkpointing_changes_no_number(backbone_loss):
    """Guards against the recomputed backward (``lora.gradient_checkpointing``, on by default: every layer's
    activations kept for the backbone's gradients did not fit an 8B backbone at micro-batch 4) changing the loss or
    any gradient, LoRA dropout included (the recompute must replay the same dropout masks), or not being on."""
    runs = []
    for on in (False, True):
        torch.manual_seed(0)   # peft draws lora_A's initial values from the global generator
        joint, peft_model, model, heads = _joint(backbone_loss, checkpointing=on, dropout=0.1)
        assert model.model.gradient_checkpointing is on
        torch.manual_seed(3)
        loss = joint(*_batch())
        loss.backward()
        grads = {n: p.grad.clone() for n, p in [*peft_model.named_parameters(), *heads.named_parameters()]
                 if p.grad is not None}
        runs.append((loss.detach(), grads))
    (loss_off, off), (loss_on, on) = runs
    assert torch.equal(loss_off, loss_on) and off.keys() == on.keys() and any("lora_" in n for n in off)
    assert all(torch.equal(off[n], on[n]) for n in off)


def test_joint_loss_is_the_reference_compute_loss_on_unpacked_rows():
    """Guards against Medusa-2's combined loss drifting from the reference's ``compute_loss``: the backbone's
    own CE (logits[0][:, :-1] vs labels[:, 1:], weight 1), head i (1-based) on labels[:, 1+i:] from position t,
    weighted decay**i * heads_coefficient, each CE a mean over its non-ignored positions; and the heads' loss
    reaching the adapter (Medusa-2's point: the backbone learns to serve its heads)."""
    joint, peft_model, model, heads = _joint("ce")
    ids, pos, mask, labels, doc = _batch()
    got = joint(ids, pos, mask, labels, doc)

    hidden = peft_model.get_base_model().model(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state
    logits = [model.lm_head(hidden)] + [heads.head_logits(hidden, k) for k in range(3)]
    want = 0.0
    for i, lg in enumerate(logits):
        loss_i = F.cross_entropy(lg[:, :-(1 + i)].reshape(-1, 96), labels[:, 1 + i:].reshape(-1), ignore_index=I)
        want = want + (loss_i if i == 0 else loss_i * 0.8 ** i * 0.2)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)

    only_heads = lora.JointWithLoss(peft_model, joint.body, model.lm_head, heads, joint.weights, None,
                                    types.SimpleNamespace(**{**vars(joint.lcfg), "backbone_weight": 0.0}))
    only_heads(ids, pos, mask, labels, doc).backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in peft_model.named_parameters() if "lora_" in n)


def test_self_distillation_is_kl_from_the_adapter_free_model_over_the_labelled_positions():
    """Guards against the reference's self-distillation term (``medusa_self_distillation``) being computed
    against another teacher or in the other direction: KL(p_original || p_tuned) where p_original is the same
    model with the adapter disabled, at the positions whose next token is labelled. Deliberate difference, kept:
    the reference divides the summed KL by every position of the batch (``/ medusa_logits.shape[0]``, padding
    and user turns included); here it is the mean over the labelled positions, as its CE is."""
    joint, peft_model, model, heads = _joint("kl", coefficient=0.0)
    ids, pos, mask, labels, doc = _batch()
    got = joint(ids, pos, mask, labels, doc)

    body = peft_model.get_base_model().model
    with torch.no_grad():
        tuned = model.lm_head(body(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state)
        with peft_model.disable_adapter():
            original = model.lm_head(body(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state)
    keep = labels[:, 1:].reshape(-1) != I
    student = tuned[:, :-1].reshape(-1, 96)[keep]
    teacher = original[:, :-1].reshape(-1, 96)[keep]
    reference_sum = F.kl_div(F.log_softmax(student, -1), F.softmax(teacher, -1), reduction="sum")
    torch.testing.assert_close(got, reference_sum / int(keep.sum()), atol=1e-5, rtol=1e-5)
    assert float(got.detach()) > 0
