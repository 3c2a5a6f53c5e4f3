"""How medusa-train trains each head family: its ``heads`` config group and what follows from it.

``HeadsConfig`` holds the keys every family has; a family with keys of its own subclasses it, and its
``recipes/heads/<kind>.yaml`` selects that schema (``heads=<kind>``, or ``heads.kind=<kind>``, which the
command line turns into the group choice). The generic training code asks ``training_family(kind)``
for everything that depends on the family -- checks of its keys, how many tokens ahead it trains, its
draft vocabulary, the settings its ``HeadsSpec`` records, the values its automatic keys resolve to (a
resumed run compares them), the memory its training adds beyond its parameters -- and never names a
family. The heads themselves (modules, spec settings, declared inputs) are ``inference.heads``'.

A new family: its ``inference.heads`` module, and here nothing when it has no keys of its own (the
defaults below train it), else a module that calls ``register_training_family`` (plus one line in
``TRAINING_MODULES`` for a built-in one) and its ``recipes/heads/<kind>.yaml``.

Free of torch: the config schema imports this before anything heavy loads.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
from dataclasses import dataclass
from enum import Enum
from typing import List, Optional

from inference.cli_support import enum_value
from inference.errors import UserError
from inference.heads.registry import family, kinds

# kind -> the module that registers its training family (families without keys of their own need none).
TRAINING_MODULES = {
    "medusa": "medusa_train.families.medusa",
    "mlp_speculator": "medusa_train.families.mlp_speculator",
    "eagle3": "medusa_train.families.eagle3",
}


class Projection(str, Enum):
    own = "own"
    shared = "shared"
    truncated = "truncated"


@dataclass
class HeadsConfig:
    """The ``heads`` keys every family has (a family's own keys: its subclass, ``TrainingFamily.config``)."""

    # Which family (inference/heads): selected with the group, ``heads=<kind>`` or ``heads.kind=<kind>``.
    kind: str = "medusa"
    num_heads: int = 3
    num_layers: int = 1
    projection: Projection = Projection.truncated
    truncated_vocab_size: int = 8192
    loss_decay: float = 0.8  # lambda_k = loss_decay ** k (k = 1..K), as the Medusa paper suggests
    loss_weights: Optional[List[float]] = None  # explicit lambda_1..lambda_K; overrides loss_decay
    # Weight of a distillation term: CE against the backbone's own distribution of the token
    # each head guesses (Hydra++'s teacher loss); 0 = labels only, 1 = teacher only.
    teacher_weight: float = 0.0
    # Training-time noise on the features the heads read (EAGLE's data noise, made scale-free): Gaussian
    # with std = feature_noise x the RMS of each backbone layer's state at that position (each layer a family
    # reads, inference.heads.inputs), on training batches only. A regulariser for drafters that overfit.
    feature_noise: float = 0.0
    # What head k at t learns to predict: "data" = the dataset token t+k+1 (the labels);
    # "backbone" = the frozen backbone's greedy token there (argmax after the true prefix up to
    # t+k), which is what greedy verification accepts (losses.backbone_labels).
    targets: str = "data"
    # Which positions train with heads.targets=backbone: "assistant" (the replies: what decoding drafts) or
    # "all" (every position of a conversation, the user's turns too: the backbone's greedy token exists
    # there as well, so the ~40% of a ShareGPT batch that only gave context also trains). Held-out accuracy
    # stays on assistant positions either way. A feature cache must store the greedy ids everywhere for "all".
    train_on: str = "assistant"


class TrainingFamily:
    """How one family trains; the defaults are a family with no keys of its own (Medusa's, Hydra's).
    Every method takes the ``heads`` node (a DictConfig, the dataclass, or a namespace of a saved config)."""

    config: type = HeadsConfig  # the heads group's schema: HeadsConfig plus the family's own keys

    def __init__(self, kind: str):
        self.kind = kind

    def validate(self, cfg) -> None:
        """Ranges and combinations of the family's keys that need no backbone, one line naming the key."""

    def depth(self, h) -> int:
        """How many tokens ahead the heads are trained to guess: the spec's ``num_heads``."""
        return int(h.num_heads)

    def depth_key(self, h) -> str:
        """The key that sets ``depth`` (named when it is out of range or does not fit)."""
        return "heads.num_heads"

    def vocabulary(self, h, vocab_size: int) -> tuple[str, Optional[int]]:
        """(projection, truncated size) of the heads on a backbone with ``vocab_size`` tokens."""
        projection = enum_value(h.projection)
        return projection, (int(h.truncated_vocab_size) if projection == "truncated" else None)

    def vocabulary_keys(self, h) -> tuple[str, ...]:
        """The keys that size the vocabulary projection (named when it does not fit)."""
        return ("heads.truncated_vocab_size",) if enum_value(h.projection) == "truncated" else ()

    def size_keys(self, h) -> tuple[str, ...]:
        """The keys that size the heads' parameters (named when they do not fit in memory)."""
        return ("heads.num_heads", "heads.num_layers", *self.vocabulary_keys(h))

    def spec_settings(self, h, hf_config):
        """The family's ``HeadsSpec`` settings for this config on the backbone ``hf_config`` describes; one
        line when the backbone cannot host the family."""
        return family(self.kind).settings()

    def resolved(self, h, hf_config) -> dict:
        """Flat ``heads.<key>`` -> the value an automatic key (null / 0 = "pick for me") takes on this
        backbone: a resumed run that spells the value out is the same run."""
        return {}

    def unroll_bytes(self, h, hf_config, length: int, batch: int, dtype_bytes: int) -> int:
        """Activation memory the heads' training keeps beyond the frozen forward, per micro-batch."""
        return 0

    def loss_bytes(self, h, hf_config, length: int, batch: int) -> int:
        """What the heads' loss keeps over a ``[batch, length]`` micro-batch: each head's logits over its
        projection in fp32 with their log-softmax and gradient, about (4K + 8) bytes per position and projected
        token for K heads, (12K + 16) with the teacher term (a review's measure of the saved tensors at small
        scale): ~7 GiB for 5 heads over a 32,768-token projection at 4 x 2,048 positions, by arithmetic."""
        from inference.backbone import text_config   # lazy: it imports torch, and medusa-train --help this module

        vocab = int(text_config(hf_config).vocab_size)
        width = self.vocabulary(h, vocab)[1] or vocab
        k = self.depth(h)
        per = 12 * k + 16 if float(getattr(h, "teacher_weight", 0.0) or 0.0) > 0 else 4 * k + 8
        return batch * length * width * per


_TRAINING: dict[str, TrainingFamily] = {}


def register_training_family(fam: TrainingFamily) -> TrainingFamily:
    """Make ``fam.kind`` trainable with its own keys (replaces a previous record)."""
    if not (dataclasses.is_dataclass(fam.config) and issubclass(fam.config, HeadsConfig)):
        raise TypeError(f"training family {fam.kind!r}: config must be a dataclass deriving from HeadsConfig")
    _TRAINING[fam.kind] = fam
    return fam


def training_family(kind) -> TrainingFamily:
    """The training record of ``kind``: registered, built in (imported on demand), or the defaults for a
    heads family with no keys of its own; an unknown kind is refused in one line listing the kinds."""
    kind = str(kind)
    if kind not in _TRAINING and kind in TRAINING_MODULES:
        importlib.import_module(TRAINING_MODULES[kind])  # registers it
    if kind not in _TRAINING:
        kinds = family_kinds()
        if kind not in kinds:
            raise UserError(f"heads.kind must be one of {list(kinds)}, got {kind!r}")
        return TrainingFamily(kind)
    return _TRAINING[kind]


def family_kinds() -> tuple[str, ...]:
    """Every kind that can be trained: the heads families (built in and registered) and training records."""
    return tuple(dict.fromkeys([*kinds(), *_TRAINING]))


def family_keys(kind) -> tuple[str, ...]:
    """The keys of ``kind``'s heads group (common and its own)."""
    return tuple(f.name for f in dataclasses.fields(training_family(kind).config))


def stray_key_line(kind, key: str) -> str:
    """One line for ``heads.<key>``, which ``kind``'s group does not have: whose key it is, what to write; a key
    of no family is unknown, with the closest of ``kind``'s keys (common and its own)."""
    owners = [k for k in family_kinds() if key in family_keys(k)]
    own = [k for k in family_keys(kind) if k not in {f.name for f in dataclasses.fields(HeadsConfig)}]
    theirs = f"its own keys: {', '.join(own)}" if own else "no keys of its own"
    if owners:
        article = "an" if owners[0][0] in "aeiou" else "a"
        return (f"heads.{key} is {article} {' and '.join(owners)} setting, not {kind}'s ({theirs}): "
                f"choose that family (heads={owners[0]}) or remove it")
    # no family's key: most likely a typo, so say it is unknown and name the closest keys this family takes
    close = difflib.get_close_matches(key, family_keys(kind), n=3, cutoff=0.6)
    if close:
        return f"unknown key heads.{key}: did you mean {' or '.join('heads.' + k for k in close)}?"
    return f"unknown key heads.{key}: heads.kind={kind} takes {', '.join(family_keys(kind))}"


def check_family_keys(h) -> None:
    """The ``heads`` node holds exactly its family's keys: a key of another family (a group chosen for one
    kind, ``kind`` set to another) is refused in one line naming whose key it is."""
    kind = str(h.kind)
    keys = set(family_keys(kind))
    given = [f.name for f in dataclasses.fields(h)] if dataclasses.is_dataclass(h) else list(h.keys())
    stray = [k for k in given if k not in keys]
    if stray:
        raise UserError(stray_key_line(kind, str(stray[0])))
    missing = sorted(keys - set(given))
    if missing:
        raise UserError(f"heads.kind={kind} has keys this config lacks ({', '.join(missing)}): select its group "
                        f"with heads={kind} (or heads.kind={kind} on the command line)")


def draft_depth(h) -> int:
    """How many tokens ahead the heads are trained to guess (the spec's ``num_heads``)."""
    return training_family(h.kind).depth(h)


def backbone_layers(h, hf_config) -> tuple[int, ...]:
    """The backbone layers besides the last one that heads of this config read on the backbone ``hf_config``
    describes: their family's declared inputs (``inference.heads.inputs``) over the settings its spec will hold."""
    inputs = family(h.kind).inputs
    if not inputs.aux_layers:
        return ()
    return inputs.layers(training_family(h.kind).spec_settings(h, hf_config))


def draft_vocabulary(h, vocab_size: int) -> tuple[str, Optional[int]]:
    """(projection, truncated size) of the heads on a backbone with ``vocab_size`` tokens."""
    return training_family(h.kind).vocabulary(h, vocab_size)
