"""What every command line of the toolkit shares: one error line, one exit code, one way to read
``key=value`` overrides into a typed config.

``medusa-eval``, ``medusa-generate``, ``medusa-export`` (OmegaConf dataclass schemas) and
``medusa-train`` (Hydra recipes) all end a user mistake the same way: ``<prog>: error: <one
line>`` on stderr and exit code 2, before anything heavy is loaded. OmegaConf's own messages are
several lines long (the key, then its reference type, object type, hints); ``config_error_line``
keeps the lines that say what is wrong.
"""

from __future__ import annotations

import contextlib
import difflib
import os
import signal
import sys
import warnings
from typing import Any, Callable, Iterator, NoReturn, Optional

from .errors import FormatWarning, UserError, no_room_line

EXIT_USER_ERROR = 2
# where ``parse_overrides`` keeps the keys written on the command line (``keys_given``): an attribute outside the
# config's keys, so no key can shadow it and no copy of the values (to_container, report.json) carries it
_GIVEN = "_keys_given"
# What a boolean key takes (any case). OmegaConf alone would also take any integer (materialize=3 -> true)
# and words such as "Y"; a value outside these is more likely a slip than a yes.
BOOLEAN_WORDS = ("true", "false", "yes", "no", "on", "off", "1", "0")
_OMEGACONF_NOISE = ("full_key", "reference_type", "object_type", "To append", "Set the environment")


def fail(prog: str, message: str) -> NoReturn:
    print(f"{prog}: error: {message}", file=sys.stderr)
    sys.exit(EXIT_USER_ERROR)


def config_error_line(e: BaseException) -> str:
    """An OmegaConf / Hydra composition error as one line, naming the key when it is known."""
    text = str(e) + ("\n" + str(e.__cause__) if e.__cause__ is not None else "")
    lines = [l.strip() for l in text.splitlines() if l.strip() and not l.strip().startswith(_OMEGACONF_NOISE)]
    key = getattr(e, "full_key", None)
    return (f"{key}: " if key and not any(str(key) in l for l in lines) else "") + (" ".join(lines) or type(e).__name__)


def parse_overrides(prog: str, schema, argv: list[str]):
    """``key=value`` arguments merged onto the dataclass ``schema``; one error line for anything else."""
    bad = [a for a in argv if "=" not in a or a.startswith("-")]
    if bad:
        fail(prog, f"arguments are key=value overrides, got {bad[0]!r} (see {prog} --help)")
    empty = next((a for a in argv if a.endswith("=") and a.count("=") == 1), None)
    if empty is not None:   # OmegaConf reads it as null: "Incompatible value 'None'" named no fix
        fail(prog, f"{empty} needs a value (see {prog} --help)")
    keys = [a.split("=", 1)[0].strip() for a in argv]
    twice = next((k for i, k in enumerate(keys) if k in keys[:i]), None)
    if twice is not None:   # the last would win silently: say which one the user meant
        fail(prog, f"{twice}= is given twice: give it once (see {prog} --help)")
    # bytes that are no UTF-8 reach Python as lone surrogates, which YAML's parser refused naming neither key nor cause
    raw = next((a for a in argv if any("\udc80" <= c <= "\udcff" for c in a)), None)
    if raw is not None:
        byte = next(ord(c) - 0xDC00 for c in raw if "\udc80" <= c <= "\udcff")
        fail(prog, f"{raw.split('=', 1)[0]}= is not UTF-8 text (byte 0x{byte:02x}): give it in UTF-8 (is the "
                   "terminal or script in another encoding?)")
    from omegaconf import OmegaConf   # lazy: --help and a word that is no key=value answer without OmegaConf

    structured = OmegaConf.structured(schema)
    not_boolean = non_boolean_override(structured, argv)
    if not_boolean:
        fail(prog, f"{not_boolean[0].split('=', 1)[0]} must be true or false (or yes/no, on/off, 1/0), got "
                   f"{not_boolean[1]!r} (see {prog} --help)")
    try:
        cfg = OmegaConf.merge(structured, OmegaConf.from_dotlist(argv))
    except Exception as e:  # unknown key / wrong type
        fail(prog, f"{unknown_key_line(structured, e) or list_line(argv, e) or config_error_line(e)} "
                   f"(see {prog} --help)")
    # A required key ("???" in the schema) left unset would otherwise surface as OmegaConf's
    # MissingMandatoryValue traceback the first time the code reads it.
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        named = [k + "=" for k in missing]
        fail(prog, f"{', '.join(named[:-1]) + ' and ' if len(named) > 1 else ''}{named[-1]} "
                   f"{'is' if len(missing) == 1 else 'are'} required "
                   f"(see {prog} --help)")
    mark_given(cfg, keys)
    return cfg


def list_line(argv: list[str], e: BaseException) -> Optional[str]:
    """For a list key given one value (``methods=medusa``, or ``methods=medusa,draft``), the bracketed form to give
    (OmegaConf says "AnyNode is not a ListConfig, list or tuple"); None for any other error."""
    key = str(getattr(e, "full_key", "") or "")
    if "is not a ListConfig" not in str(e) or not key:
        return None
    value = next((a.split("=", 1)[1] for a in argv if a.split("=", 1)[0].strip() == key), "...")
    return f"{key}= takes a list: {key}=[{value}]"


def mark_given(cfg, keys) -> Any:
    """``cfg`` with ``keys`` recorded as the ones written on its command line (``keys_given``); a dotted key
    (``backbone.random_init.x``) or a +/~ one counts as its top-level key. Returns ``cfg``."""
    object.__setattr__(cfg, _GIVEN, frozenset(str(k).lstrip("+~").split(".")[0] for k in keys))
    return cfg


