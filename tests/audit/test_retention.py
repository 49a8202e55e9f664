"""Retention: a party's log pruned to its own policy's audit.retention_days still
verifies; a log cut any other way does not; what is inside retention is kept; the
privacy ledger's witness and other parties' witnesses survive a prune; the report
names records past retention."""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

import fedciuic.audit.log as audit_log
from fedciuic.audit.events import Event
from fedciuic.audit.log import (
    AuditError,
    AuditLog,
    load_records,
    verify,
    witness_check,
)
from fedciuic.audit.report import PartyLog, build_report, to_markdown
from fedciuic.audit.retention import enforce, enforce_at_start, overdue
from fedciuic.crypto.keys import Keypair, write_keys
from fedciuic.ops.cli import main
from fedciuic.policy.rules import load_policy
from fedciuic.privacy.ledger import audit_witness
from tests.audit.conftest import T0
from tests.conftest import ROOT

EU_POLICY = ROOT / "policies" / "eu-gdpr.yaml"  # audit.retention_days: 1826
EU_HASH = load_policy(EU_POLICY).hash
DAYS = 1826
NOW = T0 + timedelta(days=DAYS + 300)  # runs 1 and 2 (days 100, 200) are past retention


@pytest.fixture(scope="module")
def key() -> Keypair:
    return Keypair.generate("eu", "EU")


def write_runs(path: Path, key: Keypair, clock: list[datetime], days: list[int]) -> None:
    """One run per entry of ``days`` (written that many days after T0): joined under
    the EU policy, trained (witnessing the region's privacy ledger), checkpointed."""
    log = AuditLog(path, "eu", key)
    for run, day in enumerate(days, 1):
        clock[0] = T0 + timedelta(days=day)
        log.append("run_joined", run_id=run, server_round=1, jurisdiction="EU", policy_hash=EU_HASH)
        log.append(
            "trained",
            run_id=run,
            server_round=1,
            epsilon=1.5 * run,
            data_fingerprint="ds",
            ledger={"releases": run, "head": f"{run:064x}"},
        )
        log.checkpoint(run_id=run, server_round=1)
    log.close()


def prune(path: Path, key: Keypair, clock: list[datetime]) -> audit_log.Pruned:
    clock[0] = NOW
    log = AuditLog(path, "eu", key)
    try:
        return enforce(log, load_policy(EU_POLICY), now=NOW)
    finally:
        log.close()


def test_records_past_retention_are_pruned_and_the_log_still_verifies(tmp_path, key, clock):
    path = tmp_path / "audit.jsonl"
    write_runs(path, key, clock, [100, 200, DAYS + 250])
    pruned = prune(path, key, clock)
    assert (pruned.records, pruned.first_seq, pruned.first_kept) == (6, 0, 6)
    records = load_records(path)
    assert [r["run_id"] for r in records[:3]] == [3, 3, 3]  # runs 1 and 2 are gone
    assert records[0]["seq"] == 6
    (note,) = [r for r in records if r["event"] == Event.PRUNED]
    details = note["details"]
    assert details["records"] == 6 and details["first_kept"] == 6
    assert details["retention_days"] == DAYS and details["policy"] == "eu-gdpr.yaml"
    assert details["first_time"].startswith("2020-04-10") and details["older_than"]
    assert records[-1]["event"] == "checkpoint"  # the prune is signed
    verdict = verify(path, key.bundle)
    assert verdict.ok, verdict.explain()
    assert verdict.first_seq == 6 and verdict.pruned_by == note["seq"]
    assert "seq 0 to 5 pruned" in verdict.explain()


