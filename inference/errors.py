"""The one exception type for mistakes a user can fix.

Entry points catch `UserError`, print its message as one line and exit non-zero; anything
else is a bug and keeps its traceback. Both halves of the toolkit raise it (the trainer
imports it from here, so a serving user never needs the trainer installed).
"""


class UserError(Exception):
    """A problem with the user's input (recipe, file, checkpoint, prompt), not a bug."""


class IncompatibleHeadsError(UserError):
    """A heads export that does not belong to the backbone it is being attached to."""


class NeedsBackboneConfig(UserError):
    """A heads directory whose config leaves facts to its target model (an EAGLE-3 drafter that names no
    aux layers reads the target's default ones): its spec can be read only with the backbone's config.
    ``base_model``: the target the directory records, "" if none, so a loader knows which one to read."""

    def __init__(self, message: str, base_model: str = ""):
        super().__init__(message)
        self.base_model = base_model
