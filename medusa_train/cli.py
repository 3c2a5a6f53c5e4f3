"""``medusa-train <recipe> [hydra overrides]`` — train Medusa heads from a packaged recipe.

Examples::

    medusa-train medusa1_smollm2                                  # the embedded default
    medusa-train medusa1_smollm2 heads.num_heads=3 trainer.max_steps=200 output_dir=runs/a
    medusa-train debug_tiny --cfg job                             # print the composed config
    medusa-train debug_tiny -m heads.num_layers=1,2               # Hydra multirun
    deepspeed --num_gpus 2 -m medusa_train.cli debug_tiny trainer.zero_stage=2   # N processes

User mistakes (unknown recipe or key, wrong type, missing file, a word that is neither a
``key=value`` override nor a supported Hydra flag, a ``data.max_length`` the backbone cannot take
or that cannot fit in memory, ...) print one line and exit 2 before any weight or data loads;
heavy imports happen only once a recipe runs, so ``--help`` is instant.

``backbone.name_or_path=...`` on the command line trains on that backbone: it clears a recipe's
``backbone.random_init`` (debug_tiny's) unless ``backbone.random_init`` is given too.
"""

from __future__ import annotations

import sys
from importlib import resources

from inference.cli_support import config_error_line, enum_value, fail

RECIPE_PACKAGE = "recipes"


def available_recipes() -> list[str]:
    root = resources.files(RECIPE_PACKAGE)
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".yaml"))


def recipe_summary(name: str) -> str:
    """The first header line of a recipe file (its purpose)."""
    text = resources.files(RECIPE_PACKAGE).joinpath(f"{name}.yaml").read_text()
    for line in text.splitlines():
        line = line.lstrip("# ").strip()
        if line:
            return line
    return ""


def usage() -> str:
    lines = [__doc__.strip().splitlines()[0], "", "usage: medusa-train <recipe> [key=value ...] [hydra flags]", "",
             "recipes:"]
    for name in available_recipes():
        lines.append(f"  {name:<24} {recipe_summary(name)}")
    lines += ["", "Hydra flags: --cfg job (print config), -m/--multirun (sweeps), --help (this text).",
              "Every recipe has output_dir=... and trainer.max_steps=...; see README.md."]
    return "\n".join(lines)


def _fail(message: str) -> None:
    fail("medusa-train", message)


# Hydra flags medusa-train passes on: those taking a value, and switches.
HYDRA_VALUE_FLAGS = ("--cfg", "-c", "--package", "-p", "--info", "-i")
HYDRA_SWITCHES = ("-m", "--multirun", "--resolve", "--help", "-h", "--hydra-help")
_OVERRIDE_PREFIXES = ("++", "+", "~")


def override_key(arg: str) -> str:
    """The dotted key of a Hydra override (``+a.b=1`` -> ``a.b``; ``~a.b`` -> ``a.b``)."""
    for prefix in _OVERRIDE_PREFIXES:
        if arg.startswith(prefix):
            arg = arg[len(prefix):]
            break
    return arg.split("=", 1)[0].strip()


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
                    _fail(f"{a} needs a value (e.g. --cfg job)")
                value = args[i + 1]
            elif value is None and i + 1 < len(args) and not args[i + 1].startswith("-") and "=" not in args[i + 1]:
                value = args[i + 1]  # --info [all|config|defaults|...]
            if value is not None and "=" not in a:
                flags.append(value)
                i += 1
            if name in ("--cfg", "-c") and value not in ("job", "hydra", "all"):
                _fail(f"{name} takes job, hydra or all, got {value!r}")
        elif a.startswith("-"):
            if a not in HYDRA_SWITCHES:
                _fail(f"unsupported flag {a!r}; medusa-train takes key=value overrides and the Hydra flags "
                      "--cfg job|hydra|all, -m/--multirun, --resolve, --info, --help")
            flags.append(a)
        elif ("=" in a and override_key(a)) or (a.startswith("~") and len(a) > 1):
            overrides.append(a)
        else:
            _fail(f"arguments after the recipe are key=value overrides or Hydra flags, got {a!r} "
                  "(list the keys: medusa-train <recipe> --cfg job)")
        i += 1
    return overrides, flags


