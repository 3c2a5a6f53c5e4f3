"""vLLM's mlp_speculator in training: its three keys (vLLM's config keys) and their checks."""

from __future__ import annotations

from dataclasses import dataclass

from inference.backbone import text_config
from inference.errors import UserError
from inference.heads.mlp_speculator import MLPSpeculatorSettings

from . import HeadsConfig, TrainingFamily, register_training_family


@dataclass
class MLPSpeculatorHeadsConfig(HeadsConfig):
    kind: str = "mlp_speculator"
    inner_dim: int = 0  # state width of every step (0 = the backbone's hidden size)
    tie_weights: bool = False  # one emb/ln/head and one proj after the first for every step >= 2
    scale_input: bool = False  # RMS-normalise the backbone state first (vLLM's ln0)


class MLPSpeculatorTraining(TrainingFamily):
    config = MLPSpeculatorHeadsConfig

    def validate(self, cfg) -> None:
        h = cfg.heads
        if h.inner_dim < 0:
            raise UserError(f"heads.inner_dim must be >= 0 (0 = backbone width), got {h.inner_dim}")
        if h.num_layers not in (0, 1):   # was accepted and ignored: the run trained what num_layers=1 trains
            raise UserError(f"heads.kind=mlp_speculator has no residual layers to stack (each step is one projection, "
                            f"embedding and norm): heads.num_layers must be 1 (or 0, the same), got {h.num_layers}")
        if h.tie_weights and h.num_heads < 2:
            raise UserError("heads.tie_weights needs heads.num_heads >= 2 (one set of step weights shared by "
                            "the steps after the first)")

    def size_keys(self, h) -> tuple[str, ...]:
        return ("heads.num_heads", "heads.inner_dim", *self.vocabulary_keys(h))

    def spec_settings(self, h, hf_config) -> MLPSpeculatorSettings:
        return MLPSpeculatorSettings(inner_dim=int(h.inner_dim) or None, tie_weights=bool(h.tie_weights),
                                     scale_input=bool(h.scale_input))

    def resolved(self, h, hf_config) -> dict:
        # num_layers is no setting here (nothing stacks): a run recorded with another value (accepted before it was
        # refused) resumes under the command that says 1
        return {"heads.inner_dim": h.inner_dim or text_config(hf_config).hidden_size, "heads.num_layers": 1}


register_training_family(MLPSpeculatorTraining("mlp_speculator"))
