"""The tamper-evident record: each party's hash-chained, signed log and its verifier
(``log``), and the per-run compliance report cross-checking the parties' logs
(``report``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedciuic.faces import face

if TYPE_CHECKING:
    from fedciuic.audit.events import SECURE_SENT_EVENTS, SENT_EVENTS, Event
    from fedciuic.audit.log import (
        AGGREGATOR_LOG,
        RECEIVED_EVENT,
        REGION_LOG,
        AuditError,
        AuditLog,
        checkpoint_head,
        code_version,
        config_hash,
        digest,
        load_records,
        redaction,
        verify,
        with_carried,
    )
    from fedciuic.audit.report import (
        PartyLog,
        Section,
        build_report,
        check_and_report,
        open_logs,
        verify_logs,
        write_sections,
    )
    from fedciuic.audit.retention import enforce_at_start, prune_log

#: What other packages use, and the module each lives in: imported on first use.
_WHERE = {
    "AGGREGATOR_LOG": "log",
    "AuditError": "log",
    "AuditLog": "log",
    "Event": "events",
    "PartyLog": "report",
    "RECEIVED_EVENT": "log",
    "REGION_LOG": "log",
    "SECURE_SENT_EVENTS": "events",
    "SENT_EVENTS": "events",
    "Section": "report",
    "build_report": "report",
    "check_and_report": "report",
    "checkpoint_head": "log",
    "code_version": "log",
    "config_hash": "log",
    "digest": "log",
    "enforce_at_start": "retention",
    "load_records": "log",
    "open_logs": "report",
    "prune_log": "retention",
    "redaction": "log",
    "verify": "log",
    "verify_logs": "report",
    "with_carried": "log",
    "write_sections": "report",
}
__all__ = [
    "AGGREGATOR_LOG",
    "RECEIVED_EVENT",
    "REGION_LOG",
    "SECURE_SENT_EVENTS",
    "SENT_EVENTS",
    "AuditError",
    "AuditLog",
    "Event",
    "PartyLog",
    "Section",
    "build_report",
    "check_and_report",
    "checkpoint_head",
    "code_version",
    "config_hash",
    "digest",
    "enforce_at_start",
    "load_records",
    "open_logs",
    "prune_log",
    "redaction",
    "verify",
    "verify_logs",
    "with_carried",
    "write_sections",
]
__getattr__ = face(__name__, _WHERE)
