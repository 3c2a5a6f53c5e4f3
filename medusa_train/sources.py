"""Where a training step's batches and loss come from: one ``BatchSource``, chosen once at setup.

The trainer's loop (forward, backward, step, log, eval, checkpoint) is the same for every way of
feeding the heads; what differs is where the micro-batches come from and how the loss is computed:

- ``OnlineSource``: the frozen backbone runs on every micro-batch (``backbone_inputs.FrozenFeatures``), the
  heads learn from the tensors their family declares (``inference.heads.inputs``; ``features.mode=off``).
- ``CachedSource``: the same hidden states (and greedy ids) read from the feature cache
  (``features.mode=train``, ``features.py``); the backbone never runs on a batch. With an fp32
  cache its losses equal the online source's bit for bit.
- ``lora.JointSource``: Medusa-2, the backbone trains through a LoRA adapter jointly with the heads.

Each source wraps the heads in the module DeepSpeed trains (``wrap``), names its parameter groups,
yields resumable training batches (``batches(epoch, index)``, whose ``state()`` a checkpoint
saves), the held-out batches, and the loss of one batch. Choosing once keeps ``if lora`` / ``if
cached`` checks out of the trainer.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Optional, Protocol

import torch
from torch import nn

from inference.backbone import lm_head_weight, logit_scaling
from inference.heads.inputs import BackboneInputs
from inference.heads.registry import family

from . import features
from .backbone_inputs import FrozenFeatures
from .families import backbone_layers
from .data.readers import ReadStats
from .data.stream import RankData, StreamStats
from .lora import JointSource
from .losses import HeadMetrics, backbone_labels, heads_loss


class BatchSource(Protocol):
    module: nn.Module  # what the DeepSpeed engine wraps (set by ``wrap``)
    stats: StreamStats  # tokens / padding of the training batches, for the logs
    read_stats: ReadStats

    def wrap(self, heads, spec, weights: list[float], inv_map) -> nn.Module: ...

    def param_groups(self, lr: float) -> list: ...

    def describe(self) -> str: ...  # what happens to the backbone, for the start-up line

    def batches(self, epoch: int = 0, index: int = 0) -> Iterable[dict]: ...  # infinite, with .state()

    def eval_batches(self) -> list[dict]: ...

    def data_counts(self) -> tuple[ReadStats, StreamStats]: ...  # collective; the run's data, all ranks together

    def loss(self, engine, batch: dict, step: int) -> torch.Tensor: ...

    def export_extra(self, engine) -> Optional[Callable]: ...  # collective; a writer for save_heads' ``extra``

    # Every rank, after the heads are saved (collective under ZeRO-3: Medusa-2's drift forwards and merge gather
    # partitioned parameters); files and messages from the ``write`` rank only.
    def after_export(self, output_dir, write: bool = True) -> None: ...


class HeadsWithLoss(nn.Module):
    """What the DeepSpeed engine wraps for frozen features: the heads, and their loss as ``forward``."""

    def __init__(self, heads, weights: list[float], inv_map, teacher_weight: float = 0.0,
                 lm_head_weight: Optional[torch.Tensor] = None, feature_noise: float = 0.0,
                 logit_scaling: tuple = (None, None)):
        super().__init__()
        self.feature_noise = feature_noise
        self.logit_scaling = logit_scaling  # the backbone's own, for the teacher term's distribution
        self.heads = heads
        self.weights = weights
        self.inv_map = inv_map
        self.teacher_weight = teacher_weight
        # A plain attribute, not a parameter or buffer: the frozen backbone's matrix is never
        # trained, cast, partitioned or checkpointed by DeepSpeed.
        self.lm_head_weight = lm_head_weight if teacher_weight > 0 else None
        self.metrics: Optional[HeadMetrics] = None
        self.last_parts: dict[str, float] = {}

    def forward(self, hidden, labels, doc_ids, input_ids=None, aux=None, position_ids=None):
        return heads_loss(self.heads, hidden, labels, doc_ids, self.weights, self.inv_map, self.metrics,
                          input_ids=input_ids, teacher_weight=self.teacher_weight,
                          lm_head_weight=self.lm_head_weight, aux=aux, position_ids=position_ids,
                          feature_noise=self.feature_noise, logit_scaling=self.logit_scaling)


class _FrozenHeads:
    """Shared by the online and cached sources: heads on frozen features; ``features(batch)`` differs."""

    def __init__(self, cfg, backbone, device: torch.device):
        self.cfg, self.backbone, self.device = cfg, backbone, device
        self.backbone_targets = cfg.heads.targets == "backbone"  # losses.backbone_labels
        self.everywhere = cfg.heads.train_on == "all"  # greedy labels on the user's turns too
        self.inputs = BackboneInputs()  # what the heads' family declares it trains on (set by ``wrap``)
        self.aux_layers: Optional[list[int]] = None  # the layers besides the last it reads, if any

    def wrap(self, heads, spec, weights, inv_map) -> nn.Module:
        self.inputs = family(spec.kind).inputs
        self.aux_layers = list(self.inputs.layers(spec.settings)) or None
        model = self.backbone.model
        self.module = HeadsWithLoss(heads, weights, inv_map, self.cfg.heads.teacher_weight, lm_head_weight(model),
                                    self.cfg.heads.feature_noise, logit_scaling(model))
        return self.module

    def param_groups(self, lr: float) -> list:
        return [p for p in self.module.parameters() if p.requires_grad]

    def describe(self) -> str:
        return "frozen"

    def features(self, batch: dict) -> dict:
        """``hidden``, ``greedy`` (with backbone targets) and ``aux`` (heads that read aux layers)."""
        raise NotImplementedError

    def loss(self, engine, batch: dict, step: int) -> torch.Tensor:
        dev = self.device
        ids, labels, doc = batch["input_ids"].to(dev), batch["labels"].to(dev), batch["doc_ids"].to(dev)
        f = self.features(batch)
        if self.backbone_targets:
            # Held-out batches (engine in eval mode) keep the replies' positions: the same measure whatever train_on.
            labels = backbone_labels(labels, doc, f["greedy"].to(dev), self.everywhere and self.module.training)
        if not (self.inputs.aux_layers or self.inputs.positions):
            return engine(f["hidden"], labels, doc, ids)
        # What the family declares beyond the last hidden state and the tokens (positional: the engine's forward).
        aux = f["aux"] if self.inputs.aux_layers else None
        positions = batch["position_ids"].to(dev) if self.inputs.positions else None
        return engine(f["hidden"], labels, doc, ids, aux, positions)

    def export_extra(self, engine) -> Optional[Callable]:
        return None

    def after_export(self, output_dir, write: bool = True) -> None:
        return None


class OnlineSource(_FrozenHeads):
    """The backbone runs under ``no_grad`` on each micro-batch of this rank's stream."""

    def __init__(self, cfg, backbone, device, data: RankData, compute_dtype: torch.dtype):
        super().__init__(cfg, backbone, device)
        self.data = data
        self.stats, self.read_stats = data.stats, data.read_stats
        self.frozen = FrozenFeatures(backbone.model, cfg.data.packing, compute_dtype, device)

    def batches(self, epoch: int = 0, index: int = 0):
        return self.data.batches(epoch, index)

    def eval_batches(self) -> list[dict]:
        return self.data.eval_batches()

    def data_counts(self) -> tuple[ReadStats, StreamStats]:
        return self.data.run_counts()

    def features(self, batch: dict) -> dict:
        # Held-out batches read the replies' greedy ids only (``loss``): the lm_head runs on no other position.
        return self.frozen.features(batch, greedy=self.backbone_targets, aux_layers=self.aux_layers,
                                    greedy_everywhere=self.everywhere and self.module.training)


