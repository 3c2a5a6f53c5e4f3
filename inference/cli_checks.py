"""What ``medusa-eval`` and ``medusa-generate`` refuse before the backbone loads.

A backbone takes seconds to minutes to load, behind its progress bars; a mistake that the keys, the heads'
config.json (and their weight files' headers: ``loading.read_heads_spec_for``), the prompts file or the backbone's
config and tokenizer already show is refused first, in one line. Each rule lives with its concept
(sampling: ``runtime.verify.SamplingConfig``; a method's keys: its options class, which also checks them
against the heads' config, ``check_spec``; a choice, its method's speculation shape (``methods.shape``) and
the choice file's reader (``methods.choice_file``); evaluation settings: ``evaluation.evaluate.check_settings``;
batch sizes: ``evaluation.batch_eval``; the report folder: ``evaluation.reports``); this module gathers what
each command needs from its config. It imports the runtime (a config alone, not a backbone): ``cli_run``
imports it, and ``cli.py`` imports that only once a command runs, so ``--help`` stays fast.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

from . import loading   # loading.read_heads_spec_for looked up when called (tests replace it)
from .backbone import check_backbone_name, load_backbone_config, load_tokenizer, parse_device
from .chat_template import check_template_args, set_template_args
from .cli_support import enum_value, keys_given
from .errors import UserError
from .evaluation.batch_eval import BATCH_BASELINES, check_sizes_measured, parse_batch_sizes
from .evaluation.choosing import calibrating, reading_budgets
from .evaluation.evaluate import check_settings
from .prompts import Prompt, answered_turn, encode_checked, encode_turn, hold_out, load_prompts, select_prompts
from .evaluation.reports import check_report_dir
from .methods import get, names
from .methods.choice_file import is_choice_file, read_choice
from .methods.registry import check_methods, methods_for_heads, options_from_keys
from .methods.shape import keyed_fields, method_mode
from .runtime.decode import check_budget, check_positions
from .runtime.model import chat_ids, check_backbone_config, position_limit
from .runtime.speculation import SpeculationSchedule
from .runtime.static_steps import check_graphs, graphs_mode
from .runtime.verify import SamplingConfig

MAX_THREADS = 1024   # as medusa-train bounds trainer.threads
MAX_BATCH_ROUNDS = 100   # each round decodes every batch with every method: 10^9 rounds ran until killed
# the decoding modes that read each sampling key (runtime.verify: typical acceptance filters with top-k / top-p too)
SAMPLING_KEYS = {"temperature": ("sample", "typical"), "top_k": ("sample", "typical"), "top_p": ("sample", "typical"),
                 "typical_epsilon": ("typical",), "typical_delta": ("typical",)}


def sampling_config(cfg):
    """The decoding mode's settings (``SamplingConfig`` refuses a bad mode, temperature, top_p ...)."""
    return SamplingConfig(mode=cfg.mode, temperature=cfg.temperature if cfg.mode != "greedy" else 1.0,
                          top_k=cfg.top_k, top_p=cfg.top_p, typical_epsilon=cfg.typical_epsilon,
                          typical_delta=cfg.typical_delta)


