"""Cross-party witnessing, the report's exit status and its unverified records.

A hash chain cannot show by itself that it was cut back to an earlier checkpoint:
each party records the other parties' latest signed checkpoints (``witness``
records), and the report checks that every log still holds what was witnessed.
The logs here are written by the real ``AuditLog`` with real keys, in the order
the aggregator and a region exchange messages.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fedciuic.audit.log import (
    GENESIS,
    WITNESS_EVENT,
    AuditError,
    AuditLog,
    cross_check,
    load_records,
    verify,
    witness_check,
)
from fedciuic.audit.report import EXIT_DISAGREE, UNVERIFIED_TITLE, check_and_report
from fedciuic.crypto.keys import Keypair, write_keys
from fedciuic.errors import EXIT_AUDIT, EXIT_OK
from fedciuic.ops.cli import main
from fedciuic.record.recorder import RunRecorder
from fedciuic.wire import Witness

RUN = 9
ROUNDS = 3


@pytest.fixture(scope="module")
def keys() -> dict[str, Keypair]:
    return {
        "aggregator": Keypair.generate("aggregator", "EU"),
        "eu": Keypair.generate("eu", "EU"),
        "cn": Keypair.generate("cn", "CN"),
    }


def federation(tmp_path: Path, keys: dict[str, Keypair]) -> Path:
    """Logs of a 3-round run with witnessing wired as the protocol does it: each
    instruction carries the aggregator's latest checkpoint (the region witnesses it),
    each reply the region's (the aggregator witnesses it), and a final message after
    run_end carries the aggregator's last one."""
    for key in keys.values():
        write_keys(key, tmp_path / "keys")
    agg = AuditLog(tmp_path / "aggregator.audit.jsonl", "aggregator", keys["aggregator"])
    regions = {r: AuditLog(tmp_path / f"{r}.jsonl", r, keys[r]) for r in ("eu", "cn")}
    agg.append(
        "run_start",
        run_id=RUN,
        regions=sorted(regions),
        config_hash="c" * 64,
        aggregator_jurisdiction="EU",
        relay_jurisdiction="EU",
    )
    agg.checkpoint(run_id=RUN)
    for r, log in regions.items():
        log.append("run_joined", run_id=RUN, server_round=1, config_hash="c" * 64, jurisdiction=r)
    for rnd in range(1, ROUNDS + 1):
        instruction = agg.last_checkpoint()
        assert instruction is not None
        for r, log in regions.items():
            log.witness("aggregator", *instruction, run_id=RUN, server_round=rnd)
            # eu trains per user; cn's records are as a log from before units (per record)
            unit = {"unit": "user"} if r == "eu" else {}
            log.append(
                "trained", run_id=RUN, server_round=rnd, epsilon=rnd, epsilon_budget=8.0, **unit
            )
            digest = f"{rnd:02d}{r}".ljust(64, "0")
            log.append(
                "update_sealed",
                run_id=RUN,
                server_round=rnd,
                region=r,
                digest=digest,
                bytes=2200,
                suite="xwing-aes256gcm",
                destination="aggregator",
                destination_jurisdiction="EU",
            )
            log.checkpoint(run_id=RUN, server_round=rnd)
            reply = log.last_checkpoint()
            assert reply is not None
            agg.append(
                "update_received",
                run_id=RUN,
                server_round=rnd,
                region=r,
                digest=digest,
                bytes=2200,
                suite="xwing-aes256gcm",
            )
            agg.witness(r, *reply, run_id=RUN, server_round=rnd)
            agg.append("update_accepted", run_id=RUN, server_round=rnd, region=r, examples=60)
        agg.append("aggregate_published", run_id=RUN, server_round=rnd, regions=sorted(regions))
        agg.checkpoint(run_id=RUN, server_round=rnd)
        for r, log in regions.items():  # federated evaluation: a reply without a transfer
            log.append("evaluated", run_id=RUN, server_round=rnd, loss=5.0 - rnd)
            log.checkpoint(run_id=RUN, server_round=rnd)
            reply = log.last_checkpoint()
            assert reply is not None
            agg.witness(r, *reply, run_id=RUN, server_round=rnd)
        agg.checkpoint(run_id=RUN, server_round=rnd)
    agg.append("run_end", run_id=RUN, status="completed", model_digest="m" * 64)
    agg.checkpoint(run_id=RUN)
    final = agg.last_checkpoint()
    assert final is not None
    for log in regions.values():
        log.witness("aggregator", *final, run_id=RUN)
        log.checkpoint(run_id=RUN)
    for log in (agg, *regions.values()):
        log.close()
    return tmp_path


