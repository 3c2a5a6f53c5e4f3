"""Losses that read the backbone's distribution through its lm_head (the heads' teacher term, Medusa-2's backbone
CE / KL) use the distribution the backbone samples from: after its own logit scale / final soft-cap (Cohere's
``logit_scale``, Gemma-2's ``final_logit_softcapping``), as verification and the greedy targets do."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from medusa_train import trainer as T
from medusa_train.data.masks import attention_mask
from medusa_train.data.tokenize import IGNORE
from medusa_train.losses import head_targets

# A random Cohere backbone (Command-R: logits = lm_head(h) x logit_scale = 0.0625), with weights large enough that
# the scale changes the distribution a lot.
COHERE = ["backbone.random_init.model_type=cohere", "+backbone.random_init.logit_scale=0.0625",
          "+backbone.random_init.initializer_range=0.5", "trainer.save_every=0", "logger.plot=false"]


def setup(cfg) -> T.MedusaTrainer:
    trainer = T.MedusaTrainer(cfg)
    trainer.setup()
    return trainer


def capped_logits(model, batch, packed: bool) -> torch.Tensor:
    """The backbone's own logits (its forward applies its logit scale), [B, T, V] in fp32."""
    mask = attention_mask(batch["doc_ids"], packed, model.dtype)
    with torch.no_grad():
        out = model(input_ids=batch["input_ids"], attention_mask=mask, position_ids=batch["position_ids"])
    return out.logits.float()


def test_teacher_term_reads_the_backbones_scaled_distribution(compose_tiny):
    """Guards against: the teacher term (heads.teacher_weight) softmaxing the raw lm_head product while the
    backbone samples from scaled / soft-capped logits, so the heads learn a far sharper distribution than the one
    verification draws from (a silently wrong target on Cohere and Gemma-2 backbones)."""
    trainer = setup(compose_tiny(*COHERE, "heads.teacher_weight=1.0", "heads.num_heads=2", "heads.projection=own",
                                 "trainer.max_steps=1"))
    model, heads = trainer.backbone.model, trainer.module.heads
    batch = next(iter(trainer.batches))
    logits = capped_logits(model, batch, trainer.cfg.data.packing)
    raw = model.get_output_embeddings()(trainer.source.frozen.backbone_hidden(batch)).float()
    assert torch.allclose(logits, raw * 0.0625, atol=1e-4) and raw.std() > 1  # the scale reshapes the softmax
    got = trainer.loss(batch)
    hidden = trainer.source.features(batch)["hidden"]
    want = 0.0
    for k, w in enumerate(trainer.module.weights):
        tgt = head_targets(batch["labels"], batch["doc_ids"], k + 1)
        rows, cols = (tgt != IGNORE).nonzero(as_tuple=True)
        teacher = torch.softmax(logits[rows, cols + k + 1], dim=-1)   # the distribution of x_{t+k+2}
        logp = torch.log_softmax(heads.project(heads.head_hidden(hidden[rows, cols], k), k).float(), dim=-1)
        want = want + w * -(teacher * logp).sum(-1).mean()
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), (float(got), float(want))


def test_medusa2_backbone_loss_is_on_the_tuned_models_own_logits(compose_tiny):
    """Guards against: Medusa-2's backbone loss (lora.backbone_loss=ce) computed on the raw lm_head product of a
    backbone that scales (or soft-caps) its logits, so the adapter is fitted to logits the merged model never
    samples from."""
    trainer = setup(compose_tiny(*COHERE, "lora.enabled=true", "lora.backbone_loss=ce", "lora.heads_warmup_steps=0",
                                 "lora.heads_coefficient=0.0", "trainer.max_steps=1"))
    batch = next(iter(trainer.batches))
    logits = capped_logits(trainer.source.peft_model, batch, trainer.cfg.data.packing)
    got = trainer.loss(batch)
    nxt = torch.full_like(batch["labels"], IGNORE)
    nxt[:, :-1] = batch["labels"][:, 1:]
    same = torch.zeros_like(nxt, dtype=torch.bool)
    same[:, :-1] = (batch["doc_ids"][:, :-1] == batch["doc_ids"][:, 1:]) & (batch["doc_ids"][:, :-1] > 0)
    where = (nxt != IGNORE) & same
    want = trainer.cfg.lora.backbone_weight * F.cross_entropy(logits[where], nxt[where])
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), (float(got), float(want))