def test_the_cli_prunes_by_the_partys_own_policy_and_verify_accepts_it(
    tmp_path, key, clock, capsys
):
    path = tmp_path / "audit.jsonl"
    write_runs(path, key, clock, [100, 200])
    write_keys(key, tmp_path / "keys")
    args = ["--key", str(tmp_path / "keys" / "eu.key.json"), "--policy", str(EU_POLICY)]
    clock[0] = datetime.now(UTC)  # the CLI prunes at the time it runs: 2020 is long past
    before = path.read_bytes()
    assert main(["audit", "prune", str(path), *args, "--dry-run"]) == 0
    assert "would prune 6 record(s) older than 1826 days" in capsys.readouterr().out
    assert path.read_bytes() == before
    assert main(["audit", "prune", str(path), *args]) == 0
    out = capsys.readouterr().out
    assert "pruned 6 record(s) older than 1826 days (seq 0 to 5" in out and "OK: " in out
    assert main(["audit", "verify", str(path), "--pubkey", str(tmp_path / "keys/eu.pub.json")]) == 0
    # Another jurisdiction's policy does not govern this log.
    cn = ["--policy", str(ROOT / "policies" / "cn-pipl.yaml")]
    assert main(["audit", "prune", str(path), *args[:2], *cn]) == 2
    assert "each party's log is kept by its own jurisdiction's policy" in capsys.readouterr().err


def test_nothing_is_pruned_or_written_when_no_record_is_past_retention(tmp_path, key, clock):
    path = tmp_path / "audit.jsonl"
    write_runs(path, key, clock, [DAYS + 100, DAYS + 200])
    before = path.read_bytes()
    assert prune(path, key, clock).records == 0
    assert path.read_bytes() == before
    assert overdue(load_records(path), DAYS, NOW) is None


def test_records_inside_retention_are_kept_and_a_run_is_kept_whole(tmp_path, key, clock):
    """Run 2 started past retention but has a record inside it: all of it stays."""
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path, "eu", key)
    for run, day in ((1, 100), (2, 200)):
        clock[0] = T0 + timedelta(days=day)
        log.append("run_joined", run_id=run, server_round=1)
        log.checkpoint(run_id=run)
    clock[0] = T0 + timedelta(days=DAYS + 250)  # inside retention at NOW
    log.append("evaluated", run_id=2, server_round=2, loss=1.0)
    log.checkpoint(run_id=2)
    log.close()
    found = overdue(load_records(path), DAYS, NOW)
    assert found is not None and found.records == 2
    assert prune(path, key, clock).records == 2
    records = load_records(path)
    assert records[0]["seq"] == 2 and records[0]["run_id"] == 2
    assert [r["event"] for r in records if r["run_id"] == 2][:2] == ["run_joined", "checkpoint"]
    assert verify(path, key.bundle).ok


def test_a_log_pruned_or_cut_without_a_signed_prune_record_fails(tmp_path, key, clock):
    path = tmp_path / "audit.jsonl"
    write_runs(path, key, clock, [100, 200, DAYS + 250])
    prune(path, key, clock)
    lines = path.read_bytes().splitlines(keepends=True)

    def check(name: str, content: list[bytes], why: str) -> None:
        forged = tmp_path / name
        forged.write_bytes(b"".join(content))
        verdict = verify(forged, key.bundle)
        assert not verdict.ok and why in (verdict.problem or ""), verdict.explain()

    # Cut further than the prune: no prune record names that start.
    check("cut.jsonl", lines[1:], "deleted: seq 0 to 6 are missing, and no audit_pruned record")
    # A kept record changed.
    check(
        "changed.jsonl",
        [lines[1].replace(b'"epsilon":4.5', b'"epsilon":0.5'), *lines[2:]],
        "changed",
    )
    # The prune record says it kept more (or less) than the log holds.
    index = next(i for i, line in enumerate(lines) if Event.PRUNED.encode() in line)
    moved = lines[index].replace(b'"first_kept":6', b'"first_kept":5')
    assert moved != lines[index]
    check("moved.jsonl", [*lines[:index], moved, *lines[index + 1 :]], "changed")
    # A log cut by someone without the key, with a prune record they wrote: unsigned.
    whole = tmp_path / "whole.jsonl"
    write_runs(whole, key, clock, [100, 200])
    kept = whole.read_bytes().splitlines(keepends=True)[3:]  # run 2, signed
    (tmp_path / "forged.jsonl").write_bytes(b"".join(kept))
    forged = AuditLog(tmp_path / "forged.jsonl", "eu", None)
    first = json.loads(kept[0])
    forged.append(Event.PRUNED, run_id=0, first_kept=first["seq"], head=first["prev"], records=3)
    forged.close()
    verdict = verify(tmp_path / "forged.jsonl", key.bundle)
    assert not verdict.ok
    assert "is not covered by a verified signature" in (verdict.problem or "")