def records_of(folder: Path) -> dict[str, list[dict[str, Any]]]:
    return {
        "aggregator": load_records(folder / "aggregator.audit.jsonl"),
        "eu": load_records(folder / "eu.jsonl"),
        "cn": load_records(folder / "cn.jsonl"),
    }


def cut_to_checkpoint(path: Path, back: int) -> None:
    """Truncate a log right after its ``back``-th checkpoint from the end (1: the one
    before the last): it then verifies by itself, as a complete log would."""
    lines = path.read_bytes().splitlines(keepends=True)
    ends = [i for i, line in enumerate(lines) if json.loads(line)["event"] == "checkpoint"]
    path.write_bytes(b"".join(lines[: ends[-1 - back] + 1]))


def report(folder: Path, *logs: str, keys: bool = True) -> int:
    paths = [
        str(folder / name) for name in logs or ("aggregator.audit.jsonl", "eu.jsonl", "cn.jsonl")
    ]
    extra = ["--keys", str(folder / "keys")] if keys else []
    return main(["audit", "report", *paths, *extra, "--out", str(folder / "report")])


def report_text(folder: Path) -> str:
    return (folder / "report" / f"compliance-report-run-{RUN}.md").read_text()


def test_honest_logs_witness_each_other_and_agree(tmp_path, keys, capsys):
    folder = federation(tmp_path, keys)
    logs = records_of(folder)
    check = witness_check(logs, run_id=RUN)
    assert check.agree, check.problems
    # every reply (train and evaluate, 2 regions, 3 rounds) and every instruction + final
    assert len(check.matched) == 2 * 2 * ROUNDS + 2 * (ROUNDS + 1) and not check.unchecked
    assert report(folder) == EXIT_OK
    text = report_text(folder)
    assert "The region and aggregator logs agree." in text
    assert "20 witnessed checkpoint(s) still held" in text
    # The regions table names what each epsilon is per (a log without a unit: record).
    regions = text.split("## Regions", 1)[1]
    eu_row = next(line for line in regions.splitlines() if line.startswith("| eu |"))
    cn_row = next(line for line in regions.splitlines() if line.startswith("| cn |"))
    assert "3.000 of 8 per user" in eu_row and "3.000 of 8 per record" in cn_row


def test_truncated_region_log_is_caught_by_aggregator_witness(tmp_path, keys, capsys):
    folder = federation(tmp_path, keys)
    eu = folder / "eu.jsonl"
    # Cut eu back to its last round's training checkpoint: its evaluation and its
    # witness of run_end are gone. Its log alone still verifies, and no transfer is
    # missing, so only the aggregator's witness of eu's later checkpoint shows it.
    cut_to_checkpoint(eu, back=2)
    assert verify(eu, keys["eu"].bundle).ok
    logs = records_of(folder)
    assert cross_check(logs["aggregator"], {"eu": logs["eu"], "cn": logs["cn"]}).agree
    check = witness_check(logs, run_id=RUN)
    (problem,) = check.problems
    held = len(logs["eu"])
    assert problem.startswith("eu's log was truncated: the aggregator's log (seq ")
    assert f"witnessed eu's checkpoint count {held + 1} head " in problem
    assert problem.endswith(f"but eu's log holds only {held} records")
    assert report(folder) == EXIT_DISAGREE
    assert "The logs DISAGREE:" in report_text(folder)
    assert "eu's log was truncated" in capsys.readouterr().out


