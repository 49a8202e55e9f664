"""The audit trail as a stage: a hash-chained log (:class:`~fedciuic.audit.log.AuditLog`)
or, for a lab run and tests, :class:`NoAudit`, chosen once and handed to the round, which
never asks whether there is a log."""

from __future__ import annotations

import re
from typing import Any, TypeAlias

from fedciuic.audit import AuditLog
from fedciuic.crypto import Keypair


class NoAudit:
    """No log: nothing is written, no head is ever witnessed or signed (a lab run)."""

    keypair: Keypair | None = None
    redact: tuple[tuple[re.Pattern[str], str], ...] = ()
    path = None

    def append(
        self, event: str, *, run_id: int, server_round: int | None = None, **details: Any
    ) -> str:
        return ""

    def checkpoint(self, *, run_id: int, server_round: int | None = None) -> None:
        return None

    def witness(
        self,
        party: str,
        count: int,
        head: str,
        *,
        run_id: int,
        server_round: int | None = None,
        late: bool = False,
    ) -> str:
        return ""

    def position(self) -> tuple[int, str]:
        return 0, ""

    def last_checkpoint(self) -> None:
        return None

    def records(self) -> list[dict[str, Any]]:
        return []


#: What a round writes to and reads from its party's audit log.
AuditTrail: TypeAlias = AuditLog | NoAudit
