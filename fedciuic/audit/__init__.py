"""The tamper-evident record: each party's hash-chained, signed log and its verifier
(``log``), and the per-run compliance report cross-checking the parties' logs
(``report``)."""

from __future__ import annotations

from fedciuic.audit.log import AuditError, AuditLog, load_records, verify
from fedciuic.audit.report import check_and_report

__all__ = ["AuditError", "AuditLog", "check_and_report", "load_records", "verify"]
