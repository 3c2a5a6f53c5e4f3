"""The one list of decoding methods, and ``generate`` / ``stream`` over any of them.

Each method registers itself in its own file with a ``Method``: its name, a one-line summary
(``medusa-eval --help``), its typed options dataclass (fields carry their command-line key, default and help
in their metadata: ``option``; the command lines' keys are generated from them), how to build its ``Decoder``
(or, for a method that is not a Decoder, a ``runner``), its speculation shape, what it costs, and what it
needs. ``evaluate``, ``check_methods``, the CLI and its
help read this registry; adding a method is its own file plus one ``register(Method(...))``.

    from inference.methods import generate
    out = generate(m, ids, "medusa", tree="tree4", max_new_tokens=64)
    out = generate(m, ids, "draft", draft="self:8", k=3)
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

import torch

from ..cli_support import enum_value
from ..errors import UserError
from ..runtime.decode import (Decoder, GenerationOutput, TokenStream, as_medusa_model, check_budget, check_call,
                              check_eos_ids, prompt_tensor, run_decoder)
from ..runtime.batch_decode import BatchOutput, run_batch
from ..runtime.model import MedusaModel, kv_bytes_per_token
from ..runtime.verify import SamplingConfig


def option(default, key: Optional[str] = None, help: str = ""):
    """An options field: its default, its ``medusa-eval`` key (None: not a command-line key), its help."""
    kw = {"default_factory": default} if callable(default) and not isinstance(default, type) else {"default": default}
    return dataclasses.field(metadata={"key": key, "help": help}, **kw)


@dataclass
class NoOptions:
    """The options of a method that has none."""


@dataclass
class Costs:
    """What a method costs beyond plain decoding (the trade-off matrix's columns)."""

    extra_parameters: int = 0
    extra_parameter_bytes: int = 0
    extra_kv_cache_bytes: int = 0  # cache slots beyond prompt + max_new_tokens, at the run's length
    training: str = "none"


def extra_parameters(module, backbone) -> tuple[int, int]:
    """(count, bytes) of ``module``'s parameters that are not tensors of ``backbone``."""
    if module is None:
        return 0, 0
    shared = {p.data_ptr() for p in backbone.parameters()}
    own = [p for p in module.parameters() if p.data_ptr() not in shared]
    return sum(p.numel() for p in own), sum(p.numel() * p.element_size() for p in own)


def slot_costs(m: MedusaModel, slots: int) -> Costs:
    """A training-free method that only allocates ``slots`` extra cache entries."""
    return Costs(extra_kv_cache_bytes=slots * kv_bytes_per_token(m))


def heads_costs(m: MedusaModel, slots: int) -> Costs:
    """A method that loads ``m``'s heads and ``slots`` extra cache entries."""
    n, size = extra_parameters(m.heads, m.model)
    return Costs(n, size, slots * kv_bytes_per_token(m), "heads")


@dataclass(frozen=True)
class Method:
    """One decoding method (see the module docstring).

    decoder(m, options, sampling, seed) -> Decoder; runner(m, prompt_ids, max_new_tokens,
    sampling, seed, options, eos_token_ids=...) -> GenerationOutput for a method that is not a Decoder;
    batch_decoder(m, options, sampling, seed, ragged) -> the method's ``BatchTreeDecoder`` (None: it
    decodes one prompt at a time; ``generate_batch`` refuses it for batches); shape: what it speculates with
    and how that is chosen, applied, recorded and read (``shape.SpeculationShape``; None: nothing to choose).
    costs(m, options, run_length) -> Costs. prepare(m, options) -> options resolves what is
    loaded once per evaluation (a draft model). fit(m, options) -> options fills the settings left
    unset from the loaded model (EAGLE-3: a tree no deeper than the drafter was trained to draft);
    ``fitted_options`` applies it wherever options meet a model. proposed(options) -> draft tokens counted per
    step for the acceptance rate (None: what each step reports). refuses(heads spec) -> why the
    method cannot decode with those heads, in one line (None: it can)."""

    name: str
    summary: str
    options: type = NoOptions
    decoder: Optional[Callable[..., Decoder]] = None
    runner: Optional[Callable[..., GenerationOutput]] = None
    batch_decoder: Optional[Callable[..., Any]] = None  # (m, options, sampling, seed, ragged) -> BatchTreeDecoder
    shape: Any = None   # a shape.SpeculationShape
    costs: Callable[..., Costs] = lambda m, options, run_length: Costs()
    prepare: Optional[Callable[[MedusaModel, Any], Any]] = None
    fit: Optional[Callable[[MedusaModel, Any], Any]] = None   # (m, options) -> options, unset ones set for m
    proposed: Optional[Callable[[Any], int]] = None
    needs_heads: bool = False
    baseline: bool = False     # a speedup reference: added to every evaluation (see devices), no acceptance rate
    # the device types (torch.device.type) on which evaluations add this baseline; empty: every device. Named in
    # methods= it runs on any device (a GPU-only reference would only slow every CPU run)
    devices: tuple[str, ...] = ()
    greedy_only: bool = False
    refuses: Optional[Callable[[Any], Optional[str]]] = None
    # (options) -> rows a step verifies beyond its shape's choice, at most as many levels deeper (medusa_lookup's
    # looked-up chain grafted under the tree): a choice file's ``static_shapes`` counts them
    grafted: Optional[Callable[[Any], int]] = None
    # among the methods that decode the same heads, the higher one is the default (medusa-eval without
    # methods=, medusa-generate); equal ones keep the registration order
    default_priority: int = 0

    def keys(self) -> list[str]:
        """Its ``medusa-eval`` option keys."""
        return [f.metadata["key"] for f in dataclasses.fields(self.options) if f.metadata.get("key")]


# The built-in methods, in the order reports and ``--help`` list them: the module that defines and
# registers each. Adding a built-in method is its module plus one line here.
BUILTIN_MODULES = (
    "inference.methods.medusa",
    "inference.methods.draft",
    "inference.methods.lookahead",
    "inference.methods.prompt_lookup",
    "inference.methods.medusa_lookup",
    "inference.methods.eagle3",
    "inference.methods.eagle3_lookup",
    "inference.methods.autoregressive",
    "inference.methods.hf_generate",
)

_METHODS: dict[str, Method] = {}
PLAIN_METHOD = "autoregressive"   # plain decoding: what a choice of no speculation at all decodes with


def _load_builtins() -> None:
    """Import the built-in method modules (each registers itself); by name, so this module never
    imports the methods that import it."""
    for module in BUILTIN_MODULES:
        importlib.import_module(module)


def register(method: Method) -> Method:
    if method.name in _METHODS:
        raise ValueError(f"decoding method {method.name!r} is registered twice")
    if (method.decoder is None) == (method.runner is None):
        raise ValueError(f"method {method.name!r} needs exactly one of decoder= or runner=")
    _METHODS[method.name] = method
    return method


def unregister(name: str) -> None:
    _METHODS.pop(name, None)


def _builtin_rank(method: Method) -> int:
    """Where the module that defines ``method`` sits in ``BUILTIN_MODULES`` (after them: a plug-in)."""
    module = getattr(method.decoder or method.runner, "__module__", None)
    return BUILTIN_MODULES.index(module) if module in BUILTIN_MODULES else len(BUILTIN_MODULES)


def names() -> tuple[str, ...]:
    """The built-in methods in ``BUILTIN_MODULES`` order whichever was imported first (the default
    method for a set of heads is the first that takes them), then plug-ins as registered; the
    baselines last."""
    _load_builtins()
    return tuple(sorted(_METHODS, key=lambda x: (_METHODS[x].baseline, _builtin_rank(_METHODS[x]))))


def get(name: str) -> Method:
    _load_builtins()
    if not isinstance(name, str):   # methods=[...] given where one method goes: a TypeError (unhashable) before
        raise UserError(f"a method is one name (one of {', '.join(names())}), got {name!r}")
    if name not in _METHODS:
        raise UserError(f"unknown method {name!r}; choose from {', '.join(names())}")
    return _METHODS[name]


def check_methods(methods: Sequence[str], m: Optional[MedusaModel] = None) -> list[str]:
    """Known names, no duplicates, heads present when a method needs them; else one ``UserError`` line."""
    if isinstance(methods, str) or not methods:
        raise UserError(f"methods must be a non-empty list of names from {', '.join(names())}")
    for x in methods:
        get(x)
    if len(set(methods)) != len(methods):
        raise UserError(f"a method is listed twice in {list(methods)}")
    needing = [x for x in methods if _METHODS[x].needs_heads]
    if m is not None and needing and m.heads is None:
        free = ", ".join(x for x in names() if not _METHODS[x].needs_heads and not _METHODS[x].baseline)
        raise UserError(f"method {needing[0]} needs Medusa heads (heads=<export directory>); the training-free "
                        f"methods {free} run without them")
    if m is not None and m.heads is not None:
        for x in needing:
            reason = _METHODS[x].refuses(m.heads.spec) if _METHODS[x].refuses is not None else None
            if reason:
                raise UserError(reason)
    return list(methods)


def check_greedy_only(methods: Iterable[str], sampling: Optional[SamplingConfig]) -> None:
    """Outside greedy mode (``sampling``; None: greedy), the first of ``methods`` registered ``greedy_only``
    refused in one line. The one wording of the rule: ``generate`` / ``stream``, the evaluations and the commands'
    checks before the backbone loads (``cli_checks``) all refuse with it."""
    if sampling is None or sampling.is_greedy:
        return
    refused = [x for x in methods if get(x).greedy_only]
    if refused:
        raise UserError(f"{refused[0]} is measured in greedy mode only")


def methods_for_heads(spec) -> list[str]:
    """The methods that decode with heads of ``spec`` (``needs_heads``, not refusing them), the default first
    (``default_priority``, then registration order)."""
    usable = [x for x in names() if _METHODS[x].needs_heads
              and (_METHODS[x].refuses is None or not _METHODS[x].refuses(spec))]
    return sorted(usable, key=lambda x: -_METHODS[x].default_priority)


# -- options --------------------------------------------------------------------------------
def make_options(method: str, options=None, **fields):
    """``method``'s options: ``options`` (or the defaults) with ``fields`` replaced."""
    cls = get(method).options
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise UserError(f"method {method} has no option {unknown[0]!r}; its options: "
                        f"{', '.join(sorted(known)) or 'none'}")
    if options is None:
        return cls(**fields)
    if type(options) is not cls:   # a subclass is another method's (eagle3_lookup's for eagle3): its settings lost
        if not (dataclasses.is_dataclass(options) and issubclass(cls, type(options))):
            raise UserError(f"method {method} takes {cls.__name__} options, got {type(options).__name__}")
        # the settings a method extends (medusa_lookup's prompt-lookup settings): the rest at defaults
        return cls(**{**{f.name: getattr(options, f.name) for f in dataclasses.fields(options)}, **fields})
    return dataclasses.replace(options, **fields) if fields else options


def fitted_options(m, method: str, options):
    """``method``'s options with the settings left unset filled from the model ``m`` (``Method.fit``)."""
    fit = get(method).fit
    return fit(as_medusa_model(m), options) if fit is not None else options


def options_from_keys(method: str, config) -> Any:
    """``method``'s options read from command-line keys (``config.<key>``), defaults elsewhere (a key
    absent from ``config`` or left unset there, None)."""
    cls = get(method).options
    values = {f.name: enum_value(getattr(config, f.metadata["key"])) for f in dataclasses.fields(cls)
              if f.metadata.get("key") and getattr(config, f.metadata["key"], None) is not None}
    return cls(**values)


def _plain(v):
    if v is None or isinstance(v, (str, int, float, bool)):
        return v
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if hasattr(v, "to_dict"):   # a SpeculationSchedule: its choice per batch size
        return v.to_dict()
    return getattr(v, "name", None) or type(v).__name__


def options_report(options) -> dict:
    """The options as the report records them: keyed by their command-line keys."""
    return {f.metadata.get("key") or f.name: _plain(enum_value(getattr(options, f.name)))
            for f in dataclasses.fields(options)}


# -- one generate / stream for every method ---------------------------------------------------
def _runner_steps(runner, m, input_ids, max_new_tokens: int, max_steps: Optional[int], *args, **kwargs):
    """A runner's whole generation as one streamed chunk, checked and run when the stream is first iterated, as
    ``run_decoder`` runs a decoder. One token a step: ``max_steps`` (after the prefill's token) bounds the tokens,
    and an answer it cut ends for "steps"."""
    ids = prompt_tensor(m, input_ids)[0].tolist()
    check_budget(m, len(ids), max_new_tokens)
    n = max_new_tokens if max_steps is None else max(1, min(max_new_tokens, max_steps + 1))
    out = runner(m, ids, n, *args, **kwargs)
    if n < max_new_tokens and out.finish_reason == "length":
        out.finish_reason = "steps"
    yield list(out.tokens)
    return out


def _prepare(m, method: str, options, sampling: Optional[SamplingConfig], option_fields: dict, call: tuple):
    """(the method, its options, the model as a ``MedusaModel``, the sampling config), checked; ``call``: the
    call's (max_new_tokens, seed, eos_token_ids, max_steps)."""
    spec = get(method)
    check_call(*call, sampling)
    m = as_medusa_model(m)
    check_eos_ids(m, call[2])
    opts = fitted_options(m, method, make_options(method, options, **option_fields))
    sampling = sampling or SamplingConfig()
    check_greedy_only([method], sampling)
    return spec, opts, m, sampling


def stream(m, input_ids, method: str = "medusa", *, options=None, max_new_tokens: int = 128,
           sampling: Optional[SamplingConfig] = None, seed: Optional[int] = None,
           eos_token_ids: Optional[Iterable[int]] = None, max_steps: Optional[int] = None,
           **option_fields) -> TokenStream:
    """Stream ``method``'s decoding: iterate for each step's new token ids; ``.result`` afterwards.

    ``m``: a ``MedusaModel`` (or a bare causal LM for methods without heads). ``options``: the
    method's options object; ``option_fields`` set its fields by name (``tree="tree4"``).
    eos_token_ids: None = the model's, ``()`` = never stop early."""
    spec, opts, m, sampling = _prepare(m, method, options, sampling, option_fields,
                                       (max_new_tokens, seed, eos_token_ids, max_steps))
    input_ids = prompt_tensor(m, input_ids)   # checked now, not at the first iteration (and read once)
    check_budget(m, input_ids.shape[1], max_new_tokens)
    if spec.runner is not None:
        return TokenStream(_runner_steps(spec.runner, m, input_ids, max_new_tokens, max_steps, sampling, seed, opts,
                                         eos_token_ids=eos_token_ids))
    decoder = spec.decoder(m, opts, sampling, seed)
    return TokenStream(run_decoder(decoder, m, input_ids, max_new_tokens, eos_token_ids, max_steps))


def generate(m, input_ids, method: str = "medusa", *, options=None, max_new_tokens: int = 128,
             sampling: Optional[SamplingConfig] = None, seed: Optional[int] = None,
             eos_token_ids: Optional[Iterable[int]] = None, max_steps: Optional[int] = None,
             on_tokens: Optional[Callable[[list[int]], None]] = None, **option_fields) -> GenerationOutput:
    """Run ``method`` to the end (arguments as ``stream``); ``on_tokens`` gets each step's new tokens."""
    if on_tokens is not None and not callable(on_tokens):   # else its TypeError came after the prompt's prefill
        raise UserError(f"on_tokens must be a function of each step's new token ids, got {type(on_tokens).__name__}")
    s = stream(m, input_ids, method, options=options, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed,
               eos_token_ids=eos_token_ids, max_steps=max_steps, **option_fields)
    for chunk in s:
        if on_tokens is not None and chunk:
            on_tokens(chunk)
    return s.result


def generate_batch(m, prompts, method: str = "medusa", *, options=None, max_new_tokens: int = 128,
                   sampling: Optional[SamplingConfig] = None, seed: Optional[int] = None,
                   eos_token_ids: Optional[Iterable[int]] = None, max_steps: Optional[int] = None,
                   ragged: str = "compact", **option_fields) -> BatchOutput:
    """Decode a batch of prompts (a list of id lists of any lengths, a [B, L] tensor, or a tokenizer's output: its
    rows without the padding its ``attention_mask`` marks) together with ``method``; returns a
    ``BatchOutput`` (a ``GenerationOutput`` per prompt). Arguments as ``generate``; ``ragged`` picks
    the cache layout (``batch_cache``). Greedy rows are token-identical to ``generate`` of each prompt. Sampled
    (``seed``): a batch of one prompt draws what ``generate`` of it draws with that seed (``draft_adaptive`` aside:
    batches keep k fixed); the rows of a larger batch share one generator, so each follows the same law with other
    draws than its prompt alone."""
    spec = get(method)
    if spec.batch_decoder is None:
        raise UserError(f"method {method} decodes one prompt at a time; batched methods: {', '.join(batched_names())}")
    spec, opts, m, sampling = _prepare(m, method, options, sampling, option_fields,
                                       (max_new_tokens, seed, eos_token_ids, max_steps))
    decoder = spec.batch_decoder(m, opts, sampling, seed, ragged)
    with torch.inference_mode():
        return run_batch(decoder, m, prompts, max_new_tokens, eos_token_ids, max_steps)


def batched_names() -> tuple[str, ...]:
    """The methods that decode batches (``batch_decoder``), in ``names()`` order."""
    return tuple(x for x in names() if _METHODS[x].batch_decoder is not None)


def describe() -> str:
    """The methods for ``--help``: name, summary and option keys of each."""
    lines = []
    for spec in map(get, names()):
        keys = spec.keys()
        lines.append(f"  {spec.name}: {spec.summary}" + (f" [{', '.join(keys)}]" if keys else ""))
    return "\n".join(lines)
