"""Audit logs: writing, every kind of tampering, torn tails, two writers, cross-checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedciuic.audit.log import (
    AuditLog,
    canonical,
    cross_check,
    load_records,
    record_hash,
    verify,
)
from fedciuic.crypto.keys import Keypair


@pytest.fixture(scope="module")
def key() -> Keypair:
    return Keypair.generate("eu", "EU")


def write_log(path: Path, key: Keypair | None, rounds: int = 3) -> Path:
    """A region's log over ``rounds`` rounds: three records and a checkpoint each."""
    log = AuditLog(path, "eu", key)
    for r in range(1, rounds + 1):
        log.append("trained", run_id=7, server_round=r, epsilon=2.5 * r, examples=60)
        log.append("update_sealed", run_id=7, server_round=r, digest=f"{r:064x}", bytes=2200)
        log.append("evaluated", run_id=7, server_round=r, loss=5.0 - r)
        log.checkpoint(run_id=7, server_round=r)
    log.close()
    return path


def lines_of(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines(keepends=True)


def test_a_log_written_and_checkpointed_verifies(tmp_path, key):
    path = write_log(tmp_path / "audit.jsonl", key)
    verdict = verify(path, key.bundle)
    assert verdict.ok, verdict.explain()
    assert verdict.records == 12 and verdict.checkpoints == 3 and verdict.verified_through == 11
    assert verdict.explain().startswith("OK: ")
    first = json.loads(lines_of(path)[0])
    assert first["prev"] == "0" * 64 and first["seq"] == 0 and first["actor"] == "eu"
    assert first["time"].endswith("Z") and first["details"]["epsilon"] == 2.5


def test_the_hash_covers_the_canonical_record(tmp_path, key):
    path = write_log(tmp_path / "audit.jsonl", key, rounds=1)
    record = json.loads(lines_of(path)[0])
    claimed = record.pop("hash")
    assert record_hash(canonical(record)) == claimed  # an independent verifier's recipe


def rewrite(path: Path, lines: list[bytes]) -> None:
    path.write_bytes(b"".join(lines))


def change(lines: list[bytes]) -> list[bytes]:
    lines[4] = lines[4].replace(b'"epsilon":5.0', b'"epsilon":0.5')
    return lines


def delete(lines: list[bytes]) -> list[bytes]:
    return lines[:4] + lines[5:]


def reorder(lines: list[bytes]) -> list[bytes]:
    return [*lines[:4], lines[5], lines[4], *lines[6:]]


def insert(lines: list[bytes]) -> list[bytes]:
    return [*lines[:5], lines[4], *lines[5:]]


def truncate_after_checkpoint(lines: list[bytes]) -> list[bytes]:
    return lines[:-1]  # the final checkpoint is gone: three records are unsigned


@pytest.mark.parametrize(
    ("tamper", "where", "why"),
    [
        (change, "line 5 (seq 4, trained)", "changed: its content does not match its hash"),
        (delete, "line 5 (seq 5, update_sealed)", "deleted: seq 4 to 4 are missing"),
        (reorder, "line 5 (seq 5, update_sealed)", "reordered: seq 4 comes later"),
        (insert, "line 6 (seq 4, trained)", "inserted: seq 4 comes again after seq 4"),
    ],
)
def test_each_kind_of_tampering_is_detected_and_located(tmp_path, key, tamper, where, why):
    path = write_log(tmp_path / "audit.jsonl", key)
    rewrite(path, tamper(lines_of(path)))
    verdict = verify(path, key.bundle)
    assert not verdict.ok and verdict.problem is not None
    assert verdict.problem.startswith(where) and why in verdict.problem, verdict.problem
    assert verdict.verified_through == 3  # the first round's checkpoint still holds
    assert "verified up to the checkpoint at seq 3" in verdict.explain()


def test_truncation_after_a_checkpoint_leaves_unsigned_records(tmp_path, key):
    path = write_log(tmp_path / "audit.jsonl", key)
    rewrite(path, truncate_after_checkpoint(lines_of(path)))
    verdict = verify(path, key.bundle)
    assert not verdict.ok and verdict.problem is None and verdict.unsigned_tail == 3
    assert "3 record(s) after the last checkpoint are not covered" in verdict.explain()


def test_a_rewritten_chain_fails_at_the_checkpoint_signature(tmp_path, key):
    """Changing a record and re-hashing everything after it needs the party's key."""
    path = write_log(tmp_path / "audit.jsonl", key, rounds=1)
    records = [json.loads(line) for line in lines_of(path)]
    records[1]["details"]["bytes"] = 1
    forged, head = [], "0" * 64
    for record in records:
        record.pop("hash")
        record["prev"] = head
        if record["event"] == "checkpoint":
            record["details"]["head"] = head
        body = canonical(record)
        head = record_hash(body)
        forged.append(body[:-1] + f',"hash":"{head}"}}\n'.encode())
    rewrite(path, forged)
    verdict = verify(path, key.bundle)
    assert "checkpoint signature does not verify" in (verdict.problem or "")


def test_a_log_signed_by_another_key_is_named(tmp_path, key):
    path = write_log(tmp_path / "audit.jsonl", key, rounds=1)
    other = Keypair.generate("eu", "EU").bundle
    verdict = verify(path, other)
    assert "signed by another key" in (verdict.problem or "")
    assert key.bundle.key_id.hex() in (verdict.problem or "")


def test_a_checkpoint_without_a_signature_fails(tmp_path):
    path = write_log(tmp_path / "audit.jsonl", None, rounds=1)
    verdict = verify(path, Keypair.generate("eu", "EU").bundle)
    assert "checkpoint has no signature" in (verdict.problem or "")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"hello\n", "line 1: not a fedciuic audit record"),
        (b'{"seq": 0}\n', "line 1: not a fedciuic audit record (missing fields"),
        (b"", "the log is empty"),
    ],
)
def test_a_file_that_is_not_an_audit_log_gets_a_verdict(tmp_path, key, content, message):
    path = tmp_path / "x.jsonl"
    path.write_bytes(content)
    verdict = verify(path, key.bundle)
    assert not verdict.ok and message in (verdict.problem or "")


