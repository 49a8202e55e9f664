"""A per-run compliance report from the audit logs of the aggregator and the regions.

For one run: what left each region, where to and under which guarantees, every refusal,
and whether the logs agree. Its tables state only what a verified signature covers, to serve
as a GDPR Art. 30 record of processing and a PIPL Art. 38-40 cross-border transfer record.
"""

from __future__ import annotations

import html
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from fedciuic.audit.events import OUTSIDE_DP, SECURE_SENT_EVENTS, SENT_EVENTS, Event
from fedciuic.audit.log import (
    RECEIVED_EVENT,
    AuditError,
    Undelivered,
    Verdict,
    WitnessCheck,
    canonical,
    cross_check,
    details_of,
    load_records,
    pruned_from,
    verify,
    witness_check,
)
from fedciuic.audit.retention import PRUNE_COMMAND, check_retention, overdue
from fedciuic.config import DEFAULT_PRIVACY_UNIT
from fedciuic.crypto import load_bundles
from fedciuic.deid import entity_label
from fedciuic.errors import EXIT_AUDIT, EXIT_OK, ConfigError

AuditRecord = Mapping[str, Any]

#: ``fedciuic audit report``'s exit status when every log verified (or none was checked),
#: but the logs disagree (2 is every fedciuic command's error).
EXIT_DISAGREE = 3
UNVERIFIED_TITLE = "Unverified records (not covered by a signature)"


@dataclass
class Section:
    title: str
    paragraphs: list[str] = field(default_factory=list)
    header: Sequence[str] = ()
    rows: Sequence[Sequence[str]] = field(default_factory=list)


@dataclass
class PartyLog:
    path: Path
    actor: str
    records: Sequence[AuditRecord]
    verdict: Verdict | None = None

    @property
    def covered(self) -> int:
        """How many of the first records a verified signature covers (0 unverified)."""
        return 0 if self.verdict is None else self.verdict.covered

    @property
    def verified(self) -> Sequence[AuditRecord]:
        """The records a verified checkpoint signature covers: the only facts."""
        return self.records[: self.covered]

    @property
    def unverified(self) -> Sequence[AuditRecord]:
        """The records after the last verified checkpoint (all, when none verified)."""
        if self.verdict is None or self.verdict.verified_through < 0:
            return self.records
        return self.records[self.covered + 1 :]

    @property
    def first_seq(self) -> int:
        """The seq of the log's first record: above 0 once older records were pruned."""
        seq = self.records[0].get("seq") if self.records else 0
        return seq if isinstance(seq, int) else 0

    @property
    def pruned(self) -> Mapping[str, Any] | None:
        """The ``audit_pruned`` details that account for the missing first records."""
        return pruned_from(self.records)

    @property
    def jurisdiction(self) -> str | None:
        """The party's jurisdiction as its own latest run or prune record names it."""
        key = "aggregator_jurisdiction" if self.actor == "aggregator" else "jurisdiction"
        event = Event.RUN_START if self.actor == "aggregator" else Event.RUN_JOINED
        for r in reversed(self.records):
            found = details_of(r).get(key) if r.get("event") == event else None
            if r.get("event") == Event.PRUNED:  # the policy it was pruned by
                found = details_of(r).get("jurisdiction")
            if isinstance(found, str) and found:
                return found
        return None


@dataclass
class Report:
    """A run's report: its sections, and where the logs disagree."""

    run_id: int
    sections: list[Section]
    disagreements: list[str]

    def redacted(self, redact: Callable[[str], str]) -> Report:
        """The report with ``redact`` applied to every piece of text (local paths)."""
        sections = [
            replace(
                s,
                title=redact(s.title),
                paragraphs=[redact(p) for p in s.paragraphs],
                rows=[[redact(c) for c in row] for row in s.rows],
            )
            for s in self.sections
        ]
        return Report(self.run_id, sections, [redact(d) for d in self.disagreements])


def open_logs(paths: Sequence[Path], verdicts: Mapping[Path, Verdict]) -> list[PartyLog]:
    logs = []
    for path in paths:
        records = load_records(path)
        if not records:
            raise AuditError(f"{path}: the audit log is empty")
        logs.append(PartyLog(path, str(records[0].get("actor")), records, verdicts.get(path)))
    if sum(log.actor == "aggregator" for log in logs) != 1:
        raise AuditError(
            "give exactly one aggregator log (aggregator.audit.jsonl) and the regions' logs"
        )
    for log in logs:
        same = [str(other.path) for other in logs if other.actor == log.actor]
        if len(same) > 1:
            raise AuditError(
                f"give one log per party: {', '.join(same)} are all {log.actor}'s; "
                "a log moved aside after a key rotation is reported on by itself"
            )
    return logs


