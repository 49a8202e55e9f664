"""Retention: each party's audit log is kept for its own jurisdiction's policy's
``audit.retention_days``, then pruned, only by a policy it declared to the other parties:
an edited copy is refused, since the others hold the party to what it declared.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedciuic.audit.events import Event
from fedciuic.audit.log import (
    AuditError,
    AuditLog,
    Declared,
    Limit,
    Pruned,
    declarations,
    declared_in,
    details_of,
    load_records,
    log_of,
    parse_time,
    prune_cut,
    record_time,
    run_of,
    verify,
)
from fedciuic.crypto import AGGREGATOR, load_keypair
from fedciuic.policy import load_policy

if TYPE_CHECKING:
    from fedciuic.policy import LoadedPolicy

PRUNE_COMMAND = "fedciuic audit prune LOG --key PARTY.key.json --policy POLICY.yaml"


def cutoff(days: int, now: datetime | None = None) -> datetime:
    """The time before which records are past a retention of ``days``."""
    return (now or datetime.now(UTC)) - timedelta(days=days)


def in_force(declared: Sequence[Declared], when: datetime | None) -> Declared | None:
    """The last policy declared at or before ``when``, else the first (older records)."""
    if not declared:
        return None
    at = [d for d in declared if when is not None and _time(d.first_time) <= when]
    return at[-1] if at else declared[0]


@functools.lru_cache(maxsize=256)  # a few declarations, read once per record pruned
def _time(value: str) -> datetime:
    found = parse_time(value)
    return found if found is not None else datetime.max.replace(tzinfo=UTC)


def bound(policy: LoadedPolicy, path: Path, party: str, now: datetime | None = None) -> Limit:
    """``AuditLog.prune``'s ``limit``: refuse a policy the log never declared (an edited
    copy has another hash), stop before a record another declared policy still keeps."""
    rules, now, hashed = policy.policy, now or datetime.now(UTC), policy.hash

    def mine(where: str | None) -> bool:
        return party != AGGREGATOR or where == rules.jurisdiction

    def limit(records: Sequence[Mapping[str, Any]]) -> tuple[int, str]:
        own = [d for d in declarations(records) if mine(d.jurisdiction)]
        if not own:  # nothing on the record binds this log (it never declared a policy)
            return len(records), ""
        if hashed not in {d.policy_hash for d in own}:
            latest = max(own, key=lambda d: d.last_time)
            raise AuditError(
                f"{path}: not pruned: {policy.path} is policy {hashed[:12]}, but the "
                f"policy this log declared to the other parties is {latest.policy_hash[:12]} "
                f"({latest.jurisdiction or rules.jurisdiction}, last declared "
                f"{latest.last_time}); a prune is bound to the declared policy and its "
                "audit.retention_days: prune with the policy you declared (`fedciuic policy "
                "check FILE` prints a file's hash)"
            )
        by_hash = {d.policy_hash: d for d in own}
        by_run: dict[int, Declared] = {}  # each run's own declaration, where it has one
        for r in records:
            run = run_of(r)
            for found, where, _ in declared_in(r):
                if mine(where) and run:
                    by_run[run] = by_hash[found]
        before = cutoff(rules.audit.retention_days, now)
        for index, r in enumerate(records):
            when, run = record_time(r), run_of(r)
            if when is None or when >= before:  # the prune's own cut-off stops here
                break
            governs = (by_run.get(run) if run else None) or in_force(own, when)
            if governs is None or governs.policy_hash == hashed:
                continue
            days = governs.retention_days
            if days is not None and when < cutoff(days, now):
                continue  # past the retention of the policy it falls under, too
            return index, (
                f"seq {r.get('seq')} on (run {run}) fall under policy "
                f"{governs.policy_hash[:12]}, which this log declared for them"
                + (f" ({days} days)" if days is not None else "")
                + ": prune them with that policy"
            )
        return len(records), ""

    return limit


def check_jurisdiction(policy: LoadedPolicy, path: Path, party: str, where: str) -> None:
    """Refuse ``policy`` unless it is that of the party's own jurisdiction ``where``."""
    if where != policy.policy.jurisdiction:
        raise AuditError(
            f"{policy.path}: the policy of {policy.policy.jurisdiction}, but {path} is the log "
            f"of {party} in {where}: each party's log is kept by its own jurisdiction's policy"
        )


