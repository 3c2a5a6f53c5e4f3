"""What each evaluated method speculates with: its speculation shape's choice (``methods.shape``), made on
this machine before the methods are compared.

``choice`` (the command line's key) is ``auto`` (measure: Medusa's tree, EAGLE-3's setting, a chain's length
per batch size, whatever the method's shape is) or ``fixed`` (the options as given), for every method, or a
mapping method -> mode. Option fields given by the caller (``tree="chain3"``) are set on every method whose
options have them, and a field that names the shape itself (``SpeculationShape.fixed_by``) makes that
method's choice ``fixed``. Methods whose shapes share a group (``medusa`` and ``medusa_lookup``: one tree)
are measured once, with the first of them, and every one of them decodes with that choice.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Sequence, Union

from ..errors import UserError
from ..methods import registry
from ..methods.shape import ChoiceContext, Chosen, method_mode


def method_options(m, methods: Sequence[str], options: Optional[Mapping[str, Any]], fields: Mapping[str, Any]) -> dict:
    """Each method's options (``options[method]`` or its defaults), with the ``fields`` its options have set,
    fitted to the model (``registry.fitted_options``). A field no registered method has is a slip: refused."""
    known = {f.name for x in registry.names() for f in dataclasses.fields(registry.get(x).options)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise UserError(f"no decoding method has an option {unknown[0]!r}")
    out = {}
    for x in methods:
        own = {f.name for f in dataclasses.fields(registry.get(x).options)}
        given = registry.make_options(x, (options or {}).get(x), **{k: v for k, v in fields.items() if k in own})
        out[x] = registry.fitted_options(m, x, given)
    return out


def choice_modes(methods: Sequence[str], choice: Union[str, Mapping[str, str]], fields: Mapping[str, Any]) -> dict:
    """method -> ``auto`` / ``fixed`` for the methods with a speculation shape (module docstring)."""
    modes = {}
    for x in methods:
        shape = registry.get(x).shape
        if shape is not None:
            mode = choice.get(x, "fixed") if isinstance(choice, Mapping) else choice
            modes[x] = method_mode(shape, mode, fields)
    return modes


def calibrating(opts: Mapping[str, Any], modes: Mapping[str, str], batched: bool) -> bool:
    """Whether any method's choice measures on calibration prompts (held out from the evaluated ones)."""
    return any(registry.get(x).shape.calibrates(opts[x], mode, batched) for x, mode in modes.items())


def reading_budgets(opts: Mapping[str, Any], modes: Mapping[str, str], batched: bool) -> bool:
    """Whether any method's choice grows candidates for the node budgets ``tree_budgets`` gives."""
    return any(registry.get(x).shape.reads_budgets(opts[x], mode, batched) for x, mode in modes.items())


def choose_all(ctx: ChoiceContext, opts: Mapping[str, Any], modes: Mapping[str, str],
               sizes: Optional[Sequence[int]] = None) -> dict[str, Chosen]:
    """method -> its shape's ``Chosen``, one prompt at a time (``sizes`` None) or per batch size; a group's
    choice is made once and applied to every method of the group."""
    made: dict[str, Chosen] = {}
    out = {}
    for x, mode in modes.items():
        shape = registry.get(x).shape
        group = shape.group(x)
        if group not in made:
            made[group] = out[x] = shape.choose(ctx, x, opts[x], mode) if sizes is None else \
                shape.size(ctx, x, opts[x], mode, sizes)
            continue
        first = made[group]
        out[x] = dataclasses.replace(first, options=shape.apply(opts[x], first.schedule, sizes is not None))
    return out


def report_entries(chosen: Mapping[str, Chosen]) -> dict:
    """What the choices add at the report's top level (each group's once: the Medusa tree, the heads' measured
    accuracy, an EAGLE-3 setting's race)."""
    out = {}
    for c in chosen.values():
        out.update(c.report)
    return out