def build_report(
    logs: Sequence[PartyLog], run_id: int | None = None, *, now: datetime | None = None
) -> Report:
    """The report for ``run_id`` (default: the last): tables from signed records only, the
    agreement checks from every record (a disagreement is one, signed or not), less region
    logs pruned of the whole run by a bound prune (said so)."""
    aggregator = next(log for log in logs if log.actor == "aggregator")
    starts = _of(aggregator.records, Event.RUN_START)
    runs = [r["run_id"] for r in starts if isinstance(r.get("run_id"), int)]
    if not runs:
        raise AuditError(f"{aggregator.path}: no run_start record; not an aggregator's log")
    run_id = runs[-1] if run_id is None else run_id
    if run_id not in runs:
        pruned = (
            f" (its records before seq {aggregator.first_seq} were pruned past retention)"
            if aggregator.pruned is not None
            else ""
        )
        raise AuditError(f"run {run_id} is not in {aggregator.path}{pruned}; runs there: {runs}")

    def of_run(records: Sequence[AuditRecord]) -> list[AuditRecord]:
        return [r for r in records if r.get("run_id") == run_id]

    regions: dict[str, PartyLog] = {}
    pruned_away: list[str] = []
    erased = check_retention({log.actor: log.records for log in logs}, now)
    for log in logs:
        if log.actor == "aggregator":
            continue
        if log.pruned is not None and not of_run(log.records):
            pruned_away.append(
                f"{log.actor}'s log no longer holds this run: its records up to "
                f"{_text(log.pruned.get('last_time'))} were pruned past its retention "
                f"({_text(log.pruned.get('retention_days'))} days, the policy it declared); "
                "it is left out of the checks below."
                if not any(e.party == log.actor for e in erased)
                else f"{log.actor}'s log no longer holds this run, and its prune is not "
                "bound to the policy it declared (above); it is left out of the checks below."
            )
        else:
            regions[log.actor] = log
    agg = of_run(aggregator.verified)
    own = {name: of_run(log.verified) for name, log in regions.items()}
    agg_all = of_run(aggregator.records)
    own_all = {name: of_run(log.records) for name, log in regions.items()}
    start = details_of(_first(agg, Event.RUN_START))
    end = details_of(_first(agg, Event.RUN_END))
    check = cross_check(agg_all, own_all)
    witnesses = witness_check(
        {log.actor: log.records for log in logs},
        run_id=run_id,
        covered={log.actor: log.covered for log in logs},
    )
    unsigned = {
        "start": _first(agg_all, Event.RUN_START) is not None and not start,
        "end": _first(agg_all, Event.RUN_END) is not None and not end,
    }
    disagreements = [
        *_config_disagreements(details_of(_first(agg_all, Event.RUN_START)), own_all),
        *check.problems,
        *witnesses.problems,
        *(e.problem for e in erased),
    ]
    sections = [
        _overview(run_id, start, end, agg, unsigned),
        _logs_section(logs, start.get("retention_days"), now),
        _regions_section(start, own, agg, unsigned["start"]),
        _transfers_section(agg, own, agg_all),
        _undelivered_section(check.undelivered, own_all),
        _privacy_section(own),
        _deid_section(own),
        _oversized_section(own),
        *_secure_section(agg, own),
        _outside_dp_section(own),
        _code_section(agg, own),
        _refusals_section(agg, own, {name: log.verified for name, log in regions.items()}, run_id),
        _agreement_section(
            disagreements, _witness_summary(witnesses), len(check.undelivered), pruned_away
        ),
        _unverified_section(logs, run_id),
        _record_of_processing(start, own),
    ]
    return Report(run_id, sections, disagreements)


def _witness_summary(check: WitnessCheck) -> str:
    parts = [f"{len(check.matched)} witnessed checkpoint(s) still held"]
    if check.unchecked:
        named = sorted({w.party for w in check.unchecked})
        parts.append(f"{len(check.unchecked)} not checked (no log given for {', '.join(named)})")
    if check.pruned:
        named = sorted({w.party for w in check.pruned})
        parts.append(
            f"{len(check.pruned)} no longer checkable ({', '.join(named)} pruned those "
            "records past retention, as a signed audit_pruned record says)"
        )
    if check.problems:
        parts.append(f"{len(check.problems)} not held or malformed (above)")
    return (
        "Witnessing: each party records the latest signed checkpoint of the parties it "
        "hears from; every party's log must still hold each checkpoint another party "
        "witnessed. In this run: " + "; ".join(parts) + "."
    )


def _first(records: Sequence[AuditRecord], event: str) -> AuditRecord | None:
    return next((r for r in records if r.get("event") == event), None)


def _text(value: Any) -> str:
    return "-" if value is None else str(value)


#: How each kind of figure is printed, to what it means (the logs keep the exact value).
_FIGURES = {"noise": ".3g", "rate": ".3g", "epsilon": ".2f", "delta": "g"}


def _figure(value: Any, kind: str) -> str:
    """A figure of the ``kind`` in ``_FIGURES``; anything not a number as it is."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return _text(value)
    return format(value, _FIGURES[kind])


def _round(record: AuditRecord) -> str:
    return _text(record.get("round"))


def _of(records: Sequence[AuditRecord], *events: str) -> list[AuditRecord]:
    return [r for r in records if r.get("event") in events]


def _each(
    own: Mapping[str, Sequence[AuditRecord]], *events: str
) -> Iterator[tuple[str, AuditRecord, Mapping[str, Any]]]:
    """Each region's records of ``events``, regions by name: (region, record, details)."""
    for region, records in sorted(own.items()):
        for r in _of(records, *events):
            yield region, r, details_of(r)


