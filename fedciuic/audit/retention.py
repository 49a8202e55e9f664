"""Retention: each party's audit log is kept for its own jurisdiction's policy's
``audit.retention_days``, then pruned (``AuditLog.prune``: a signed ``audit_pruned``
record anchors what is kept, so the pruned log still verifies).

Which policy: a region's log by the region's own policy, the aggregator's by the
policy of the aggregator's jurisdiction. The agent prunes its region's log when it
starts, the aggregator its own log when a run starts; ``fedciuic audit prune`` does it
for any log (docs/audit.md, "Retention").
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedciuic.audit.log import AuditError, AuditLog, Pruned, load_records, prune_cut, verify

if TYPE_CHECKING:
    from fedciuic.policy import LoadedPolicy

PRUNE_COMMAND = "fedciuic audit prune LOG --key PARTY.key.json --policy POLICY.yaml"


def cutoff(days: int, now: datetime | None = None) -> datetime:
    """The time before which records are past a retention of ``days``."""
    return (now or datetime.now(UTC)) - timedelta(days=days)


def enforce(log: AuditLog, policy: LoadedPolicy, *, now: datetime | None = None) -> Pruned:
    """Prune ``log`` by ``policy``, which must be its party's own jurisdiction's (the
    key says which): every record older than the policy's ``audit.retention_days``."""
    rules = policy.policy
    held = log.keypair.bundle.jurisdiction if log.keypair is not None else None
    if held is not None and held != rules.jurisdiction:
        raise AuditError(
            f"{policy.path}: the policy of {rules.jurisdiction}, but {log.path} is the log of "
            f"{log.actor} in {held}: each party's log is kept by its own jurisdiction's policy"
        )
    days = rules.audit.retention_days
    return log.prune(
        cutoff(days, now),
        retention_days=days,
        jurisdiction=rules.jurisdiction,
        policy=policy.path.name,
        policy_hash=policy.hash,
    )


def enforce_at_start(
    log: AuditLog, policy: LoadedPolicy | None, logger: logging.Logger, who: str
) -> Pruned | None:
    """``enforce`` as a party starts: what it pruned is logged; a prune that cannot be
    done is a warning, never a reason not to start (the log stays whole and writable)."""
    if policy is None or log.keypair is None:
        return None
    try:
        pruned = enforce(log, policy)
    except AuditError as err:
        logger.warning("fedciuic: %s: audit log not pruned to its retention: %s", who, err)
        return None
    if pruned.records:
        logger.info(
            "fedciuic: %s: pruned %d audit record(s) older than %d days (%s to %s), per %s",
            who,
            pruned.records,
            policy.policy.audit.retention_days,
            pruned.first_time,
            pruned.last_time,
            policy.path.name,
        )
    return pruned


@dataclass(frozen=True)
class Overdue:
    """Records a log still holds past its retention: what a prune would remove."""

    records: int
    first_time: str
    last_time: str
    days: int


def overdue(
    records: Sequence[Mapping[str, Any]], days: int, now: datetime | None = None
) -> Overdue | None:
    """The records of a log that are past a retention of ``days`` (those ``prune`` would
    remove: a run with a later record is kept whole), None when there are none."""
    cut = prune_cut(records, cutoff(days, now))
    if cut == 0:
        return None
    return Overdue(cut, str(records[0].get("time")), str(records[cut - 1].get("time")), days)


def prune_log(
    path: Path,
    key_file: Path,
    policy_file: Path,
    *,
    dry_run: bool = False,
    now: datetime | None = None,
) -> str:
    """``fedciuic audit prune``: prune the log at ``path`` by ``policy_file`` (its party's
    own), signing with ``key_file``; what was done, in one line, and the log's verdict."""
    from fedciuic.crypto import load_keypair
    from fedciuic.policy import load_policy

    keypair = load_keypair(key_file)
    policy = load_policy(policy_file)
    if not path.is_file():
        raise AuditError(f"{path}: no audit log here")
    days = policy.policy.audit.retention_days
    if dry_run:
        found = overdue(load_records(path), days, now)
        if found is None:
            return (
                f"{path}: no record older than {days} days ({policy.path.name}): nothing to prune"
            )
        return (
            f"{path}: would prune {found.records} record(s) older than {days} days "
            f"({found.first_time} to {found.last_time}, {policy.path.name})"
        )
    log = AuditLog(path, keypair.bundle.party, keypair)
    try:
        pruned = enforce(log, policy, now=now)
    finally:
        log.close()
    if not pruned.records:
        return f"{path}: no record older than {days} days ({policy.path.name}): nothing pruned"
    return (
        f"{path}: pruned {pruned.records} record(s) older than {days} days "
        f"(seq {pruned.first_seq} to {pruned.first_kept - 1}, {pruned.first_time} to "
        f"{pruned.last_time}), per {policy.path.name}\n" + verify(path, keypair.bundle).explain()
    )