def test_a_log_that_fails_verification_is_not_pruned(tmp_path, key, clock):
    path = tmp_path / "audit.jsonl"
    write_runs(path, key, clock, [100, 200])
    path.write_bytes(path.read_bytes().replace(b'"epsilon":1.5', b'"epsilon":0.1'))
    before = path.read_bytes()
    with pytest.raises(AuditError, match="not pruned: the log fails verification"):
        prune(path, key, clock)
    assert path.read_bytes() == before


def test_a_writer_in_another_process_goes_on_in_the_pruned_log(tmp_path, key, clock):
    path = tmp_path / "audit.jsonl"
    write_runs(path, key, clock, [100, 200])
    writer = AuditLog(path, "eu", key)  # open before the prune, holding the old file
    writer.append("evaluated", run_id=2, server_round=1, loss=2.0)
    clock[0] = T0 + timedelta(days=DAYS + 260)
    writer.append("agent_started", run_id=0)  # inside retention at NOW: kept
    writer.checkpoint(run_id=0)
    prune(path, key, clock)
    writer.append("evaluated", run_id=3, server_round=1, loss=1.0)
    writer.checkpoint(run_id=3)
    writer.close()
    records = load_records(path)
    assert records[-2]["event"] == "evaluated" and records[-2]["run_id"] == 3
    assert verify(path, key.bundle).ok, verify(path, key.bundle).explain()


def test_the_privacy_ledgers_witness_outlives_a_prune(tmp_path, key, clock):
    """The ledger's rollback check reads the audit log's witness of it: a prune carries
    the last one forward, so a pruned log cannot reset a dataset's spend."""
    state = tmp_path / "state"
    path = state / "audit.jsonl"
    write_runs(path, key, clock, [100, 200])
    before = audit_witness(path, region="eu", dataset="ds")
    assert before is not None and (before.releases, before.epsilon) == (2, 3.0)
    assert prune(path, key, clock).records == 6
    assert not [r for r in load_records(path) if r["event"] == "trained"]
    after = audit_witness(path, region="eu", dataset="ds")
    assert after is not None
    assert (after.releases, after.head, after.epsilon) == (2, f"{2:064x}", 3.0)
    # A second prune, of everything, carries forward what the first carried.
    clock[0] = NOW + timedelta(days=DAYS + 1)
    log = AuditLog(path, "eu", key)
    log.prune(clock[0], retention_days=1)
    log.close()
    again = audit_witness(path, region="eu", dataset="ds")
    assert again is not None and (again.releases, again.epsilon) == (2, 3.0)
    assert verify(path, key.bundle).ok


def test_witnessed_checkpoints_a_prune_removed_are_no_disagreement(tmp_path, key, clock):
    path = tmp_path / "eu.jsonl"
    write_runs(path, key, clock, [100, 200, DAYS + 250])
    records = load_records(path)
    old = records[2]["details"]  # the checkpoint of run 1: count 2
    new = records[-1]["details"]  # the checkpoint of run 3
    aggregator = [
        {"seq": 0, "event": "witness", "run_id": 1, "details": {"party": "eu", **_head(old)}},
        {"seq": 1, "event": "witness", "run_id": 3, "details": {"party": "eu", **_head(new)}},
    ]
    prune(path, key, clock)
    check = witness_check({"aggregator": aggregator, "eu": load_records(path)})
    assert check.agree, check.problems
    assert [w.count for w in check.pruned] == [2] and [w.count for w in check.matched] == [8]
    # Without a prune record, the same missing records are a truncation.
    cut = load_records(path)
    cut = [r for r in cut if r["event"] != Event.PRUNED]
    assert witness_check({"aggregator": aggregator, "eu": cut}).problems


def _head(details: dict[str, object]) -> dict[str, object]:
    return {"count": details["count"], "head": details["head"]}


def test_the_party_prunes_at_start_and_a_prune_that_fails_only_warns(tmp_path, key, clock, caplog):
    path = tmp_path / "audit.jsonl"
    write_runs(path, key, clock, [100, 200])
    policy = load_policy(EU_POLICY)
    log = AuditLog(path, "eu", key)
    clock[0] = datetime.now(UTC)
    with caplog.at_level(logging.INFO):
        done = enforce_at_start(log, policy, logging.getLogger("test"), "region eu")
    assert done is not None and done.records == 6
    assert "pruned 6 audit record(s) older than 1826 days" in caplog.text
    log.close()
    assert verify(path, key.bundle).ok
    other = AuditLog(tmp_path / "cn.jsonl", "cn", Keypair.generate("cn", "CN"))
    with caplog.at_level(logging.WARNING):
        assert enforce_at_start(other, policy, logging.getLogger("test"), "region cn") is None
    assert "not pruned to its retention" in caplog.text
    other.close()