def _by_round(rows: Sequence[Sequence[str]]) -> list[Sequence[str]]:
    return sorted(rows, key=lambda row: (int(row[0]) if row[0].isdigit() else 0, row[1]))


def _table(
    title: str,
    about: str,
    header: Sequence[str],
    rows: Sequence[Sequence[str]],
    empty: str | None = None,
) -> Section:
    """A section of one table after ``about``; with no rows, only ``empty`` (or ``about``)."""
    if rows:
        return Section(title, [about] if about else [], header, rows)
    return Section(title, [about if empty is None else empty])


def _overview(
    run_id: int,
    start: Mapping[str, Any],
    end: Mapping[str, Any],
    agg: Sequence[AuditRecord],
    unsigned: Mapping[str, bool],
) -> Section:
    published, withheld = _of(agg, Event.AGGREGATE_PUBLISHED), _of(agg, Event.AGGREGATE_WITHHELD)
    times = [r.get("time") for r in agg]
    regions = start.get("regions")
    regions = ", ".join(map(str, regions)) if isinstance(regions, list) else "-"
    status = _text(end.get("status", "not ended in this log's signed records"))

    def signed(record: str, value: str) -> str:  # the run_start or run_end record's value
        return "not covered by a signature (see Unverified records)" if unsigned[record] else value

    def of_start(key: str) -> str:
        return signed("start", _text(start.get(key)))

    return Section(
        "Run",
        [
            "From the aggregator's records that a verified checkpoint signature covers; "
            "what comes after its last verified checkpoint is listed under Unverified records."
        ],
        header=("item", "value"),
        rows=[
            ("run id", str(run_id)),
            ("time (UTC)", f"{_text(times[0])} to {_text(times[-1])}" if times else "-"),
            ("status", signed("end", status)),
            ("regions", signed("start", regions)),
            ("aggregator jurisdiction", of_start("aggregator_jurisdiction")),
            ("relay jurisdiction", of_start("relay_jurisdiction")),
            ("base model", signed("start", _base_model(start))),
            ("DP terms asked", signed("start", _dp_terms(start.get("dp")))),
            ("config hash", of_start("config_hash")),
            ("code", of_start("code_version")),
            ("aggregator key id", of_start("key_id")),
            ("aggregates published / withheld", f"{len(published)} / {len(withheld)}"),
            ("final model digest", signed("end", _text(end.get("model_digest")))),
        ],
    )


def _base_model(start: Mapping[str, Any]) -> str:
    """The frozen base every region trains on: its name and its fingerprint."""
    model, fingerprint = start.get("model"), start.get("base_fingerprint")
    if not model and not fingerprint:
        return "-"
    return f"{_text(model)} (fingerprint {str(fingerprint)[:16] or '-'})"


def _dp_terms(dp: Any) -> str:
    """The differential privacy the run config asked of every region."""
    if not isinstance(dp, Mapping):
        return "-"
    if not dp.get("on"):
        return "off"
    return (
        f"target epsilon {_text(dp.get('target_epsilon'))} per {_text(dp.get('unit'))} per run, "
        f"delta {_text(dp.get('target_delta'))}, clipping norm "
        f"{_text(dp.get('max_grad_norm'))}, secure noise "
        f"{'on' if dp.get('secure_mode') else 'OFF'}"
    )


def _logs_section(logs: Sequence[PartyLog], retention: Any, now: datetime | None = None) -> Section:
    rows, overdue_lines = [], []
    for log in logs:
        verdict, first = log.verdict, log.first_seq
        status = (
            "not verified (no public key given)"
            if verdict is None
            else ("OK" if verdict.ok else "FAIL: " + verdict.explain().split("\n", 1)[-1].strip())
        )
        covered = (
            f"{log.covered} (seq {first} to {first + log.covered - 1})" if log.covered else "none"
        )
        kept, late = _retention(log, retention, now)
        if late:
            overdue_lines.append(late)
        # The file's name only: where it sits on this machine is no one's business.
        rows.append((log.actor, log.path.name, str(len(log.records)), covered, status, kept))
    return Section(
        "Audit logs examined",
        [
            "Each log is hash-chained and signed at checkpoints with its party's key. Only the "
            "records a verified checkpoint signature covers are facts in the tables below. "
            "Each party's log is kept for its own jurisdiction's audit.retention_days, then "
            "pruned: a signed audit_pruned record names what was removed, and the log still "
            "verifies.",
            *overdue_lines,
        ],
        (
            "party",
            "file",
            "records",
            "covered by a verified signature",
            "verification",
            "retention",
        ),
        rows,
    )


