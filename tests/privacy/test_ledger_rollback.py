"""A rolled-back privacy ledger is refused, and can be rebuilt from the audit log."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from fedciuic.audit.log import AGGREGATOR_LOG, REGION_LOG, AuditLog, load_records
from fedciuic.config import PrivacyUnit
from fedciuic.deid.secret import SECRET_FILE, data_commitment, region_secret
from fedciuic.privacy.ledger import (
    LEDGER_FILE,
    LedgerRolledBack,
    PrivacyError,
    PrivacyLedger,
    RebuildRefused,
    Rebuilt,
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
        for line in [honest.header.model_dump_json().encode()] + [r.line() for r in honest.rounds]
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
    with pytest.raises(PrivacyError, match="release 2 is recorded in none of"):
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
    honest = release(tmp_path, 2)
    (tmp_path / LEDGER_FILE).write_bytes(saved)
    assert main(["ledger", "rebuild", "--state-path", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    # One line per source and the epsilon it shows, where each release came from, the result.
    assert out[:4] == [
        f"source {tmp_path / LEDGER_FILE} (current ledger): 1 release(s), epsilon "
        f"{honest.rounds[0].epsilon:.3f}",
        f"source {tmp_path / REGION_LOG} (region audit log): 2 release(s), epsilon "
        f"{honest.epsilon:.3f}",
        f"release 1: from {LEDGER_FILE}, {REGION_LOG}",
        f"release 2: from {REGION_LOG}",
    ]
    assert out[4].startswith(f"rebuilt {tmp_path / LEDGER_FILE}: 2 release(s), epsilon ")
    assert "kept as evidence" in out[5]
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


# -- the rebuild never shows less spent than any witness ---------------------------------

N = 4  # releases in the histories below


def accepted(
    aggregator: Path, ledger: PrivacyLedger, server_round: int, named: str = DATASET
) -> None:
    """The aggregator's record of the region's accepted update: its epsilon, no ledger
    line; ``named``: what the reply said of the data (its digest, or a commitment)."""
    log = AuditLog(aggregator, "aggregator", None)
    try:
        log.append(
            "update_accepted",
            run_id=1,
            server_round=server_round,
            region="eu",
            examples=60,
            epsilon=ledger.epsilon,
            unit=ledger.header.unit,
            data_fingerprint=named,
        )
    finally:
        log.close()


def releases_and_a_truncated_audit_log(
    state: Path, aggregator: Path | None = None
) -> PrivacyLedger:
    """N releases (each accepted by the aggregator, given its log), then the region's audit
    log cut back to its first two: it no longer witnesses releases 3 and 4."""
    for server_round in range(1, N + 1):
        ledger = release(state, server_round)
        if aggregator is not None:
            accepted(aggregator, ledger, server_round)
        if server_round == 2:
            cut = (state / REGION_LOG).read_bytes()
    (state / REGION_LOG).write_bytes(cut)
    return ledger


def rolled_back_to(state: Path, honest: PrivacyLedger, k: int) -> None:
    (state / LEDGER_FILE).write_bytes(b"".join(line + b"\n" for line in honest.lines[: k + 1]))


def spent_by_witnesses(state: Path, aggregator: Path | None = None) -> float:
    """The most epsilon any witness shows, read here apart from the rebuild's own code:
    every copy of the ledger in the state folder, the region's audit log, the aggregator's."""
    shown = [0.0]
    for copy in state.glob(LEDGER_FILE + "*"):
        for line in copy.read_bytes().splitlines() if not copy.name.endswith(".lock") else []:
            try:
                shown.append(float(json.loads(line)["epsilon"]))
            except (ValueError, KeyError, TypeError):
                continue  # the header, or a damaged line
    witness = audit_witness(state / REGION_LOG, region="eu", dataset=DATASET)
    shown.append(witness.epsilon if witness is not None else 0.0)
    if aggregator is not None:
        shown += [
            r["details"]["epsilon"]
            for r in load_records(aggregator)
            if r["event"] == "update_accepted"
        ]
    return max(shown)


def assert_not_below(state: Path, done: Rebuilt, floor: float) -> None:
    """The invariant: the rebuilt ledger spends at least what every witness shows, and is
    a ledger (its own checks and the audit log's witness accept it)."""
    assert done.epsilon >= floor - 1e-9
    assert PrivacyLedger.load(state / LEDGER_FILE).epsilon == pytest.approx(done.epsilon)
    assert open_ledger(state).epsilon == pytest.approx(done.epsilon)


def files(state: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in state.iterdir() if not p.name.endswith(".lock")}


@pytest.mark.parametrize("k", range(N + 1))
@pytest.mark.parametrize("witness", ["kept aside", "aggregator log"])
def test_a_rebuild_after_a_rollback_to_any_position_spends_no_less_than_any_witness(
    tmp_path, witness, k
):
    """The audit log lost releases 3 and 4, the ledger went back to k releases: what
    else saw them is an earlier rebuild's kept-aside copy, or the aggregator's log."""
    state = tmp_path / "state"
    state.mkdir()
    aggregator = tmp_path / AGGREGATOR_LOG if witness == "aggregator log" else None
    honest = releases_and_a_truncated_audit_log(state, aggregator)
    kept = state / f"{LEDGER_FILE}.rolled-back-20250101T000000Z"
    if witness == "kept aside":
        shutil.copy(state / LEDGER_FILE, kept)
    rolled_back_to(state, honest, k)
    floor = spent_by_witnesses(state, aggregator)
    assert floor == pytest.approx(honest.epsilon)
    if witness == "aggregator log" and k < N:
        # It keeps each update's epsilon, not the ledger's lines: releases only it saw
        # cannot be restored, so the rebuild refuses rather than show less.
        before = files(state)
        with pytest.raises(RebuildRefused, match="no source holds, would be dropped") as err:
            rebuild_ledger(state, aggregator_log=aggregator)
        assert f"{aggregator} (record seq" in str(err.value)
        assert f"epsilon of {honest.epsilon:.3f}" in str(err.value)
        assert files(state) == before  # nothing changed
    else:
        done = rebuild_ledger(state, **({"aggregator_log": aggregator} if aggregator else {}))
        assert_not_below(state, done, floor)
        assert done.releases == N and open_ledger(state).heads == honest.heads
        assert state / REGION_LOG in done.origins[0]
        assert state / REGION_LOG not in done.origins[N - 1]  # the truncated log lacks it


def test_a_rebuild_keeps_the_releases_after_a_damaged_line(tmp_path):
    honest = releases_and_a_truncated_audit_log(tmp_path)
    path = tmp_path / LEDGER_FILE
    lines = path.read_bytes().split(b"\n")
    lines[2] = lines[2].replace(b'"kind"', b'"kin#', 1)  # release 2's line damaged on disk
    path.write_bytes(b"\n".join(lines))
    floor = spent_by_witnesses(tmp_path)
    done = rebuild_ledger(tmp_path)
    assert_not_below(tmp_path, done, floor)
    assert done.releases == N and open_ledger(tmp_path).heads == honest.heads
    assert done.sources[0].damaged == 1  # release 2 came from the audit log, 3 and 4 after it
    assert done.origins[1] == (tmp_path / REGION_LOG,) and done.origins[3] == (path,)


def another_ledger(state: Path, other: Path, fork: str) -> Path:
    """A second ledger for the dataset: from the same first release on (a copy of the
    state folder that trained on), or one started afresh."""
    if fork == "another header":
        other.mkdir()
        header = open_ledger(other).header.model_copy(update={"created": "2001-01-01T00:00:00Z"})
        (other / LEDGER_FILE).write_bytes(header.model_dump_json().encode() + b"\n")
        release(other, 7)
    else:
        shutil.copytree(state, other)
        release(other, 7)  # its own release 2
    return other / LEDGER_FILE


@pytest.mark.parametrize("fork", ["current ledger", "kept aside", "another header"])
def test_two_ledgers_for_one_dataset_are_refused_naming_both(tmp_path, fork):
    state = tmp_path / "state"
    state.mkdir()
    release(state, 1)
    second = another_ledger(state, tmp_path / "other", fork)
    release(state, 2)
    if fork == "current ledger":  # the other copy was put in place of the ledger
        shutil.copy(second, state / LEDGER_FILE)
        names = [f"{state / LEDGER_FILE}:3", f"{state / REGION_LOG} (record seq"]
    else:
        shutil.copy(second, state / f"{LEDGER_FILE}.rolled-back-20250101T000000Z")
        names = [f"{state / LEDGER_FILE}:", f"{state / LEDGER_FILE}.rolled-back-20250101T000000Z:"]
    before = files(state)
    where = "hold different headers" if fork == "another header" else "release 2 is run 1 round"
    with pytest.raises(RebuildRefused, match=f"two ledgers for one dataset: .*{where}") as err:
        rebuild_ledger(state)
    assert all(name in str(err.value) for name in names), str(err.value)
    assert files(state) == before  # nothing changed, no ledger that drops either one


def test_a_rebuild_never_replaces_the_evidence_an_earlier_one_kept(tmp_path, monkeypatch):
    real = time.strftime
    same_second = "20250101T000000Z"
    monkeypatch.setattr(
        time, "strftime", lambda fmt, *t: same_second if fmt == "%Y%m%dT%H%M%SZ" else real(fmt, *t)
    )
    release(tmp_path, 1)
    one = (tmp_path / LEDGER_FILE).read_bytes()
    release(tmp_path, 2)
    (tmp_path / LEDGER_FILE).write_bytes(one.split(b"\n")[0] + b"\n")
    first = rebuild_ledger(tmp_path).kept_aside
    (tmp_path / LEDGER_FILE).write_bytes(one)
    second = rebuild_ledger(tmp_path).kept_aside
    assert first is not None and second is not None and first != second
    assert first.read_bytes() == one.split(b"\n")[0] + b"\n" and second.read_bytes() == one


def test_the_rebuild_command_prints_each_source_and_refuses_less_than_the_aggregator_saw(
    tmp_path, capsys
):
    from fedciuic.ops.cli import main

    state = tmp_path / "state"
    state.mkdir()
    aggregator = tmp_path / AGGREGATOR_LOG
    honest = releases_and_a_truncated_audit_log(state, aggregator)
    rolled_back_to(state, honest, 1)
    argv = ["ledger", "rebuild", "--state-path", str(state), "--aggregator-log", str(aggregator)]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out.splitlines() == [
        f"source {state / LEDGER_FILE} (current ledger): 1 release(s), epsilon "
        f"{honest.rounds[0].epsilon:.3f}",
        f"source {state / REGION_LOG} (region audit log): 2 release(s), epsilon "
        f"{honest.rounds[1].epsilon:.3f}",
        f"source {aggregator} (aggregator audit log, epsilon only): no ledger line, epsilon "
        f"{honest.epsilon:.3f}",
    ]
    assert f"{aggregator} (record seq" in err and "nothing was changed" in err
    assert len(open_ledger_lines := (state / LEDGER_FILE).read_bytes().splitlines()) == 2
    assert open_ledger_lines == honest.lines[:2]


def test_the_aggregators_records_name_the_dataset_by_the_regions_commitment(tmp_path):
    """Replies name the data by a commitment under the region's key, per run: a rebuild
    that has the key recognises the aggregator's records and still refuses to show less
    than they do."""
    state = tmp_path / "state"
    state.mkdir()
    key = region_secret(state / SECRET_FILE)
    aggregator = tmp_path / AGGREGATOR_LOG
    for server_round in range(1, N + 1):
        ledger = release(state, server_round)
        accepted(aggregator, ledger, server_round, data_commitment(key, DATASET, 1))
        if server_round == 2:
            cut = (state / REGION_LOG).read_bytes()
    (state / REGION_LOG).write_bytes(cut)
    rolled_back_to(state, ledger, 2)
    assert data_commitment(key, DATASET, 1) != data_commitment(key, DATASET, 2) != DATASET
    with pytest.raises(RebuildRefused, match="no source holds, would be dropped"):
        rebuild_ledger(state, aggregator_log=aggregator)
