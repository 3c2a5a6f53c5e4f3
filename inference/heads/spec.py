"""``HeadsSpec``: everything needed to rebuild heads and to check they fit a backbone.

It is what the native export's ``config.json`` holds and what every foreign importer produces, so
its keys are part of the on-disk format. Common fields (sizes, projection, base model, ``kind``) live
on the spec; what only one family reads lives in ``spec.settings``, an instance of that family's own
dataclass (``registry.HeadFamily.settings``, chosen by ``kind``), validated by the family. On disk
the settings stay flat beside the common fields (``to_dict`` / ``from_dict``), as they always were,
so existing exports load unchanged and new ones are byte-identical; a key that is neither common nor
the family's is refused in one line. This module stays free of torch.

``backbone_fingerprint`` / ``check_compatible`` refuse heads made for another backbone (hidden
size, vocabulary, architecture fields) before any weight is attached.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import typing
from typing import Any, Optional

from ..chat_template import check_template_args
from ..errors import IncompatibleHeadsError, UserError
from .registry import HeadFamily, family, setting_names

FORMAT_VERSION = 2   # 2: chat_template_args recorded (written only by heads that have them; the rest stay 1)
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


# Format 1's config.json layout, frozen: every export so far wrote these keys after ``kind`` for every
# kind, in this order, the settings of families that do not read them at these unset values. Writing
# the same keys keeps config.json byte-identical to what earlier versions wrote (and read), and reading
# accepts them at these values in any family's config; a family's own settings overwrite its keys, and a
# family added later writes its settings after them. The one place that knows this old layout.
FORMAT1_LAYOUT = {"inner_dim": None, "tie_weights": False, "scale_input": False, "backbone_adapter": None,
                  "aux_layers": None, "draft_layer": None}


MAX_HEADS = 64  # num_heads (engines draft 1-10 tokens ahead; each head is a projection to the vocabulary)
MAX_HEAD_LAYERS = 64  # num_layers (Medusa uses 1)


@dataclasses.dataclass(init=False)
class HeadsSpec:
    """Everything needed to rebuild heads and check they fit a backbone (config.json).

    ``HeadsSpec(..., kind=k, settings=<k's settings>)``, or the family's settings as keywords (flat, as
    config.json has them): ``HeadsSpec(..., kind="eagle3", aux_layers=[2, 4, 6], draft_layer={...})``.
    A family's setting is read where the family keeps it, ``spec.settings.aux_layers``; only config.json
    (``to_dict`` / ``from_dict``) lays the settings flat beside the common fields.
    """

    num_heads: int
    num_layers: int
    hidden_size: int
    vocab_size: int
    projection: str
    truncated_vocab_size: Optional[int]
    base_model: str
    base_model_fingerprint: str
    kind: str
    # Common, not a family's: heads of any family trained with a LoRA backbone (Medusa-2) record the
    # adapter folder (relative) the backbone needs.
    backbone_adapter: Optional[str]
    # Common: the chat template's variables the training data was rendered with (Qwen3's enable_thinking); decoding
    # renders prompts the same way wherever the folder goes. Written only when set, as format 2: a reader from before
    # says "written by a newer medusa-train" (a variable it would drop changes every prompt); the rest stay format 1.
    chat_template_args: Optional[dict]
    format_version: int
    settings: Any  # the family's own settings (``family(kind).settings``)

    def __init__(self, num_heads: int, num_layers: int, hidden_size: int, vocab_size: int, projection: str = "own",
                 truncated_vocab_size: Optional[int] = None, base_model: str = "", base_model_fingerprint: str = "",
                 kind: str = "medusa", backbone_adapter: Optional[str] = None, format_version: int = 1,
                 settings: Any = None, chat_template_args: Optional[dict] = None, **family_settings):
        self.num_heads, self.num_layers = num_heads, num_layers
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.projection, self.truncated_vocab_size = projection, truncated_vocab_size
        self.base_model, self.base_model_fingerprint, self.kind = base_model, base_model_fingerprint, kind
        self.backbone_adapter, self.format_version = backbone_adapter, format_version
        self.chat_template_args = check_template_args(chat_template_args, "heads config chat_template_args") or None
        fam = family(kind)  # an unknown kind: one line listing the kinds
        clash = sorted(_COMMON_NAMES.intersection(setting_names(fam)))
        if clash:  # config.json, where they lie flat beside the common fields, could not tell them apart
            raise TypeError(f"heads family {kind!r}: settings {clash} are common HeadsSpec fields")
        if settings is None:
            settings = family_settings_of(fam, family_settings)
        elif family_settings:
            raise TypeError("give a family's settings as settings= or as keywords, not both")
        elif not isinstance(settings, fam.settings):
            raise TypeError(f"heads kind {kind!r} takes settings of type {fam.settings.__name__}, "
                            f"got {type(settings).__name__}")
        self.settings = settings
        self._check(fam)

    def _check(self, fam: HeadFamily) -> None:
        if fam.validate is not None:
            fam.validate(self)
        if self.projection not in PROJECTIONS:
            raise UserError(f"heads projection must be one of {PROJECTIONS}, got {self.projection!r}")
        if not (1 <= self.num_heads <= MAX_HEADS and 0 <= self.num_layers <= MAX_HEAD_LAYERS):
            # bounded: a damaged config.json's 10^8 heads were built (minutes, then out of memory) before the weights
            # were compared with it
            raise UserError(f"need num_heads in 1..{MAX_HEADS} and num_layers in 0..{MAX_HEAD_LAYERS}, got "
                            f"{self.num_heads}, {self.num_layers}")
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
        """config.json: the common fields with the family's settings flat beside them, in format 1's layout."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in ("backbone_adapter", "chat_template_args", "format_version", "settings")}
        own = dataclasses.asdict(self.settings)
        unset = {**FORMAT1_LAYOUT, "backbone_adapter": self.backbone_adapter}
        for key in FORMAT1_LAYOUT:
            out[key] = own.pop(key) if key in own else unset[key]
        template = {"chat_template_args": self.chat_template_args} if self.chat_template_args else {}
        version = max(self.format_version, 2) if template else self.format_version
        return {**out, **own, **template, "format_version": version}

    @classmethod
    def from_dict(cls, d: dict) -> "HeadsSpec":
        """The spec of a config.json dict: common keys, then the family's settings (``kind``'s); a key that is
        neither is refused in one line (format 1's unset keys of other families pass, see FORMAT1_LAYOUT)."""
        common = {k: v for k, v in d.items() if k in _COMMON_NAMES}
        check_value_types(common, cls)
        own = {k: v for k, v in d.items() if k not in _COMMON_NAMES}
        check_value_types(own, family(common.get("kind", "medusa")).settings)
        return cls(**common, **own)


_COMMON_NAMES = frozenset(f.name for f in dataclasses.fields(HeadsSpec)) - {"settings"}


def family_settings_of(fam: HeadFamily, flat: dict):
    """``fam``'s settings from flat keys (config.json's, or keywords); a key the family does not have is
    refused in one line naming its settings, unless it is a format-1 key at its unset value."""
    own = setting_names(fam)
    stray = sorted(k for k, v in flat.items()
                   if k not in own and not (k in FORMAT1_LAYOUT and v == FORMAT1_LAYOUT[k]))
    if stray:
        theirs = f"reads {', '.join(own)}" if own else "has no settings"
        raise UserError(f"heads config has unknown keys {stray} (heads kind {fam.kind!r} {theirs} besides the "
                        "common keys)")
    return fam.settings(**{k: flat[k] for k in own if k in flat})


_JSON_TYPES = {int: "an integer", float: "a number", bool: "true or false", str: "a string", list: "a list",
               dict: "an object"}


def check_value_types(values: dict, cls) -> None:
    """Each value of a config.json dict of the JSON type ``cls``'s field annotation names (int, float, bool, str,
    list, dict, or Optional of one): ``"num_heads": "3"`` said ``'<' not supported between 'str' and 'int'``
    from deep in a check, or built a spec that failed later still."""
    hints = typing.get_type_hints(cls)
    for key, value in values.items():
        wanted = hints.get(key)
        optional = typing.get_origin(wanted) is typing.Union and type(None) in typing.get_args(wanted)
        if optional:
            if value is None:
                continue
            wanted = next(a for a in typing.get_args(wanted) if a is not type(None))
        wanted = typing.get_origin(wanted) or wanted
        if wanted not in _JSON_TYPES:
            continue
        ok = isinstance(value, wanted) and not (wanted in (int, float) and isinstance(value, bool))
        if wanted is float and isinstance(value, int) and not isinstance(value, bool):
            ok = True
        if not ok:
            raise UserError(f"heads config {key} must be {_JSON_TYPES[wanted]}{' or null' if optional else ''}, "
                            f"got {json.dumps(value)}")


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