def _retention(log: PartyLog, retention: Any, now: datetime | None) -> tuple[str, str]:
    """A log's retention cell and, when it holds records past it, how to prune them."""
    jurisdiction = log.jurisdiction
    days = retention.get(jurisdiction) if isinstance(retention, Mapping) else None
    pruned = log.pruned
    done = (
        f"; seq 0 to {log.first_seq - 1} pruned (written {_text(pruned.get('first_time'))} to "
        f"{_text(pruned.get('last_time'))})"
        if pruned is not None
        else ""
    )
    if not isinstance(days, int) or isinstance(days, bool):
        return f"no retention period known for {jurisdiction or 'its jurisdiction'}{done}", ""
    late = overdue(log.records, days, now)
    if late is None:
        return f"{days} days ({jurisdiction}): none past it{done}", ""
    return (
        f"{days} days ({jurisdiction}): {late.records} record(s) past it{done}",
        f"{'The aggregator' if log.actor == 'aggregator' else log.actor}'s log keeps "
        f"{late.records} record(s) older than {days} days, its policy's retention "
        f"({jurisdiction}), written {late.first_time} to {late.last_time}: prune with "
        f"`{PRUNE_COMMAND}` (the party's own key and policy; its agent, or the aggregator, "
        "does this when it starts).",
    )


def _regions_section(
    start: Mapping[str, Any],
    own: Mapping[str, Sequence[AuditRecord]],
    agg: Sequence[AuditRecord],
    start_unsigned: bool,
) -> Section:
    rows = []
    regions = start.get("regions")
    for region in regions if isinstance(regions, list) else []:
        records = own.get(region)
        accepted, declined = (
            sum(details_of(r).get("region") == region for r in _of(agg, event))
            for event in (Event.UPDATE_ACCEPTED, Event.REGION_DECLINED)
        )
        trained = _of(records or [], Event.TRAINED)
        joined = details_of(_first(records or [], Event.RUN_JOINED))
        last = details_of(trained[-1]) if trained else {}
        epsilon, budget = last.get("epsilon"), last.get("epsilon_budget")
        # A log from before units has none: its rounds were record-level.
        unit = last.get("unit") or DEFAULT_PRIVACY_UNIT
        spent = (
            f"{epsilon:.3f} of {budget:g} per {unit}"
            if isinstance(epsilon, int | float) and isinstance(budget, int | float)
            else ("no DP" if trained else "-")
        )
        where, policy = (str(joined.get(k) or "-") for k in ("jurisdiction", "policy_hash"))
        given = "yes" if records is not None else "no (log not given)"
        rows.append((str(region), where, policy[:12], str(accepted), str(declined), spent, given))
    paragraphs = [
        "Epsilon is the dataset's cumulative spend after its last round in this run, "
        "from the region's own log (its privacy ledger records the same), per record or "
        "per user: a guarantee per user covers all of one person's records together."
    ]
    if start_unsigned:
        paragraphs.append(
            "The aggregator's run_start record is not covered by a signature: the regions "
            "of this run are not established (see Unverified records)."
        )
    return Section(
        "Regions",
        paragraphs,
        ("region", "jurisdiction", "policy", "updates accepted", "declined", "epsilon", "log"),
        rows,
    )


def _receipt(record: AuditRecord) -> tuple[str, str, str]:
    d = details_of(record)
    return (_round(record), str(d.get("region")), str(d.get("digest")))


def _transfers_section(
    agg: Sequence[AuditRecord],
    own: Mapping[str, Sequence[AuditRecord]],
    agg_all: Sequence[AuditRecord],
) -> Section:
    received = {_receipt(r) for r in _of(agg, RECEIVED_EVENT)}
    claimed = {_receipt(r) for r in _of(agg_all, RECEIVED_EVENT)}

    def row(r: AuditRecord, region: str, to: str, status: str) -> tuple[str, ...]:
        d = details_of(r)
        size, suite = _text(d.get("bytes")), _text(d.get("suite"))
        return (_round(r), region, to, size, suite, str(d.get("digest"))[:16], status)

    rows = []
    for region, r, d in _each(own, *SENT_EVENTS):
        key = (_round(r), region, str(d.get("digest")))
        seen = (
            "yes" if key in received else "only in an unverified record" if key in claimed else "NO"
        )
        to = f"{d.get('destination', 'aggregator')} ({d.get('destination_jurisdiction')})"
        rows.append(row(r, region, to, seen))
    for r in _of(agg, RECEIVED_EVENT):
        if (sender := details_of(r).get("region")) not in own:
            rows.append(row(r, str(sender), "aggregator (as received)", "region log not given"))
    return Section(
        "Transfers",
        [
            "Every update that left a region: where it went, its size and protection, and "
            "whether the aggregator logged receiving the same ciphertext (SHA-256)."
        ],
        ("round", "region", "destination", "bytes", "suite", "digest", "received"),
        _by_round(rows),
    )


def _code_section(agg: Sequence[AuditRecord], own: Mapping[str, Sequence[AuditRecord]]) -> Section:
    """Which code made each update, as its reply named it, against what its region recorded."""
    joined = {
        region: str(details_of(_first(records, Event.RUN_JOINED)).get("code", ""))
        for region, records in own.items()
    }
    rows = []
    for r in _of(agg, RECEIVED_EVENT):
        d = details_of(r)
        region, code = str(d.get("region")), str(d.get("agent_code", ""))
        recorded = joined.get(region)
        same = "yes" if recorded and recorded == code else "NO"
        if recorded is None:
            same = "region log not given"
        rows.append((_round(r), region, _text(d.get("agent_version")), code[:16] or "-", same))
    return _table(
        "Code",
        "Which code made each update that arrived: the region agent's fedciuic version and "
        "the SHA-256 of its installed code, as its signed reply named them, and whether "
        "that is the code the region's own log recorded for the run.",
        ("round", "region", "agent version", "code digest", "as the region recorded"),
        _by_round(rows),
    )