def test_rewritten_region_log_after_a_checkpoint_is_caught_by_aggregator_witness(tmp_path, keys):
    """Cut back to an earlier checkpoint, then grown again past the witnessed count:
    the record at the witnessed position now has another hash."""
    folder = federation(tmp_path, keys)
    eu_path = folder / "eu.jsonl"
    cut_to_checkpoint(eu_path, back=2)
    eu = AuditLog(eu_path, "eu", keys["eu"])
    for _ in range(3):
        eu.append("evaluated", run_id=RUN, server_round=ROUNDS, loss=0.1)
    eu.checkpoint(run_id=RUN, server_round=ROUNDS)
    eu.close()
    assert verify(eu_path, keys["eu"].bundle).ok
    problems = witness_check(records_of(folder), run_id=RUN).problems
    assert problems and all(p.startswith("eu's log was truncated or rewritten") for p in problems)
    assert "which eu's log no longer holds (its seq " in problems[0]


def test_truncated_aggregator_log_is_caught_by_region_witness(tmp_path, keys, capsys):
    folder = federation(tmp_path, keys)
    aggregator = folder / "aggregator.audit.jsonl"
    # Cut the aggregator's log back to the checkpoint before run_end: the run no longer
    # looks ended. It verifies alone and every transfer still matches.
    cut_to_checkpoint(aggregator, back=1)
    assert verify(aggregator, keys["aggregator"].bundle).ok
    logs = records_of(folder)
    assert not any(r["event"] == "run_end" for r in logs["aggregator"])
    assert cross_check(logs["aggregator"], {"eu": logs["eu"], "cn": logs["cn"]}).agree
    problems = witness_check(logs, run_id=RUN).problems
    assert len(problems) == 2  # eu and cn each witnessed the final checkpoint
    assert problems[0].startswith("aggregator's log was truncated: eu's log (seq ")
    assert "but the aggregator's log holds only" in problems[0]
    assert report(folder) == EXIT_DISAGREE
    assert "witnessed aggregator's checkpoint count" in report_text(folder)


def test_a_log_cut_just_before_the_witnessed_checkpoint_is_caught(tmp_path, keys):
    """eu's records up to its last witnessed checkpoint are intact, but that checkpoint
    is gone: cut there, or cut there and written on."""
    folder = federation(tmp_path, keys)
    path = folder / "eu.jsonl"
    witnessed = [
        r["details"]["count"]
        for r in load_records(folder / "aggregator.audit.jsonl")
        if r["event"] == WITNESS_EVENT and r["details"]["party"] == "eu"
    ][-1]
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:witnessed]))
    (problem,) = witness_check(records_of(folder), run_id=RUN).problems
    assert problem.startswith("eu's log was truncated: the aggregator's log")
    assert problem.endswith(f"but eu's log holds only {witnessed} records")
    log = AuditLog(path, "eu", keys["eu"])
    log.append("evaluated", run_id=RUN, server_round=ROUNDS, loss=0.0)
    log.checkpoint(run_id=RUN)
    log.close()
    assert verify(path, keys["eu"].bundle).ok
    (problem,) = witness_check(records_of(folder), run_id=RUN).problems
    assert problem.startswith("eu's log was truncated or rewritten: the aggregator's log")
    assert problem.endswith(
        f"still holds the records it signed, but not that checkpoint (seq {witnessed})"
    )


def test_a_rolled_back_region_is_caught_without_its_log(tmp_path, keys):
    """The aggregator's own witnesses of eu must never go back, even when eu's log is
    not given: a lower count, or another head for the same count, is a fork."""
    log = AuditLog(tmp_path / "aggregator.audit.jsonl", "aggregator", keys["aggregator"])
    log.append("run_start", run_id=RUN, regions=["eu"])
    log.witness("eu", 40, "a" * 64, run_id=RUN, server_round=1)
    log.witness("eu", 30, "b" * 64, run_id=RUN, server_round=2)
    log.witness("eu", 30, "c" * 64, run_id=RUN, server_round=3)
    log.close()
    check = witness_check({"aggregator": load_records(tmp_path / "aggregator.audit.jsonl")})
    assert len(check.unchecked) == 3 and len(check.problems) == 2
    assert check.problems[0].startswith("eu's log was rolled back or forked")
    assert "count 30 head bbbbbbbbbbbbbbbb…, after witnessing count 40" in check.problems[0]
    assert "count 30 head cccccccccccccccc…, after witnessing count 30" in check.problems[1]