def enforce(log: AuditLog, policy: LoadedPolicy, *, now: datetime | None = None) -> Pruned:
    """Prune ``log`` by ``policy``, its party's own jurisdiction's, as ``bound`` allows."""
    rules = policy.policy
    if log.keypair is not None:
        check_jurisdiction(policy, log.path, log.actor, log.keypair.bundle.jurisdiction)
    days = rules.audit.retention_days
    return log.prune(
        cutoff(days, now),
        limit=bound(policy, log.path, log.actor, now),
        retention_days=days,
        jurisdiction=rules.jurisdiction,
        policy=policy.path.name,
        policy_hash=policy.hash,
    )


def enforce_at_start(
    log: AuditLog, policy: LoadedPolicy | None, logger: logging.Logger, who: str
) -> Pruned | None:
    """``enforce`` as a party starts: a failed prune is a warning, never a reason not to
    start (the log stays whole and writable)."""
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
    if pruned.held:
        logger.warning("fedciuic: %s: audit records past retention kept: %s", who, pruned.held)
    return pruned


@dataclass(frozen=True)
class Overdue:
    """Records a log still holds past its retention: what a prune would remove."""

    records: int
    first_time: str
    last_time: str
    days: int


def overdue(
    records: Sequence[Mapping[str, Any]],
    days: int,
    now: datetime | None = None,
    limit: int | None = None,
) -> Overdue | None:
    """The records ``prune`` would remove past a retention of ``days``, or None."""
    cut = prune_cut(records, cutoff(days, now), limit)
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
    """``fedciuic audit prune``: what was done and the log's verdict; ``bound`` refuses an
    undeclared policy even with nothing to prune."""
    keypair = load_keypair(key_file)
    policy = load_policy(policy_file)
    if not path.is_file():
        raise AuditError(f"{path}: no audit log here")
    days = policy.policy.audit.retention_days
    check_jurisdiction(policy, path, keypair.bundle.party, keypair.bundle.jurisdiction)
    records = load_records(path)
    stop, held = bound(policy, path, keypair.bundle.party, now)(records)  # or refuses
    kept = f"; kept: {held}" if held else ""
    nothing = f"{path}: no record older than {days} days ({policy.path.name}): nothing"
    if dry_run:
        found = overdue(records, days, now, stop)
        if found is None:
            return f"{nothing} to prune{kept}"
        return (
            f"{path}: would prune {found.records} record(s) older than {days} days "
            f"({found.first_time} to {found.last_time}, {policy.path.name}){kept}"
        )
    log = AuditLog(path, keypair.bundle.party, keypair)
    try:
        pruned = enforce(log, policy, now=now)
    finally:
        log.close()
    kept = f"; kept: {pruned.held}" if pruned.held else ""
    if not pruned.records:
        return f"{nothing} pruned{kept}"
    return (
        f"{path}: pruned {pruned.records} record(s) older than {days} days "
        f"(seq {pruned.first_seq} to {pruned.first_kept - 1}, {pruned.first_time} to "
        f"{pruned.last_time}), per {policy.path.name}{kept}\n"
        + verify(path, keypair.bundle).explain()
    )


# -- what the report checks: each prune against the policy its party declared ------------

#: How much earlier than another party's witness of it at T a record may have been written
#: (a reply judged at its round's end, clocks a little apart).
EVIDENCE_SLACK = timedelta(days=1)


@dataclass(frozen=True)
class Erased:
    """A run a party's log lost inside its declared retention, or (``run_id`` None) a
    prune no declared policy binds."""

    party: str
    run_id: int | None
    problem: str


def _who(party: str) -> str:
    return "the aggregator" if party == AGGREGATOR else party