class CachedSource(_FrozenHeads):
    """Batches (with hidden states and greedy ids) from the feature cache, built first where missing."""

    def __init__(self, cfg, backbone, device, data: RankData, compute_dtype: torch.dtype, plan: features.CachePlan):
        super().__init__(cfg, backbone, device)
        plan = dataclasses.replace(plan, aux_layers=backbone_layers(cfg.heads, backbone.model.config))
        self.compute_dtype, self.plan = compute_dtype, plan
        frozen = FrozenFeatures(backbone.model, cfg.data.packing, compute_dtype, device)  # building only
        self.cache, self.manifest = features.open_cache(cfg, backbone, frozen, plan, data.eval_batches)
        self.stats, self.read_stats = features.stream_stats(self.manifest)
        # The cache is built: the body's weights are dead for the rest of the run, on every rank (~13 GiB of
        # Llama-3.1-8B in bf16), freed before the heads are built (what the memory check counts). The heads read
        # the embeddings and lm_head only, which stay.
        backbone.release_body()

    def batches(self, epoch: int = 0, index: int = 0):
        return features.CachedBatches(self.cache, self.manifest, self.plan.rank, self.plan.world_size,
                                      self.cfg.trainer.seed, self.device, self.compute_dtype, self.stats,
                                      epoch, index)

    def eval_batches(self) -> list[dict]:
        # kept in host memory and moved one batch at a time (``features``): on the GPU for the whole run they
        # held ~1-4 GiB at Llama-3.1-8B's width (EAGLE-3's three layers the most), uncounted by the memory check
        return self.cache.eval_batches(torch.device("cpu"), self.compute_dtype)

    def data_counts(self) -> tuple[ReadStats, StreamStats]:
        return self.read_stats, self.stats   # what the build counted, in the cache's manifest

    def describe(self) -> str:
        return f"frozen; its body's {self.backbone.released / 2**30:.2f} GiB freed: the feature cache feeds the heads"

    def features(self, batch: dict) -> dict:
        return {**batch, **{k: batch[k].to(self.device) for k in ("hidden", "aux") if k in batch}}


def make_source(cfg, backbone, device, data: RankData, compute_dtype: torch.dtype, plan: features.CachePlan):
    """The one batch source this recipe trains from (``lora.enabled`` / ``features.mode``)."""
    if cfg.lora.enabled:
        return JointSource(cfg, backbone, device, data)
    if features.enabled(cfg):
        return CachedSource(cfg, backbone, device, data, compute_dtype, plan)
    return OnlineSource(cfg, backbone, device, data, compute_dtype)
