"""Tamper-evident audit logs: one append-only, hash-chained JSON Lines file per party.

Each line is the canonical JSON of ``seq, time, run_id, round, actor, event, details,
prev`` with ``,"hash":"<hex>"`` before its closing brace; ``prev`` chains the records, and
a fsync'ed ``checkpoint`` signs the count and head with the party's key, so nobody without
it can rewrite what came before. A torn last line is moved aside, logged, by the next
writer: nothing is dropped silently (docs/audit.md is the format reference).

Witnessing (RFC 6962, C2SP tlog-witness): each party records as ``witness`` the latest
signed checkpoint of every party it hears from, since a chain cannot show by itself that
it was cut back. ``AuditLog.prune`` removes records past retention after a signed
``audit_pruned`` record naming the last hash removed: a verifier starts such a log's chain
at its first record's ``prev``, and accepts it only under a verified signature.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import fcntl
import hashlib
import json
import os
import re
import struct
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO, TypeGuard

from fedciuic.audit.events import LEDGER_WITNESSES, SENT_EVENTS, Event
from fedciuic.audit.pruning import PRUNING_SUFFIX as PRUNING_SUFFIX  # users import it from here
from fedciuic.audit.pruning import remove_side_files, replace_with, replaced
from fedciuic.crypto import AGGREGATOR, Keypair, PublicBundle
from fedciuic.errors import FedciuicError

RECORD_LABEL = b"\x00fedciuic-audit-record/1\x00"
CHECKPOINT_LABEL = b"\x01fedciuic-audit-checkpoint/1\x00"
GENESIS = "0" * 64
#: A record of another party's signed checkpoint: details ``party``, ``count``, ``head``.
WITNESS_EVENT = Event.WITNESS
TIME_FORMAT = "%Y-%m-%dT%H:%M:%S.%fZ"
FIELDS = ("seq", "time", "run_id", "round", "actor", "event", "details", "prev")
#: A region's log, in its state-path; the aggregator's, in its audit folder.
REGION_LOG = "audit.jsonl"
AGGREGATOR_LOG = "aggregator.audit.jsonl"
#: The events in which an update leaves a region, and arrives at the aggregator.
RECEIVED_EVENT = Event.UPDATE_RECEIVED
_TAIL_READ = 1 << 16


class AuditError(FedciuicError):
    """An audit log cannot be opened or written; the party must not go on without it."""


def _is_head(value: object) -> TypeGuard[str]:
    return isinstance(value, str) and re.fullmatch("[0-9a-f]{64}", value) is not None


def _is_count(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 64


def checkpoint_head(count: object, head: object) -> tuple[int, str]:
    """A checkpoint head from another party (untrusted), validated; ``AuditError`` if not."""
    if not _is_count(count):
        raise AuditError(f"checkpoint head: count {count!r:.40} is not a non-negative integer")
    if not _is_head(head):
        raise AuditError(f"checkpoint head: head {head!r:.80} is not 64 lower-case hex digits")
    if count == 0 and head != GENESIS:
        raise AuditError("checkpoint head: the genesis head (64 zeros for count 0) expected")
    return count, head


def canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def record_hash(body: bytes) -> str:
    """The hash of a record's canonical bytes (its line without the hash suffix)."""
    return hashlib.sha256(RECORD_LABEL + body).hexdigest()


def checkpoint_message(count: int, head: str) -> bytes:
    """What a checkpoint signs: the record count and the chain head, domain-separated."""
    payload = CHECKPOINT_LABEL + struct.pack(">Q", count) + bytes.fromhex(head)
    return hashlib.sha256(payload).digest()


def _line(record: dict[str, Any]) -> tuple[bytes, str]:
    body = canonical(record)
    digest = record_hash(body)
    return body[:-1] + f',"hash":"{digest}"}}'.encode() + b"\n", digest


def split_line(line: bytes) -> tuple[bytes, str]:
    """A line's canonical body and the hash it claims; ``ValueError`` if it has none."""
    suffix_len = len(',"hash":"') + 64 + len('"}')
    tail = line[-suffix_len:]
    if len(line) <= suffix_len or not tail.startswith(b',"hash":"') or not tail.endswith(b'"}'):
        raise ValueError('the line does not end with ,"hash":"<64 hex digits>"}')
    return line[:-suffix_len] + b"}", tail[9:-2].decode("ascii", "replace")


def digest(data: bytes | bytearray | memoryview) -> str:
    """The SHA-256 of what crossed the relay (an envelope, or a clear update)."""
    return hashlib.sha256(data).hexdigest()


def config_hash(config: Mapping[str, Any]) -> str:
    """The SHA-256 of a run config's canonical JSON: both ends log it, so they can be
    shown to have run under the same settings."""
    return hashlib.sha256(canonical(dict(config))).hexdigest()


def code_version() -> str:
    from importlib.metadata import version

    from fedciuic import __version__

    return f"fedciuic {__version__}, flwr {version('flwr')}"


def _now() -> str:
    return datetime.now(UTC).strftime(TIME_FORMAT)


#: ``TIME_FORMAT`` as written: a pattern, since pruning reads every record's time.
_TIME = re.compile(r"(\d{4})-(\d{2})-(\d{2})T(\d{2}):(\d{2}):(\d{2})\.(\d{6})Z", re.ASCII)