def backbone_overrides(overrides: list[str]) -> list[str]:
    """A backbone named on the command line wins over the recipe's random one: add
    ``backbone.random_init=null`` when ``backbone.name_or_path`` is overridden and random_init is not."""
    keys = [override_key(a) for a in overrides]
    if "backbone.name_or_path" in keys and not any(k == "backbone.random_init" or
                                                   k.startswith("backbone.random_init.") for k in keys):
        return [*overrides, "backbone.random_init=null"]
    return list(overrides)


def _task(cfg) -> None:
    from inference.errors import UserError

    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode
        from omegaconf import open_dict

        run = task_runner(cfg)
        hc = HydraConfig.get()
        if hc.mode == RunMode.MULTIRUN:  # each sweep job trains into its own folder
            with open_dict(cfg):
                cfg.output_dir = hc.runtime.output_dir
        if not _PRECHECKED:  # runs with Hydra flags (sweeps) are checked here, per job
            preflight(cfg)
        run(cfg)
    except UserError as e:
        _fail(str(e))


def task_runner(cfg):
    """What a recipe runs: ``task: distill`` -> distill.run; ``features.mode=build`` -> features.run_build;
    otherwise the trainer (which reads the feature cache itself under ``features.mode=train``)."""
    if enum_value(cfg.task) == "distill":
        from .distill import run
    elif enum_value(cfg.features.mode) == "build":
        from .features import run_build as run
    else:
        from .trainer import run
    return run


_PRECHECKED = False


def preflight(cfg) -> None:
    """What a run needs from disk, checked before any weight or data loads: a readable local data source,
    and a ``data.max_length`` the backbone has positions (and this machine memory) for."""
    from .backbone import check_family, check_fits
    from .config import check_data_source

    check_data_source(cfg.data.source)
    check_fits(cfg)
    check_family(cfg)


def _precheck(recipe: str, overrides: list[str]) -> None:
    """Compose and validate the config, and check that the backbone can take (and this machine hold)
    ``data.max_length`` from its config alone; one error line for a bad key, type, value or size."""
    global _PRECHECKED
    from inference.errors import UserError

    from .config import validate

    try:
        cfg = compose_recipe(recipe, overrides)
    except Exception as e:  # Hydra / OmegaConf composition errors
        _fail(f"{config_error_line(e)} (list the keys: medusa-train {recipe} --cfg job)")
    try:
        validate(cfg)
        preflight(cfg)
    except UserError as e:
        _fail(str(e))
    _PRECHECKED = True


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    argv = [a for a in argv if not a.startswith("--local_rank")]  # set by the deepspeed launcher
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return
    recipe, rest = argv[0], argv[1:]
    if recipe not in available_recipes():
        _fail(f"unknown recipe {recipe!r}; available: {', '.join(available_recipes())}")

    overrides, flags = split_args(rest)
    rest = backbone_overrides(rest)
    if not flags:
        _precheck(recipe, backbone_overrides(overrides))  # plain overrides: fail fast, in one line, before Hydra runs
    import hydra

    from .config import register_configs

    register_configs()
    sys.argv = [f"medusa-train {recipe}", *rest]
    hydra.main(version_base=None, config_path=f"pkg://{RECIPE_PACKAGE}", config_name=recipe)(_task)()



def compose_recipe(recipe: str, overrides: list[str] | None = None):
    """The composed, type-checked config of a recipe, without running it (tests, tooling)."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    from .config import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module=RECIPE_PACKAGE, version_base=None):
        return compose(config_name=recipe, overrides=backbone_overrides(list(overrides or [])))


if __name__ == "__main__":  # python -m medusa_train.cli / deepspeed --module medusa_train.cli
    main()
