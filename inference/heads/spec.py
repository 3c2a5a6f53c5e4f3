"""``HeadsSpec``: everything needed to rebuild heads and to check they fit a backbone.

It is what the native export's ``config.json`` holds (field for field, ``dataclasses.asdict``),
and what every foreign importer produces, so its keys are part of the on-disk format: the
mlp_speculator fields stay flat here (``inner_dim``, ``tie_weights``, ``scale_input``) for every
kind, and existing exports must keep loading. Kind-specific checks are the family's own
(``registry.HeadFamily.validate``); this module stays free of torch.

``backbone_fingerprint`` / ``check_compatible`` refuse heads made for another backbone (hidden
size, vocabulary, architecture fields) before any weight is attached.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Optional

from ..errors import IncompatibleHeadsError, UserError
from .registry import family

FORMAT_VERSION = 1
PROJECTIONS = ("own", "shared", "truncated")

# Architecture fields that decide whether heads fit a backbone. Weights may differ (a
# fine-tune of the same base keeps the fingerprint); shapes and numerics may not.
_FINGERPRINT_KEYS = (
    "model_type", "hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "intermediate_size", "rope_theta", "max_position_embeddings",
    "tie_word_embeddings", "rms_norm_eps", "layer_norm_epsilon",
)


def backbone_fingerprint(config) -> str:
    """A short stable hash of a transformers config's architecture fields."""
    cfg = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    picked = {k: cfg.get(k) for k in _FINGERPRINT_KEYS if cfg.get(k) is not None}
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if isinstance(rope, dict):  # transformers 5 keeps rope_theta (and scaling) in rope_parameters
        for k in ("rope_theta", "rope_type", "factor"):
            if rope.get(k) is not None:
                picked[k] = rope[k]
    blob = json.dumps(picked, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


@dataclasses.dataclass
class HeadsSpec:
    """Everything needed to rebuild heads and check they fit a backbone (config.json)."""

    num_heads: int
    num_layers: int
    hidden_size: int
    vocab_size: int
    projection: str = "own"
    truncated_vocab_size: Optional[int] = None
    base_model: str = ""
    base_model_fingerprint: str = ""
    kind: str = "medusa"
    inner_dim: Optional[int] = None   # mlp_speculator: state width (None = hidden_size)
    tie_weights: bool = False         # mlp_speculator: one emb/proj/ln/head for steps >= 2 (vLLM's tie_weights)
    scale_input: bool = False         # mlp_speculator: RMS-normalise the backbone state first (vLLM's ln0)
    backbone_adapter: Optional[str] = None  # Medusa-2: LoRA adapter dir (relative) the backbone needs
    aux_layers: Optional[list] = None  # eagle3: the three backbone hidden_states ids the drafter reads
    draft_layer: Optional[dict] = None  # eagle3: the decoder layer's sizes (eagle3.draft_layer_config)
    format_version: int = FORMAT_VERSION

    def __post_init__(self):
        fam = family(self.kind)  # an unknown kind: one line listing the kinds
        undeclared = [f for f in fam.fields if f not in _FIELD_NAMES]
        if undeclared:
            raise TypeError(f"heads family {self.kind!r} reads fields HeadsSpec does not have: {undeclared}")
        if fam.validate is not None:
            fam.validate(self)
        if self.projection not in PROJECTIONS:
            raise UserError(f"heads projection must be one of {PROJECTIONS}, got {self.projection!r}")
        if self.num_heads < 1 or self.num_layers < 0:
            raise UserError(f"need num_heads >= 1 and num_layers >= 0, got {self.num_heads}, {self.num_layers}")
        if self.projection == "truncated":
            n = self.truncated_vocab_size
            if not n or not 0 < n <= self.vocab_size:
                raise UserError(f"truncated_vocab_size must be in 1..{self.vocab_size}, got {n}")
        else:
            self.truncated_vocab_size = None

    @property
    def output_size(self) -> int:
        return self.truncated_vocab_size if self.projection == "truncated" else self.vocab_size

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "HeadsSpec":
        unknown = sorted(set(d) - _FIELD_NAMES)
        if unknown:
            raise UserError(f"heads config has unknown keys {unknown}")
        return cls(**d)


_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(HeadsSpec))


def check_compatible(spec: HeadsSpec, backbone_config, where: str = "heads") -> None:
    """Refuse heads made for another backbone, naming the first mismatch (then the family's own check)."""
    cfg = backbone_config
    if spec.hidden_size != cfg.hidden_size:
        raise IncompatibleHeadsError(
            f"{where} were trained for hidden size {spec.hidden_size}, the backbone has {cfg.hidden_size}")
    if spec.vocab_size != cfg.vocab_size:
        raise IncompatibleHeadsError(
            f"{where} were trained for vocab size {spec.vocab_size}, the backbone has {cfg.vocab_size}")
    fp = backbone_fingerprint(cfg)
    if spec.base_model_fingerprint and spec.base_model_fingerprint != fp:
        raise IncompatibleHeadsError(
            f"{where} were trained on a backbone with config fingerprint {spec.base_model_fingerprint} "
            f"({spec.base_model or 'unknown'}), this backbone's is {fp}")
    check = family(spec.kind).check_backbone
    if check is not None:  # what only the family knows (EAGLE-3: its aux layer ids exist in this backbone)
        check(spec, cfg, where)