def test_a_late_reply_showing_an_older_head_is_checked_but_is_no_rollback(tmp_path, keys):
    """A reply handled after a newer one of the same region (a late reply the courier
    kept) shows an older head: the aggregator marks it late; it is checked against the
    region's log like any witness, is not read as the region going back, and another
    head for a count already witnessed is still a fork."""
    log = AuditLog(tmp_path / "aggregator.audit.jsonl", "aggregator", keys["aggregator"])
    log.append("run_start", run_id=RUN, regions=["eu"])
    log.witness("eu", 40, "a" * 64, run_id=RUN, server_round=3)
    log.witness("eu", 30, "b" * 64, run_id=RUN, server_round=2, late=True)
    log.close()
    check = witness_check({"aggregator": load_records(tmp_path / "aggregator.audit.jsonl")})
    assert not check.problems and len(check.unchecked) == 2
    log = AuditLog(tmp_path / "aggregator.audit.jsonl", "aggregator", keys["aggregator"])
    log.witness("eu", 30, "c" * 64, run_id=RUN, server_round=2, late=True)
    log.close()
    (problem,) = witness_check(
        {"aggregator": load_records(tmp_path / "aggregator.audit.jsonl")}
    ).problems
    assert problem.startswith("eu's log was rolled back or forked")
    assert "count 30 head cccccccccccccccc…, after witnessing count 30 head bbbb" in problem


def test_the_aggregator_marks_a_witness_older_than_one_it_recorded_late(tmp_path, keys):
    from fedciuic.aggregator.journal import Journal

    log = AuditLog(tmp_path / "aggregator.audit.jsonl", "aggregator", keys["aggregator"])
    journal = Journal(RunRecorder(tmp_path / "run", {"run_id": RUN}), log, RUN)
    for count in (17, 15, 19):
        journal.witness(None, "us", Witness(count, "d" * 64))
    log.close()
    marks = [
        (r["details"]["count"], r["details"].get("late", False))
        for r in load_records(tmp_path / "aggregator.audit.jsonl")
        if r["event"] == "witness"
    ]
    assert marks == [(17, False), (15, True), (19, False)]


@pytest.mark.parametrize(
    ("details", "why"),
    [
        ({"party": "eu", "count": -1, "head": "a" * 64}, "count -1 is not a non-negative"),
        ({"party": "eu", "count": True, "head": "a" * 64}, "count True is not"),
        ({"party": "eu", "count": "3", "head": "a" * 64}, "count '3' is not"),
        ({"party": "eu", "count": 2.0, "head": "a" * 64}, "count 2.0 is not"),
        ({"party": "eu", "count": 2**64, "head": "a" * 64}, "is not a non-negative"),
        ({"party": "eu", "count": 3, "head": "A" * 64}, "is not 64 lower-case hex"),
        ({"party": "eu", "count": 3, "head": "a" * 63}, "is not 64 lower-case hex"),
        ({"party": "eu", "count": 3, "head": None}, "head None is not"),
        ({"party": "eu", "count": 0, "head": "a" * 64}, "64 zeros for count 0"),
        ({"party": "", "count": 3, "head": "a" * 64}, "party is not a party's name"),
        ({"party": ["eu"], "count": 3, "head": "a" * 64}, "party is not a party's name"),
        ({"count": 3, "head": "a" * 64}, "party is not a party's name"),
    ],
)
def test_malformed_witness_records_are_problems_not_exceptions(tmp_path, keys, details, why):
    folder = federation(tmp_path, keys)
    log = AuditLog(folder / "aggregator.audit.jsonl", "aggregator", keys["aggregator"])
    log.append(WITNESS_EVENT, run_id=RUN, **details)  # written around witness()'s checks
    log.close()
    (problem,) = witness_check(records_of(folder), run_id=RUN).problems
    assert (
        problem.startswith("the aggregator's log (seq ") and "malformed witness record" in problem
    )
    assert why in problem
    assert "not covered by a signature" not in problem  # covered= not given


def test_a_witness_record_with_details_that_are_not_an_object(tmp_path, keys):
    log = AuditLog(tmp_path / "a.jsonl", "aggregator", keys["aggregator"])
    log.append(WITNESS_EVENT, run_id=RUN)
    log.close()
    records = load_records(tmp_path / "a.jsonl")
    records[0]["details"] = ["eu", 3]
    (problem,) = witness_check({"aggregator": records}).problems
    assert "malformed witness record: details is not an object" in problem