def keys_given(cfg) -> Optional[frozenset]:
    """The keys written on ``cfg``'s command line (``parse_overrides``), whatever their values: a key written
    equal to its default is given all the same, a default the schema (or the command's own code) set is not.
    None for a config no command line made (a library caller's dataclass): the caller judges by the values."""
    return getattr(cfg, "__dict__", {}).get(_GIVEN)


def unknown_key_line(structured, e: BaseException) -> Optional[str]:
    """For a key the schema ``structured`` lacks, one line naming it and the closest keys beside it (difflib), so
    a typo (num_promts) says what was meant; None for any other error."""
    from omegaconf import DictConfig   # lazy: only a refused command line reads the schema's keys
    from omegaconf.errors import ConfigKeyError

    key = str(getattr(e, "full_key", "") or "")
    if not isinstance(e, ConfigKeyError) or not key:
        return None
    parent, _, name = key.rpartition(".")
    try:
        node = structured.select(parent) if parent else structured
    except Exception:   # noqa: BLE001 (a parent that is itself no key: the plain line says so)
        return None
    known = [str(k) for k in node.keys()] if isinstance(node, DictConfig) else []
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
    prefix = f"{parent}." if parent else ""
    hint = f": did you mean {' or '.join(prefix + k for k in close)}?" if close else ""
    return f"unknown key {key!r}{hint}"


def non_boolean_override(structured, argv: list[str]) -> Optional[tuple[str, str]]:
    """The first ``key=value`` of ``argv`` (and its value) whose key is a boolean field of the schema
    ``structured`` but whose value is no boolean word: OmegaConf alone reads any integer (``=3``) as true."""
    for arg in argv:
        key, eq, value = arg.partition("=")
        if eq and is_boolean_key(structured, key) and value.strip().lower() not in BOOLEAN_WORDS + ("null", "none"):
            return arg, value
    return None


def is_boolean_key(structured, key: str) -> bool:
    """Whether ``key`` (dotted) names a boolean field of the schema ``structured`` (False for a key inside
    an untyped dict, such as backbone.random_init.*: composing judges those)."""
    from omegaconf import BooleanNode, DictConfig   # lazy: as parse_overrides (its callers have loaded it)

    node = structured
    try:
        for part in key.lstrip("+~").split("."):
            node = node._get_node(part, validate_access=False) if isinstance(node, DictConfig) else None
            if node is None:
                return False
    except Exception:
        return False
    return isinstance(node, BooleanNode)


def enum_value(x: Any) -> Any:
    """A config enum's value (Hydra hands enums to the code; reports and JSON want their strings)."""
    return getattr(x, "value", x)


def ignore_further_interrupts() -> None:
    """For a command on its way out, its one line said: a further Ctrl-C (a double press) would only land in the
    clean-up torch runs at exit, as a traceback under the line. Only for the command itself, never for a caller in
    Python, whose signals are its own."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@contextlib.contextmanager
def warnings_as_lines(prog: str, category: type) -> Iterator[None]:
    """Inside the block, each warning of ``category`` printed as one line, ``<prog>: warning: <message>``, and each
    message once (a spec read and the load that follows see the same dir): not Python's two lines, a source path
    and a source line a user cannot act on. Other warnings are shown as they would have been."""
    shown: set = set()
    with warnings.catch_warnings():
        original = warnings.showwarning

        def show(message, cat, filename, lineno, file=None, line=None):
            if not issubclass(cat, category):
                original(message, cat, filename, lineno, file, line)
            elif str(message) not in shown:
                shown.add(str(message))
                print(f"{prog}: warning: {message}", file=sys.stderr)

        warnings.showwarning = show
        warnings.simplefilter("always", category)   # every one reaches ``show``, which says each message once
        yield


def run_cli(prog: str, doc, schema, task, argv: Optional[list[str]],
            refuse: Optional[Callable[[list[str]], Optional[str]]] = None) -> None:
    """``--help`` prints ``doc`` (a callable: its text, built only then); otherwise parse ``argv`` onto ``schema``
    (a callable: built only then) and run ``task(cfg)``, turning a ``UserError`` into one line and exit 2.
    ``refuse(argv)``: a line refusing replaced keys, or None."""
    console = argv is None   # the command itself, not a caller in Python (whose signals are its own)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help", "help"):
        print((doc() if callable(doc) else doc).strip())
        return
    refused = refuse(argv) if refuse is not None else None
    if refused:
        fail(prog, f"{refused} (see {prog} --help)")
    cfg = parse_overrides(prog, schema() if callable(schema) and not isinstance(schema, type) else schema, argv)
    try:
        with warnings_as_lines(prog, FormatWarning):
            task(cfg)
    except UserError as e:
        fail(prog, str(e))
    except KeyboardInterrupt:   # Ctrl-C: what was written stays whole (every writer swaps its output in)
        if console:
            ignore_further_interrupts()
        print(f"\n{prog}: interrupted", file=sys.stderr)
        sys.exit(130)
    except BrokenPipeError:   # `medusa-generate ... | head`: the reader left; nothing more to say to it
        try:   # the exit's own flush of stdout must not fail too
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):   # stdout without a descriptor (captured)
            pass
        sys.exit(1)
    except Exception as e:   # a full disk (a report, an export): one line, not a traceback; anything else is a bug
        line = no_room_line(e)
        if line is None:
            raise
        fail(prog, line)
