"""A per-run compliance report from the audit logs of the aggregator and the regions.

It shows, for one run, what left each region, where it went and under which
guarantees: epsilon spent against the budget, every transfer (destination
jurisdiction, bytes, suite), every refusal with its reasons, and whether the
regions' logs and the aggregator's agree. It is laid out to serve as a GDPR
Art. 30 record of processing and a PIPL Art. 38-40 cross-border transfer record.
Written as Markdown and as HTML from one document model.
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedciuic.audit import (
    RECEIVED_EVENT,
    SENT_EVENTS,
    AuditError,
    Verdict,
    cross_check,
    load_records,
)

Record = Mapping[str, Any]


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
    records: Sequence[Record]
    verdict: Verdict | None = None


def open_logs(paths: Sequence[Path], verdicts: Mapping[Path, Verdict]) -> list[PartyLog]:
    logs = []
    for path in paths:
        records = load_records(path)
        if not records:
            raise AuditError(f"{path}: the audit log is empty")
        logs.append(PartyLog(path, str(records[0]["actor"]), records, verdicts.get(path)))
    if sum(log.actor == "aggregator" for log in logs) != 1:
        raise AuditError(
            "give exactly one aggregator log (aggregator.audit.jsonl) and the regions' logs"
        )
    return logs


def _runs(aggregator: PartyLog) -> list[int]:
    return [int(r["run_id"]) for r in aggregator.records if r["event"] == "run_start"]


def build(logs: Sequence[PartyLog], run_id: int | None = None) -> tuple[int, list[Section]]:
    """The report's sections for ``run_id`` (default: the last run the aggregator started)."""
    aggregator = next(log for log in logs if log.actor == "aggregator")
    regions = {log.actor: log for log in logs if log.actor != "aggregator"}
    runs = _runs(aggregator)
    if not runs:
        raise AuditError(f"{aggregator.path}: no run_start record; not an aggregator's log")
    run_id = runs[-1] if run_id is None else run_id
    if run_id not in runs:
        raise AuditError(f"run {run_id} is not in {aggregator.path}; runs there: {runs}")

    def of_run(records: Sequence[Record]) -> list[Record]:
        return [r for r in records if r["run_id"] == run_id]

    agg = of_run(aggregator.records)
    own = {name: of_run(log.records) for name, log in regions.items()}
    start = next(r for r in agg if r["event"] == "run_start")["details"]
    end: Mapping[str, Any] = next((r["details"] for r in agg if r["event"] == "run_end"), {})
    check = cross_check(agg, own)
    sections = [
        _overview(run_id, start, end, agg),
        _logs_section(logs),
        _regions_section(start, own, agg),
        _transfers_section(agg, own, check.matched),
        _refusals_section(agg, own),
        _agreement_section(start, own, check.problems),
        _record_of_processing(start, own),
    ]
    return run_id, sections


def _first(records: Sequence[Record], event: str) -> Record | None:
    return next((r for r in records if r["event"] == event), None)


def _overview(
    run_id: int, start: Mapping[str, Any], end: Mapping[str, Any], agg: Sequence[Record]
) -> Section:
    published = [r for r in agg if r["event"] == "aggregate_published"]
    withheld = [r for r in agg if r["event"] == "aggregate_withheld"]
    first, last = agg[0]["time"], agg[-1]["time"]
    return Section(
        "Run",
        header=("item", "value"),
        rows=[
            ("run id", str(run_id)),
            ("time (UTC)", f"{first} to {last}"),
            ("status", str(end.get("status", "not ended in this log"))),
            ("regions", ", ".join(start.get("regions", []))),
            ("aggregator jurisdiction", str(start.get("aggregator_jurisdiction"))),
            ("relay jurisdiction", str(start.get("relay_jurisdiction"))),
            ("config hash", str(start.get("config_hash"))),
            ("code", str(start.get("code_version"))),
            ("aggregator key id", str(start.get("key_id"))),
            ("aggregates published / withheld", f"{len(published)} / {len(withheld)}"),
            ("final model digest", str(end.get("model_digest", "-"))),
        ],
    )


