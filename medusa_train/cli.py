"""``medusa-train <recipe> [hydra overrides]`` — train Medusa heads from a packaged recipe.

Examples::

    medusa-train medusa1_smollm2                                  # the embedded default
    medusa-train medusa1_smollm2 heads.num_heads=3 trainer.max_steps=200 output_dir=runs/a
    medusa-train debug_tiny --cfg job                             # print the composed config
    medusa-train debug_tiny -m heads.num_layers=1,2               # Hydra multirun
    deepspeed --num_gpus 2 --module medusa_train.cli debug_tiny trainer.zero_stage=2   # N processes

User mistakes (unknown recipe or key, wrong type, missing file, a word that is neither a
``key=value`` override nor a supported Hydra flag, a ``data.max_length`` the backbone cannot take
or that cannot fit in memory, ...) print one line and exit 2 before any weight or data loads;
Hydra and torch load only once the words are accepted (``launch.py``), so ``--help`` is instant.

``backbone.name_or_path=...`` on the command line trains on that backbone: it clears a recipe's
``backbone.random_init`` (debug_tiny's) unless ``backbone.random_init`` is given too.

The heads family is a config group (``recipes/heads/<kind>.yaml``, the family's own keys beside the common
ones): ``heads=eagle3`` selects it, and so does ``heads.kind=eagle3``, which is rewritten into that choice.
A key of another family (``heads.inner_dim`` with medusa heads) is refused in one line naming its family.
"""

from __future__ import annotations

import re
import sys
import textwrap
from importlib import resources

from inference.cli_support import ignore_further_interrupts
from inference.errors import UserError
from .overrides import INTERRUPTED_BEFORE_RUN, RECIPE_PACKAGE, override_key, recipe_overrides, refuse

def available_recipes() -> list[str]:
    root = resources.files(RECIPE_PACKAGE)
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".yaml"))


def recipe_summary(name: str) -> str:
    """The first sentence of a recipe file's header paragraph (its purpose), whole: a paragraph's first line
    alone cut descriptions mid-sentence ("one Llama decoder layer over")."""
    text = resources.files(RECIPE_PACKAGE).joinpath(f"{name}.yaml").read_text()
    paragraph: list[str] = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        words = line.lstrip("#").strip()
        if not words and paragraph:
            break
        if words:
            paragraph.append(words)
    joined = " ".join(paragraph)
    # a sentence ends at ". " before a capital (not inside "e.g. x" or "runs/a.b"), or at the paragraph's end
    end = re.search(r"[.!?](?=\s+[A-Z(])", joined)
    return joined[:end.end()] if end else joined


def usage() -> str:
    lines = [__doc__.strip().splitlines()[0], "", "usage: medusa-train <recipe> [key=value ...] [hydra flags]", "",
             "recipes:"]
    width, indent = 120, " " * 27   # a summary wraps under itself, whole
    for name in available_recipes():
        lines += textwrap.wrap(recipe_summary(name), width, initial_indent=f"  {name:<24} ", subsequent_indent=indent,
                               break_on_hyphens=False, break_long_words=False)
    lines += ["", "Hydra flags: --cfg job|hydra|all (print config), --resolve (with --cfg), --info,",
              "-m/--multirun (sweeps), --help (this text).",
              "Every recipe has output_dir=... and trainer.max_steps=...; see README.md."]
    return "\n".join(lines)


# Hydra flags medusa-train passes on: those taking a value, and switches.
HYDRA_VALUE_FLAGS = ("--cfg", "-c", "--package", "-p", "--info", "-i")
HYDRA_SWITCHES = ("-m", "--multirun", "--resolve", "--help", "-h", "--hydra-help")
_PRINT_FLAGS = {"--cfg", "-c", "--info", "-i", "--help", "-h", "--hydra-help"}  # print, run nothing
INFO_TOPICS = ("all", "config", "defaults", "defaults-tree", "plugins", "searchpath")  # Hydra's --info choices


