"""The trainer's one batch source (``medusa_train/sources.py``): chosen once from the config, and the
online and cached sources yield the same batches and the same loss on the tiny recipe."""

from __future__ import annotations

import pytest
import torch

from medusa_train import features
from medusa_train import trainer as T
from medusa_train.lora import JointSource
from medusa_train.sources import CachedSource, OnlineSource

RUN = ["trainer.max_steps=4", "trainer.log_every=1", "trainer.save_every=0", "logger.plot=false"]
CACHED = ["features.mode=train", "features.dtype=fp32", "features.shard_batches=3"]
LORA = ["lora.enabled=true", "lora.r=4", "lora.target_modules=[q_proj,v_proj]"]


def make_trainer(cfg) -> T.MedusaTrainer:
    trainer = T.MedusaTrainer(cfg)
    trainer.setup()
    return trainer


@pytest.mark.parametrize("extra, kind", [([], OnlineSource), (CACHED, CachedSource), (LORA, JointSource)],
                         ids=["online", "cached", "joint-lora"])
def test_the_config_chooses_one_source(extra, kind, compose_tiny):
    """Guards against: a recipe trained from the wrong place (a cached run still forwarding the backbone, a
    Medusa-2 run training frozen features), and a source that cannot resume: ``batches(**state)`` must
    continue exactly where the saved position was."""
    trainer = make_trainer(compose_tiny(*RUN, *extra))
    assert type(trainer.source) is kind and trainer.module is trainer.source.module
    it = iter(trainer.batches)
    for _ in range(3):
        next(it)
    resumed = iter(trainer.source.batches(**trainer.batches.state()))
    for _ in range(3):
        a, b = next(it), next(resumed)
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])
    assert trainer.eval_set and all("input_ids" in b for b in trainer.eval_set)
    trainer.cleanup(plot=False)


@pytest.mark.parametrize("targets", ["data", "backbone"])
def test_online_and_fp32_cached_sources_give_the_same_batches_and_loss(targets, compose_tiny, tmp_path):
    """Guards against: the cached source reading other batches than the online stream yields (order,
    packing, labels), storing hidden states or greedy ids other than the online source computes, or
    computing its loss another way (train and eval batches): with an fp32 cache each loss is bit-identical."""
    online = make_trainer(compose_tiny(*RUN, f"heads.targets={targets}", out=tmp_path / "online"))
    cfg = compose_tiny(*RUN, *CACHED, f"heads.targets={targets}", out=tmp_path / "cached")
    features.run_build(cfg)
    cached = make_trainer(cfg)
    a, b = iter(online.batches), iter(cached.batches)
    pairs = [(next(a), next(b)) for _ in range(4)] + list(zip(online.eval_set, cached.eval_set))
    assert len(online.eval_set) == len(cached.eval_set)
    with torch.no_grad():
        for x, y in pairs:
            for key in features.KEYS:
                assert torch.equal(x[key], y[key]), key
            assert float(online.loss(x)) == float(cached.loss(y))
    online.cleanup(plot=False)
    cached.cleanup(plot=False)
