"""Typed errors: every user-facing failure names where it happened and how to fix it.

Messages follow one style, ``source:field: problem; fix``, so that a user reading
a log line knows which file or setting to change without a traceback.
"""

from __future__ import annotations

from collections.abc import Iterable


class FedciuicError(Exception):
    """Base class for errors meant for the user (printed as one line, no traceback)."""


class ConfigError(FedciuicError):
    """A run config, node config or other setting is invalid.

    Collects every problem found, so that users fix them all in one go.
    """

    def __init__(self, problems: Iterable[str]) -> None:
        self.problems = list(problems)
        super().__init__("; ".join(self.problems))


class DataError(FedciuicError):
    """A region's data path is missing, unreadable, empty or malformed."""


class ModelError(FedciuicError):
    """A model preset is unknown or a checkpoint directory cannot be loaded."""


class FederationError(FedciuicError):
    """The federation cannot make progress (no regions connected, no replies)."""
