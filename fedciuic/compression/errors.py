"""What a codec or a residual file raises."""

from __future__ import annotations

from fedciuic.errors import FedciuicError


class MalformedUpdate(FedciuicError, ValueError):
    """An encoded update that is not what its codec writes (untrusted input: each
    check names what is wrong, and the aggregator rejects that update alone)."""


class ResidualError(FedciuicError):
    """The error-feedback residual on disk is corrupted or belongs to something else."""