def test_a_log_cut_mid_line_verifies_to_its_last_checkpoint_and_reports_the_torn_tail(
    tmp_path, key
):
    path = write_log(tmp_path / "audit.jsonl", key, rounds=2)
    log = AuditLog(path, "eu", key)
    log.append("trained", run_id=7, server_round=3, epsilon=7.5)
    log.close()
    data = path.read_bytes()
    path.write_bytes(data[:-40])  # killed mid-write
    verdict = verify(path, key.bundle)
    assert verdict.problem is None and verdict.verified_through == 7
    assert verdict.torn_tail is not None and "incomplete" in verdict.torn_tail
    assert "verified up to the checkpoint at seq 7" in verdict.explain()


def test_the_next_writer_moves_a_torn_tail_aside_and_logs_it(tmp_path, key):
    path = write_log(tmp_path / "audit.jsonl", key, rounds=1)
    torn = b'{"actor":"eu","details":{"epsilon":'
    with open(path, "ab") as handle:
        handle.write(torn)
    log = AuditLog(path, "eu", key)
    log.append("trained", run_id=8, server_round=1, epsilon=1.0)
    log.checkpoint(run_id=8, server_round=1)
    log.close()
    verdict = verify(path, key.bundle)
    assert verdict.ok, verdict.explain()
    moved = [r for r in load_records(path) if r["event"] == "torn_tail_moved"]
    assert len(moved) == 1 and moved[0]["details"]["bytes"] == len(torn)
    assert (tmp_path / moved[0]["details"]["moved_to"]).read_bytes() == torn


def test_two_writers_on_one_log_keep_one_chain(tmp_path, key):
    path = tmp_path / "audit.jsonl"
    a, b = AuditLog(path, "eu", key), AuditLog(path, "eu", key)
    for i in range(5):
        a.append("trained", run_id=1, server_round=i)
        b.append("evaluated", run_id=2, server_round=i)
    a.checkpoint(run_id=1)
    a.close()
    b.close()
    verdict = verify(path, key.bundle)
    assert verdict.ok and verdict.records == 11, verdict.explain()


def test_paths_are_redacted_when_asked(tmp_path, key):
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path, "eu", key, redact=[("/data/eu", "<data-path>")])
    log.append("declined", run_id=1, reason="data-path /data/eu/x.txt is unreadable")
    log.close()
    text = path.read_text()
    assert "/data/eu" not in text and "<data-path>/x.txt" in text


def test_periodic_checkpoints(tmp_path, key):
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path, "eu", key, checkpoint_every=4)
    for i in range(8):
        log.append("evaluated", run_id=1, server_round=i)
    log.close()
    events = [r["event"] for r in load_records(path)]
    assert events.count("checkpoint") == 2 and events[-1] == "checkpoint"
    assert verify(path, key.bundle).ok


def test_region_and_aggregator_logs_cross_check():
    def rec(event, region, digest, r=1):
        return {
            "event": event,
            "run_id": 7,
            "round": r,
            "details": {"region": region, "digest": digest},
        }

    aggregator = [rec("update_received", "eu", "aa"), rec("update_received", "cn", "bb")]
    eu = [rec("update_sealed", "eu", "aa")]
    cn = [rec("update_sealed", "cn", "bb")]
    assert cross_check(aggregator, {"eu": eu, "cn": cn}).agree
    swapped = cross_check(aggregator, {"eu": eu, "cn": [rec("update_sealed", "cn", "cc")]})
    assert not swapped.agree and len(swapped.problems) == 2
    assert (
        "cn logged sending cc" in swapped.problems[0]
        or "cn logged sending cc" in swapped.problems[1]
    )
