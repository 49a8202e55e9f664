"""Typed errors: every user-facing failure names where it happened and how to fix it.

Messages read ``source:field: problem; fix``, so a log line says what to change without a traceback.
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

    #: Whether the message holds only public facts (run config, policy, protocol), so a
    #: ``dp_only`` region may send it as a decline's reason (fedciuic/releases.py).
    public_reason: ClassVar[bool] = False


class ConfigError(FedciuicError):
    """A run config, node config or other setting is invalid: every problem, fixed in one go."""

    def __init__(self, problems: Iterable[str]) -> None:
        self.problems = list(problems)
        super().__init__("; ".join(self.problems))


class DataError(FedciuicError):
    """A region's data path is missing, unreadable, empty or malformed."""


class ModelError(FedciuicError):
    """A model preset is unknown or a checkpoint directory cannot be loaded."""


class FederationError(FedciuicError):
    """The federation cannot make progress (no regions connected, no replies)."""