def record_time(record: Mapping[str, Any]) -> datetime | None:
    """When a record was written (its ``time``, UTC), None when it holds no valid time."""
    return parse_time(record.get("time"))


def parse_time(value: object) -> datetime | None:
    """A time as records write it (UTC, microseconds, ``Z``), None when it is not one."""
    found = _TIME.fullmatch(value) if isinstance(value, str) else None
    if found is None:
        return None
    year, month, day, hour, minute, second, micro = map(int, found.groups())
    try:
        return datetime(year, month, day, hour, minute, second, micro, tzinfo=UTC)
    except ValueError:  # e.g. month 13
        return None


def details_of(record: Mapping[str, Any] | None) -> Mapping[str, Any]:
    """A record's details, empty unless they are a mapping (records are untrusted)."""
    details = None if record is None else record.get("details")
    return details if isinstance(details, Mapping) else {}


def run_of(record: Mapping[str, Any]) -> int | None:
    """A record's run id, None unless a count (a list there must not become a key)."""
    value = record.get("run_id")
    return value if _is_count(value) else None


def prune_cut(
    records: Sequence[Mapping[str, Any]], before: datetime, limit: int | None = None
) -> int:
    """How many of a log's first records pruning at ``before`` removes: those written before
    it, up to ``limit``, less those of a run with a later record (a run is kept whole)."""
    end = len(records) if limit is None else max(0, min(limit, len(records)))
    cut = next(
        (i for i in range(end) if (t := record_time(records[i])) is None or t >= before), end
    )
    kept_runs = {run_of(r) for r in records[cut:]} - {0, None}
    return next((i for i in range(cut) if run_of(records[i]) in kept_runs), cut)


#: How far a prune may go into a log's records and why (``retention.bound``).
Limit = Callable[[Sequence[Mapping[str, Any]]], tuple[int, str]]


@dataclass(frozen=True)
class Declared:
    """A policy a party declared to the others, as its own log records it; the times span
    the records that declared it."""

    policy_hash: str
    jurisdiction: str | None
    retention_days: int | None
    first_time: str
    last_time: str


def _days(value: object) -> int | None:
    return value if _is_count(value) and value > 0 else None


def declared_in(record: Mapping[str, Any]) -> list[tuple[str, str | None, int | None]]:
    """The ``(policy_hash, jurisdiction, retention_days)`` a record declares, if well-formed."""
    details, event, actor = details_of(record), record.get("event"), record.get("actor")
    if event == Event.RUN_START:
        hashes, days = details.get("policy_hashes"), details.get("retention_days")
        if not isinstance(hashes, Mapping):
            return []
        days = days if isinstance(days, Mapping) else {}
        return [
            (h, j, _days(days.get(j)))
            for j, h in hashes.items()
            if isinstance(j, str) and isinstance(h, str) and h
        ]
    found, where = details.get("policy_hash"), details.get("jurisdiction")
    own = event == Event.RUN_JOINED or (
        # the aggregator's decisions name the sender's policy, not its own
        event == Event.POLICY_DECISION and details.get("actor") == actor != AGGREGATOR
    )
    if not own or not isinstance(found, str) or not found:
        return []
    return [(found, where if isinstance(where, str) and where else None, None)]


def declarations(records: Iterable[Mapping[str, Any]]) -> list[Declared]:
    """Every policy a log declares or its prunes carried, per (hash, jurisdiction), in order."""
    seen: dict[tuple[str, str | None], dict[str, Any]] = {}

    def add(h: str, j: str | None, days: int | None, first: str, last: str) -> None:
        entry = seen.setdefault((h, j), {"retention_days": None})
        entry["retention_days"] = entry["retention_days"] or days
        entry["first_time"] = min(filter(None, (entry.get("first_time"), first)), default="")
        entry["last_time"] = max(filter(None, (entry.get("last_time"), last)), default="")

    for r in records:
        when = r.get("time") if isinstance(r.get("time"), str) else ""
        carried = details_of(r).get("declared") if r.get("event") == Event.PRUNED else None
        for item in carried if isinstance(carried, list) else []:
            if not isinstance(item, Mapping) or not isinstance(item.get("policy_hash"), str):
                continue
            j, first, last = (item.get(k) for k in ("jurisdiction", "first_time", "last_time"))
            add(
                item["policy_hash"],
                j if isinstance(j, str) and j else None,
                _days(item.get("retention_days")),
                first if isinstance(first, str) else "",
                last if isinstance(last, str) else "",
            )
        for h, j, days in declared_in(r):
            add(h, j, days, str(when), str(when))
    found = [
        Declared(h, j, entry["retention_days"], entry["first_time"], entry["last_time"])
        for (h, j), entry in seen.items()
    ]
    return sorted(found, key=lambda d: d.first_time)


@dataclass(frozen=True)
class Pruned:
    """What one ``AuditLog.prune`` removed: seq ``first_seq`` to ``first_kept - 1``."""

    records: int = 0
    first_seq: int = 0
    first_kept: int = 0
    first_time: str = ""
    last_time: str = ""
    held: str = ""  # why records past the cut-off were kept (a ``Limit`` stopped it)


