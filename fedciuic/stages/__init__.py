"""What each end of a round is handed once per run and never asks about again:
``sealing`` (sealed or clear, both ends) and ``audit`` (a log, or none)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedciuic.faces import face

if TYPE_CHECKING:
    from fedciuic.stages.audit import AuditTrail, NoAudit
    from fedciuic.stages.sealing import (
        Clear,
        ClearRegion,
        ClearReplies,
        Provenance,
        RegionSealing,
        ReplySealing,
        Sealed,
        SealingRegion,
        aggregator_sealing,
    )

#: What other packages use, and the module each lives in: imported on first use.
_WHERE = {
    "AuditTrail": "audit",
    "Clear": "sealing",
    "ClearRegion": "sealing",
    "ClearReplies": "sealing",
    "Provenance": "sealing",
    "NoAudit": "audit",
    "RegionSealing": "sealing",
    "ReplySealing": "sealing",
    "Sealed": "sealing",
    "SealingRegion": "sealing",
    "aggregator_sealing": "sealing",
}
__all__ = [
    "AuditTrail",
    "Clear",
    "ClearRegion",
    "ClearReplies",
    "NoAudit",
    "Provenance",
    "RegionSealing",
    "ReplySealing",
    "Sealed",
    "SealingRegion",
    "aggregator_sealing",
]
__getattr__ = face(__name__, _WHERE)