def _privacy_section(own: Mapping[str, Sequence[AuditRecord]]) -> Section:
    """Each region's DP-SGD parameters per round, from its own log."""
    rows = [
        (
            _round(r),
            region,
            _figure(d.get("noise_multiplier"), "noise"),
            _figure(d.get("sample_rate"), "rate"),
            _text(d.get("max_grad_norm")),
            _text(d.get("steps")),
            _text(d.get("unit") or DEFAULT_PRIVACY_UNIT),
            _figure(d.get("delta"), "delta"),
            _figure(d.get("epsilon"), "epsilon"),
        )
        for region, r, d in _each(own, Event.TRAINED)
        if d.get("epsilon") is not None
    ]
    return _table(
        "Privacy parameters",
        "What each region's DP-SGD applied, per round, from its own log: the noise "
        "multiplier, the sampling rate (expected fraction of its privacy units per "
        "step), the clipping norm, the steps, the unit, and its dataset's cumulative "
        "epsilon after the round at that delta.",
        (
            "round",
            "region",
            "noise multiplier",
            "sampling rate",
            "clipping norm",
            "steps",
            "unit",
            "delta",
            "epsilon after",
        ),
        rows,
        "No region's log records a DP round in this run.",
    )


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _deid_section(own: Mapping[str, Sequence[AuditRecord]]) -> Section:
    """What each region's de-identification replaced before each round it trained."""
    scrubbed = {(region, _round(r)): d for region, r, d in _each(own, Event.DATA_DEIDENTIFIED)}
    rows = []
    for region, r, _ in _each(own, Event.TRAINED):
        d = scrubbed.get((region, _round(r)))
        if d is None:
            rows.append((_round(r), region, "none", "-", "-", "-", "not de-identified"))
            continue
        identity = _mapping(d.get("identity"))
        counts = _mapping(d.get("counts"))
        rows.append(
            (
                _round(r),
                region,
                _text(identity.get("config_hash"))[:12],
                _text(identity.get("replacement")),
                _text(_mapping(identity.get("recognizers")).get("presidio-analyzer")),
                _text(d.get("records")),
                ", ".join(f"{entity_label(k)} {v}" for k, v in sorted(counts.items()))
                or "nothing found",
            )
        )
    return _table(
        "De-identification",
        "What each region replaced in its texts before it trained, per round, from its "
        "own log (docs/deidentification.md): the pipeline's config hash (entity types, "
        "replacement, recognizer versions, dictionary, key), the replacement, Presidio's "
        "version, the records with an identifier, and the identifiers replaced per "
        "entity type. No value is ever recorded.",
        (
            "round",
            "region",
            "pipeline",
            "replacement",
            "presidio",
            "records with identifiers",
            "identifiers replaced",
        ),
        rows,
        "No region's log records a round it trained in this run.",
    )


def _oversized_section(own: Mapping[str, Sequence[AuditRecord]]) -> Section:
    """The records each region dropped unread for their size, per round."""
    rows = [
        (
            _round(r),
            region,
            _text(d.get("max_record_bytes")),
            _text(d.get("records")),
            ", ".join(f"{name} {n}" for name, n in sorted(_mapping(d.get("files")).items())) or "-",
        )
        for region, r, d in _each(own, Event.RECORDS_OVERSIZED)
    ]
    return _table(
        "Long records",
        "Records over a region's max-record-bytes, dropped unread from what it trained "
        'on, per round, from its own log (docs/data.md, "Long records"): the limit in '
        "bytes, how many, and how many per file.",
        ("round", "region", "max-record-bytes", "records dropped", "per file"),
        rows,
        "No region's log records a record dropped for its size in this run.",
    )


def _names(value: Any) -> str:
    return ", ".join(map(str, value)) if isinstance(value, list) and value else "-"


