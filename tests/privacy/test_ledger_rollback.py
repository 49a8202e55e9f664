"""A rolled-back privacy ledger is refused, and can be rebuilt from the audit log."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from fedciuic.audit.log import REGION_LOG, AuditLog
from fedciuic.config import PrivacyUnit
from fedciuic.privacy.ledger import (
    LEDGER_FILE,
    LedgerRolledBack,
    PrivacyError,
    PrivacyLedger,
    audit_witness,
    rebuild_ledger,
)

DATASET = "a" * 64


def open_ledger(state: Path, unit: PrivacyUnit = "record") -> PrivacyLedger:
    return PrivacyLedger.open(
        state / LEDGER_FILE,
        region="eu",
        dataset=DATASET,
        delta=1e-5,
        accountant="prv",
        unit=unit,
        witness=audit_witness(state / REGION_LOG, region="eu", dataset=DATASET),
    )


def release(
    state: Path, server_round: int, *, note: bool = True, unit: PrivacyUnit = "record"
) -> PrivacyLedger:
    """One released round as the ClientApp does it: the ledger record, then the audit
    log's ``trained`` event that witnesses the ledger's new head."""
    ledger = open_ledger(state, unit)
    step = (1.0, 0.01, 30)
    ledger.append(
        ledger.new_record(
            run_id=1,
            server_round=server_round,
            step=step,
            max_grad_norm=1.0,
            secure_mode=True,
            epsilon=ledger.epsilon_after(step),
        )
    )
    if note:
        log = AuditLog(state / REGION_LOG, "eu", None)
        try:
            log.append(
                "trained",
                run_id=1,
                server_round=server_round,
                data_fingerprint=DATASET,
                epsilon=ledger.epsilon,
                unit=ledger.header.unit,
                ledger=ledger.witness_record(),
            )
        finally:
            log.close()
    return ledger


def _older_copy(state: Path, saved: bytes) -> None:
    (state / LEDGER_FILE).write_bytes(saved)


def _header_only(state: Path, saved: bytes) -> None:
    path = state / LEDGER_FILE
    path.write_bytes(path.read_bytes().split(b"\n")[0] + b"\n")


def _deleted(state: Path, saved: bytes) -> None:
    (state / LEDGER_FILE).unlink()


ROLLBACKS = {
    "older copy": (
        _older_copy,
        r"audit log .* records 3 release\(s\) .* but the ledger has 1 release",
    ),
    "truncated to its header": (_header_only, r"records 3 release\(s\) .* ledger has 0 release"),
    "deleted": (_deleted, r"records 3 release\(s\) .* but there is no ledger file"),
}


@pytest.mark.parametrize("name", list(ROLLBACKS))
def test_rolled_back_ledger_is_refused(tmp_path, name):
    release(tmp_path, 1)
    saved = (tmp_path / LEDGER_FILE).read_bytes()  # a "backup" after one release
    release(tmp_path, 2)
    release(tmp_path, 3)
    damage, message = ROLLBACKS[name]
    damage(tmp_path, saved)
    with pytest.raises(LedgerRolledBack, match=message) as err:
        open_ledger(tmp_path)
    text = str(err.value)
    assert "was rolled back" in text and str(tmp_path / LEDGER_FILE) in text
    assert f"fedciuic ledger rebuild --state-path {tmp_path}" in text
    assert "keeps every release" in text
    assert "backup" not in text  # restoring a backup is the rollback itself


def test_a_ledger_replaced_by_another_of_the_same_length_is_refused(tmp_path):
    release(tmp_path, 1)
    release(tmp_path, 2)
    ledger = PrivacyLedger.load(tmp_path / LEDGER_FILE)
    # Another ledger with two cheaper releases: as long, same epsilon shape, other head.
    other = tmp_path / "other"
    other.mkdir()
    fake = PrivacyLedger.open(
        other / LEDGER_FILE,
        region="eu",
        dataset=DATASET,
        delta=1e-5,
        accountant="prv",
        unit="record",
    )
    for server_round in (1, 2):
        step = (5.0, 0.01, 30)
        fake.append(
            fake.new_record(
                run_id=1,
                server_round=server_round,
                step=step,
                max_grad_norm=1.0,
                secure_mode=True,
                epsilon=fake.epsilon_after(step) + ledger.epsilon,  # not lower than witnessed
            )
        )
    shutil.copy(other / LEDGER_FILE, tmp_path / LEDGER_FILE)
    with pytest.raises(LedgerRolledBack, match="does not match its audit log: after release 2"):
        open_ledger(tmp_path)


def test_a_ledger_ahead_of_its_audit_log_is_accepted(tmp_path):
    # A process that died after writing the ledger and before its audit record: the
    # ledger is ahead of its witness, the safe direction.
    release(tmp_path, 1)
    release(tmp_path, 2, note=False)
    assert len(open_ledger(tmp_path).rounds) == 2


def test_a_rollback_behind_an_audit_log_of_epsilons_only_is_refused(tmp_path):
    # An audit log written before ledger heads were witnessed still records epsilon.
    release(tmp_path, 1, note=False)
    saved = (tmp_path / LEDGER_FILE).read_bytes()
    ledger = release(tmp_path, 2, note=False)
    log = AuditLog(tmp_path / REGION_LOG, "eu", None)
    log.append(
        "trained", run_id=1, server_round=2, data_fingerprint=DATASET, epsilon=ledger.epsilon
    )
    log.close()
    (tmp_path / LEDGER_FILE).write_bytes(saved)
    with pytest.raises(LedgerRolledBack, match=f"cumulative epsilon of {ledger.epsilon:.3f}"):
        open_ledger(tmp_path)


@pytest.mark.parametrize("name", list(ROLLBACKS))
def test_rebuild_restores_every_witnessed_release(tmp_path, name):
    release(tmp_path, 1)
    saved = (tmp_path / LEDGER_FILE).read_bytes()
    release(tmp_path, 2)
    honest = release(tmp_path, 3)
    ROLLBACKS[name][0](tmp_path, saved)
    done = rebuild_ledger(tmp_path)
    assert done.releases == 3 and done.epsilon == pytest.approx(honest.epsilon)
    assert (done.kept_aside is None) == (name == "deleted")
    again = open_ledger(tmp_path)  # the witness accepts it
    assert again.heads == honest.heads
    assert (tmp_path / LEDGER_FILE).read_bytes() == b"".join(
        line + b"\n"
        for line in [honest.header.model_dump_json().encode()]
        + [r.model_dump_json().encode() for r in honest.rounds]
    )
    release(tmp_path, 4)  # and the region goes on
    assert len(open_ledger(tmp_path).rounds) == 4


def test_rebuild_keeps_releases_only_the_ledger_holds(tmp_path):
    release(tmp_path, 1)
    release(tmp_path, 2, note=False)  # never witnessed
    done = rebuild_ledger(tmp_path)
    assert done.releases == 2 and done.from_audit == 1


def test_rebuild_refuses_when_a_release_is_known_to_neither(tmp_path):
    release(tmp_path, 1)
    saved = (tmp_path / LEDGER_FILE).read_bytes()
    release(tmp_path, 2, note=False)
    release(tmp_path, 3)
    (tmp_path / LEDGER_FILE).write_bytes(saved)
    with pytest.raises(PrivacyError, match="release 2 is recorded neither in the ledger nor"):
        rebuild_ledger(tmp_path)


def test_rebuild_without_a_witness_refuses(tmp_path):
    release(tmp_path, 1, note=False)
    with pytest.raises(PrivacyError, match="witnesses no release of this ledger"):
        rebuild_ledger(tmp_path)


def test_damaged_ledger_message_points_at_the_rebuild_not_a_backup(tmp_path):
    release(tmp_path, 1)
    path = tmp_path / LEDGER_FILE
    path.write_bytes(path.read_bytes()[:-5])
    with pytest.raises(PrivacyError, match="last line is truncated") as err:
        open_ledger(tmp_path)
    assert "fedciuic ledger rebuild" in str(err.value) and "backup" not in str(err.value)
    assert rebuild_ledger(tmp_path).releases == 1  # the audit log holds the torn record


def test_the_rebuild_command_repairs_a_rolled_back_ledger(tmp_path, capsys):
    from fedciuic.ops.cli import main

    release(tmp_path, 1)
    saved = (tmp_path / LEDGER_FILE).read_bytes()
    release(tmp_path, 2)
    (tmp_path / LEDGER_FILE).write_bytes(saved)
    assert main(["ledger", "rebuild", "--state-path", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "2 release(s)" in out and "kept as evidence" in out
    assert len(open_ledger(tmp_path).rounds) == 2
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["ledger", "rebuild", "--state-path", str(empty)]) == 2
    assert "witnesses no release" in capsys.readouterr().err


def test_rebuild_restores_a_user_level_ledger_as_user_level(tmp_path):
    release(tmp_path, 1, unit="user")
    release(tmp_path, 2, unit="user")
    (tmp_path / LEDGER_FILE).unlink()
    done = rebuild_ledger(tmp_path)
    assert done.releases == 2
    assert open_ledger(tmp_path, "user").header.unit == "user"
    with pytest.raises(PrivacyError, match="the ledger accounts per user"):
        open_ledger(tmp_path, "record")


def test_a_ledger_and_log_from_before_units_stay_readable_as_record_level(tmp_path):
    """A header without ``unit`` (as written before units existed) keeps its bytes, so
    the heads its audit log witnessed still match, and the rebuild restores it."""
    path = tmp_path / LEDGER_FILE
    header = PrivacyLedger.open(
        path, region="eu", dataset=DATASET, delta=1e-5, accountant="prv", unit="record"
    ).header
    old = header.model_dump_json(exclude={"unit"}).encode()
    assert b"unit" not in old
    path.write_bytes(old + b"\n")
    release(tmp_path, 1)
    release(tmp_path, 2)
    ledger = open_ledger(tmp_path)  # checked against the witnessed heads
    assert ledger.header.unit == "record" and ledger.lines[0] == old
    path.unlink()
    rebuild_ledger(tmp_path)
    assert path.read_bytes().split(b"\n")[0] == old
    assert len(open_ledger(tmp_path).rounds) == 2
