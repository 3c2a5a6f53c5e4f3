"""Medusa heads in training: no keys of their own; one combination that would train nothing."""

from __future__ import annotations

from inference.cli_support import enum_value
from inference.errors import UserError

from . import TrainingFamily, register_training_family


class MedusaTraining(TrainingFamily):
    def validate(self, cfg) -> None:
        h = cfg.heads
        # A Medusa head is its residual blocks and its projection: sharing the backbone's lm_head leaves the
        # blocks as the only weights, and with none of them nothing trains (other families keep input layers).
        if enum_value(h.projection) == "shared" and h.num_layers == 0:
            raise UserError("heads.projection=shared with heads.num_layers=0 leaves nothing to train; use "
                            "num_layers >= 1")


register_training_family(MedusaTraining("medusa"))