def redaction(paths: Sequence[tuple[str, str]]) -> tuple[tuple[re.Pattern[str], str], ...]:
    """Patterns replacing each path (as given, and resolved) by its label only as a whole
    path: a ``data-path`` like ``eu`` must not rewrite a region's name or base64."""
    patterns = [
        (re.compile(rf"(?<![\w./-]){re.escape(form.rstrip('/'))}(?=/|$|[^\w.-])"), label)
        for path, label in paths
        if path
        for form in sorted({path, str(Path(path).expanduser().resolve())}, key=len, reverse=True)
        if "/" in form  # else not recognisable as a path inside free text
    ]
    return tuple(sorted(patterns, key=lambda p: -len(p[0].pattern)))


def _redact(value: Any, patterns: Sequence[tuple[re.Pattern[str], str]]) -> Any:
    if isinstance(value, str):
        for pattern, label in patterns:
            value = pattern.sub(label, value)
        return value
    if isinstance(value, Mapping):
        return {k: _redact(v, patterns) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_redact(v, patterns) for v in value]
    return value


class AuditLog:
    """Appends records to one party's log; safe across processes (a lock per append)."""

    def __init__(
        self,
        path: Path,
        actor: str,
        keypair: Keypair | None,
        *,
        redact: Sequence[tuple[str, str]] = (),
        checkpoint_every: int = 64,
    ) -> None:
        self.path = path
        self.actor = actor
        self.keypair = keypair
        self.redact = redaction(redact)
        self.checkpoint_every = checkpoint_every
        self._since_checkpoint = 0
        self._file = self._open(
            "open", "; nothing is sent without one: fix the folder's permissions or the path"
        )
        with self._locked(sync=False):
            remove_side_files(self.path)

    def close(self) -> None:
        self._file.close()

    def _open(self, verb: str, fix: str = "") -> BinaryIO:
        """The file the path names now, its tail left to read again under the lock."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
        except OSError as err:
            raise AuditError(
                f"{self.path}: cannot {verb} the audit log ({err.strerror}){fix}"
            ) from None
        self._size, self._seq, self._head = -1, 0, GENESIS
        # The latest checkpoint's (count, head) in the file's first ``_checkpoint_scanned`` bytes.
        self._last_checkpoint: tuple[int, str] | None = None
        self._checkpoint_scanned = 0
        return os.fdopen(fd, "a+b")

    def _reopen(self) -> None:
        old, self._file = self._file, self._open("reopen")
        old.close()

    def prune(
        self, before: datetime, *, run_id: int = 0, limit: Limit | None = None, **why: Any
    ) -> Pruned:
        """Remove the records before ``before`` from the log's start, as far as ``limit``
        allows; a log that fails verification is evidence, and is never pruned."""
        if self.keypair is None:
            raise AuditError(
                f"{self.path}: not pruned: pruning is signed with the party's key, and "
                "this log has none"
            )
        if before.tzinfo is None:  # record times are UTC
            before = before.replace(tzinfo=UTC)
        with self._locked():
            self._file.seek(0)
            first = record_time(_json_object(self._file.readline()))
            if first is not None and first >= before:  # the usual case: read no further
                return Pruned()
            self._file.seek(0)
            lines = self._file.read(self._size).splitlines()
            try:
                records = [json.loads(line) for line in lines]
                if not all(isinstance(r, dict) for r in records):
                    raise ValueError("not a JSON object")
            except ValueError:
                raise AuditError(
                    f"{self.path}: not pruned: a line is not an audit record; run "
                    "`fedciuic audit verify` on it"
                ) from None
            remove_side_files(self.path)
            due = prune_cut(records, before)
            if due == 0:
                return Pruned()
            stop, why_stopped = limit(records) if limit is not None else (due, "")
            cut = prune_cut(records, before, stop)
            held = why_stopped if cut < due else ""
            if cut == 0:
                return Pruned(held=held)
            verdict = verify(self.path, self.keypair.bundle)
            if verdict.problem is not None:
                raise AuditError(
                    f"{self.path}: not pruned: the log fails verification ({verdict.problem}); "
                    "keep it as evidence and start a new log"
                )
            removed = records[:cut]
            seqs = int(removed[0]["seq"]), int(removed[-1]["seq"]) + 1
            times = str(removed[0].get("time")), str(removed[-1].get("time"))
            pruned = Pruned(cut, *seqs, *times, held)
            details = {
                "first_kept": pruned.first_kept,
                "head": split_line(lines[cut - 1])[1],
                "records": pruned.records,
                "first_time": pruned.first_time,
                "last_time": pruned.last_time,
                "older_than": before.astimezone(UTC).strftime(TIME_FORMAT),
                **why,
                # What must outlive them: the privacy ledger's witnesses, the policies declared.
                "carried": _carried(removed, self.actor),
                "declared": [asdict(d) for d in declarations(removed)],
            }
            self._write(Event.PRUNED, run_id, None, details)
            self._checkpoint(run_id, None)
            self._replace_from(sum(len(line) + 1 for line in lines[:cut]))
        return pruned

    def _replace_from(self, offset: int) -> None:
        """Replace the file by its bytes from ``offset`` on, under the lock."""
        self._file.seek(offset)
        kept = self._file.read()
        mode = os.fstat(self._file.fileno()).st_mode & 0o777
        try:
            replace_with(self.path, kept, mode)
        except OSError as err:
            raise AuditError(
                f"{self.path}: the prune is recorded, but the file could not be replaced "
                f"({err.strerror}); the log is whole: prune again"
            ) from None
        seq, head = self._seq, self._head
        self._reopen()  # closing the old file lets the writers waiting on it go on
        self._seq, self._head, self._size = seq, head, len(kept)

    def append(
        self, event: str, *, run_id: int, server_round: int | None = None, **details: Any
    ) -> str:
        """Append one record and return its hash; checkpoint when one is due."""
        with self._locked():
            digest = self._write(event, run_id, server_round, _redact(details, self.redact))
            self._since_checkpoint += 1
            if self._since_checkpoint >= self.checkpoint_every:
                self._checkpoint(run_id, server_round)
        return digest

    def position(self) -> tuple[int, str]:
        """The number of records and the chain head now (for the aggregator's checkpoint)."""
        with self._locked():
            return self._seq, self._head

    def last_checkpoint(self) -> tuple[int, str] | None:
        """The (count, head) the latest checkpoint in the file signs (for the others to
        witness), None before the first."""
        with self._locked():
            if self._checkpoint_scanned > self._size:  # the file shrank under us
                self._last_checkpoint, self._checkpoint_scanned = None, 0
            if self._checkpoint_scanned < self._size:
                self._scan_checkpoints()
            return self._last_checkpoint

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
        """Record ``party``'s latest signed checkpoint as it showed it (untrusted); ``late``:
        in a reply handled after a newer one (a lower count is no rollback then)."""
        count, head = checkpoint_head(count, head)
        if not isinstance(party, str) or not party:
            raise AuditError(f"witness: party {party!r:.40} is not a party's name")
        details = {"party": party, "count": count, "head": head} | ({"late": True} if late else {})
        return self.append(WITNESS_EVENT, run_id=run_id, server_round=server_round, **details)

    def _scan_checkpoints(self) -> None:
        """Find the latest checkpoint in the bytes not scanned yet, a chunk at a time back."""
        stop, pos, carry = self._checkpoint_scanned, self._size, b""
        while pos > stop:
            start = max(stop, pos - _TAIL_READ)
            self._file.seek(start)
            pieces = (self._file.read(pos - start) + carry).split(b"\n")
            carry = pieces.pop(0) if start > stop else b""
            for line in reversed(pieces):
                found = _checkpoint_of(line)
                if found is not None:
                    self._last_checkpoint, self._checkpoint_scanned = found, self._size
                    return
            pos = start  # ``carry`` (a line's end) joins the chunk before it
        self._checkpoint_scanned = self._size  # none since: the one known stays

    def check_continues(self, seq: int, head: str) -> None:
        """Refuse to go on unless the log still holds record ``seq - 1`` with hash ``head``."""
        with self._locked():
            found = GENESIS
            if seq > 0:
                self._file.seek(0)
                for line in self._file:
                    if _json_object(line).get("seq") == seq - 1:
                        with contextlib.suppress(ValueError):
                            found = split_line(line.rstrip(b"\n"))[1]
                            break
                else:
                    found = ""
            if found != head:
                raise AuditError(
                    f"{self.path}: the log no longer holds the record the checkpoint names "
                    f"(seq {seq - 1}, hash {head[:16]}); it was rewritten or replaced: run "
                    "`fedciuic audit verify` on it before resuming"
                )

    def records(self) -> list[dict[str, Any]]:
        """Every complete record so far, parsed (:func:`load_records`)."""
        return load_records(self.path)

    def checkpoint(self, *, run_id: int, server_round: int | None = None) -> None:
        """Sign everything so far and flush it to disk."""
        with self._locked():
            self._checkpoint(run_id, server_round)

    def _checkpoint(self, run_id: int, server_round: int | None) -> None:
        details: dict[str, Any] = {"count": self._seq, "head": self._head}
        if self.keypair is not None:
            signature = self.keypair.sign(checkpoint_message(self._seq, self._head))
            details["key_id"] = self.keypair.bundle.key_id.hex()
            details["signature"] = base64.b64encode(signature).decode("ascii")
        self._write(Event.CHECKPOINT, run_id, server_round, details)
        self._file.flush()
        os.fsync(self._file.fileno())
        self._since_checkpoint = 0

    def _write(
        self, event: str, run_id: int, server_round: int | None, details: dict[str, Any]
    ) -> str:
        values = (self._seq, _now(), run_id, server_round, self.actor, event, details, self._head)
        line, digest = _line(dict(zip(FIELDS, values, strict=True)))
        self._file.write(line)
        self._file.flush()
        if self._checkpoint_scanned == self._size:
            self._checkpoint_scanned += len(line)
            if event == Event.CHECKPOINT:
                self._last_checkpoint = (self._seq, self._head)
        self._size += len(line)
        self._seq += 1
        self._head = digest
        return digest

    @contextlib.contextmanager
    def _locked(self, *, sync: bool = True) -> Iterator[None]:
        """The file the path names locked (reopened if a prune replaced it), its tail synced."""
        fcntl.flock(self._file.fileno(), fcntl.LOCK_EX)
        try:
            while replaced(self.path, self._file.fileno()):
                fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)
                self._reopen()
                fcntl.flock(self._file.fileno(), fcntl.LOCK_EX)
            if sync:
                self._sync_tail()
            yield
        finally:
            self._file.flush()
            fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)

    def _sync_tail(self) -> None:
        """Pick up where the file ends, and move a torn last line aside, logging it."""
        size = os.fstat(self._file.fileno()).st_size
        if size == self._size:
            return
        self._file.seek(max(0, size - _TAIL_READ))
        tail = self._file.read()
        if size > _TAIL_READ and tail.count(b"\n") < 2:
            self._file.seek(0)
            tail = self._file.read()
        torn = b""
        if tail and not tail.endswith(b"\n"):
            cut = tail.rfind(b"\n") + 1
            torn, tail = tail[cut:], tail[:cut]
            self._file.truncate(size - len(torn))
            size -= len(torn)
        lines = tail.splitlines()
        if lines:
            try:
                last = json.loads(lines[-1])
                self._seq, self._head = int(last["seq"]) + 1, split_line(lines[-1])[1]
            except (ValueError, KeyError, TypeError):
                raise AuditError(
                    f"{self.path}: the last record is not a fedciuic audit record; the log was "
                    "altered: keep it as evidence, run `fedciuic audit verify`, start a new log"
                ) from None
        self._size = size
        if torn:
            side = self.path.with_name(f"{self.path.name}.torn-{time.time_ns()}")
            side.write_bytes(torn)
            details = {"bytes": len(torn), "sha256": digest(torn), "moved_to": side.name}
            self._write(Event.TORN_TAIL, 0, None, details)