def split_args(args: list[str]) -> tuple[list[str], list[str]]:
    """(overrides, Hydra flags) of the words after the recipe; anything else is one error line."""
    overrides, flags = [], []
    i = 0
    while i < len(args):
        a = args[i]
        name = a.split("=", 1)[0]
        if a.startswith("-") and name in HYDRA_VALUE_FLAGS:
            flags.append(a)
            value = a.split("=", 1)[1] if "=" in a else None
            if value is None and name in ("--cfg", "-c", "--package", "-p"):  # a value is required
                if i + 1 >= len(args) or args[i + 1].startswith("-"):
                    refuse(f"{a} needs a value (e.g. --cfg job)")
                value = args[i + 1]
            elif value is None and i + 1 < len(args) and not args[i + 1].startswith("-") and "=" not in args[i + 1]:
                value = args[i + 1]  # --info [all|config|defaults|...]
            if value is not None and "=" not in a:
                flags.append(value)
                i += 1
            if name in ("--cfg", "-c") and value not in ("job", "hydra", "all"):
                refuse(f"{name} takes job, hydra or all, got {value!r}")
            if name in ("--info", "-i"):
                if value is not None and value not in INFO_TOPICS:
                    refuse(f"{name} takes {', '.join(INFO_TOPICS)}, got {value!r}")
                if value is None:   # Hydra's flags go first (``launch``): a bare --info took the next override
                    flags.append("all")
        elif a.startswith("-"):
            if a not in HYDRA_SWITCHES:
                refuse(f"unsupported flag {a!r}; medusa-train takes key=value overrides and the Hydra flags "
                       "--cfg job|hydra|all, -m/--multirun, --resolve, --info, --help")
            flags.append(a)
        elif ("=" in a and override_key(a)) or (a.startswith("~") and len(a) > 1):
            overrides.append(a)
        else:
            refuse(f"arguments after the recipe are key=value overrides or Hydra flags, got {a!r} "
                   "(list the keys: medusa-train <recipe> --cfg job)")
        i += 1
    keys = [override_key(a) for a in overrides]
    twice = next((k for i, k in enumerate(keys) if k in keys[:i]), None)
    if twice is not None:   # Hydra would take the last silently: say which one the user meant
        refuse(f"{twice} is given twice: give it once")
    return overrides, flags


def main(argv: list[str] | None = None) -> None:
    console = argv is None   # the command itself, not a caller in Python (whose signals are its own)
    argv = list(sys.argv[1:] if argv is None else argv)
    argv = [a for a in argv if not a.startswith("--local_rank")]  # set by the deepspeed launcher
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return
    recipe, rest = argv[0], argv[1:]
    if recipe not in available_recipes():
        refuse(f"unknown recipe {recipe!r}; available: {', '.join(available_recipes())}")

    overrides, flags = split_args(rest)
    try:
        overrides = recipe_overrides(overrides)
    except UserError as e:
        refuse(str(e))
    names = {f.split("=", 1)[0] for f in flags}
    multirun = bool(names & {"-m", "--multirun"})
    if multirun and names & {"--cfg", "-c", "--info", "-i"}:
        refuse("-m/--multirun runs a sweep and --cfg/--info print a config: give one of them")
    for flag in names & {"--resolve", "--package", "-p"}:   # Hydra ignored them and trained, or ended in a traceback
        if not names & {"--cfg", "-c"}:
            refuse(f"{flag} changes what --cfg prints: give it with --cfg job|hydra|all")
    if "--hydra-help" in names:   # Hydra's own help composes no config: overrides made it fail with a traceback
        overrides = []
    try:
        from .launch import launch   # lazy: Hydra and torch load only once the words are accepted
    except KeyboardInterrupt:  # a Ctrl-C while torch imports: one line, as everywhere after
        refuse(INTERRUPTED_BEFORE_RUN)
    try:
        launch(recipe, overrides, flags, multirun=multirun, prints=bool(names & _PRINT_FLAGS))
    except SystemExit as e:
        if console and e.code not in (0, None):
            ignore_further_interrupts()
        raise


if __name__ == "__main__":  # python -m medusa_train.cli / deepspeed --module medusa_train.cli
    main()