def check_decoding_keys(cfg):
    """The keys both commands decode with: threads, max_new_tokens, the sampling settings (returned)."""
    # threads: at most what torch's OpenMP takes (thousands fail in "can't start new thread" tracebacks)
    for key, low, high, what in (("threads", 0, MAX_THREADS, " (0: one per idle core)"),
                                 ("max_new_tokens", 1, None, "")):
        value = getattr(cfg, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < low or (high and value > high):
            span = f"in {low}..{high}" if high else f">= {low}"
            raise UserError(f"{key} must be an integer {span}{what}, got {value!r}")
    check_backbone_name(cfg.backbone)
    check_template_args(cfg.chat_template_args)
    seed = getattr(cfg, "seed", 0)
    # torch.Generator.manual_seed takes -2**63 .. 2**64-1; an evaluation adds the prompt's index to it
    if seed is not None and not -2**63 <= seed < 2**63:
        raise UserError(f"seed must lie in -2**63 .. 2**63-1, got {seed}")
    buckets = cfg.graph_buckets
    check_graphs(cfg.graphs, list(buckets) if not isinstance(buckets, (str, int)) else buckets,
                 parse_device(cfg.device).type if graphs_mode(cfg.graphs) == "on" else None)
    sampling = sampling_config(cfg)
    check_mode_keys(cfg)
    return sampling


def check_mode_keys(cfg) -> None:
    """Refuse a sampling key the decoding mode does not read (``temperature=0.3`` without ``mode=sample``): the run
    decoded greedily while report.json recorded the temperature, and the user was never told."""
    given = keys_given(cfg) or frozenset()
    unread = next((k for k in SAMPLING_KEYS if k in given and cfg.mode not in SAMPLING_KEYS[k]), None)
    if unread is not None:
        default = "" if "mode" in given else " (the default)"
        raise UserError(f"{unread}= is not read with mode={cfg.mode}{default}: it applies to mode="
                        f"{' or '.join(SAMPLING_KEYS[unread])}; give that mode, or drop {unread}=")


def heads_spec(cfg, strict: bool = False):
    """The spec of the heads in ``cfg.heads`` (config only), or None when there are none or (not ``strict``)
    it cannot be read here; ``strict``: an unreadable directory refused in one line."""
    if not cfg.heads or cfg.heads == "???":
        return None
    try:
        return loading.read_heads_spec_for(cfg.heads, cfg.backbone, trust_remote_code=cfg.trust_remote_code)
    except UserError:
        if strict:
            raise
        return None


def check_options_fit(options: dict, spec, cfg) -> None:
    """What each method's options can tell from the heads' config alone (EAGLE-3: top-k within the drafter's
    outputs) and from the backbone's (``backbone_config``: a self:N draft within its layers), the backbone's
    layers decodable (``runtime.model.check_backbone_config``: full attention) and max_new_tokens within its
    positions; ``check_model`` / ``MedusaModel`` / the decoders say it again once loaded."""
    for opts in options.values():
        check = getattr(opts, "check_spec", None)
        if check is not None and spec is not None:
            check(spec)
    if getattr(cfg, "apply_adapter", None) and spec is not None and not spec.backbone_adapter:
        raise UserError(f"apply_adapter=true, but the heads in {cfg.heads} were trained without a LoRA adapter "
                        "(Medusa-2): there is none to merge; drop apply_adapter")
    config = backbone_config(cfg, spec)
    if config is None:
        return
    check_backbone_config(config, backbone_name(cfg, spec))
    check_positions(config, cfg.max_new_tokens)
    for opts in options.values():
        check = getattr(opts, "check_backbone", None)
        if check is not None:
            check(config, backbone_name(cfg, spec))


def backbone_name(cfg, spec) -> Optional[str]:
    """The backbone the command loads: ``backbone=``, else the one the heads record, else (no heads)
    embedded:smollm2; None where there is none to read here (or a ``random:`` test model, never rebuilt)."""
    name = cfg.backbone or getattr(spec, "base_model", None) or (None if cfg.heads else "embedded:smollm2")
    return None if not name or str(name).startswith("random:") else str(name)


def backbone_config(cfg, spec):
    """The config (not the weights) of the backbone the command loads (``backbone_name``); None when it cannot
    be read here (the load says why)."""
    name = backbone_name(cfg, spec)
    if name is None:
        return None
    try:
        return load_backbone_config(name, trust_remote_code=cfg.trust_remote_code)
    except UserError:
        if os.path.isdir(os.path.expanduser(name)):   # a local folder's config said why: now, not after the heads
            raise
        return None
    except (OSError, ValueError):
        return None


def encode_prompts(m, prompts: list[Prompt], cfg) -> list[list[int]]:
    """medusa-generate's prompts (``generate_prompts``) encoded, each with its system message (``encode_turn``) at
    the turn it answers (``answered_turn``: a chat's last question, with the replies the record gives; the first
    question was answered once, the rest of the chat dropped), every one checked to fit the backbone's positions
    with max_new_tokens before any is decoded."""
    ids = [encode_turn(m, p, answered_turn(p)) for p in prompts]
    for i, row in enumerate(ids, start=1):
        check_budget(m, len(row), cfg.max_new_tokens, what=f"prompt {i} of {len(ids)}" if len(ids) > 1 else "prompt")
    return ids


def tokenizer_model(cfg, spec):
    """The backbone the command loads (``backbone_name``) as far as its prompts see it, its tokenizer and config
    alone (no weights): ``encode_chat`` and ``max_positions`` as a loaded model has them, so that the prompt checks
    made once it has loaded (``encode_prompts``, ``prompts.encode_checked``) run before. None where the
    config or tokenizer cannot be read here (the load says why, before the weights); a tokenizer transformers
    cannot build (no tokenizer files: a traceback from the load) is refused in one line."""
    name = backbone_name(cfg, spec)
    if name is None:
        return None
    try:
        config = load_backbone_config(name, trust_remote_code=cfg.trust_remote_code)
        tokenizer = load_tokenizer(name, trust_remote_code=cfg.trust_remote_code)
    except UserError:
        if os.path.isdir(os.path.expanduser(name)):   # a local folder's files said why: now, before the weights
            raise
        return None
    except ValueError as e:   # transformers' words span lines
        raise UserError(f"cannot load the tokenizer of backbone {name!r}: {' '.join(str(e).split())}") from None
    set_template_args(tokenizer, cfg.chat_template_args, whose=f" of backbone {name!r}")

    def encode_chat(prompt, system=None) -> list[int]:
        return chat_ids(tokenizer, prompt, system, whose=f" of backbone {name!r}")

    return SimpleNamespace(max_positions=position_limit(config), config=config, encode_chat=encode_chat)


def check_prompts_fit(cfg, prompts: list[Prompt], spec) -> None:
    """``encode_prompts``' check before the weights load (``tokenizer_model``): each prompt encoded with the
    backbone's tokenizer alone and checked against its positions (a 4,800-token prompt refused after an 8B model
    had loaded)."""
    model = tokenizer_model(cfg, spec)
    if model is not None:
        encode_prompts(model, prompts, cfg)


def check_eval_prompts_fit(cfg, prompts: list, calibration: Optional[list], spec) -> None:
    """The evaluation's own prompt checks (``encode_checked``: each first turn (second too with turns=both) within the
    backbone's positions with max_new_tokens, each calibration prompt with calibration_tokens; a tokenizer without a
    chat template) made before the weights load (``tokenizer_model``), where the evaluation makes them only once they
    have."""
    model = tokenizer_model(cfg, spec)
    if model is None:
        return
    encode_checked(model, prompts, cfg.max_new_tokens, cfg.turns)
    if calibration:
        encode_checked(model, calibration, cfg.calibration_tokens, key="calibration_tokens")


def method_options(cfg, method: str, spec):
    """``method``'s typed options from the command line's keys (bad K / W / N: one line), the settings left unset
    fitted to the heads of ``spec`` (``fitted``, where the options have it: EAGLE-3's tree)."""
    options = options_from_keys(method, cfg)
    fitted = getattr(options, "fitted", None)
    return fitted(spec) if fitted is not None else options


def choice_modes(cfg, options: dict) -> dict:
    """method -> ``auto`` / ``fixed`` for the methods with a speculation shape: ``choice=``, or fixed where a key
    naming the shape itself was given (``tree=tree8``; ``shape.method_mode``)."""
    mode = cfg.choice if cfg.choice in ("auto", "fixed") else "fixed"   # a file: applied by the caller
    modes = {}
    for x, opts in options.items():
        shape = get(x).shape
        if shape is not None:
            given = [name for name, key in keyed_fields(opts).items() if getattr(cfg, key, None) is not None]
            modes[x] = method_mode(shape, mode, given)
    return modes


def check_fixed_choices(options: dict, modes: dict, spec) -> None:
    """Refuse, from the heads' config alone, a fixed choice the heads cannot decode with (a tree deeper than the
    heads, more ranks than their outputs, an empty or old tree file); a choice still to measure always fits."""
    for x, mode in modes.items():
        shape = get(x).shape
        if spec is None or shape.calibrates(options[x], mode, False) or shape.calibrates(options[x], mode, True):
            continue
        choice = shape.fixed_choice(options[x], spec)
        if choice is not None:
            shape.check_spec(choice, spec)


def read_choice_file(cfg, spec, usable: list[str], defaults: Optional[dict] = None, evaluated: bool = False):
    """The ``SavedChoice`` of ``choice=<file>`` (None for auto / fixed), read against the heads of ``spec``
    with the command line's other keys (``choice_file.read_choice``; ``evaluated``: ``usable`` are the methods an
    evaluation measures). A key the file sets also given on the command
    line (written there, even as the command's default: ``given_key``) is refused: the file's value won
    silently (tree=chain1 beside a Medusa choice file decoded the file's tree, and report.json said chain1)."""
    if not is_choice_file(cfg.choice):
        return None
    saved = read_choice(cfg.choice, spec, usable, lambda method: method_options(cfg, method, spec), evaluated)
    shape, options = get(saved.method).shape, method_options(cfg, saved.method, spec)
    choices = [c for c in saved.schedule.choices.values() if c is not None]
    keys = {key for c in choices for key in shape.encode(c, options)}
    if len(choices) < len(saved.schedule.choices):   # plain decoding at a batch size: the keys decoding plainly sets
        plain = shape.apply(options, SpeculationSchedule({1: None}), False)
        keys |= {key for name, key in keyed_fields(options).items() if getattr(plain, name) != getattr(options, name)}
    for key in sorted(keys):
        if given_key(cfg, key, defaults):
            raise UserError(f"{key}= and choice={cfg.choice} both set {saved.method}'s {shape.noun}: give one")
    return saved


def check_eval_keys(cfg):
    """(sampling settings, batch sizes or None: one prompt at a time) of an evaluation, every key the
    config alone decides checked: decoding, batching, calibration, tree budgets, turns."""
    sampling = check_decoding_keys(cfg)
    check_settings(max_new_tokens=cfg.max_new_tokens, turns=cfg.turns, calibration_prompts=cfg.calibration_prompts,
                   calibration_tokens=cfg.calibration_tokens, budgets=list(cfg.tree_budgets))
    sizes = parse_batch_sizes(cfg.batch_size)
    rounds = cfg.batch_rounds
    if isinstance(rounds, bool) or not isinstance(rounds, int) or not 1 <= rounds <= MAX_BATCH_ROUNDS:
        raise UserError(f"batch_rounds must be an integer in 1..{MAX_BATCH_ROUNDS}, got {rounds!r}")
    if sizes is None and "batch_rounds" in (keys_given(cfg) or ()):
        raise UserError("batch_rounds= is read by a batched evaluation only: give batch_size=B or [1,2,...] too, "
                        "or drop batch_rounds=")
    if sizes is not None and cfg.compare:
        raise UserError("compare=true measures one prompt at a time: with batch_size give methods=[...]")
    if sizes is not None and cfg.turns != "first":
        raise UserError("batch_size decodes first turns only: drop turns= or batch_size=")
    if cfg.max_new_tokens == 1:   # measurable, and said in report.md too: a figure that looks like a speedup
        print("note: max_new_tokens=1: each method's one token comes from the prompt's forward and no draft is "
              "verified, so the speedups compare prefills, not decoding", file=sys.stderr)
    return sampling, sizes


def added_baselines(greedy: bool, device: str, batched: bool) -> list[str]:
    """The baselines an evaluation adds on ``device`` (a ``torch.device`` type): the greedy-only ones in greedy mode
    only, each on its ``Method.devices`` only, and a batched evaluation only those it decodes in batches."""
    return [x for x in names() if get(x).baseline and (greedy or not get(x).greedy_only)
            and (not get(x).devices or device in get(x).devices) and (not batched or x in BATCH_BASELINES)]


def eval_methods(cfg) -> list[str]:
    """The methods an evaluation runs, from ``methods`` / ``compare``, the mode and whether heads exist."""
    if cfg.method is not None:
        raise UserError("method= is gone: give methods=[name, ...] (the baselines are added)")
    if cfg.methods is not None and cfg.compare:
        raise UserError("give one of methods= or compare=true")
    baselines = added_baselines(enum_value(cfg.mode) == "greedy", parse_device(cfg.device).type,
                                parse_batch_sizes(cfg.batch_size) is not None)
    spec = heads_spec(cfg)  # unreadable: every heads method, medusa by default (loading says what is wrong)
    usable = [] if not cfg.heads else methods_for_heads(spec) if spec is not None else \
        [x for x in names() if get(x).needs_heads]
    if cfg.compare:
        chosen = [x for x in names() if not get(x).baseline and (x in usable or not get(x).needs_heads)]
    elif cfg.methods is not None:
        chosen = [str(x) for x in (cfg.methods if not isinstance(cfg.methods, str) else cfg.methods.split(","))]
        if not [x for x in chosen if x.strip()]:
            raise UserError("methods= is empty: name at least one method (the baselines are added), or leave it out")
    elif cfg.heads:
        chosen = usable[:1]
    else:
        free = "|".join(x for x in names() if not get(x).needs_heads and not get(x).baseline)
        raise UserError(f"give heads=<export directory> to evaluate Medusa heads, or methods=[{free}] "
                        "(or compare=true) for the training-free methods")
    methods = check_methods(chosen + [b for b in baselines if b not in chosen])
    needing = [x for x in methods if get(x).needs_heads]
    if needing and not cfg.heads:
        raise UserError(f"method {needing[0]} needs heads=<export directory>")
    refused = [x for x in needing if x not in usable]
    if refused:  # e.g. methods=[medusa] with EAGLE-3 heads: one line before the backbone loads
        raise UserError(get(refused[0]).refuses(spec))
    return methods


def eval_prompts(cfg, options: dict, modes: dict, sizes: Optional[list[int]], saved=None):
    """(the prompts evaluated, the calibration prompts or None when no choice calibrates, the prompts held out
    because the given choice file ``saved`` was chosen on them); batch sizes above the prompts evaluated refused
    (they would be reported as measured, but never were)."""
    prompts = load_prompts(cfg.prompts)
    longer = sum(len(p.turns) > 2 for p in prompts) if cfg.turns == "both" else 0
    if longer:   # MT-Bench has two: a third was dropped without a word
        print(f"note: {longer} of the {len(prompts)} prompts have more than two turns: turns=both answers the first "
              "two of each", file=sys.stderr)
    wanted = cfg.num_prompts
    if wanted is not None and (isinstance(wanted, bool) or not isinstance(wanted, int) or wanted < 1):
        raise UserError(f"num_prompts must be >= 1, got {wanted}")
    prompts, chose = hold_out(prompts, (saved.chosen_on or ()) if saved is not None else ())
    if chose:
        print(f"note: {len(chose)} of the prompts chose {saved.path} (its calibration prompts): held out of the "
              "evaluation", file=sys.stderr)
    elif saved is not None and saved.chosen_on is None:
        print(f"note: {saved.path} does not record the prompts it was chosen on (written before medusa-train "
              "recorded them): if they are among these, they are scored on their own choice; rerun choice=auto "
              "to write one that does", file=sys.stderr)
    if not prompts:
        raise UserError(f"every prompt of the set chose {saved.path}: evaluate it on other prompts")
    calibrates = calibrating(options, modes, sizes is not None)
    unread = next((k for k in ("calibration_prompts", "calibration_tokens", "tree_budgets")
                   if k in (keys_given(cfg) or ())), None)
    if unread is not None and not calibrates:   # the run would say nothing of it, report.json record it
        why = f"choice={cfg.choice}" if cfg.choice != "auto" else \
            "the keys given fix each method's choice, or its choice is measured only batched"
        raise UserError(f"{unread}= is read when a choice is measured, and none is measured here ({why}): "
                        f"drop {unread}=")
    if "tree_budgets" in (keys_given(cfg) or ()) and not reading_budgets(options, modes, sizes is not None):
        raise UserError("tree_budgets= sizes the trees a choice grows one prompt at a time, and no choice here grows "
                        "them (" + ("batched choices size their own candidates" if sizes is not None else
                                    "each method's choice is fixed, grows the one tree tree=calibrated:N "
                                    "sizes, or chooses by other measures") +
                        "): drop tree_budgets=")
    evaluated, calibration = select_prompts(prompts, wanted, cfg.calibration_prompts) if calibrates else \
        (prompts[:wanted] if wanted is not None else prompts, None)
    if sizes is not None:
        check_sizes_measured(sizes, len(evaluated))
    return evaluated, calibration, chose


def eval_out_dir(cfg) -> Path:
    """The folder an evaluation writes its report to (default: beside the heads), checked writable."""
    name = "compare" if cfg.compare else "eval"
    out = Path(cfg.out) if cfg.out else Path(cfg.heads).resolve().parent / name if cfg.heads else Path("runs") / name
    check_report_dir(out)
    return out


def generate_prompts(cfg) -> tuple[list[Prompt], bool]:
    """(the prompts, whether several were asked for: prompt=[...], prompts_file= or batch_size=). A prompts_file
    record's system message is its own (as medusa-eval encodes it), ``system=`` that of the records without one
    and of prompt= (the records' were once dropped: every prompt was encoded with system= alone)."""
    given, system = cfg.prompt, "" if cfg.system is None else str(cfg.system)
    if cfg.prompts_file is not None:
        if given is not None:
            raise UserError("give one of prompt= or prompts_file=")
        prompts = load_prompts(cfg.prompts_file)
        own = sum(bool(p.system) for p in prompts)
        if own and system:   # a file mixing both is fine, but which message a record gets must not be a guess
            print(f"note: {own} of the {len(prompts)} records of {cfg.prompts_file} give their own system message, "
                  "used instead of system=", file=sys.stderr)
        later = sum(answered_turn(p) + 1 < len(p.turns) for p in prompts)
        if later:   # MT-Bench's turns form: its later questions follow answers this command does not decode
            print(f"note: {later} of the {len(prompts)} records of {cfg.prompts_file} have later questions without "
                  "the replies before them: each such record's first is answered (medusa-eval turns=both answers "
                  "them in order)", file=sys.stderr)
        return [p if p.system else dataclasses.replace(p, system=system) for p in prompts], True
    texts, several = _generate_texts(given, cfg)
    return [Prompt(str(i), [t], system=system) for i, t in enumerate(texts, start=1)], several


def _generate_texts(given, cfg) -> tuple[list[str], bool]:
    """prompt='s texts (one, or a list) and whether several were asked for, or one line saying what is wrong."""
    if isinstance(given, (int, float)) and not isinstance(given, bool):
        given = str(given)
    if isinstance(given, str) or given is None:
        if not (given or "").strip():
            raise UserError('prompt="..." is required and must not be empty')
        return [given], cfg.batch_size is not None
    if isinstance(given, bool):   # prompt=true: a word the command line reads as a boolean, not a ": " to quote
        word = str(given).lower()
        raise UserError(f"prompt must be text, got the boolean {word}: quote it, e.g. 'prompt=\"{word}\"'")
    if not hasattr(given, "__iter__") or hasattr(given, "keys"):
        # the shell's quotes go first: 'prompt="Write: a poem"' reaches the parser quoted, prompt=""..."" does not
        raise UserError("prompt must be text or a list of texts (quote a prompt holding \": \" for the shell and the "
                        "command line both, e.g. 'prompt=\"Write: a poem\"')")
    texts = list(given)
    if not texts:
        raise UserError('prompt="..." is required and must not be empty')
    for i, t in enumerate(texts, start=1):
        if not isinstance(t, str) or not t.strip():
            raise UserError(f"prompt {i} of {len(texts)} is {'empty' if isinstance(t, str) else 'not text'}")
    return texts, True


def given_key(cfg, key: str, defaults: Optional[dict] = None) -> bool:
    """Whether a method key was given on the command line: written there (``cli_support.keys_given``), whatever its
    value, and not null (unset). Comparing values missed a key written equal to the default (medusa-generate's
    tree=tree4 beside a choice file, or beside EAGLE-3 heads, was ignored). A config no command line made (a
    library caller's) falls back to the values: given where it differs from the schema default (None, or
    ``defaults[key]``)."""
    value = getattr(cfg, key, None)
    written = keys_given(cfg)
    if written is not None:
        return key in written and value is not None
    return value is not None and value != (defaults or {}).get(key)


def check_keys_used(cfg, methods: list[str], defaults: Optional[dict] = None, names_methods: bool = True) -> None:
    """Refuse a method key given on the command line that none of ``methods`` (what this command decodes with)
    takes: ``eagle_nodes=4`` beside Medusa heads was silently ignored, the run measuring something else than asked.
    A key is given when it was written on the command line (``given_key``). ``names_methods``: the command takes
    ``methods=`` (medusa-eval); medusa-generate decodes with the heads' method or a choice file's."""
    from .cli_keys import CommandKeys, method_keys   # lazy, as cli_keys' own registry import

    own = {f.name for f in dataclasses.fields(CommandKeys)}
    for key, (_, _, _, takers) in sorted(method_keys().items()):
        if key in own or not given_key(cfg, key, defaults) or set(takers) & set(methods):
            continue
        how = ", or name such a method" if names_methods else ""   # medusa-generate names no method
        raise UserError(f"{key}= is a key of {', '.join(takers)}, and none of the methods decoding here "
                        f"({', '.join(methods)}) takes it: drop it{how}")
