"""``medusa-eval`` and ``medusa-generate``: measure decoding methods, or decode with Medusa heads.

    medusa-eval heads=runs/medusa1_smollm2/heads                       # MT-Bench first turns, choice=auto
    medusa-eval heads=runs/a/heads num_prompts=10 max_new_tokens=96 out=runs/a/eval
    medusa-eval heads=runs/a/heads tree=tree8 turns=both prompts=my_prompts.jsonl
    medusa-eval heads=runs/a/heads mode=sample temperature=0.7 methods=[medusa]
    medusa-eval methods=[lookahead] prompts=code                         # no heads: training-free methods
    medusa-eval methods=[draft,prompt_lookup] draft=self:8 draft_k=3     # + the autoregressive / HF baselines
    medusa-eval heads=runs/a/heads methods=[medusa_lookup] prompts=code  # Medusa tree + prompt lookup branch
    medusa-eval compare=true prompts=code out=runs/compare_code          # every method: compare.md + .png
    medusa-eval heads=runs/e3/heads methods=[eagle3] choice=fixed eagle_nodes=4 eagle_depth=1
    medusa-eval heads=runs/e3/heads methods=[eagle3_lookup] eagle_lookup_tokens=6   # + a prompt-lookup branch
    medusa-eval heads=runs/a/heads batch_size=[1,2,4,8,16,32]          # batched: throughput per batch size
    medusa-generate heads=runs/a/heads prompt="Write a haiku about the sea." choice=runs/a/eval/medusa_choice.json
    medusa-generate heads=runs/a/heads 'prompt=["Say hi.", "Name a colour."]'   # decoded as one batch
    medusa-generate heads=runs/e3/heads prompt="Hi." choice=runs/e3/eval/eagle3_lookup_choice.json  # eval's pick

Key=value overrides as in ``medusa-train`` (Hydra). The runtime library never imports Hydra; only these entry
points do. User mistakes print one line and exit 2, before anything loads where the keys, the heads'
config.json and the prompts decide (cli_checks.py; the commands themselves: cli_run.py). Boolean keys take true/false, yes/no, on/off, 1/0. Each
method's keys, their defaults and help are its options' own (listed by medusa-eval --help; cli_keys.py).

What a method speculates with is chosen by ``choice``: auto (medusa-eval's default: measured on held-out
calibration prompts and this machine, per method: Medusa's tree, EAGLE-3's (nodes, depth, top-k), a chain's
length per batch size; plain decoding where nothing pays) | fixed (the method's keys as given; a named
tree=tree8 / tree file / calibrated:N is always used as given) | <file>: a ``<method>_choice.json`` that
medusa-eval writes beside report.json for every choice it measured; medusa-generate decodes with that file's
method and choice, a batched evaluation's per batch size. Replaced keys (eagle_tree=, batch_chains=,
tree=auto) and the files they wrote (tree_schedule.json, eagle3[_lookup]_tree.json) are refused in one line.

medusa-eval picks its methods with ``methods=[...]`` (default: the first method that decodes with the
heads: medusa, or eagle3_lookup for EAGLE-3 heads); ``compare=true`` is short for every available method
(those needing heads only with heads=, and only those that decode with them) and also writes the
trade-off matrix; medusa-generate decodes with that same default method (tree=tree4 for Medusa heads). The
baselines are always added: autoregressive, and hf_generate in greedy mode (and on CUDA hf_generate_static,
transformers' generate with its static, compiled cache). Without heads= the backbone is
``backbone=`` (default embedded:smollm2). Prompt sets: embedded:mtbench (default), code (bundled code /
structured-output prompts) or a JSONL file.

batch_size=B (or a list, batch_size=[1,2,4,8]) evaluates batched decoding instead: the prompts in
consecutive batches of B, each batch decoded by every requested method that batches (generate_batch),
the plain batched loop and transformers' batched generate; report.json's ``batched`` section and
throughput_vs_batch.png, each method's speculation sized per batch size with choice=auto. medusa-generate
takes several prompts as prompt=[...] or prompts_file= (a JSONL as medusa-eval's prompts=) and decodes them
together (batch_size=N: N at a time), with a batched evaluation's choice file speculating as it measured.
"""
from __future__ import annotations

from typing import Optional

from .cli_keys import (GENERATE_DEFAULTS, EvalKeys, GenerateKeys, command_keys_help, keys_help, replaced_key,
                       schema)
from .cli_support import run_cli

_SCHEMAS: dict = {}


def __getattr__(name: str):
    """``EvalConfig`` / ``GenerateConfig``: the commands' schemas, built from the method registry on first use
    (building them imports the runtime, which ``medusa-generate --help`` should not wait for)."""
    if name not in ("EvalConfig", "GenerateConfig"):
        raise AttributeError(name)
    if name not in _SCHEMAS:
        _SCHEMAS[name] = schema(name, EvalKeys) if name == "EvalConfig" else \
            schema(name, GenerateKeys, GENERATE_DEFAULTS)
    return _SCHEMAS[name]


def eval_help() -> str:
    """``medusa-eval --help``: the module docstring, the registered methods and every method key (imports the
    runtime)."""
    from .methods.registry import describe   # lazy: the registry imports the runtime, only for --help's method list

    return (__doc__.strip() + "\n\nmedusa-eval keys:\n" + command_keys_help(EvalKeys)
            + "\n\nmedusa-eval methods ([their keys]):\n" + describe()
            + "\n\nmethod keys (unset: the method's default):\n" + keys_help() + "\n")


def generate_help() -> str:
    """``medusa-generate --help``: the module docstring and the command's own keys (no runtime import: the method
    keys' list needs the registry, so it is medusa-eval --help's)."""
    changed = ", ".join(f"{k}={v}" for k, v in GENERATE_DEFAULTS.items())
    return (__doc__.strip() + "\n\nmedusa-generate keys:\n" + command_keys_help(GenerateKeys)
            + f"\n\nmethod keys: as medusa-eval --help lists them, except here {changed}\n")


def _command(name: str):
    """``cli_run``'s command ``name`` (``run_eval`` / ``run_generate``), to call once the keys are accepted."""
    from . import cli_run   # lazy: the runtime, the evaluation and the loaders load only once a command runs

    return getattr(cli_run, name)


def eval_main(argv: Optional[list[str]] = None) -> None:
    run_cli("medusa-eval", eval_help, lambda: __getattr__("EvalConfig"), lambda cfg: _command("run_eval")(cfg),
            argv, refuse=replaced_key)


def generate_main(argv: Optional[list[str]] = None) -> None:
    run_cli("medusa-generate", generate_help, lambda: __getattr__("GenerateConfig"),
            lambda cfg: _command("run_generate")(cfg), argv, refuse=replaced_key)