def _json_object(line: bytes) -> dict[str, Any]:
    try:
        value = json.loads(line)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _checkpoint_of(line: bytes) -> tuple[int, str] | None:
    """The (count, head) of a checkpoint record's line, None for any other line."""
    record = _json_object(line) if b'"event":"' + Event.CHECKPOINT.encode() + b'"' in line else {}
    if record.get("event") != Event.CHECKPOINT:
        return None
    details = details_of(record)
    count, head = details.get("count"), details.get("head")
    return (count, head) if _is_count(count) and _is_head(head) else None


@dataclass
class Verdict:
    """What verifying one log found: OK, or the first bad record and why."""

    path: Path
    records: int = 0
    checkpoints: int = 0
    verified_through: int = -1  # seq of the last checkpoint that verified
    problem: str | None = None
    torn_tail: str | None = None
    unsigned_tail: int = 0  # records after the last checkpoint
    actor: str = ""
    first_seq: int = 0  # the first record's seq: above 0 once records were pruned
    pruned_by: int = -1  # seq of the audit_pruned record that accounts for them

    @property
    def ok(self) -> bool:
        return self.problem is None and self.torn_tail is None and self.unsigned_tail == 0

    @property
    def covered(self) -> int:
        """How many first records a verified checkpoint covers (not the checkpoint itself)."""
        return max(self.verified_through - self.first_seq, 0)

    def explain(self) -> str:
        covered = (
            f"verified up to the checkpoint at seq {self.verified_through}"
            if self.verified_through >= 0
            else "no checkpoint verified"
        )
        if self.ok:
            pruned = (
                f" (seq 0 to {self.first_seq - 1} pruned, as the signed audit_pruned record at "
                f"seq {self.pruned_by} says)"
                if self.first_seq
                else ""
            )
            return (
                f"OK: {self.path}: {self.records} records ({self.actor}), {self.checkpoints} "
                f"signed checkpoints, the last at seq {self.verified_through}{pruned}"
            )
        lines = [f"FAIL: {self.path}: {covered}"]
        lines += [f"  {found}" for found in (self.problem, self.torn_tail) if found]
        if self.unsigned_tail and not self.problem:
            lines.append(
                f"  {self.unsigned_tail} record(s) after the last checkpoint are not covered by a "
                "signature: the log was truncated or its writer stopped before checkpointing"
            )
        return "\n".join(lines)