@pytest.mark.parametrize(
    ("count", "head"),
    [
        (-1, "a" * 64),
        (True, "a" * 64),
        (1.0, "a" * 64),
        (3, "A" * 64),
        (3, "a" * 65),
        (0, "a" * 64),
    ],
)
def test_witness_refuses_a_malformed_checkpoint_head(tmp_path, keys, count, head):
    log = AuditLog(tmp_path / "a.jsonl", "aggregator", keys["aggregator"])
    with pytest.raises(AuditError, match="checkpoint head"):
        log.witness("eu", count, head, run_id=RUN)
    with pytest.raises(AuditError, match="party"):
        log.witness("", 3, "a" * 64, run_id=RUN)
    log.witness("eu", 0, GENESIS, run_id=RUN)
    log.close()
    (record,) = load_records(tmp_path / "a.jsonl")
    assert record["event"] == WITNESS_EVENT
    assert record["details"] == {"party": "eu", "count": 0, "head": GENESIS}


def test_last_checkpoint_is_what_the_checkpoint_record_signs(tmp_path, keys):
    path = tmp_path / "eu.jsonl"
    log = AuditLog(path, "eu", keys["eu"], checkpoint_every=4)
    assert log.last_checkpoint() is None
    log.append("trained", run_id=1)
    assert log.last_checkpoint() is None
    log.checkpoint(run_id=1)
    for i in range(5):  # a periodic checkpoint after the fourth
        log.append("evaluated", run_id=1, server_round=i)
    last = log.last_checkpoint()
    log.close()
    checkpoints = [r for r in load_records(path) if r["event"] == "checkpoint"]
    assert len(checkpoints) == 2
    assert last == (checkpoints[-1]["details"]["count"], checkpoints[-1]["details"]["head"])
    assert last == (checkpoints[-1]["seq"], checkpoints[-1]["prev"])


def test_last_checkpoint_after_other_process_appended(tmp_path, keys):
    path = tmp_path / "eu.jsonl"
    ours = AuditLog(path, "eu", keys["eu"])
    ours.append("trained", run_id=1)
    ours.checkpoint(run_id=1)
    mine = ours.last_checkpoint()
    assert mine == (1, load_records(path)[0]["hash"])
    # Another process checkpoints more than a tail-read's worth of records, then
    # appends records it does not checkpoint.
    key_file = write_keys(keys["eu"], tmp_path / "keys")[0]
    script = (
        "import sys; from pathlib import Path\n"
        "from fedciuic.audit.log import AuditLog\n"
        "from fedciuic.crypto.keys import load_keypair\n"
        "log = AuditLog(Path(sys.argv[1]), 'eu', load_keypair(Path(sys.argv[2])),"
        " checkpoint_every=10**6)\n"
        "for i in range(400): log.append('evaluated', run_id=2, pad='x' * 300)\n"
        "log.checkpoint(run_id=2)\n"
        "for i in range(400): log.append('evaluated', run_id=2, pad='y' * 300)\n"
        "log.close()\n"
    )
    subprocess.run([sys.executable, "-c", script, str(path), str(key_file)], check=True)
    records = load_records(path)
    (theirs,) = [r for r in records if r["event"] == "checkpoint" and r["run_id"] == 2]
    assert path.stat().st_size > 4 * (1 << 16)
    expected = (theirs["details"]["count"], theirs["details"]["head"])
    assert ours.last_checkpoint() == expected
    fresh = AuditLog(path, "eu", keys["eu"])  # a writer that opens the file cold
    assert fresh.last_checkpoint() == expected
    fresh.checkpoint(run_id=3)
    assert ours.last_checkpoint() == (len(records), records[-1]["hash"])
    ours.close()
    fresh.close()
    assert verify(path, keys["eu"].bundle).ok


