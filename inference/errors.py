"""The one exception type for mistakes a user can fix.

Entry points catch `UserError`, print its message as one line and exit non-zero; anything
else is a bug and keeps its traceback. Both halves of the toolkit raise it (the trainer
imports it from here, so a serving user never needs the trainer installed).
"""


class UserError(Exception):
    """A problem with the user's input (recipe, file, checkpoint, prompt), not a bug."""


class IncompatibleHeadsError(UserError):
    """A heads export that does not belong to the backbone it is being attached to."""