def _logs_section(logs: Sequence[PartyLog]) -> Section:
    rows = []
    for log in logs:
        verdict = log.verdict
        status = (
            "not verified (no public key given)"
            if verdict is None
            else ("OK" if verdict.ok else "FAIL: " + verdict.explain().split("\n", 1)[-1].strip())
        )
        rows.append((log.actor, str(log.path), str(len(log.records)), status))
    return Section(
        "Audit logs examined",
        ["Each log is hash-chained and signed at checkpoints with its party's key."],
        ("party", "file", "records", "verification"),
        rows,
    )


def _regions_section(
    start: Mapping[str, Any], own: Mapping[str, Sequence[Record]], agg: Sequence[Record]
) -> Section:
    rows = []
    for region in start.get("regions", []):
        records = own.get(region)
        accepted = [
            r for r in agg if r["event"] == "update_accepted" and r["details"]["region"] == region
        ]
        declined = [
            r for r in agg if r["event"] == "region_declined" and r["details"]["region"] == region
        ]
        if records is None:
            trained = None
            joined = None
        else:
            trained = [r for r in records if r["event"] == "trained"]
            joined = _first(records, "run_joined")
        last = trained[-1]["details"] if trained else {}
        epsilon = (
            f"{last['epsilon']:.3f} of {last['epsilon_budget']:g}"
            if last.get("epsilon") is not None
            else ("no DP" if trained else "-")
        )
        rows.append(
            (
                region,
                str((joined or {}).get("details", {}).get("jurisdiction") or "-"),
                str((joined or {}).get("details", {}).get("policy_hash") or "-")[:12],
                str(len(accepted)),
                str(len(declined)),
                epsilon,
                "yes" if records is not None else "no (log not given)",
            )
        )
    return Section(
        "Regions",
        [
            "Epsilon is the dataset's cumulative spend after its last round in this run, "
            "from the region's own log (its privacy ledger records the same)."
        ],
        ("region", "jurisdiction", "policy", "updates accepted", "declined", "epsilon", "log"),
        rows,
    )


def _transfers_section(
    agg: Sequence[Record], own: Mapping[str, Sequence[Record]], matched: Sequence[Any]
) -> Section:
    seen = {(t.round, t.region, t.digest) for t in matched}
    received = {
        (r["round"], r["details"]["region"], r["details"]["digest"])
        for r in agg
        if r["event"] == RECEIVED_EVENT
    }
    rows = []
    for region, records in sorted(own.items()):
        for r in records:
            if r["event"] not in SENT_EVENTS:
                continue
            d = r["details"]
            key = (r["round"], region, d["digest"])
            rows.append(
                (
                    str(r["round"]),
                    region,
                    f"{d.get('destination', 'aggregator')} ({d.get('destination_jurisdiction')})",
                    str(d["bytes"]),
                    str(d["suite"]),
                    d["digest"][:16],
                    "yes" if key in seen else ("NO" if key not in received else "?"),
                )
            )
    for r in agg:
        d = r["details"]
        if r["event"] == RECEIVED_EVENT and d["region"] not in own:
            rows.append(
                (
                    str(r["round"]),
                    d["region"],
                    "aggregator (as received)",
                    str(d["bytes"]),
                    str(d["suite"]),
                    d["digest"][:16],
                    "region log not given",
                )
            )
    return Section(
        "Transfers",
        [
            "Every update that left a region: where it went, its size and protection, and "
            "whether the aggregator logged receiving the same ciphertext (SHA-256)."
        ],
        ("round", "region", "destination", "bytes", "suite", "digest", "received"),
        sorted(rows, key=lambda row: (int(row[0]) if row[0].isdigit() else 0, row[1])),
    )


def _refusals_section(agg: Sequence[Record], own: Mapping[str, Sequence[Record]]) -> Section:
    rows = []
    for region, records in sorted(own.items()):
        for r in records:
            if r["event"] == "declined":
                rows.append((str(r["round"]), region, "declined", r["details"]["reason"]))
    for r in agg:
        d = r["details"]
        if r["event"] == "update_rejected":
            rows.append((str(r["round"]), "aggregator", f"rejected {d['region']}", d["reason"]))
        elif r["event"] == "aggregate_withheld":
            rows.append(
                (str(r["round"]), "aggregator", "withheld aggregate", "; ".join(d["reasons"]))
            )
        elif r["event"] == "region_declined" and d["region"] not in own:
            rows.append((str(r["round"]), d["region"], "declined (as received)", d["reason"]))
    return Section(
        "Refusals",
        [] if rows else ["None: every region took part and every update was accepted."],
        ("round", "by", "what", "reasons") if rows else (),
        rows,
    )