def read_lines(path: Path) -> tuple[list[bytes], bytes]:
    """The complete lines of a log, and a torn last line (b"" if none)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise AuditError(f"{path}: no audit log here") from None
    except OSError as err:
        raise AuditError(f"{path}: cannot read the audit log ({err.strerror})") from None
    cut = data.rfind(b"\n") + 1
    return data[:cut].splitlines(), data[cut:]


def verify(path: Path, bundle: PublicBundle) -> Verdict:
    """Check every hash, link and checkpoint signature; stop at the first bad record."""
    lines, torn = read_lines(path)
    verdict = Verdict(path)

    def fail(problem: str) -> Verdict:
        verdict.problem = problem
        return verdict

    if torn:
        verdict.torn_tail = (
            f"torn tail: the last line ({len(torn)} bytes) is incomplete, a write cut short"
        )
    if not lines and not torn:
        return fail("the log is empty")
    expected, head = 0, GENESIS
    since = 0
    # The seqs an audit_pruned record names as the last it removed: only their hashes kept.
    named = {
        found - 1
        for line in lines
        if Event.PRUNED.encode() in line
        and _is_count(found := details_of(_json_object(line)).get("first_kept"))
    }
    held: dict[int, str] = {}
    for index, line in enumerate(lines):
        where = f"line {index + 1}"
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or any(f not in record for f in FIELDS):
                raise ValueError(f"missing fields {[f for f in FIELDS if f not in record]}")
            body, claimed = split_line(line)
            seq = record["seq"]
            if not _is_count(seq):
                raise ValueError("seq is not a non-negative integer")
        except (ValueError, TypeError) as err:
            return fail(f"{where}: not a fedciuic audit record ({err})")
        where = f"{where} (seq {seq}, {record['event']})"
        if index == 0 and seq > 0 and _is_head(record["prev"]):
            # Pruned, or cut: the chain starts here; an audit_pruned record must say so.
            expected, head = seq, record["prev"]
            verdict.first_seq = seq
        if record_hash(body) != claimed or record.get("hash") != claimed:
            return fail(f"{where}: changed: its content does not match its hash")
        if seq < expected:
            return fail(f"{where}: inserted: seq {seq} comes again after seq {expected - 1}")
        if seq > expected:
            if any(_seq_of(other) == expected for other in lines[index + 1 :]):
                return fail(f"{where}: reordered: seq {expected} comes later in the file")
            return fail(f"{where}: deleted: seq {expected} to {seq - 1} are missing")
        if record["prev"] != head:
            return fail(f"{where}: inserted or reordered: prev does not name the record before it")
        verdict.actor = verdict.actor or str(record["actor"])
        if record["event"] == Event.CHECKPOINT:
            if problem := _check_checkpoint(record["details"], seq, head, bundle):
                return fail(f"{where}: {problem}")
            verdict.checkpoints += 1
            verdict.verified_through = seq
            since = -1
        elif record["event"] == Event.PRUNED:
            if problem := _check_pruned(record["details"], seq, verdict.first_seq, held, lines[0]):
                return fail(f"{where}: {problem}")
            if verdict.pruned_by < 0 and record["details"]["first_kept"] == verdict.first_seq:
                verdict.pruned_by = seq
        head, expected = claimed, expected + 1
        if seq in named:
            held[seq] = claimed
        since += 1
        verdict.records += 1
    verdict.unsigned_tail = since
    if verdict.first_seq:
        missing = f"line 1 (seq {verdict.first_seq}): deleted: seq 0 to {verdict.first_seq - 1}"
        if verdict.pruned_by < 0:
            verdict.problem = (
                f"{missing} are missing, and no {Event.PRUNED} record accounts for them"
            )
        elif verdict.pruned_by >= verdict.verified_through:
            verdict.problem = (
                f"{missing} are missing; the {Event.PRUNED} record that accounts for them (seq "
                f"{verdict.pruned_by}) is not covered by a verified signature"
            )
        if verdict.problem is not None:  # where the log starts is not established
            verdict.verified_through = -1
    return verdict


def _check_pruned(
    details: Any, seq: int, first_seq: int, held: Mapping[int, str], first_line: bytes
) -> str | None:
    """What is wrong with an ``audit_pruned`` record: the head it names must be the log's."""
    if not isinstance(details, dict):
        return f"{Event.PRUNED} record without details"
    first_kept, head = details.get("first_kept"), details.get("head")
    if not _is_count(first_kept) or not 0 < first_kept <= seq or not _is_head(head):
        return f"malformed {Event.PRUNED} record (first_kept, head)"
    if first_kept > first_seq:  # the file still holds the last record it removed
        if held.get(first_kept - 1) != head:
            return (
                f"the {Event.PRUNED} record names head {head[:16]} for seq {first_kept - 1}, which "
                "the log holds with another hash"
            )
    elif first_kept == first_seq and json.loads(first_line).get("prev") != head:
        return f"the {Event.PRUNED} record names another head than the first record's prev"
    return None


