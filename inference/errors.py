"""The one exception type for mistakes a user can fix.

Entry points catch `UserError`, print its message as one line and exit non-zero; anything
else is a bug and keeps its traceback. Both halves of the toolkit raise it (the trainer
imports it from here, so a serving user never needs the trainer installed).
"""

import errno
import os
import re
from typing import Optional


class UserError(Exception):
    """A problem with the user's input (recipe, file, checkpoint, prompt), not a bug."""


class FormatWarning(UserWarning):
    """Something in a foreign checkpoint or an export the user should know, that is not an error. Here, free of
    torch, so that every command prints it as one line (``cli_support.warnings_as_lines``)."""


class IncompatibleHeadsError(UserError):
    """A heads export that does not belong to the backbone it is being attached to."""


class NeedsBackboneConfig(UserError):
    """A heads directory whose config leaves facts to its target model (an EAGLE-3 drafter that names no
    aux layers reads the target's default ones): its spec can be read only with the backbone's config.
    ``base_model``: the target the directory records, "" if none, so a loader knows which one to read."""

    def __init__(self, message: str, base_model: str = ""):
        super().__init__(message)
        self.base_model = base_model


# A write that failed for want of room: a full disk, a quota, a file-size limit (``ulimit -f``).
_NO_ROOM = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


def first_line(e: BaseException) -> str:
    """An exception's message cut to its first line (its type's name when it has none): for one-line refusals."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def no_room_line(e: BaseException) -> Optional[str]:
    """The one line for an error (or one it was raised from) of a write that failed for want of room, None for any
    other error: a full disk is the user's to mend, not a bug, and every writer swaps its output in whole, so what
    was written before stays as it was. safetensors reports the errno in its own error's text ("(os error 28)")."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        code = e.errno if isinstance(e, OSError) else None
        if code is None and type(e).__name__ == "SafetensorError":
            found = re.search(r"os error (\d+)", str(e))
            code = int(found[1]) if found else None
        if code in _NO_ROOM:
            where = f" {e.filename}" if getattr(e, "filename", None) else ""
            return (f"could not write{where}: {os.strerror(code)}; free space (or raise the limit) and run the same "
                    "command again: what was written before is whole, and a training run resumes from its last "
                    "checkpoint")
        e = e.__cause__ or e.__context__
    return None
