"""Heads training under DeepSpeed on one CUDA GPU (skipped without one): ZeRO 0 (fp32), ZeRO 1 and 2 (bf16).

bf16 needs ZeRO >= 1 (config.validate: the ZeRO optimizer keeps the fp32 master weights), so ZeRO 0 runs fp32."""

import math

import pytest
import torch

from conftest import GPU_TIER_DEVICE as DEV
from medusa_train import trainer as T

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("zero, precision", [(0, "fp32"), (1, "bf16"), (2, "bf16")])
def test_heads_train_on_cuda(zero, precision, compose_tiny):
    """Guards against CPU-only assumptions in the training path on CUDA (batches, masks, heads, the
    frozen backbone on another device than the engine's) and against ZeRO-2's bf16 optimizer not
    updating the heads: the loss falls on a repeated batch, the backbone stays bit-identical."""
    tr = T.MedusaTrainer(compose_tiny(f"trainer.device={DEV}", f"trainer.precision={precision}",
                                      f"trainer.zero_stage={zero}",
                                      "heads.projection=shared", "trainer.max_steps=3", "trainer.save_every=0",
                                      "trainer.threads=0", "logger.plot=false"))
    tr.setup()
    assert tr.device.type == DEV
    model = tr.backbone.model
    assert next(model.parameters()).device.type == DEV
    assert all(p.device.type == DEV for p in tr.module.heads.parameters())
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    batch = next(iter(tr.batches))
    dev = tr.device
    losses = []
    for _ in range(6):  # the same batch again and again
        hidden = tr.source.frozen.hidden_states(batch)
        assert hidden.device.type == DEV and hidden.dtype == (torch.bfloat16 if precision == "bf16" else torch.float32)
        loss = tr.engine(hidden, batch["labels"].to(dev), batch["doc_ids"].to(dev))
        tr.engine.backward(loss)
        tr.engine.step()
        losses.append(float(loss.detach()))
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.05, losses
    tr.train()  # and the trainer's own loop (logging, eval)
    assert tr.step == 3
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), f"backbone {k} changed"
    tr.cleanup(plot=False)
