"""The head-family registry: what the rest of the code asks instead of naming families.

A ``HeadFamily`` record says everything generic code needs about one kind of heads: the module
class that holds them, how fresh heads start from the backbone, its own settings (a dataclass the
spec holds as ``spec.settings``) and how they are validated, the backbone tensors it trains on
(``inputs``), and which drafting mixin it drafts trees with.
The spec, the native loader, the trainer and the formats go through ``family(kind)``, so a new
family is one module that calls ``register_family`` (plus one line in ``FAMILY_MODULES`` for a
built-in one) and touches nothing else.

Built-in families register when their module is first imported; ``family`` imports it on demand
(from the table in ``inference.heads``), which keeps importing this module free of torch.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Callable, Optional

from ..errors import UserError
from . import FAMILY_MODULES, KINDS
from .inputs import BackboneInputs


@dataclasses.dataclass
class NoSettings:
    """The settings of a family that has none beyond the spec's common fields (Medusa, Hydra)."""


@dataclasses.dataclass(frozen=True)
class HeadFamily:
    """One kind of heads.

    kind:      the ``HeadsSpec.kind`` / config.json ``kind`` value.
    module:    the ``nn.Module`` class; ``module(spec)`` builds uninitialised heads (what a loader
               fills from a state dict).
    drafting:  the drafting mixin ``module`` derives from (``IndependentDrafting`` for heads that
               see h_t only, ``PathDrafting`` for heads fed the path they extend).
    init:      ``(spec, lm_head_weight, input_embeddings, token_map) -> heads``: fresh heads started
               from the backbone; default ``module.from_backbone``.
    settings:  the dataclass of the family's own settings (``spec.settings``; stored flat in config.json
               beside the common fields, so each field's name is a config.json key); every field has a
               default and a ``help`` in its metadata.
    inputs:    the backbone tensors its heads train on (``inputs.BackboneInputs``), what the trainer's
               feature cache, batch sources and loss read instead of asking the kind.
    validate:  ``(spec) -> None``, raising a one-line ``UserError`` for a bad value of its settings.
    check_backbone: ``(spec, backbone_config, where) -> None``, raising a one-line ``IncompatibleHeadsError``
               when heads of this family cannot run on that backbone for a reason the generic
               checks (hidden size, vocabulary, fingerprint) do not see; ``check_compatible`` calls it.
    describe:  ``(spec) -> str``: the drafter's shape in words for logs (what its heads and layers are);
               default "K heads x L layers", which says the wrong thing for a family whose
               ``num_heads`` is not a count of heads (EAGLE-3's unrolled steps).
    """

    kind: str
    module: type
    drafting: type
    init: Optional[Callable] = None
    settings: type = NoSettings
    inputs: BackboneInputs = BackboneInputs()
    validate: Optional[Callable] = None
    check_backbone: Optional[Callable] = None
    describe: Optional[Callable] = None

    def shape(self, spec) -> str:
        if self.describe is not None:
            return self.describe(spec)
        return f"{spec.num_heads} heads x {spec.num_layers} layers"

    def fresh(self, spec, lm_head_weight, input_embeddings=None, token_map=None):
        init = self.init or self.module.from_backbone
        return init(spec, lm_head_weight, input_embeddings, token_map)


_FAMILIES: dict[str, HeadFamily] = {}


def register_family(fam: HeadFamily) -> HeadFamily:
    """Make ``fam.kind`` buildable, loadable and draftable everywhere (replaces a previous record)."""
    if not issubclass(fam.module, fam.drafting):
        raise TypeError(f"{fam.module.__name__} must derive from its drafting mixin {fam.drafting.__name__}")
    if not dataclasses.is_dataclass(fam.settings):
        raise TypeError(f"heads family {fam.kind!r}: settings must be a dataclass, got {fam.settings!r}")
    names = setting_names(fam)
    if fam.inputs.aux_layers and "aux_layers" not in names:  # where BackboneInputs.layers reads the ids
        raise TypeError(f"heads family {fam.kind!r} reads aux layers but its settings have no aux_layers field")
    _FAMILIES[fam.kind] = fam
    return fam


def setting_names(fam: HeadFamily) -> tuple[str, ...]:
    """The names of a family's own settings (its config.json keys beside the common ones)."""
    return tuple(f.name for f in dataclasses.fields(fam.settings))


def kinds() -> tuple[str, ...]:
    """The built-in kinds, then any registered at run time (a plug-in or a test)."""
    return tuple(dict.fromkeys([*KINDS, *_FAMILIES]))


def family(kind: str) -> HeadFamily:
    """The record of ``kind``; an unknown kind is refused in one line that lists the known ones."""
    if kind not in _FAMILIES and kind in FAMILY_MODULES:
        importlib.import_module(FAMILY_MODULES[kind])  # registers it
    fam = _FAMILIES.get(kind)
    if fam is None:
        raise UserError(f"heads kind must be one of {kinds()}, got {kind!r}")
    return fam


def build_heads(spec):
    """An uninitialised module of the spec's family (``spec.kind``)."""
    return family(spec.kind).module(spec)


def init_heads(spec, lm_head_weight, input_embeddings=None, token_map=None):
    """Fresh heads of any family, initialised from the backbone as each family prescribes."""
    return family(spec.kind).fresh(spec, lm_head_weight, input_embeddings, token_map)