def test_report_exits_nonzero_when_logs_disagree(tmp_path, keys, capsys):
    """0 agree and verified; 1 a log fails verification; 2 an error; 3 disagree."""
    folder = federation(tmp_path, keys)
    assert report(folder) == EXIT_OK == 0
    assert report(folder, keys=False) == EXIT_OK  # nothing checked: said, not an error
    assert "logs not verified (no --keys)" in capsys.readouterr().out
    # Each log verifies, but what eu says it sent is not what the aggregator received.
    eu = folder / "eu.jsonl"
    original = eu.read_bytes()
    lines = original.splitlines(keepends=True)
    changed = AuditLog(folder / "eu2.jsonl", "eu", keys["eu"])
    for line in lines:  # eu's log, re-written by eu itself with another digest
        record = json.loads(line)
        if record["event"] == "checkpoint":
            changed.checkpoint(run_id=record["run_id"], server_round=record["round"])
            continue
        details = record["details"]
        if record["event"] == "update_sealed" and record["round"] == 2:
            details = {**details, "digest": "e" * 64}
        changed.append(
            record["event"], run_id=record["run_id"], server_round=record["round"], **details
        )
    changed.close()
    (folder / "eu2.jsonl").replace(eu)
    assert verify(eu, keys["eu"].bundle).ok
    capsys.readouterr()
    assert report(folder) == EXIT_DISAGREE == 3
    out = capsys.readouterr().out
    assert f"audit: the logs DISAGREE on run {RUN}:" in out
    assert "eu logged sending eeeeeeeeeeeeeeee, the aggregator logged no such update" in out
    # A log that fails verification: 1, whatever else is found.
    eu.write_bytes(original.replace(b'"loss":4.0', b'"loss":0.4'))
    assert report(folder) == EXIT_AUDIT == 1
    # An error: 2.
    assert report(folder, "aggregator.audit.jsonl", "missing.jsonl") == 2
    assert "missing.jsonl: no audit log here" in capsys.readouterr().err


def test_check_and_report_says_what_it_found(tmp_path, keys):
    folder = federation(tmp_path, keys)
    cut_to_checkpoint(folder / "cn.jsonl", back=2)
    outcome = check_and_report(
        [folder / n for n in ("aggregator.audit.jsonl", "eu.jsonl", "cn.jsonl")],
        folder / "keys",
        folder / "out",
    )
    assert outcome.verified is True and outcome.exit_code == EXIT_DISAGREE
    assert outcome.run_id == RUN and outcome.report.is_file()
    assert [p.split(":")[0] for p in outcome.disagreements] == ["cn's log was truncated"]


def test_unsigned_tail_is_shown_unverified(tmp_path, keys, capsys):
    """Records after a log's last checkpoint are listed as unverified, never in the
    tables: here a forged rejection and a second published aggregate nobody signed."""
    folder = federation(tmp_path, keys)
    agg = AuditLog(folder / "aggregator.audit.jsonl", "aggregator", None)
    agg.append("update_rejected", run_id=RUN, server_round=2, region="cn", reason="FORGED-REASON")
    agg.append("aggregate_published", run_id=RUN, server_round=4, regions=["eu"])
    agg.close()
    assert report(folder) == EXIT_AUDIT
    text = report_text(folder)
    tables, unverified = text.split(f"## {UNVERIFIED_TITLE}", 1)
    assert "FORGED-REASON" not in tables
    assert "| aggregates published / withheld | 3 / 0 |" in tables
    assert "UNVERIFIED: no verified checkpoint signature covers these records" in unverified
    assert "| aggregator | " in unverified and "FORGED-REASON" in unverified
    assert "| 4 | aggregate_published |" in unverified
    assert "2 record(s) after the last checkpoint are not covered" in text
    page = (folder / "report" / f"compliance-report-run-{RUN}.html").read_text()
    assert page.index("FORGED-REASON") > page.index(UNVERIFIED_TITLE)


def test_without_keys_every_record_is_unverified(tmp_path, keys):
    folder = federation(tmp_path, keys)
    assert report(folder, keys=False) == EXIT_OK
    text = report_text(folder)
    tables, unverified = text.split(f"## {UNVERIFIED_TITLE}", 1)
    assert "| 1 | eu | aggregator (EU) |" not in tables  # no transfer stated as fact
    assert "| status | not covered by a signature (see Unverified records) |" in tables
    assert "| eu | " in unverified and "update_sealed" in unverified
    assert "The region and aggregator logs agree." in tables  # agreement reads everything


