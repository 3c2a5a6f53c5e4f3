"""The keys of ``medusa-eval`` and ``medusa-generate``: the commands' own keys, declared here once, and every
registered decoding method's option keys, declared once in the method's options dataclass
(``methods.registry.option``: key, default, help) and generated from there.

A method key's schema default is unset (None): an unset key leaves the method's own default (and says that
the key was not given, which a speculation shape reads: ``tree=tree8`` names Medusa's tree, so
``choice=auto`` leaves it). Its type comes from the options field (OmegaConf checks it when the command line
is read), its value checks from the options class (run before anything loads), its help from the field's
metadata (``--help``). A key two methods share (``tree``) is one key. Replaced keys are refused with what
to give instead (``replaced_key``).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

# keys that are gone, and what replaced them (one line each, before anything loads)
REPLACED = {
    "eagle_tree": "eagle_tree= is gone: give choice=auto (measured on this machine), choice=fixed (the eagle_* keys "
                  "as given) or choice=<eval dir>/<method>_choice.json (what medusa-eval chose)",
    "batch_chains": "batch_chains= is gone: give choice=auto (chain lengths sized per batch size) or choice=fixed "
                    "(the set draft_k / prompt_lookup_tokens at every batch size)",
}
TREE_AUTO = ("tree=auto is gone: give choice=auto (the tree measured on this machine); tree= names a fixed tree "
             "(tree8, a tree file, calibrated:N)")


def declared_key(default: Any = None, help: str = "", *, factory: Any = None, removed: bool = False) -> Any:
    """A command key's one declaration: its default and its ``--help`` line (``command_keys_help``) together,
    so the help cannot drift from the schema. ``removed``: still read (to refuse it with a pointer), not listed."""
    meta = {"help": help, "removed": removed}
    return field(default_factory=factory, metadata=meta) if factory else field(default=default, metadata=meta)


_key = declared_key   # short, for the many declarations below


@dataclass
class CommandKeys:
    """The keys both commands share (not a method's)."""

    heads: str = _key("???", "a heads export directory")
    backbone: Optional[str] = _key(None, "the backbone (unset: the base model recorded in the heads' config.json)")
    device: str = _key("auto", "auto | cpu | cuda")
    dtype: str = _key("float32", "float32 | bfloat16 | float16")
    choice: str = _key("auto", "what each method speculates with: auto (measured on the calibration prompts and this "
                       "machine: Medusa's tree, EAGLE-3's setting, a chain's length per batch size) | fixed (the "
                       "method keys as given) | a <method>_choice.json medusa-eval wrote (its method and choice)")
    mode: str = _key("greedy", "greedy (lossless) | typical (lossy) | sample (exact)")
    temperature: float = _key(0.7, "sampling temperature (mode=typical / sample)")
    top_p: float = _key(1.0, "nucleus sampling's mass (1.0: off)")
    top_k: int = _key(0, "sample among the k likeliest tokens (0: off)")
    typical_epsilon: float = _key(0.09, "mode=typical: the acceptance threshold's cap, "
                                  "min(epsilon, delta * exp(-entropy)); in (0, 1]")
    typical_delta: float = _key(0.3, "mode=typical: the entropy-scaled part of that threshold")
    max_new_tokens: int = _key(128, "tokens generated per prompt (per turn)")
    seed: int = _key(0, "random seed (sampling, random draws)")
    threads: int = _key(0, "torch CPU threads (0 = auto: one per core not kept busy by other processes)")
    # the plans are kept in ~/.cache/medusa-train/kernel_plans.json (runtime/linear_kernels.py)
    kernels: str = _key("auto", "auto: skinny CPU products take the faster formulation, timed once per machine | "
                        "measure: time them afresh | stock: transformers'")
    # runtime/draft_weights.py; drafting reads half the bytes, the backbone verifies, so greedy outputs and
    # sampling's distribution are unchanged
    draft_weights: str = _key("float", "float: heads as trained | float16: fp32 heads' own linears in float16")
    # runtime/static_steps.py, captured_calls.py; report.json's "graphs" records the captures
    graphs: str = _key("auto", "auto: the backbone's steps and the drafters' forwards as CUDA graphs on CUDA (off "
                       "elsewhere) | on (CUDA only) | off (dynamic shapes, no capture) | uncaptured (the static-shape "
                       "steps without capture, any device)")
    # the bound: static_steps.MAX_BUCKET (not imported: --help imports no runtime; a test ties the two)
    graph_buckets: List[int] = _key(help="the row counts (and batch sizes) a captured step is padded up to (strictly "
                                    "increasing, at most 2048); larger steps run uncaptured",
                                    factory=lambda: [1, 2, 4, 8, 16, 32, 64, 128])
    chat_template_args: Dict[str, Any] = _key(help="variables of the backbone's chat template for every prompt, e.g. "
                                              "chat_template_args.enable_thinking=false (Qwen3 with thinking off)",
                                              factory=dict)
    trust_remote_code: bool = _key(False, "run the backbone's (or draft checkpoint's) own modelling code")
    apply_adapter: Optional[bool] = _key(None, "Medusa-2 heads (trained with a LoRA adapter): merge it into the "
                                         "backbone; unset: when the backbone is the one the heads record (no "
                                         "backbone= given); false for a merged model")


@dataclass
class EvalKeys(CommandKeys):
    heads: Optional[str] = _key(None, "a heads export directory; needed only by the methods that use heads")
    prompts: str = _key("embedded:mtbench", "embedded:mtbench | code | a JSONL of prompts")
    num_prompts: Optional[int] = _key(None, "first N prompts (unset: all; choice=auto calibrates on the set's "
                                      "last, never evaluated)")
    turns: str = _key("first", "first | both")
    method: Any = _key(None, removed=True)  # refused with a pointer to methods=
    methods: Optional[List[str]] = _key(None, "the methods to measure (unset: the heads family's default method); "
                                        "the baselines are added")
    compare: bool = _key(False, "run every available method, write compare.md + compare.png")
    calibration_prompts: int = _key(8, "prompts held out (the set's last) to measure choice=auto on")
    calibration_tokens: int = _key(48, "tokens generated per calibration prompt")
    tree_budgets: List[int] = _key(help="the tree sizes (nodes) choice=auto measures for Medusa, one prompt at a "
                                            "time (not batched, not with tree=calibrated:N)",
                                   factory=lambda: [1, 2, 3, 4, 6, 8, 12, 16, 24, 32])
    out: Optional[str] = _key(None, "the report folder, new or an earlier evaluation's (unset: <heads>/../eval, "
                              "<heads>/../compare with compare=true; runs/eval or runs/compare without heads)")
    progress_bar: bool = _key(True, "show progress bars")
    batch_size: Any = _key(1, "1: one prompt at a time | B | [1,2,4,...]: batched evaluation (batch_eval)")
    batch_rounds: int = _key(1, "batched evaluation: each batch decoded this many times per method, interleaved")


@dataclass
class GenerateKeys(CommandKeys):
    choice: str = _key("fixed", "fixed | a <method>_choice.json medusa-eval wrote (auto is an evaluation's to make)")
    prompt: Any = _key(None, "a prompt, or a list of prompts decoded together: prompt=[\"...\", \"...\"]")
    prompts_file: Optional[str] = _key(None, "several prompts: a JSONL (forms as medusa-eval prompts=) | code")
    batch_size: Any = _key(None, "several prompts: how many decode together (unset: all of them)")
    system: Optional[str] = _key(None, "a system message for the chat template")


# medusa-generate decodes one prompt at a time by default: a smaller tree than the library's (tree8) pays there
GENERATE_DEFAULTS = {"tree": "tree4"}
_PLAIN_TYPES = (bool, int, float, str)


def method_keys() -> dict[str, tuple[Any, str, Any, list[str]]]:
    """key -> (its options field's type, its help, its default, the methods taking it), over every registered
    method (the first declaration of a shared key gives its type and default; a method that explains it
    otherwise adds its own words to the help)."""
    from .methods.registry import get, names   # the registry imports the runtime: only where keys are built

    keys: dict[str, tuple[Any, str, Any, list[str]]] = {}
    for name in names():
        cls = get(name).options
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            key, text = f.metadata.get("key"), f.metadata.get("help", "")
            if not key:
                continue
            if key not in keys:
                default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
                keys[key] = (hints.get(f.name, Any), text, default, [])
            elif text not in keys[key][1]:
                kind, known, default, methods = keys[key]
                keys[key] = (kind, f"{known}; {name}: {text}", default, methods)
            keys[key][3].append(name)
    return keys


def _optional(kind) -> Any:
    """The schema type of a method key: its field's plain type (Optional[int] -> int), or Any."""
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    base = args[0] if len(args) == 1 else kind
    return Optional[base] if base in _PLAIN_TYPES else Any


def schema(name: str, base: type, defaults: Optional[dict] = None) -> type:
    """``base``'s keys plus every method key not among them (unset by default, or ``defaults[key]``)."""
    own = {f.name for f in dataclasses.fields(base)}
    extra = [(key, _optional(kind), field(default=(defaults or {}).get(key)))
             for key, (kind, _, _, _) in method_keys().items() if key not in own]
    return dataclasses.make_dataclass(name, extra, bases=(base,))


def _shown(default: Any) -> str:
    """A default as it is typed on the command line."""
    if default is None:
        return "unset"
    if default == "???":
        return "required"
    if isinstance(default, bool):
        return str(default).lower()
    if isinstance(default, list):
        return "[" + ",".join(map(str, default)) + "]"
    return str(default)


def command_keys_help(keys: type) -> str:
    """``--help``'s list of a command's own keys (``EvalKeys`` / ``GenerateKeys``): each with its default and
    its help, read from the one declaration (``_key``). Imports nothing: medusa-generate --help stays instant."""
    lines = []
    for f in dataclasses.fields(keys):
        if f.metadata.get("removed"):
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        lines.append(f"  {f.name} (default {_shown(default)}): {f.metadata.get('help', '')}")
    return "\n".join(lines)


def keys_help() -> str:
    """``--help``'s list of method keys: each with its default, its help and the methods taking it."""
    lines = []
    for key, (_, text, default, methods) in sorted(method_keys().items()):
        shown = "fitted" if default is None else default
        lines.append(f"  {key} (default {shown}; {', '.join(methods)}): {text}")
    return "\n".join(lines)


def replaced_key(argv: list[str]) -> Optional[str]:
    """The line refusing the first replaced key in ``argv`` (``REPLACED``, tree=auto), or None."""
    for arg in argv:
        key, _, value = arg.partition("=")
        if key in REPLACED:
            return REPLACED[key]
        if key == "tree" and value == "auto":
            return TREE_AUTO
    return None
