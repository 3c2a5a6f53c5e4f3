"""``medusa-train``'s overrides as Hydra composes them, shared by the command line (``cli.py``) and the launch
(``launch.py``): the recipes' package, an override's key, a backbone or heads family named on the command line.
Light (no Hydra, no torch): ``medusa-train --help`` and a refused word import it.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

from inference.cli_support import EXIT_USER_ERROR, fail
from inference.errors import UserError
from .families import family_kinds

RECIPE_PACKAGE = "recipes"
# A Ctrl-C before a task took the signals over (torch's import, the checks, Hydra's start): nothing is written yet.
INTERRUPTED_BEFORE_RUN = "interrupted before the run started; nothing was written; run the same command again"
_OVERRIDE_PREFIXES = ("++", "+", "~")


def refuse(message: str, every_rank: bool = True) -> NoReturn:
    """``medusa-train: error: <message>`` on stderr, exit 2. ``every_rank=False``: a refusal of the configuration
    alone (its composition, its values), which every process of a launch makes alike, is said by rank 0 alone, not
    once per rank; what a process finds on its own node (files, memory, devices) is said by every process."""
    launched = int(os.environ.get("WORLD_SIZE", "1") or 1) > 1   # a scheduler may set RANK for one process
    if not every_rank and launched and int(os.environ.get("RANK", "0") or 0) != 0:
        sys.exit(EXIT_USER_ERROR)
    fail("medusa-train", message)


def override_key(arg: str) -> str:
    """The dotted key of a Hydra override (``+a.b=1`` -> ``a.b``; ``~a.b`` -> ``a.b``)."""
    for prefix in _OVERRIDE_PREFIXES:
        if arg.startswith(prefix):
            arg = arg[len(prefix):]
            break
    return arg.split("=", 1)[0].strip()


def backbone_overrides(overrides: list[str]) -> list[str]:
    """A backbone named on the command line wins over the recipe's random one: add
    ``backbone.random_init=null`` when ``backbone.name_or_path`` is overridden and random_init is not."""
    keys = [override_key(a) for a in overrides]
    if "backbone.name_or_path" not in keys:
        return list(overrides)
    given = [a for a, k in zip(overrides, keys) if k == "backbone.random_init" or k.startswith("backbone.random_init.")]
    if not given:
        return [*overrides, "backbone.random_init=null"]
    # A random backbone given beside a named one (``random_init=null`` / ``~`` only clear it): the config's own
    # check cannot see it when the name is the default's, and the run would train on the random one.
    random = [a for a in given if not a.startswith("~") and a.split("=", 1)[-1].strip().lower() not in
              ("null", "~", "none")]
    if random:
        name = next(a for a, k in zip(overrides, keys) if k == "backbone.name_or_path")
        raise UserError(f"{name} and {random[0]} both name a backbone: give one")
    return list(overrides)


def heads_kind_overrides(overrides: list[str]) -> list[str]:
    """``heads.kind=<kind>`` chooses the family's config group, ``heads=<kind>``: the family's keys come with
    it (a value set on the recipe's group would keep the recipe family's keys). Both given and differing: one line."""
    out, chosen = [], {}
    for arg in overrides:
        key = override_key(arg)
        if key in ("heads", "heads.kind") and "=" in arg and not arg.startswith(("~", "+")):
            chosen[key] = arg.split("=", 1)[1]
            arg = f"heads={chosen[key]}"
        out.append(arg)
    if len(set(chosen.values())) > 1:
        raise UserError(f"heads={chosen['heads']} and heads.kind={chosen['heads.kind']} name two families: give one")
    unknown = [k for k in chosen.values() if "," not in k and k not in family_kinds()]  # (a sweep: per job)
    if unknown:
        raise UserError(f"heads.kind must be one of {list(family_kinds())}, got {unknown[0]!r}")
    return out


# The keys that name a file or folder: a leading ``~`` in them is the user's home, as the shell would have made it
PATH_KEYS = ("output_dir", "data.source", "features.cache_dir", "trainer.resume", "backbone.name_or_path",
             "lora.init_heads")


def home_overrides(overrides: list[str]) -> list[str]:
    """A path key's value that reached the program as ``~/...`` (quoted, so the shell left it) as the home folder's
    path: the checks read it so (``os.path.expanduser``) while Hydra and the writers took it literally, and a
    folder named ``~`` was made in the working directory."""
    out = []
    for arg in overrides:
        key, sep, value = arg.partition("=")
        bare = value.strip()
        quote = bare[:1] if len(bare) >= 2 and bare[0] in "'\"" and bare[-1] == bare[0] else ""
        path = bare[1:-1] if quote else bare
        if sep and override_key(arg) in PATH_KEYS and not arg.startswith("~") and path.startswith("~") \
                and "," not in path and os.path.expanduser(path) != path:
            arg = f"{key}={quote}{os.path.expanduser(path)}{quote}"
        out.append(arg)
    return out


def recipe_overrides(overrides: list[str]) -> list[str]:
    """The command line's overrides as Hydra composes them (``home_overrides``, ``backbone_overrides``,
    ``heads_kind_overrides``)."""
    return heads_kind_overrides(backbone_overrides(home_overrides(overrides)))
