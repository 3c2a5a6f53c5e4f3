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

The heads family is a config group (``recipes/heads/<kind>.yaml``, the family's own keys beside the common
ones): ``heads=eagle3`` selects it, and so does ``heads.kind=eagle3``, which is rewritten into that choice.
A key of another family (``heads.inner_dim`` with medusa heads) is refused in one line naming its family.
"""

from __future__ import annotations

import os
import re
import sys
from importlib import resources
from pathlib import Path

from inference.cli_support import config_error_line, enum_value, fail, non_boolean_override
from inference.errors import UserError
from .config import register_configs, validate
from .families import family_kinds, stray_key_line

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


def recipe_overrides(overrides: list[str]) -> list[str]:
    """The command line's overrides as Hydra composes them (``backbone_overrides``, ``heads_kind_overrides``)."""
    return heads_kind_overrides(backbone_overrides(overrides))


def compose_error_line(recipe: str, overrides: list[str], e: BaseException) -> str:
    """A composition error as one line; a ``heads`` key that the chosen family's group does not have (another
    family's setting, or a typo) names the family whose key it is."""
    text = f"{e}\n{e.__cause__ or ''}"
    stray = re.search(r"Key '(\w+)' not in '\w*HeadsConfig'", text)
    if stray is None:
        return f"{config_error_line(e)} (list the keys: medusa-train {recipe} --cfg job)"
    chosen = [a.split("=", 1)[1] for a in recipe_overrides(overrides) if override_key(a) == "heads" and "=" in a]
    try:
        kind = chosen[-1] if chosen else compose_recipe(recipe, []).heads.kind
        return stray_key_line(kind, stray.group(1))
    except Exception:  # the family itself is unknown: Hydra's own line names the missing group option
        return f"{config_error_line(e)} (list the keys: medusa-train {recipe} --cfg job)"


def _task(cfg) -> None:
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
            from .preflight import preflight  # loads torch: not for --help

            validate(cfg)
            preflight(cfg)
        write_run_record(cfg)
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
_PRINT_FLAGS = {"--cfg", "-c", "--info", "-i", "--help", "-h", "--hydra-help"}  # print, run nothing


def create_output_dir(output_dir) -> None:
    """Create the accepted run's folder (what Hydra would do next), or say in one line why it cannot be
    (``config.check_output_dir`` cannot tell from permissions alone: root may write /proc, the kernel refuses)."""
    try:
        Path(str(output_dir)).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        _fail(f"output_dir={output_dir} cannot be created: {e.strerror or e}")


RECORD_DIR = ".hydra"


def write_run_record(cfg) -> None:
    """Hydra's record of the run, ``<output_dir>/.hydra/{config,hydra,overrides}.yaml``, written here once the
    configuration is accepted: the recipes set ``hydra.output_subdir: null`` because Hydra writes it before
    the app runs, so a refused command left one behind, and a refused resume overwrote the run's own record
    with the settings it refused. Each file is replaced atomically and only when its text changes: an idle
    rerun touches nothing; an accepted resume records what it changed (safe keys only, e.g. trainer.max_steps)."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    if int(os.environ.get("RANK", "0") or 0) != 0:  # one writer per run
        return
    hydra_cfg = HydraConfig.instance().cfg
    record = {"config.yaml": OmegaConf.to_yaml(cfg), "hydra.yaml": OmegaConf.to_yaml(hydra_cfg),
              "overrides.yaml": OmegaConf.to_yaml(hydra_cfg.hydra.overrides.task)}
    folder = Path(str(cfg.output_dir)) / RECORD_DIR
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in record.items():
        path = folder / name
        if path.is_file() and path.read_text(encoding="utf-8") == text:
            continue
        tmp = folder / f".{name}.tmp-{os.getpid()}"
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)


def _precheck(recipe: str, overrides: list[str], sweep: bool = False) -> None:
    """Compose and validate the config, and check that the backbone can take (and this machine hold)
    ``data.max_length`` from its config alone; one error line for a bad key, type, value or size.
    A single run's folder is then created; a sweep job (``sweep``) leaves that, and its resume check, to Hydra."""
    global _PRECHECKED
    try:
        cfg = compose_recipe(recipe, overrides)
    except Exception as e:  # Hydra / OmegaConf composition errors
        _fail(compose_error_line(recipe, overrides, e))
    check_boolean_overrides(cfg, overrides)
    try:
        from .preflight import preflight  # loads torch: not for --help

        validate(cfg)
        preflight(cfg, resume=not sweep)
    except UserError as e:
        _fail(str(e))
    if not sweep:
        create_output_dir(cfg.output_dir)  # accepted: now the folder may be made (Hydra would, with a traceback)
        _PRECHECKED = True


def check_boolean_overrides(cfg, overrides: list[str]) -> None:
    """A boolean key takes true/false (yes/no, on/off, 1/0) only: OmegaConf alone would read any integer
    (``heads.scale_input=3``) as true. Judged on the composed config ``cfg``, whose ``heads`` node is the
    chosen family's schema (its own boolean keys included)."""
    not_boolean = non_boolean_override(cfg, overrides)
    if not_boolean:
        arg, value = not_boolean
        _fail(f"{override_key(arg)} must be true or false (or yes/no, on/off, 1/0), got {value!r}")


def sweep_jobs(overrides: list[str]) -> list[list[str]]:
    """The overrides of each job a Hydra sweep (``-m``) runs, crossed as Hydra's basic sweeper crosses them
    (``a=1,2 b=x,y``: four jobs; ``range()`` and ``choice()`` too); one line for what it cannot parse."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
        return [list(job) for job in BasicSweeper.split_arguments(parsed, None)[0]]
    except Exception as e:  # an override Hydra's grammar refuses, or a sweep the basic sweeper cannot run
        _fail(f"{config_error_line(e)} (a sweep is key=a,b,c, range(start,stop) or choice(a,b))")


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
    try:
        overrides = recipe_overrides(overrides)
    except UserError as e:
        _fail(str(e))
    names = {f.split("=", 1)[0] for f in flags}
    multirun = bool(names & {"-m", "--multirun"})
    if multirun and names & {"--cfg", "-c", "--info", "-i"}:
        _fail("-m/--multirun runs a sweep and --cfg/--info print a config: give one of them")
    if multirun and not names & _PRINT_FLAGS:
        # Every job of a sweep, before Hydra runs the first: one bad combination refuses the sweep, nothing written.
        for job in sweep_jobs(overrides):
            _precheck(recipe, job, sweep=True)
    elif not names & _PRINT_FLAGS:
        _precheck(recipe, overrides)  # a single run: fail fast, in one line, before Hydra runs
    import hydra

    register_configs()
    # Flags first: Hydra's argparse takes no flag after its first override (output_dir=x -m a=1,2).
    sys.argv = [f"medusa-train {recipe}", *flags, *overrides]
    hydra.main(version_base=None, config_path=f"pkg://{RECIPE_PACKAGE}", config_name=recipe)(_task)()



def compose_recipe(recipe: str, overrides: list[str] | None = None):
    """The composed, type-checked config of a recipe, without running it (tests, tooling)."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module=RECIPE_PACKAGE, version_base=None):
        return compose(config_name=recipe, overrides=recipe_overrides(list(overrides or [])))


if __name__ == "__main__":  # python -m medusa_train.cli / deepspeed --module medusa_train.cli
    main()
