"""Fixtures shared by the audit tests."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime

import pytest

import fedciuic.audit.log as audit_log

#: Where the ``clock`` fixture starts: the time the log writes until a test sets another.
T0 = datetime(2020, 1, 1, tzinfo=UTC)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[datetime]]:
    """The time the log writes into each record, set by the test."""
    now = [T0]
    monkeypatch.setattr(audit_log, "_now", lambda: now[0].strftime(audit_log.TIME_FORMAT))
    yield now
