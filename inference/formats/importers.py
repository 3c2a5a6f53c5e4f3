"""The importer registry: how a foreign heads directory is recognised and read.

Each foreign layout registers, from its own module, three functions:

  detect(dir) -> bool                 is this directory mine? (cheap: file names, config keys)
  read_spec(dir) -> HeadsSpec         the heads it holds, without loading weights
  load(dir, spec) -> (heads, lm_head) the heads, values exactly as the engine would run them, and
                                      the dir's own copy of a shared lm_head (or None)

and optionally ``read_spec_for(dir, backbone_config) -> HeadsSpec``: the spec when the backbone is
known, for layouts whose config leaves facts to the target (an EAGLE-3 dir without aux layer ids
means the target's default layers); ``Importer.spec`` picks it when there is a backbone.

Built-in layouts (``inference.formats.BUILTIN_MODULES``): ``reference`` (reference Medusa,
TensorRT-LLM, TGI v1/v2), ``vllm`` (vLLM's Medusa drafter), ``vllm_mlp_speculator``, ``eagle3`` (vLLM / SGLang
EAGLE-3 drafters), ``speculators`` (vLLM's ``Eagle3Speculator`` layout).
``inference.loading`` asks ``detect_layout`` first and falls back to the native loader, so this
registry is the only place that knows foreign layouts exist.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable, Optional

from ..errors import UserError
from . import load_builtin_formats


@dataclasses.dataclass(frozen=True)
class Importer:
    layout: str
    detect: Callable[[Path], bool]
    read_spec: Callable
    load: Callable
    read_spec_for: Optional[Callable] = None

    def spec(self, d: Path, backbone_config=None):
        """The heads ``d`` holds, read with the backbone's config when the layout needs it."""
        if backbone_config is not None and self.read_spec_for is not None:
            return self.read_spec_for(d, backbone_config)
        return self.read_spec(d)


_IMPORTERS: dict[str, Importer] = {}


def register_importer(layout: str, *, detect: Callable[[Path], bool], read_spec: Callable,
                      load: Callable, read_spec_for: Optional[Callable] = None) -> Importer:
    """Make ``layout`` directories loadable by ``load_heads`` / ``load_medusa`` / ``medusa-export``."""
    _IMPORTERS[layout] = imp = Importer(layout, detect, read_spec, load, read_spec_for)
    return imp


def detect_layout(heads_dir) -> Optional[str]:
    """The registered layout of ``heads_dir``, or None (not a foreign layout: the native loader decides)."""
    d = Path(heads_dir)
    if not d.is_dir():
        return None
    load_builtin_formats()
    return next((name for name, imp in _IMPORTERS.items() if imp.detect(d)), None)


def importer_for(layout: str) -> Importer:
    load_builtin_formats()
    imp = _IMPORTERS.get(layout)
    if imp is None:
        raise UserError(f"unknown heads layout {layout!r}: choose one of {', '.join(_IMPORTERS)}")
    return imp