def _secure_section(
    agg: Sequence[AuditRecord], own: Mapping[str, Sequence[AuditRecord]]
) -> list[Section]:
    """Each secure sum as the aggregator recorded it, against what the regions' logs sent."""
    sums = _of(agg, Event.SECURE_SUM)
    if not sums:
        return []
    masked: dict[str, list[str]] = {}
    for region, _, d in _each(own, Event.SECURE_MASKED):
        masked.setdefault(str(d.get("session")), []).append(region)
    sent: dict[str, dict[str, int]] = {}  # session -> region -> bytes its messages took
    for region, _, d in _each(own, *SECURE_SENT_EVENTS):
        if type(size := d.get("bytes")) is int:
            mine = sent.setdefault(str(d.get("session")), {})
            mine[region] = mine.get(region, 0) + size
    rows = []
    for r in sums:
        d = details_of(r)
        session = str(d.get("session", ""))
        rows.append(
            (
                _round(r),
                _text(d.get("outcome")),
                _names(d.get("joined")),
                _names(d.get("survivors")),
                _names(d.get("dropped")),
                _names(d.get("revealed")),
                _names(masked.get(session, [])),
                ", ".join(f"{k} {v:,}" for k, v in sorted(sent.get(session, {}).items())) or "-",
                str(len(d.get("refused") or [])),
            )
        )
    return [
        Section(
            "Secure sums",
            [
                "The aggregator learned only each sum: every region masked its update, and "
                "the masks came off only in the sum of the survivors' (docs/"
                "secure-aggregation.md). Survivors: whose masked vectors were summed; "
                "dropped: shared seeds but sent no masked vector; revealed: sent the shares "
                "that unmasked the sum; masked (regions' logs): the regions whose own logs "
                "record sending a masked vector for that sum; bytes sent: what each region's "
                "log records its messages in that sum took (its masked vector among them), "
                "besides its trained reply."
            ],
            (
                "round",
                "outcome",
                "joined",
                "survivors",
                "dropped",
                "revealed",
                "masked (regions' logs)",
                "bytes sent (regions' logs)",
                "refused messages",
            ),
            rows,
        )
    ]


def _outside_dp_section(own: Mapping[str, Sequence[AuditRecord]]) -> Section:
    """The figures a reply carried beside its DP update that DP does not protect, as its
    region's ``outside_dp`` lists them (older logs: what of them was not a DP release)."""
    counted = {(region, r.get("run_id")) for region, r, _ in _each(own, Event.UNITS_COUNTED)}
    recorded = {  # the rounds whose trained record lists what left outside DP
        (region, r.get("run_id"), r.get("round"))
        for region, r, d in _each(own, Event.TRAINED)
        if OUTSIDE_DP in d
    }
    sized = {  # the rounds whose update's size depended on the data
        (region, r.get("run_id"), r.get("round"))
        for region, r, d in _each(own, Event.TRAINED)
        if d.get("size_of_data", True)  # not recorded (older logs): counted as such
    }
    rows = []
    for region, r, d in _each(own, Event.TRAINED, Event.EVALUATED, *SENT_EVENTS):
        event, run_round = r.get("event"), (region, r.get("run_id"), r.get("round"))
        examples = f"{_text(d.get('examples'))} examples"
        what = "trained" if event == Event.TRAINED else "evaluated"
        if event in (Event.TRAINED, Event.EVALUATED) and OUTSIDE_DP in d:
            if d[OUTSIDE_DP]:
                rows.append((_round(r), region, what, ", ".join(map(str, d[OUTSIDE_DP]))))
            continue
        if event == Event.TRAINED:
            if run_round[:2] in counted:  # its weight was the run's DP count
                continue
            figures = f"{examples}, {_text(d.get('steps'))} steps"
        elif event == Event.EVALUATED:
            if "ledger" in d:  # a DP evaluation, charged to the ledger
                continue
            figures = f"{examples}, eval loss {_text(d.get('loss'))}"
        else:
            if run_round in recorded or run_round not in sized:  # listed, or public
                continue
            what, figures = "update size", f"{_text(d.get('bytes'))} bytes"
        rows.append((_round(r), region, what, figures))
    return _table(
        "Figures sent outside DP",
        "Besides its DP update, a reply may carry figures DP does not protect: its "
        "training example count (the aggregate's weight) unless the run released a DP "
        "count of units (count-noise), its held-out loss and example count unless the "
        "evaluation was a DP release (eval-noise), its training loss and step time "
        "unless the run or its policy withholds them, and under a top-k codec its "
        "update's size (docs/privacy.md, fedciuic/releases.py). From each region's own "
        "log: the fields its release table classed as figures of its data in what it sent.",
        ("round", "region", "what", "figures"),
        _by_round(rows),
        "None: each region's own log records sending only DP releases (the run's count "
        "of units, its evaluations and updates), figures of public configuration and "
        "commitments.",
    )


def _reasons(value: Any) -> str:
    return "; ".join(map(str, value)) if isinstance(value, list) else _text(value)


def _refusals_section(
    agg: Sequence[AuditRecord],
    own: Mapping[str, Sequence[AuditRecord]],
    agents: Mapping[str, Sequence[AuditRecord]],
    run_id: int,
) -> Section:
    rows = [
        (_round(r), region, "declined", _text(d.get("reason")))
        for region, r, d in _each(own, Event.DECLINED)
    ]
    rows += [
        (
            _text(d.get("claimed_round")),
            region,
            f"refused a {_text(d.get('kind'))} request (pid {_text(d.get('peer_pid'))})",
            _text(d.get("reason")),
        )
        for region, _, d in _each(agents, Event.REQUEST_REFUSED)
        if d.get("flower_run") == run_id  # a region agent's refusals claiming this run
    ]
    for r in agg:
        d, event = details_of(r), r.get("event")
        if event == Event.UPDATE_REJECTED:
            rows.append(
                (_round(r), "aggregator", f"rejected {d.get('region')}", _text(d.get("reason")))
            )
        elif event == Event.AGGREGATE_WITHHELD:
            rows.append((_round(r), "aggregator", "withheld aggregate", _reasons(d.get("reasons"))))
        elif event == Event.REGION_DECLINED and d.get("region") not in own:
            rows.append(
                (_round(r), str(d.get("region")), "declined (as received)", _text(d.get("reason")))
            )
    return _table(
        "Refusals",
        "",
        ("round", "by", "what", "reasons"),
        rows,
        "None in the signed records: every region took part and every update was accepted.",
    )