def test_the_report_names_records_past_retention_and_how_to_prune_them(tmp_path, key, clock):
    agg_key = Keypair.generate("aggregator", "EU")
    path = tmp_path / "eu.jsonl"
    write_runs(path, key, clock, [100, 200])
    aggregator = AuditLog(tmp_path / "aggregator.audit.jsonl", "aggregator", agg_key)
    clock[0] = T0 + timedelta(days=200)
    aggregator.append(
        "run_start",
        run_id=2,
        regions=["eu"],
        aggregator_jurisdiction="EU",
        retention_days={"EU": DAYS},
    )
    aggregator.checkpoint(run_id=2)
    aggregator.close()
    logs = [
        PartyLog(tmp_path / "aggregator.audit.jsonl", "aggregator", load_records(aggregator.path)),
        PartyLog(path, "eu", load_records(path)),
    ]
    logs[0].verdict = verify(logs[0].path, agg_key.bundle)
    logs[1].verdict = verify(path, key.bundle)
    report = to_markdown(2, build_report(logs, 2, now=NOW).sections)
    assert "eu's log keeps 6 record(s) older than 1826 days" in report
    assert "prune with `fedciuic audit prune LOG --key PARTY.key.json --policy" in report
    assert "| 1826 days (EU): 6 record(s) past it |" in report
    inside = to_markdown(2, build_report(logs, 2, now=T0 + timedelta(days=300)).sections)
    assert "1826 days (EU): none past it" in inside and "older than" not in inside


def test_a_region_log_pruned_of_a_run_is_left_out_of_its_checks_and_said_so(tmp_path, key, clock):
    """The aggregator's policy keeps its log longer than the region's: a report of the
    old run finds no disagreement in what the region's retention removed."""
    agg_key = Keypair.generate("aggregator", "EU")
    aggregator = AuditLog(tmp_path / "aggregator.audit.jsonl", "aggregator", agg_key)
    eu = AuditLog(tmp_path / "eu.jsonl", "eu", key)
    clock[0] = T0 + timedelta(days=100)
    aggregator.append(
        "run_start",
        run_id=1,
        regions=["eu"],
        config_hash="c" * 64,
        policy_hashes={"EU": EU_HASH},
        retention_days={"EU": DAYS},
    )
    eu.append(
        "run_joined",
        run_id=1,
        server_round=1,
        config_hash="c" * 64,
        jurisdiction="EU",
        policy_hash=EU_HASH,
    )
    eu.append("update_sealed", run_id=1, server_round=1, region="eu", digest="d" * 64)
    aggregator.append("update_received", run_id=1, server_round=1, region="eu", digest="d" * 64)
    for log in (aggregator, eu):
        log.checkpoint(run_id=1)
    clock[0] = T0 + timedelta(days=DAYS + 250)
    eu.append("agent_started", run_id=0)
    eu.checkpoint(run_id=0)
    aggregator.close()
    eu.close()
    prune(tmp_path / "eu.jsonl", key, clock)
    logs = [
        PartyLog(aggregator.path, "aggregator", load_records(aggregator.path)),
        PartyLog(eu.path, "eu", load_records(eu.path)),
    ]
    logs[0].verdict = verify(aggregator.path, agg_key.bundle)
    logs[1].verdict = verify(eu.path, key.bundle)
    assert logs[1].verdict.ok
    report = build_report(logs, 1, now=NOW)
    assert report.disagreements == []
    text = to_markdown(1, report.sections)
    assert "eu's log no longer holds this run: its records up to 2020-04-10" in text
    assert "(1826 days, the policy it declared)" in text
    row = "| eu | eu.jsonl | 4 | 3 (seq 3 to 5) | OK | 1826 days (EU): none past it; seq 0 to 2 "
    assert row + "pruned" in text