def test_verified_records_are_facts_in_the_tables(tmp_path, keys):
    folder = federation(tmp_path, keys)
    assert report(folder) == EXIT_OK
    text = report_text(folder)
    tables, unverified = text.split(f"## {UNVERIFIED_TITLE}", 1)
    assert "| status | completed |" in tables
    assert "| 2 | eu | aggregator (EU) | 2200 | xwing-aes256gcm |" in tables
    assert "None: every record of this run is covered by a verified signature." in unverified


def test_report_on_malformed_records_gives_problems_not_a_traceback(tmp_path, keys, capsys):
    folder = federation(tmp_path, keys)
    agg = AuditLog(folder / "aggregator.audit.jsonl", "aggregator", None)
    agg.append("update_received", run_id=RUN, server_round=1, region=["eu"])
    agg.append("update_accepted", run_id=RUN, server_round="x")  # type: ignore[arg-type]  # hostile
    agg.append("aggregate_withheld", run_id=RUN, server_round=2, reasons="not a list")
    agg.close()
    eu = AuditLog(folder / "eu.jsonl", "eu", None)
    eu.append("update_sealed", run_id=RUN, server_round=None)
    eu.append("trained", run_id=RUN, server_round=3, epsilon="high", epsilon_budget=None)
    eu.close()
    assert report(folder, keys=False) == EXIT_DISAGREE
    out = capsys.readouterr().out
    assert "the aggregator's log (seq " in out and "malformed update_received record" in out
    assert "eu's log (seq " in out and "malformed update_sealed record" in out
    assert report(folder) == EXIT_AUDIT
    assert f"compliance-report-run-{RUN}.md" in capsys.readouterr().out


def test_last_checkpoint_ignores_a_detail_that_looks_like_one(tmp_path, keys):
    path = tmp_path / "eu.jsonl"
    log = AuditLog(path, "eu", keys["eu"])
    log.checkpoint(run_id=1)
    log.append("note", run_id=1, nested={"event": "checkpoint", "details": {"count": 0}})
    log.close()
    other = AuditLog(path, "eu", keys["eu"])
    assert other.last_checkpoint() == (0, GENESIS)
    other.close()


def test_a_party_without_a_checkpoint_yet_is_witnessed_as_the_empty_log(tmp_path, keys):
    agg = AuditLog(tmp_path / "aggregator.audit.jsonl", "aggregator", keys["aggregator"])
    eu = AuditLog(tmp_path / "eu.jsonl", "eu", keys["eu"])
    eu.append("run_joined", run_id=RUN)
    assert eu.last_checkpoint() is None
    agg.witness("eu", 0, GENESIS, run_id=RUN)
    for log in (agg, eu):
        log.close()
    logs = {
        p: load_records(tmp_path / f)
        for p, f in (("aggregator", "aggregator.audit.jsonl"), ("eu", "eu.jsonl"))
    }
    check = witness_check(logs)
    assert check.agree and len(check.matched) == 1


def test_two_logs_of_one_party_are_refused(tmp_path, keys, capsys):
    folder = federation(tmp_path, keys)
    (folder / "eu-copy.jsonl").write_bytes((folder / "eu.jsonl").read_bytes())
    assert report(folder, "aggregator.audit.jsonl", "eu.jsonl", "eu-copy.jsonl") == 2
    assert "give one log per party" in capsys.readouterr().err


def test_last_checkpoint_scans_back_across_chunk_boundaries(tmp_path, keys):
    """A cold writer finds the latest checkpoint wherever the file's 64 KiB read
    chunks cut the lines: here the first chunk boundary falls inside the checkpoint
    line, at several places, and on each side of it."""
    for offset in (-1, 0, 1, 40, 120, 200, 10_000):
        path = tmp_path / f"eu-{offset}.jsonl"
        log = AuditLog(path, "eu", keys["eu"], checkpoint_every=10**6)
        log.append("trained", run_id=1)
        log.checkpoint(run_id=1)
        begins = path.stat().st_size - len(path.read_bytes().splitlines()[-1]) - 1
        target = begins + offset + (1 << 16)  # the file's size once the cut falls there
        while path.stat().st_size < target - 2400:
            log.append("evaluated", run_id=1, pad="x" * 1000)
        last = path.read_bytes().splitlines()[-1]
        base = len(last) + 1 - 1000  # an `evaluated` line without its pad
        log.append("evaluated", run_id=1, pad="y" * (target - path.stat().st_size - base))
        expected = log.last_checkpoint()
        log.close()
        assert path.stat().st_size == target
        cold = AuditLog(path, "eu", keys["eu"])
        assert cold.last_checkpoint() == expected == (1, load_records(path)[0]["hash"])
        cold.close()