def _config_disagreements(
    start: Mapping[str, Any], own: Mapping[str, Sequence[AuditRecord]]
) -> list[str]:
    lines = []
    config = start.get("config_hash")
    for region, records in sorted(own.items()):
        joined = _first(records, Event.RUN_JOINED)
        if joined is None:
            # One that refused the run before joining has no run config to compare.
            if not records:
                lines.append(f"{region}: its log has no record of this run.")
        elif details_of(joined).get("config_hash") != config:
            lines.append(f"{region}: ran under another run config (hash differs).")
    return lines


def _agreement_section(
    disagreements: Sequence[str],
    witnessing: str,
    undelivered: int = 0,
    pruned_away: Sequence[str] = (),
) -> Section:
    paragraphs = [
        "The region and aggregator logs agree." if not disagreements else "The logs DISAGREE:"
    ]
    if undelivered:
        paragraphs.append(
            f"{undelivered} update(s) left a region, spending its privacy budget, and never "
            "reached the aggregator, which logged that region's reply as failed in that "
            "round: see Spent, not delivered."
        )
    return Section(
        "Agreement between the logs", [*paragraphs, *disagreements, *pruned_away, witnessing]
    )


def _undelivered_section(
    undelivered: Sequence[Undelivered], own: Mapping[str, Sequence[AuditRecord]]
) -> Section:
    """Releases the aggregator never received: spent, not delivered, and why."""
    rows = []
    for item in undelivered:
        t = item.transfer
        records = own.get(t.region, [])
        trained = [details_of(r) for r in _of(records, Event.TRAINED) if r.get("round") == t.round]
        epsilon = trained[-1].get("epsilon") if trained else None
        spent = f"{epsilon:.3f}" if isinstance(epsilon, int | float) else "-"
        notices = _of(records, Event.UPDATE_UNDELIVERED)
        known = "yes" if any(details_of(r).get("digest") == t.digest for r in notices) else "no"
        rows.append((str(t.round), t.region, spent, t.digest[:16], item.reason or "-", known))
    return _table(
        "Spent, not delivered",
        "Updates a region released (its ledger counts their epsilon) that the aggregator "
        "never received, with the aggregator's record of why, and whether the region's "
        "own log records it as undelivered (from the aggregator's signed run-end notice).",
        (
            "round",
            "region",
            "epsilon after it",
            "digest",
            "why (the aggregator's record)",
            "region knows",
        ),
        rows,
        "None: every update that left a region reached the aggregator.",
    )


def _unverified_section(logs: Sequence[PartyLog], run_id: int) -> Section:
    rows = []
    elsewhere = 0
    for log in logs:
        for r in log.unverified:
            if r.get("run_id") != run_id:
                elsewhere += 1
                continue
            details = canonical(details_of(r)).decode()
            details = details if len(details) <= 160 else details[:157] + "..."
            rows.append((log.actor, _text(r.get("seq")), _round(r), _text(r.get("event")), details))
    section = _table(
        UNVERIFIED_TITLE,
        "UNVERIFIED: no verified checkpoint signature covers these records (they come after "
        "their log's last verified checkpoint, or their log was not verified or failed). "
        "They are what the file says, not established facts, and the tables above leave "
        "them out. A log's last verified checkpoint record itself (its time, run and round) "
        "is covered only by a later checkpoint or another party's witness.",
        ("party", "seq", "round", "event", "details"),
        rows,
        "None: every record of this run is covered by a verified signature.",
    )
    if elsewhere:
        section.paragraphs.append(f"{elsewhere} more unverified record(s) belong to other runs.")
    return section


def _record_of_processing(
    start: Mapping[str, Any], own: Mapping[str, Sequence[AuditRecord]]
) -> Section:
    jurisdictions = sorted(
        {
            str(details_of(j).get("jurisdiction"))
            for records in own.values()
            if (j := _first(records, Event.RUN_JOINED)) is not None
        }
    )
    policies = _mapping(start.get("policy_hashes"))
    retention = _mapping(start.get("retention_days"))
    return Section(
        "Record of processing and cross-border transfers",
        [
            "GDPR Art. 30(1) record of processing activities; PIPL Art. 38-40 record of "
            "personal information provided abroad.",
        ],
        ("item", "entry"),
        [
            ("purpose", "federated fine-tuning of a shared language model adapter"),
            (
                "data that stays in each region",
                "training text (never leaves; only model deltas are sent)",
            ),
            (
                "what is transferred",
                "LoRA adapter deltas, differentially private (DP-SGD), "
                "compressed, sealed to the aggregator (see Transfers)",
            ),
            (
                "recipient",
                f"the aggregator, in {start.get('aggregator_jurisdiction')}; "
                f"relay (ciphertext only) in {start.get('relay_jurisdiction')}",
            ),
            ("source jurisdictions", ", ".join(jurisdictions) or "-"),
            (
                "safeguards",
                "per-jurisdiction policy checked by the region before sending and "
                "by the aggregator on receipt (policy hashes above); post-quantum hybrid "
                "encryption; a privacy ledger per dataset",
            ),
            (
                "policies (aggregator's copy)",
                ", ".join(f"{j} {str(h)[:12]}" for j, h in policies.items()) or "none",
            ),
            (
                "retention of these records (the policies' audit.retention_days)",
                ", ".join(f"{j} {_text(days)} days" for j, days in retention.items()) or "-",
            ),
        ],
    )


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def to_markdown(run_id: int, sections: Sequence[Section]) -> str:
    out = [f"# fedciuic compliance report: run {run_id}", ""]
    for s in sections:
        out += [f"## {s.title}", ""]
        for paragraph in s.paragraphs:
            out += [paragraph, ""]
        if s.header:
            out.append("| " + " | ".join(s.header) + " |")
            out.append("|" + " --- |" * len(s.header))
            out += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in s.rows]
            out.append("")
    return "\n".join(out)


