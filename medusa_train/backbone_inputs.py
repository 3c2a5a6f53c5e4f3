"""Run the frozen backbone for what the heads train on: the tensors their family declares
(``inference.heads.inputs.BackboneInputs``) plus what the run's loss options read.

``FrozenFeatures`` is used by the online batch source on every micro-batch and by the feature-cache builder
once per batch, so both store/feed exactly the same tensors (the online == cached(fp32) guarantee). Only the
backbone's body runs (the heads need its hidden states, not its own logits), which skips the 49k-vocabulary
lm_head product on every token; the lm_head runs only where greedy targets need the backbone's argmax.
"""

from __future__ import annotations

import torch

from inference.backbone import HiddenStateTap, backbone_logits, decoder_body

from .data.masks import attention_mask
from .data.tokenize import IGNORE
from .losses import greedy_positions

GREEDY_CHUNK = 1024  # rows per backbone lm_head product for greedy targets: bounds the [rows, vocab] logits


class FrozenFeatures:
    """What the frozen backbone gives the heads: last hidden states, the layers their family declares it reads
    (``aux``) and, for ``heads.targets=backbone``, its greedy tokens. Used by the online batch source on every micro-batch and by the feature-cache builder
    once per batch, so both store/feed exactly the same tensors (the online == cached(fp32) guarantee)."""

    def __init__(self, model, packed: bool, compute_dtype: torch.dtype, device: torch.device):
        self.model, self.packed = model, packed
        self.compute_dtype, self.device = compute_dtype, device
        self.body = decoder_body(model)

    @torch.no_grad()
    def backbone_hidden(self, batch: dict, aux_layers=None):
        """The backbone's last hidden states in its own dtype (before the cast to the heads' precision);
        with ``aux_layers`` also (hidden, aux): those layers' hidden states concatenated [B, T, len x H]."""
        dev = self.device
        ids, pos, doc = batch["input_ids"].to(dev), batch["position_ids"].to(dev), batch["doc_ids"].to(dev)
        mask = attention_mask(doc, self.packed, self.model.dtype)
        if not aux_layers:
            return self.body(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).last_hidden_state
        with HiddenStateTap(self.model, aux_layers) as tap:
            last = self.body(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).last_hidden_state
        return last, tap.features()

    def hidden_states(self, batch: dict) -> torch.Tensor:
        """What the heads are fed: the last hidden states in the training precision."""
        return self.backbone_hidden(batch).to(self.compute_dtype)

    @torch.no_grad()
    def greedy_ids(self, hidden: torch.Tensor, labels: torch.Tensor, doc_ids: torch.Tensor,
                   everywhere: bool = False) -> torch.Tensor:
        """[B, T] the backbone's argmax over its full vocabulary where ``losses.backbone_labels`` reads it,
        IGNORE elsewhere. ``hidden`` comes from ``backbone_hidden`` (backbone dtype, not the heads'
        rounding); the lm_head runs on ``GREEDY_CHUNK`` rows at a time so a 49k vocabulary stays small.
        ``everywhere``: at every in-document position (``heads.train_on=all``), not only the replies'."""
        need = greedy_positions(labels.to(hidden.device), doc_ids.to(hidden.device), everywhere)
        out = torch.full(need.shape, IGNORE, dtype=torch.long, device=hidden.device)
        rows = hidden[need]
        if rows.shape[0]:
            out[need] = torch.cat([backbone_logits(self.model, rows[s:s + GREEDY_CHUNK]).argmax(-1)
                                   for s in range(0, rows.shape[0], GREEDY_CHUNK)])
        return out

    def features(self, batch: dict, greedy: bool = True, aux_layers=None, greedy_everywhere: bool = False) -> dict:
        """``hidden`` (training precision), with ``greedy`` the ``greedy`` ids (at every in-document position
        with ``greedy_everywhere``) and with ``aux_layers`` (the layers the heads' family declares, by id) the
        ``aux`` features (training precision): one backbone forward for all."""
        out = {}
        raw = self.backbone_hidden(batch, aux_layers)
        if aux_layers:
            raw, aux = raw
            out["aux"] = aux.to(self.compute_dtype)
        out["hidden"] = raw.to(self.compute_dtype)
        if greedy:
            out["greedy"] = self.greedy_ids(raw, batch["labels"], batch["doc_ids"], greedy_everywhere)
        return out