def _jurisdiction(
    party: str, records: Sequence[Mapping[str, Any]], aggregator: Sequence[Mapping[str, Any]]
) -> str | None:
    """Where ``party`` is, as the aggregator's log records it, else as its own log says."""
    found: str | None = None
    if party == AGGREGATOR:
        for r in aggregator:
            where = details_of(r).get("aggregator_jurisdiction")
            if r.get("event") == Event.RUN_START and isinstance(where, str) and where:
                found = where
        return found
    held = {h: j for r in aggregator for h, j, _ in declared_in(r)}
    for r in aggregator:
        details = details_of(r)
        declared = details.get("policy_hash")
        if details.get("region") == party and isinstance(declared, str) and declared in held:
            found = held[declared]
    if found is None:
        own = [d.jurisdiction for d in declarations(records) if d.jurisdiction]
        found = own[-1] if own else None
    return found


def _run_keys(logs: Mapping[str, Sequence[Mapping[str, Any]]]) -> dict[tuple[str, int], str]:
    """The key each party used in each run, as another party first recorded it."""
    found: dict[tuple[str, int], str] = {}
    for other, records in logs.items():
        for r in records:
            run, details, event = run_of(r), details_of(r), r.get("event")
            if not run:
                continue
            if event == Event.RUN_JOINED and other != AGGREGATOR:
                named = {AGGREGATOR: details.get("aggregator_key_id")}
            elif event == Event.RUN_START and other == AGGREGATOR:
                ids = details.get("region_key_ids")
                named = dict(ids) if isinstance(ids, Mapping) else {}
            else:
                continue
            for party, key in named.items():
                if isinstance(party, str) and isinstance(key, str) and key:
                    found.setdefault((party, run), key)
    return found


def _prune_problems(
    party: str,
    records: Sequence[Mapping[str, Any]],
    where: str | None,
    declared: Sequence[Declared],
) -> list[Erased]:
    """Each ``audit_pruned`` record of ``party``'s log, against the policies the
    aggregator's log holds for its jurisdiction ``where``."""
    out = []
    for r in records:
        if r.get("event") != Event.PRUNED:
            continue
        d = details_of(r)
        used, used_where, used_days = (
            d.get(k) for k in ("policy_hash", "jurisdiction", "retention_days")
        )
        at, last = record_time(r), parse_time(d.get("last_time"))
        label = f"{log_of(party)} (audit_pruned seq {r.get('seq')!r:.24}, {r.get('time')!s:.32})"
        by = f"pruned by policy {str(used)[:12]} ({used_days!s:.12} days)"
        if not declared:
            problem = (
                f"{label}: {by}, but no policy of {_who(party)}'s jurisdiction "
                f"({where or 'unknown'}) is on the aggregator's record: nothing binds the "
                "retention it applied"
            )
            out.append(Erased(party, None, problem))
            continue
        issues = []
        if used_where != where:
            issues.append(
                f"pruned by the policy of {used_where!s:.32}, but {_who(party)} is in {where}"
            )
        match = next((p for p in declared if p.policy_hash == used), None)
        if match is None:
            named = ", ".join(f"{p.policy_hash[:12]} ({p.retention_days} days)" for p in declared)
            issues.append(
                f"{by}, which is not the policy {_who(party)} declared ({named}, as the "
                "aggregator's log records it)"
            )
        governs = match or in_force(declared, at)
        if governs is None or (days := governs.retention_days) is None:
            issues.append("the declared policy's retention_days is not on the record")
        elif at is None or last is None or last >= at - timedelta(days=days):
            issues.append(
                f"it removed records written up to {d.get('last_time')!s:.32}, inside the "
                f"{days} days {_who(party)}'s declared policy {governs.policy_hash[:12]} keeps "
                "them: records inside the declared retention are gone"
            )
        if issues:
            out.append(Erased(party, None, f"{label}: " + "; ".join(issues)))
    return out


