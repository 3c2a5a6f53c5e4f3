"""``medusa-train <recipe> [hydra overrides]`` — train Medusa heads from a packaged recipe.

Examples::

    medusa-train medusa1_smollm2                                  # the embedded default
    medusa-train medusa1_smollm2 heads.num_heads=3 trainer.max_steps=200 output_dir=runs/a
    medusa-train debug_tiny --cfg job                             # print the composed config
    medusa-train debug_tiny -m heads.num_layers=1,2               # Hydra multirun
    deepspeed --num_gpus 2 -m medusa_train.cli debug_tiny trainer.zero_stage=2   # N processes

User mistakes (unknown recipe or key, wrong type, missing file, ...) print one line and exit
non-zero; heavy imports happen only once a recipe runs, so ``--help`` is instant.
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


def _precheck(recipe: str, overrides: list[str]) -> None:
    """Compose and validate the config; print a one-line error for a bad key, type or value."""
    from inference.errors import UserError

    from .config import validate

    try:
        validate(compose_recipe(recipe, overrides))
    except UserError as e:
        _fail(str(e))
    except Exception as e:  # Hydra / OmegaConf composition errors
        _fail(f"{config_error_line(e)} (list the keys: medusa-train {recipe} --cfg job)")


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    argv = [a for a in argv if not a.startswith("--local_rank")]  # set by the deepspeed launcher
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return
    recipe, rest = argv[0], argv[1:]
    if recipe not in available_recipes():
        _fail(f"unknown recipe {recipe!r}; available: {', '.join(available_recipes())}")

    if rest and all("=" in a and not a.startswith("-") for a in rest):
        _precheck(recipe, rest)  # plain overrides: fail fast, in one line, before Hydra runs
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
        return compose(config_name=recipe, overrides=list(overrides or []))


if __name__ == "__main__":  # python -m medusa_train.cli / deepspeed --module medusa_train.cli
    main()