def _carried(removed: Sequence[Mapping[str, Any]], actor: str) -> list[Any]:
    """Per dataset, the details of the records witnessing its ledger's longest chain and
    highest epsilon: the ledger's rollback check needs them past a prune (docs/privacy.md)."""
    best: dict[object, list[Mapping[str, Any]]] = {}
    for r in with_carried(removed):
        details = details_of(r)
        witness = r.get("event") in LEDGER_WITNESSES and r.get("actor") == actor
        if witness and isinstance(details.get("ledger"), Mapping):
            best.setdefault(details.get("data_fingerprint"), []).append(details)

    def releases(d: Mapping[str, Any]) -> float:
        count = d["ledger"].get("releases")
        return count if _is_count(count) else -1

    def epsilon(d: Mapping[str, Any]) -> float:
        value = d.get("epsilon")
        return float(value) if isinstance(value, int | float) else -1.0

    out: list[Any] = []
    for found in best.values():
        for top in (max(found, key=releases), max(found, key=epsilon)):
            if all(top is not kept for kept in out):
                out.append(top)
    return out


def with_carried(records: Iterable[Mapping[str, Any]]) -> Iterable[Mapping[str, Any]]:
    """The records, each ``audit_pruned`` one preceded by the ``trained`` records it
    carried: a prune never hides what a privacy ledger spent."""
    for r in records:
        carried = details_of(r).get("carried") if r.get("event") == Event.PRUNED else None
        for item in carried if isinstance(carried, list) else []:
            yield {**r, "event": Event.TRAINED, "details": item}
        yield r