def _gone(
    party: str,
    logs: Mapping[str, Sequence[Mapping[str, Any]]],
    declared: Sequence[Declared],
    run_keys: Mapping[tuple[str, int], str],
    now: datetime,
) -> list[Erased]:
    """Witnessed runs of ``party`` its log lost inside its declared retention, or holds only
    in part; one signed with another key (a log moved aside at a rotation) is not its own."""
    records = logs[party]
    held = {run_of(r) for r in records}
    keys = {  # the key ids that signed its checkpoints
        str(details_of(r).get("key_id"))
        for r in records
        if r.get("event") == Event.CHECKPOINT and details_of(r).get("key_id")
    }
    first = record_time(records[0]) if records else None
    start = records[0].get("seq") if records else 0
    start = start if isinstance(start, int) else 0
    seen: dict[int, tuple[datetime, str, object]] = {}
    split: dict[int, tuple[str, object, int]] = {}
    for other, theirs in logs.items():
        if other == party:
            continue
        for r in theirs:
            run, when, details = run_of(r), record_time(r), details_of(r)
            witnessed = r.get("event") == Event.WITNESS and details.get("party") == party
            if not witnessed or not run or when is None:
                continue
            count = details.get("count")
            if run not in held:
                if run not in seen or when > seen[run][0]:
                    seen[run] = (when, other, r.get("seq"))
            elif party != AGGREGATOR and isinstance(count, int) and 0 < count <= start:
                split.setdefault(run, (other, r.get("seq"), count))

    def elsewhere(run: int) -> bool:  # signed with another key: that key's log holds it
        key = run_keys.get((party, run), "")
        return bool(key and keys and key not in keys)

    out = [
        Erased(
            party,
            run,
            f"{log_of(party)} holds run {run} only in part: {log_of(other)} (witness seq "
            f"{seq!r:.24}) saw {party} sign {count} records in that run, and its records "
            f"before seq {start} are gone; a prune keeps a run whole",
        )
        for run, (other, seq, count) in sorted(split.items())
        if not elsewhere(run)
    ]
    for run, (when, other, seq) in sorted(seen.items(), key=lambda item: item[1][0]):
        if elsewhere(run):
            continue
        key = run_keys.get((party, run), "")
        if not (start or (first is not None and first <= when) or (key and key in keys)):
            continue  # a log begun after the run, with nothing to say it is the same log
        governs = in_force(declared, when)
        saw = (
            f"{log_of(other)} (witness seq {seq!r:.24}) saw {_who(party)} sign on "
            f"{when:%Y-%m-%d %H:%M}"
        )
        if governs is None or (days := governs.retention_days) is None:
            problem = (
                f"{log_of(party)} no longer holds run {run}, which {saw}, and no policy "
                f"{_who(party)} declared is on the aggregator's record to say how long it keeps it"
            )
        elif now < when - EVIDENCE_SLACK + timedelta(days=days):
            problem = (
                f"{log_of(party)} no longer holds run {run}, which {saw}; {_who(party)}'s declared "
                f"policy {governs.policy_hash[:12]} ({governs.jurisdiction}) keeps its records "
                f"{days} days, to {when + timedelta(days=days):%Y-%m-%d}: records inside the "
                "declared retention are gone"
            )
        else:
            continue
        out.append(Erased(party, run, problem))
    return out


def check_retention(
    logs: Mapping[str, Sequence[Mapping[str, Any]]], now: datetime | None = None
) -> list[Erased]:
    """What retention cannot explain: a prune by an undeclared policy or inside the
    declared retention, or a witnessed run gone while it keeps it (verify the logs first)."""
    now = now or datetime.now(UTC)
    aggregator = logs.get(AGGREGATOR, [])
    held = declarations(aggregator)  # the policy of every jurisdiction it held, and when
    run_keys = _run_keys(logs)
    out = []
    for party, records in logs.items():
        where = _jurisdiction(party, records, aggregator)
        declared = [d for d in held if where is not None and d.jurisdiction == where]
        out += _prune_problems(party, records, where, declared)
        out += _gone(party, logs, declared, run_keys, now)
    return out