def test_redaction_replaces_whole_paths_only(tmp_path):
    """A short relative data-path (``eu``) must not rewrite a region's name or base64;
    an absolute path is redacted only where it stands as a whole path."""
    from fedciuic.audit.log import AuditLog, load_records

    data = tmp_path / "data" / "eu"
    log = AuditLog(
        tmp_path / "a.jsonl", "eu", None, redact=[("eu", "<data-path>"), (str(data), "<d>")]
    )
    log.append(
        "note",
        run_id=1,
        region="eu",
        blob="ZXUeuZXU=",
        path=f"{data}/x.jsonl",
        other=f"{data}2/x.jsonl",
        message=f"cannot read {data}: gone",
    )
    details = load_records(tmp_path / "a.jsonl")[-1]["details"]
    assert details["region"] == "eu" and details["blob"] == "ZXUeuZXU="
    assert details["path"] == "<d>/x.jsonl" and details["message"] == "cannot read <d>: gone"
    assert details["other"] == f"{data}2/x.jsonl"


def test_run_report_and_simulate_fail_when_the_logs_disagree(tmp_path, keys, capsys):
    """`fedciuic report` (and so `simulate` and start.sh, which end with it) exits non-zero
    on a truncated log that still verifies by itself: the witnesses disagree."""
    from fedciuic.ops.run_report import write_run_report

    folder = federation(tmp_path, keys)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.json").write_text(
        json.dumps({"run": {"run_id": RUN, "status": "completed", "regions": []}, "rounds": {}})
    )
    logs = [folder / "aggregator.audit.jsonl", folder / "eu.jsonl", folder / "cn.jsonl"]
    report = write_run_report(run_dir, audit_logs=logs, keys_dir=folder / "keys")
    assert report.ok and not report.disagreements
    cut_to_checkpoint(folder / "eu.jsonl", 2)
    report = write_run_report(run_dir, audit_logs=logs, keys_dir=folder / "keys")
    assert not report.problems  # eu's log verifies by itself
    assert report.disagreements and "eu's log was truncated" in report.disagreements[0]
    args = ["report", str(run_dir), "--keys", str(folder / "keys")]
    for log in logs:
        args += ["--audit-log", str(log)]
    assert main(args) == 1
    assert "the logs DISAGREE" in capsys.readouterr().err


def test_a_region_that_declined_before_joining_is_no_disagreement(tmp_path, keys):
    """cn's policy refused the run outright: its log holds its declines but no
    run_joined (no run config to compare). That is agreement, not a contradiction."""
    from fedciuic.audit.report import build_report, open_logs

    agg = AuditLog(tmp_path / "aggregator.audit.jsonl", "aggregator", keys["aggregator"])
    cn = AuditLog(tmp_path / "cn.jsonl", "cn", keys["cn"])
    agg.append("run_start", run_id=RUN, regions=["cn"], config_hash="c" * 64)
    cn.append("declined", run_id=RUN, server_round=1, reason="aggregator in US")
    agg.append("region_declined", run_id=RUN, server_round=1, region="cn", reason="aggregator")
    for log in (agg, cn):
        log.checkpoint(run_id=RUN)
        log.close()
    logs = open_logs([tmp_path / "aggregator.audit.jsonl", tmp_path / "cn.jsonl"], {})
    assert build_report(logs, RUN).disagreements == []
    silent = AuditLog(tmp_path / "eu.jsonl", "eu", keys["eu"])
    silent.append("run_joined", run_id=RUN + 1, config_hash="c" * 64)
    silent.close()
    logs = open_logs(
        [tmp_path / "aggregator.audit.jsonl", tmp_path / "cn.jsonl", tmp_path / "eu.jsonl"], {}
    )
    assert build_report(logs, RUN).disagreements == ["eu: its log has no record of this run."]
