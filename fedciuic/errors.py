"""Typed errors: every user-facing failure names where it happened and how to fix it.

Messages follow one style, ``source:field: problem; fix``, so that a user reading
a log line knows which file or setting to change without a traceback.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

#: The exit codes of ``fedciuic`` commands, one meaning each (``fedciuic audit report``
#: uses its own 3, EXIT_DISAGREE, for logs that verify but disagree).
EXIT_OK = 0
EXIT_AUDIT = 1  # a log failed verification or could not be verified, or the logs disagree
EXIT_ERROR = 2  # bad input: a config, a path, a file (one line says which and the fix)
EXIT_NO_AGGREGATE = 3  # the run ended without publishing an aggregate: nothing trained
EXIT_UNFINISHED = 4  # the run did not end: interrupted, failed, or still running


class FedciuicError(Exception):
    """Base class for errors meant for the user (printed as one line, no traceback)."""

    #: Whether the message is made only of public facts (the run config, a policy, the
    #: protocol's messages): a region whose policy lets out only DP releases sends it as
    #: a decline's reason; any other reason stays in its audit log (fedciuic/releases.py).
    public_reason: ClassVar[bool] = False


class ConfigError(FedciuicError):
    """A run config, node config or other setting is invalid: every problem found, so
    that users fix them all in one go."""

    def __init__(self, problems: Iterable[str]) -> None:
        self.problems = list(problems)
        super().__init__("; ".join(self.problems))


class DataError(FedciuicError):
    """A region's data path is missing, unreadable, empty or malformed."""


class ModelError(FedciuicError):
    """A model preset is unknown or a checkpoint directory cannot be loaded."""


class FederationError(FedciuicError):
    """The federation cannot make progress (no regions connected, no replies)."""