def _agreement_section(
    start: Mapping[str, Any], own: Mapping[str, Sequence[Record]], problems: Sequence[str]
) -> Section:
    lines = []
    config = start.get("config_hash")
    for region, records in sorted(own.items()):
        joined = _first(records, "run_joined")
        if joined is None:
            lines.append(f"{region}: its log has no record of this run.")
        elif joined["details"].get("config_hash") != config:
            lines.append(f"{region}: ran under another run config (hash differs).")
    lines += problems
    verdict = "The region and aggregator logs agree." if not lines else "The logs DISAGREE:"
    return Section("Agreement between the logs", [verdict, *lines])


def _record_of_processing(start: Mapping[str, Any], own: Mapping[str, Sequence[Record]]) -> Section:
    jurisdictions = sorted(
        {
            str(j["details"].get("jurisdiction"))
            for records in own.values()
            if (j := _first(records, "run_joined")) is not None
        }
    )
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
                ", ".join(f"{j} {h[:12]}" for j, h in (start.get("policy_hashes") or {}).items())
                or "none",
            ),
        ],
    )


# -- rendering ----------------------------------------------------------------------------


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


def to_html(run_id: int, sections: Sequence[Section]) -> str:
    e = html.escape
    out = [
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>fedciuic compliance report: run {run_id}</title>",
        "<style>body{font-family:sans-serif;max-width:72rem;margin:2rem auto}"
        "table{border-collapse:collapse}td,th{border:1px solid #999;padding:.2rem .5rem;"
        "text-align:left;vertical-align:top}</style></head><body>",
        f"<h1>fedciuic compliance report: run {run_id}</h1>",
    ]
    for s in sections:
        out.append(f"<h2>{e(s.title)}</h2>")
        out += [f"<p>{e(p)}</p>" for p in s.paragraphs]
        if s.header:
            out.append("<table><tr>" + "".join(f"<th>{e(h)}</th>" for h in s.header) + "</tr>")
            out += ["<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>" for row in s.rows]
            out.append("</table>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def write_report(
    logs: Sequence[PartyLog], out_dir: Path, run_id: int | None = None
) -> tuple[Path, Path]:
    return write_sections(*build(logs, run_id), out_dir)


def write_sections(run_id: int, sections: Sequence[Section], out_dir: Path) -> tuple[Path, Path]:
    """The report's Markdown and HTML files, from sections already built."""
    out_dir.mkdir(parents=True, exist_ok=True)
    md = out_dir / f"compliance-report-run-{run_id}.md"
    page = out_dir / f"compliance-report-run-{run_id}.html"
    md.write_text(to_markdown(run_id, sections), encoding="utf-8")
    page.write_text(to_html(run_id, sections), encoding="utf-8")
    return md, page


def verify_and_report(
    paths: Sequence[Path], keys_dir: Path | None, out_dir: Path, run_id: int | None = None
) -> tuple[bool, list[str]]:
    """Verify each log with its party's bundle from ``keys_dir`` (when given), write
    the report, and say what was found: (all verified, lines to print)."""
    logs = open_logs(paths, {})
    verify_logs(logs, keys_dir)
    lines = [f"audit: {log.verdict.explain()}" for log in logs if log.verdict is not None]
    md, _ = write_report(logs, out_dir, run_id)
    lines.append(f"compliance report: {md} (and .html)")
    return all(log.verdict is None or log.verdict.ok for log in logs), lines


def verify_logs(logs: Sequence[PartyLog], keys_dir: Path | None) -> None:
    """Set each log's verdict, checked with its party's bundle from ``keys_dir``; with no
    keys the logs stay unverified (and reports say so)."""
    from fedciuic.audit import verify
    from fedciuic.crypto.keys import load_bundles
    from fedciuic.errors import ConfigError

    if keys_dir is None:
        return
    bundles = {b.party: b for b in load_bundles(keys_dir).values()}
    for log in logs:
        if log.actor not in bundles:
            raise ConfigError([f"{keys_dir}: no {log.actor}.pub.json to verify {log.path}"])
        log.verdict = verify(log.path, bundles[log.actor])