def html_table(
    header: Sequence[str], rows: Sequence[Sequence[str]], classes: Sequence[str] = ()
) -> str:
    """A table; row ``i`` gets the class ``classes[i]`` where one is given."""
    e = html.escape
    out = ["<table><tr>" + "".join(f"<th>{e(h)}</th>" for h in header) + "</tr>"]
    for i, row in enumerate(rows):
        cls = f' class="{classes[i]}"' if i < len(classes) and classes[i] else ""
        out.append(f"<tr{cls}>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>")
    return "\n".join([*out, "</table>"])


def html_sections(sections: Sequence[Section], heading: str = "h2") -> list[str]:
    """Each section as its heading, paragraphs and table."""
    out = []
    for s in sections:
        out.append(f"<{heading}>{html.escape(s.title)}</{heading}>")
        out += [f"<p>{html.escape(p)}</p>" for p in s.paragraphs]
        if s.header:
            out.append(html_table(s.header, s.rows))
    return out


def to_html(run_id: int, sections: Sequence[Section]) -> str:
    out = [
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>fedciuic compliance report: run {run_id}</title>",
        "<style>body{font-family:sans-serif;max-width:72rem;margin:2rem auto}"
        "table{border-collapse:collapse}td,th{border:1px solid #999;padding:.2rem .5rem;"
        "text-align:left;vertical-align:top}</style></head><body>",
        f"<h1>fedciuic compliance report: run {run_id}</h1>",
        *html_sections(sections),
        "</body></html>",
    ]
    return "\n".join(out) + "\n"


def write_sections(run_id: int, sections: Sequence[Section], out_dir: Path) -> tuple[Path, Path]:
    """The report's Markdown and HTML files, from sections already built."""
    out_dir.mkdir(parents=True, exist_ok=True)
    md = out_dir / f"compliance-report-run-{run_id}.md"
    page = out_dir / f"compliance-report-run-{run_id}.html"
    md.write_text(to_markdown(run_id, sections), encoding="utf-8")
    page.write_text(to_html(run_id, sections), encoding="utf-8")
    return md, page


@dataclass
class ReportOutcome:
    """What ``fedciuic audit report`` found, the lines to print and the report written."""

    run_id: int
    verified: bool | None  # None: no keys, nothing verified
    disagreements: list[str]
    lines: list[str]
    report: Path

    @property
    def exit_code(self) -> int:
        if self.verified is False:
            return EXIT_AUDIT
        return EXIT_DISAGREE if self.disagreements else EXIT_OK


def check_and_report(
    paths: Sequence[Path], keys_dir: Path | None, out_dir: Path, run_id: int | None = None
) -> ReportOutcome:
    """Verify each log (given ``keys_dir``), cross-check them, write the report."""
    logs = open_logs(paths, {})
    verify_logs(logs, keys_dir)
    lines = [f"audit: {log.verdict.explain()}" for log in logs if log.verdict is not None]
    if keys_dir is None:
        lines.append(
            "audit: logs not verified (no --keys): the report lists every record as unverified"
        )
    report = build_report(logs, run_id)
    if report.disagreements:
        lines.append(f"audit: the logs DISAGREE on run {report.run_id}:")
        lines += [f"  {problem}" for problem in report.disagreements]
    md, _ = write_sections(report.run_id, report.sections, out_dir)
    lines.append(f"compliance report: {md} (and .html)")
    verified = None if keys_dir is None else all(log.verdict and log.verdict.ok for log in logs)
    return ReportOutcome(report.run_id, verified, report.disagreements, lines, md)


def verify_logs(logs: Sequence[PartyLog], keys_dir: Path | None) -> None:
    """Set each log's verdict with its party's bundle from ``keys_dir`` (none: unverified)."""
    if keys_dir is None:
        return
    bundles = {b.party: b for b in load_bundles(keys_dir).values()}
    for log in logs:
        if log.actor not in bundles:
            raise ConfigError([f"{keys_dir}: no {log.actor}.pub.json to verify {log.path}"])
        log.verdict = verify(log.path, bundles[log.actor])