def pruned_from(records: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The details of the ``audit_pruned`` record accounting for a log's missing first
    records, or None (verify the log first)."""
    if not records:
        return None
    start, prev = records[0].get("seq"), records[0].get("prev")
    if not _is_count(start) or start == 0:
        return None
    for r in records:
        d = details_of(r)
        if r.get("event") == Event.PRUNED and (d.get("first_kept"), d.get("head")) == (start, prev):
            return d
    return None


def _seq_of(line: bytes) -> int | None:
    value = _json_object(line).get("seq")
    return value if isinstance(value, int) else None


def _check_checkpoint(details: Any, seq: int, head: str, bundle: PublicBundle) -> str | None:
    if not isinstance(details, dict):
        return "checkpoint without details"
    if details.get("count") != seq or details.get("head") != head:
        return "checkpoint does not match the records before it (count or head differ)"
    if "signature" not in details:
        return "checkpoint has no signature (the party wrote it without a key)"
    if details.get("key_id") != bundle.key_id.hex():
        return (
            f"signed by another key: key id {details.get('key_id')}, expected "
            f"{bundle.key_id.hex()} ({bundle.party})"
        )
    try:
        signature = base64.b64decode(str(details["signature"]), validate=True)
    except (binascii.Error, ValueError):
        return "checkpoint signature is not base64"
    if not bundle.verify(checkpoint_message(seq, head), signature):
        return f"checkpoint signature does not verify with key {bundle.key_id.hex()}"
    return None


def load_records(path: Path) -> list[dict[str, Any]]:
    """Every complete record of a log, parsed (for show and report; verify first)."""
    lines, _ = read_lines(path)
    records = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except ValueError:
            raise AuditError(f"{path}:{number}: not JSON; run `fedciuic audit verify`") from None
        if not isinstance(record, dict):
            raise AuditError(f"{path}:{number}: not an audit record")
        records.append(record)
    return records


@dataclass(frozen=True)
class Transfer:
    run_id: int
    round: int
    region: str
    digest: str


@dataclass(frozen=True)
class Undelivered:
    """An update sent that the aggregator logged failing: spent, not delivered, never silent."""

    transfer: Transfer
    reason: str


@dataclass
class CrossCheck:
    """Whether what regions logged as sent is what the aggregator logged as received."""

    matched: list[Transfer] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    undelivered: list[Undelivered] = field(default_factory=list)

    @property
    def agree(self) -> bool:
        return not self.problems


def _transfer(record: Mapping[str, Any], region: str | None) -> Transfer | None:
    """A send or receipt record as a Transfer; None when it is malformed (untrusted)."""
    details = details_of(record)
    run_id, server_round, found = record.get("run_id"), record.get("round"), details.get("digest")
    region = details.get("region", "") if region is None else region
    if (
        not _is_count(run_id)
        or not (_is_count(server_round) or server_round is None)
        or not isinstance(region, str)
        or not isinstance(found, str)
    ):
        return None
    return Transfer(run_id, server_round if server_round is not None else -1, region, found)


def cross_check(
    aggregator: Iterable[Mapping[str, Any]], regions: Mapping[str, Iterable[Mapping[str, Any]]]
) -> CrossCheck:
    """Match sends with receipts by run, round, region and digest (malformed: a problem)."""
    result = CrossCheck()
    received: set[Transfer] = set()
    runs: set[int] = set()
    failed: dict[tuple[int, int, str], str] = {}  # the aggregator's failed replies

    def add(into: set[Transfer], r: Mapping[str, Any], party: str, region: str | None) -> None:
        t = _transfer(r, region)
        if t is not None:
            into.add(t)
        else:
            result.problems.append(
                f"{log_of(party)} (seq {r.get('seq')!r:.24}): malformed {r.get('event')} record"
            )

    for r in aggregator:
        run_id, details = r.get("run_id"), r.get("details")
        if _is_count(run_id):
            runs.add(run_id)  # a run the aggregator's log covers, receipts or none
            if r.get("event") == Event.REPLY_FAILED and isinstance(details, Mapping):
                key = (run_id, r.get("round"), details.get("region"))
                # The first is what the round acted on: a later error changed nothing.
                failed.setdefault(key, str(details.get("reason", "")))  # type: ignore[arg-type]
        if r.get("event") == RECEIVED_EVENT:
            add(received, r, AGGREGATOR, None)
    sent: set[Transfer] = set()
    for region, records in regions.items():
        for r in records:
            if r.get("event") in SENT_EVENTS:
                add(sent, r, region, region)
    for t in sorted(sent | received, key=lambda t: (t.run_id, t.round, t.region, t.digest)):
        if t in sent and t in received:
            result.matched.append(t)
        elif t in sent and (t.run_id, t.round, t.region) in failed:
            result.undelivered.append(Undelivered(t, failed[(t.run_id, t.round, t.region)]))
        elif t in sent and t.run_id in runs:
            result.problems.append(
                f"run {t.run_id} round {t.round}: {t.region} logged sending {t.digest[:16]}, "
                "the aggregator logged no such update"
            )
        elif t in received and t.region in regions:
            result.problems.append(
                f"run {t.run_id} round {t.round}: the aggregator logged receiving "
                f"{t.digest[:16]} from {t.region}, whose log has no such update"
            )
    return result


@dataclass(frozen=True)
class Witnessed:
    """``witness``'s record ``seq``: ``party``'s checkpoint signed ``count`` up to ``head``."""

    witness: str
    seq: int
    party: str
    count: int
    head: str


@dataclass
class WitnessCheck:
    """Whether every party's log still holds every checkpoint another party witnessed."""

    matched: list[Witnessed] = field(default_factory=list)
    unchecked: list[Witnessed] = field(default_factory=list)  # that party's log not given
    #: checkpoints whose records that party's log has since pruned past its retention
    pruned: list[Witnessed] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def agree(self) -> bool:
        return not self.problems


def log_of(party: str) -> str:
    """How messages name a party's log."""
    return "the aggregator's log" if party == AGGREGATOR else f"{party}'s log"


def _witness_details(details: object) -> tuple[str, int, str] | str:
    """A witness record's (party, count, head), or what is wrong with it."""
    if not isinstance(details, dict):
        return "details is not an object"
    party, count, head = details.get("party"), details.get("count"), details.get("head")
    if not isinstance(party, str) or not party:
        return "party is not a party's name"
    try:
        return (party, *checkpoint_head(count, head))
    except AuditError as err:  # the one check of a head received from another party
        return str(err)


def witness_check(
    logs: Mapping[str, Sequence[Mapping[str, Any]]],
    *,
    run_id: int | None = None,
    covered: Mapping[str, int] | None = None,
) -> WitnessCheck:
    """Check every ``witness`` record (of ``run_id``): the party's log must still hold record
    ``count - 1`` with hash ``head`` and its checkpoint at ``count`` (unless pruned), and its
    witnesses never go back. ``covered``: how many first records a signature covers."""
    chains: dict[str, dict[int, str]] = {}
    starts = {
        party: records[0]["seq"] if pruned_from(records) is not None else 0
        for party, records in logs.items()
    }
    signed: dict[str, dict[int, tuple[object, object]]] = {}
    for party, records in logs.items():
        chain, checkpoints = chains.setdefault(party, {}), signed.setdefault(party, {})
        for r in records:
            seq, claimed = r.get("seq"), r.get("hash")
            if isinstance(seq, int) and isinstance(claimed, str):
                chain.setdefault(seq, claimed)
                details = r.get("details")
                if r.get("event") == Event.CHECKPOINT and isinstance(details, dict):
                    checkpoints.setdefault(seq, (details.get("count"), details.get("head")))
    result = WitnessCheck()
    for name, records in logs.items():
        last: dict[str, tuple[int, str, object]] = {}  # party -> count, head, seq
        heads: dict[str, dict[int, tuple[str, object]]] = {}  # party -> count -> head, seq
        for index, r in enumerate(records):
            if r.get("event") != WITNESS_EVENT or (
                run_id is not None and r.get("run_id") != run_id
            ):
                continue
            at = f"{log_of(name)} (seq {r.get('seq')!r:.24})"
            unsigned = (
                " (this witness record is not covered by a signature)"
                if covered is not None and index >= covered.get(name, 0)
                else ""
            )
            parsed = _witness_details(r.get("details"))
            if isinstance(parsed, str):
                result.problems.append(f"{at}: malformed witness record: {parsed}{unsigned}")
                continue
            party, count, head = parsed
            seq = r.get("seq")
            # A late reply (handled after a newer one) shows an older head: no rollback.
            late = r["details"].get("late") is True
            seen = f"{at} witnessed {party}'s checkpoint count {count} head {head[:16]}…"
            before = last.get(party)
            same = heads.setdefault(party, {}).get(count)
            earlier = (count, *same) if same is not None and same[0] != head else None
            if earlier is None and not late and before is not None and count < before[0]:
                earlier = before
            if earlier is not None:
                result.problems.append(
                    f"{party}'s log was rolled back or forked: {seen}, after witnessing count "
                    f"{earlier[0]} head {earlier[1][:16]}… (seq {earlier[2]!r:.24}){unsigned}"
                )
            heads[party].setdefault(count, (head, seq))
            if not late:
                last[party] = (count, head, seq)
            witnessed = Witnessed(name, seq if isinstance(seq, int) else -1, party, count, head)
            if party not in logs:
                result.unchecked.append(witnessed)
                continue
            held = starts[party] + len(logs[party])  # the records it has had
            found = GENESIS if count == 0 else chains[party].get(count - 1)
            problem = None
            if count == 0:  # the empty log's head (a party with no checkpoint yet)
                pass
            elif count - 1 < starts[party]:  # past its retention: gone, and signed as gone
                result.pruned.append(witnessed)
                continue
            elif (found is None and count > held) or (found == head and count >= held):
                problem = f"truncated: {seen}, but {log_of(party)} holds only {held} records"
            elif found is None:
                problem = f"rewritten: {seen}, but {log_of(party)} has no record seq {count - 1}"
            elif found != head:
                problem = (
                    f"truncated or rewritten: {seen}, which {log_of(party)} no longer holds "
                    f"(its seq {count - 1} has hash {found[:16]}…)"
                )
            elif signed[party].get(count) != (count, head):
                problem = (
                    f"truncated or rewritten: {seen}; {log_of(party)} still holds the records "
                    f"it signed, but not that checkpoint (seq {count})"
                )
            if problem is None:
                result.matched.append(witnessed)
            else:
                result.problems.append(f"{party}'s log was {problem}{unsigned}")
    return result
