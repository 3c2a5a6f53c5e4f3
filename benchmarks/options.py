"""What ``bench.py`` and its micro-benchmarks share to refuse a mistaken option: one line, exit 2, before any model.

A micro-benchmark loads a model (or trains one) before it times anything, so a ``--rounds 0`` or a heads path
with a typo used to end in a traceback seconds or minutes later. Each option's type here checks its value while
argparse reads it, and ``Parser`` prints argparse's complaint as the toolkit's one ``<prog>: error: <line>``
(``inference.cli_support``) instead of a usage block. Only the standard library is imported: the checks run
before torch loads.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import NoReturn

EXIT_USER_ERROR = 2  # as inference.cli_support's: the one exit code of a user mistake
# Every spelling inference.backbone.DTYPES takes (not imported from there: that module loads torch);
# tests/evaluation/test_bench_options.py keeps the two the same.
DTYPES = ("float32", "fp32", "bfloat16", "bf16", "float16", "fp16", "half")


class Parser(argparse.ArgumentParser):
    """argparse, whose errors are one line (``<prog>: error: <message>``, exit 2) as every other CLI's."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)


def positive_int(text: str) -> int:
    """An integer >= 1 (rounds, steps, tokens, prompts: zero of them leaves nothing to time)."""
    return _int_at_least(text, 1)


def nonnegative_int(text: str) -> int:
    """An integer >= 0 (--threads: 0 keeps torch's default)."""
    return _int_at_least(text, 0)


def int_at_least(low: int):
    """An argparse type: an integer >= ``low``."""
    def check(text: str) -> int:
        return _int_at_least(text, low)
    check.__name__ = f"integer >= {low}"
    return check


def _int_at_least(text: str, low: int) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if n < low:
        raise argparse.ArgumentTypeError(f"must be {'positive' if low == 1 else f'at least {low}'}, got {n}")
    return n


def dtype(text: str) -> str:
    """A float dtype's name, as ``inference.backbone.parse_dtype`` spells them."""
    if text.lower() not in DTYPES:
        raise argparse.ArgumentTypeError(f"must be float32, bfloat16 or float16, got {text!r}")
    return text.lower()


def directory(text: str) -> str:
    """A folder that exists (a heads export, a backbone, a --bin)."""
    if not os.path.isdir(os.path.expanduser(text)):
        what = "not a directory" if os.path.exists(os.path.expanduser(text)) else "not found"
        raise argparse.ArgumentTypeError(f"{text}: {what}")
    return text


def backbone(text: str) -> str:
    """A backbone as ``inference.backbone.load_backbone`` takes it: ``embedded:<name>``, a hub id or a folder.
    Whatever looks like a local path (its test, ``_check_local``'s) must be a folder here, before the load."""
    looks_local = text.startswith((".", "/", "~")) or (os.path.sep in text and text.count("/") > 1)
    return directory(text) if looks_local or Path(os.path.expanduser(text)).exists() else text
