"""A prune is bound to the policy its party declared to the others: ``audit prune`` and
the parties' own prunes at start refuse any other (an edited copy), never remove what
another declared policy still keeps, and carry what was declared past the prune;
``audit report`` checks every ``audit_pruned`` record and every run another party saw
against the declared policy, and exits non-zero naming the party when records inside
its retention are gone; a prune killed mid-way leaves no side file after the next open."""

from __future__ import annotations

import logging
import os
import select
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

import fedciuic.audit.log as audit_log
from fedciuic.audit.events import Event
from fedciuic.audit.log import (
    AGGREGATOR_LOG,
    PRUNING_SUFFIX,
    REGION_LOG,
    AuditLog,
    load_records,
    verify,
)
from fedciuic.audit.report import EXIT_DISAGREE
from fedciuic.audit.retention import check_retention, cutoff, enforce, enforce_at_start
from fedciuic.crypto import AGGREGATOR
from fedciuic.crypto.keys import Keypair, write_keys
from fedciuic.errors import EXIT_OK
from fedciuic.ops.cli import main
from fedciuic.policy.rules import LoadedPolicy, load_policy
from tests.conftest import ROOT

EU_POLICY = ROOT / "policies" / "eu-gdpr.yaml"
CN_POLICY = ROOT / "policies" / "cn-pipl.yaml"
SHIPPED_DAYS = "retention_days: 1826"
DAYS = 1826
CONFIG = "c" * 64
NOW = datetime.now(UTC)  # the report and the CLI judge retention at the time they run
REFUSED = 2  # every fedciuic command's error


def edited(tmp_path: Path, days: int = 1, version: str | None = None) -> Path:
    """A copy of the EU policy with another retention (so another hash), as a party
    would edit it: the file it then prunes by."""
    text = EU_POLICY.read_text(encoding="utf-8")
    assert SHIPPED_DAYS in text
    text = text.replace(SHIPPED_DAYS, f"retention_days: {days}")
    path = tmp_path / f"eu-{days}-days.yaml"
    path.write_text(text, encoding="utf-8")
    return path


@dataclass
class Federation:
    """The EU region's and the aggregator's logs and keys, written as a run writes them:
    each run declares the EU policy (the region in ``run_joined``, the aggregator in
    ``run_start``, ``update_accepted``), and each party witnesses the other's checkpoint."""

    root: Path
    eu: Keypair
    agg: Keypair
    clock: list[datetime]
    policy: LoadedPolicy

    @property
    def keys(self) -> Path:
        return self.root / "keys"

    @property
    def eu_log(self) -> Path:
        return self.root / "eu" / REGION_LOG

    @property
    def agg_log(self) -> Path:
        return self.root / "aggregator" / AGGREGATOR_LOG

    def log(self, party: str) -> Path:
        return self.agg_log if party == AGGREGATOR else self.eu_log

    def key(self, party: str) -> Keypair:
        return self.agg if party == AGGREGATOR else self.eu

    def run(self, run_id: int, when: datetime, *, region: bool = True) -> None:
        self.clock[0] = when
        agg = AuditLog(self.agg_log, AGGREGATOR, self.agg)
        agg.append(
            Event.RUN_START,
            run_id=run_id,
            regions=["eu"],
            config_hash=CONFIG,
            aggregator_jurisdiction="EU",
            policy_hashes={"EU": self.policy.hash},
            retention_days={"EU": self.policy.policy.audit.retention_days},
            key_id=self.agg.bundle.key_id.hex(),
            region_key_ids={"eu": self.eu.bundle.key_id.hex()},
        )
        agg.checkpoint(run_id=run_id)
        if region:
            eu = AuditLog(self.eu_log, "eu", self.eu)
            head = agg.last_checkpoint()
            assert head is not None
            eu.witness(AGGREGATOR, *head, run_id=run_id, server_round=1)
            eu.append(
                Event.RUN_JOINED,
                run_id=run_id,
                server_round=1,
                config_hash=CONFIG,
                jurisdiction="EU",
                policy_hash=self.policy.hash,
                key_id=self.eu.bundle.key_id.hex(),
                aggregator_key_id=self.agg.bundle.key_id.hex(),
            )
            digest = f"{run_id:064x}"
            eu.append(
                Event.UPDATE_SEALED, run_id=run_id, server_round=1, region="eu", digest=digest
            )
            eu.checkpoint(run_id=run_id, server_round=1)
            head = eu.last_checkpoint()
            assert head is not None
            agg.witness("eu", *head, run_id=run_id, server_round=1)
            agg.append(
                Event.UPDATE_RECEIVED, run_id=run_id, server_round=1, region="eu", digest=digest
            )
            agg.append(
                Event.UPDATE_ACCEPTED,
                run_id=run_id,
                server_round=1,
                region="eu",
                policy_hash=self.policy.hash,
            )
            agg.checkpoint(run_id=run_id, server_round=1)
            eu.close()
        agg.close()

    def prune_by(
        self, party: str, when: datetime, days: int, jurisdiction: str, policy_hash: str
    ) -> None:
        """A prune as a party that bypasses ``audit prune`` writes it, with its own key and
        code: what it names as its policy is up to it. The log still verifies."""
        self.clock[0] = when
        log = AuditLog(self.log(party), party, self.key(party))
        try:
            pruned = log.prune(
                cutoff(days, when),
                retention_days=days,
                jurisdiction=jurisdiction,
                policy="edited.yaml",
                policy_hash=policy_hash,
            )
        finally:
            log.close()
        assert pruned.records
        assert verify(self.log(party), self.key(party).bundle).ok

    def report(self, run_id: int, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
        out = self.root / "reports"
        logs = [str(self.agg_log), str(self.eu_log)]
        where = ["--keys", str(self.keys), "--out", str(out)]
        code = main(["audit", "report", *logs, *where, "--run", str(run_id)])
        printed = capsys.readouterr()
        report = (out / f"compliance-report-run-{run_id}.md").read_text(encoding="utf-8")
        return code, printed.out + printed.err + report


@pytest.fixture(scope="module")
def keypairs() -> tuple[Keypair, Keypair]:
    return Keypair.generate("eu", "EU"), Keypair.generate(AGGREGATOR, "EU")


@pytest.fixture
def federation(
    tmp_path: Path, keypairs: tuple[Keypair, Keypair], clock: list[datetime]
) -> Federation:
    fed = Federation(tmp_path, *keypairs, clock, load_policy(EU_POLICY))
    for pair in keypairs:
        write_keys(pair, fed.keys)
    return fed


# -- audit prune and the parties' own prunes ----------------------------------------------


@pytest.mark.parametrize("party", ["eu", AGGREGATOR])
def test_audit_prune_refuses_a_policy_other_than_the_one_the_log_declared(
    federation, party, tmp_path, capsys
):
    """The issue's case: a copy of the party's own policy edited to retention_days: 1,
    two days after the run. Refused, dry run or not, naming the file, both hashes and
    the fix; nothing changes."""
    federation.run(1, NOW - timedelta(days=3))
    path, policy = federation.log(party), edited(tmp_path)
    before = path.read_bytes()
    key = federation.keys / f"{party}.key.json"
    for dry in ([], ["--dry-run"]):
        code = main(["audit", "prune", str(path), "--key", str(key), "--policy", str(policy), *dry])
        err = capsys.readouterr().err
        assert code == REFUSED, err
        assert f"{path}: not pruned: {policy} is policy {load_policy(policy).hash[:12]}" in err
        assert f"declared to the other parties is {federation.policy.hash[:12]} (EU" in err
        assert "prune with the policy you declared" in err
        assert err.count("\n") == 1  # one line, no traceback
    assert path.read_bytes() == before
    # The declared policy itself prunes (nothing is past its retention yet).
    code = main(["audit", "prune", str(path), "--key", str(key), "--policy", str(EU_POLICY)])
    assert code == EXIT_OK
    assert "nothing pruned" in capsys.readouterr().out and path.read_bytes() == before


@pytest.mark.parametrize("party", ["eu", AGGREGATOR])
def test_a_party_starting_with_an_edited_policy_prunes_nothing(federation, party, tmp_path, caplog):
    """The agent's and the aggregator's own prune at start is bound the same way: an
    edited policy file is a warning, the log stays whole and the party starts."""
    federation.run(1, NOW - timedelta(days=3))
    path = federation.log(party)
    before = path.read_bytes()
    log = AuditLog(path, party, federation.key(party))
    federation.clock[0] = NOW
    with caplog.at_level(logging.WARNING):
        done = enforce_at_start(log, load_policy(edited(tmp_path)), logging.getLogger("t"), party)
    log.close()
    assert done is None
    assert "audit log not pruned to its retention" in caplog.text
    assert "prune with the policy you declared" in caplog.text
    assert path.read_bytes() == before


@pytest.mark.parametrize("party", ["eu", AGGREGATOR])
def test_a_prune_never_removes_what_another_declared_policy_keeps(federation, party, tmp_path):
    """Runs 1-2 declared the shipped policy (1826 days), run 3 a later one of 365 days:
    pruning by the later one stops at the first record the earlier one still keeps,
    and says so; the earlier policy then prunes its own runs once they are past it."""
    later = load_policy(edited(tmp_path, days=365))
    federation.run(1, NOW - timedelta(days=400))
    federation.run(2, NOW - timedelta(days=390))
    federation.policy = later
    federation.run(3, NOW - timedelta(days=380))
    path = federation.log(party)
    before = path.read_bytes()
    federation.clock[0] = NOW
    log = AuditLog(path, party, federation.key(party))
    try:
        pruned = enforce(log, later, now=NOW)
    finally:
        log.close()
    assert pruned.records == 0 and path.read_bytes() == before
    first = load_records(path)[0]
    shipped = load_policy(EU_POLICY).hash
    assert pruned.held == (
        f"seq 0 on (run {first['run_id']}) fall under policy {shipped[:12]}, which this log "
        "declared for them"
        + (" (1826 days)" if party == AGGREGATOR else "")  # run_start records retention
        + ": prune them with that policy"
    )
    # Five years on, the shipped policy's runs are past it and go; run 3 stays its own.
    federation.clock[0] = later_on = NOW + timedelta(days=DAYS - 385)
    log = AuditLog(path, party, federation.key(party))
    try:
        pruned = enforce(log, load_policy(EU_POLICY), now=later_on)
    finally:
        log.close()
    kept = load_records(path)
    assert pruned.records and {r["run_id"] for r in kept} - {0} == {3}
    assert verify(path, federation.key(party).bundle).ok


def test_what_a_log_declared_outlives_the_prune_that_removes_it(federation, tmp_path, capsys):
    """Once every run is pruned, the audit_pruned record carries the policy they
    declared: an edited copy is still refused."""
    federation.run(1, NOW - timedelta(days=DAYS + 10))
    federation.clock[0] = NOW
    log = AuditLog(federation.eu_log, "eu", federation.eu)
    try:
        assert enforce(log, federation.policy, now=NOW).records
    finally:
        log.close()
    records = load_records(federation.eu_log)
    assert not [r for r in records if r["event"] == Event.RUN_JOINED]
    (note,) = [r for r in records if r["event"] == Event.PRUNED]
    assert [d["policy_hash"] for d in note["details"]["declared"]] == [federation.policy.hash]
    key = federation.keys / "eu.key.json"
    policy = edited(tmp_path)
    code = main(
        ["audit", "prune", str(federation.eu_log), "--key", str(key), "--policy", str(policy)]
    )
    assert code == REFUSED
    assert (
        f"declared to the other parties is {federation.policy.hash[:12]}" in capsys.readouterr().err
    )


# -- audit report -------------------------------------------------------------------------

#: How a party erases a run it should still hold, and what the report must say about it.
Erase = Callable[[Federation], None]


def _edited_prune(fed: Federation) -> None:
    fed.prune_by("eu", NOW - timedelta(days=1), 1, "EU", load_policy(edited(fed.root)).hash)


def _declared_hash_shorter_retention(fed: Federation) -> None:
    fed.prune_by("eu", NOW - timedelta(days=1), 1, "EU", fed.policy.hash)


def _another_jurisdictions_policy(fed: Federation) -> None:
    fed.prune_by("eu", NOW - timedelta(days=1), 1, "CN", load_policy(CN_POLICY).hash)


def _a_later_prune_hides_the_first(fed: Federation) -> None:
    """Pruned by the edited policy, then again, so that the first audit_pruned record
    itself is gone: a later one, by the same policy, is still there."""
    policy = load_policy(edited(fed.root)).hash
    fed.prune_by("eu", NOW - timedelta(days=1, hours=12), 1, "EU", policy)
    fed.clock[0] = NOW - timedelta(days=1, hours=6)
    log = AuditLog(fed.eu_log, "eu", fed.eu)
    log.append(Event.AGENT_STARTED, run_id=0)
    log.checkpoint(run_id=0)
    log.close()
    fed.prune_by("eu", NOW - timedelta(hours=1), 1, "EU", policy)
    assert len([r for r in load_records(fed.eu_log) if r["event"] == Event.PRUNED]) == 1


def _a_fresh_log_without_a_prune_record(fed: Federation) -> None:
    """The log deleted and started again with the same key: it verifies, and holds no
    audit_pruned record at all."""
    fed.eu_log.unlink()
    fed.clock[0] = NOW - timedelta(days=1)
    log = AuditLog(fed.eu_log, "eu", fed.eu)
    log.append(Event.AGENT_STARTED, run_id=0)
    log.checkpoint(run_id=0)
    log.close()
    assert verify(fed.eu_log, fed.eu.bundle).ok


@pytest.mark.parametrize(
    ("erase", "says"),
    [
        (_edited_prune, "which is not the policy eu declared"),
        (_declared_hash_shorter_retention, "inside the 1826 days eu's declared policy"),
        (_another_jurisdictions_policy, "pruned by the policy of CN, but eu is in EU"),
        (_a_later_prune_hides_the_first, "which is not the policy eu declared"),
        (_a_fresh_log_without_a_prune_record, "records inside the declared retention are gone"),
    ],
    ids=["edited", "shorter-retention", "other-jurisdiction", "prune-again", "no-prune-record"],
)
def test_the_report_flags_a_region_that_erased_records_inside_its_declared_retention(
    federation, capsys, erase, says
):
    """The issue's case and its variants: run 1 three days ago, the region's records of
    it gone a day ago. Each region log verifies; the report exits non-zero naming eu
    and does not bless the prune."""
    federation.run(1, NOW - timedelta(days=3))
    erase(federation)
    code, text = federation.report(1, capsys)
    assert code == EXIT_DISAGREE, text
    assert "audit: OK: " in text and "FAIL" not in text  # every log verifies
    assert says in text
    assert (
        f"eu's log no longer holds run 1, which the aggregator's log (witness seq 2) saw eu "
        f"sign on {(NOW - timedelta(days=3)):%Y-%m-%d %H:%M}; eu's declared policy "
        f"{federation.policy.hash[:12]} (EU) keeps its records 1826 days"
    ) in text
    assert "the policy it declared); it is left out" not in text  # not blessed


def test_the_report_flags_the_aggregators_log_pruned_by_an_edited_policy(federation, capsys):
    federation.run(1, NOW - timedelta(days=3))
    federation.prune_by(
        AGGREGATOR, NOW - timedelta(days=1), 1, "EU", load_policy(edited(federation.root)).hash
    )
    federation.run(2, NOW)
    code, text = federation.report(2, capsys)
    assert code == EXIT_DISAGREE, text
    assert "FAIL" not in text
    assert "the aggregator's log (audit_pruned seq" in text
    assert "which is not the policy the aggregator declared" in text
    assert "the aggregator's log no longer holds run 1, which eu's log (witness seq 0)" in text


def test_a_prune_by_the_declared_policy_past_its_retention_is_no_disagreement(federation, capsys):
    """The same report of a region that pruned as it declared: exit 0, and the run the
    region no longer holds is said to be pruned by the policy it declared."""
    federation.run(1, NOW - timedelta(days=DAYS + 200))
    log = AuditLog(federation.eu_log, "eu", federation.eu)
    federation.clock[0] = NOW - timedelta(days=100)
    try:
        assert enforce(log, federation.policy, now=federation.clock[0]).records
    finally:
        log.close()
    code, text = federation.report(1, capsys)
    assert code == EXIT_OK, text
    assert "eu's log no longer holds this run" in text
    assert "(1826 days, the policy it declared); it is left out of the checks below" in text


def test_the_report_flags_a_run_a_region_holds_only_in_part(federation, capsys, monkeypatch):
    """A region's own code cuts inside a run (keeping its last records, so the run looks
    held): the checkpoint the aggregator saw it sign in that run is gone with its
    records, which no prune by the rules does."""
    federation.run(1, NOW - timedelta(days=3))
    signed = load_records(federation.eu_log)[3]  # the checkpoint eu signed in run 1
    assert signed["event"] == Event.CHECKPOINT and signed["run_id"] == 1
    monkeypatch.setattr(audit_log, "prune_cut", lambda records, before, limit=None: 3)
    federation.prune_by("eu", NOW - timedelta(days=1), 1, "EU", federation.policy.hash)
    code, text = federation.report(1, capsys)
    assert code == EXIT_DISAGREE, text
    assert (
        "eu's log holds run 1 only in part: the aggregator's log (witness seq 2) saw eu sign "
        "3 records in that run, and its records before seq 3 are gone"
    ) in text


def test_a_log_moved_aside_after_a_key_rotation_is_no_disagreement(federation, capsys):
    """Run 1 was signed with the region's old key, whose log was moved aside; the new
    log does not hold it, and is not asked to."""
    federation.run(1, NOW - timedelta(days=3))
    federation.eu_log.rename(federation.eu_log.with_name("audit.old.jsonl"))
    for old in federation.keys.glob("eu.*.json"):
        old.unlink()
    federation.eu = Keypair.generate("eu", "EU")
    write_keys(federation.eu, federation.keys)
    federation.run(2, NOW - timedelta(days=1))
    code, text = federation.report(2, capsys)
    assert code == EXIT_OK, text
    assert "no longer holds run 1" not in text


def test_hostile_records_are_problems_for_the_retention_check_not_exceptions():
    """Every field the check reads may be anything: the report must still come out."""
    junk: list[object] = [None, [], {}, "x", -1, True, [1], {"a": 1}, 1e300]
    for value in junk:
        details = {
            "policy_hash": value,
            "jurisdiction": value,
            "retention_days": value,
            "last_time": value,
            "declared": [value, {"policy_hash": "h", "retention_days": value}],
            "policy_hashes": {"EU": value} if value is not None else value,
            "party": value,
            "count": value,
            "region": value,
            "region_key_ids": value,
            "key_id": value,
        }
        records = [
            {"seq": value, "time": value, "run_id": value, "event": event, "details": details}
            for event in (*Event, "?")
        ]
        logs = {AGGREGATOR: records, "eu": records, "cn": [{"details": value}]}
        assert isinstance(check_retention(logs, NOW), list)
        assert isinstance(audit_log.declarations(records), list)


# -- a prune killed mid-way -----------------------------------------------------------------

#: A child that prunes and stops (as if killed) once its side file is written and
#: fsync'ed, before the rename: the parent kills it there with SIGKILL.
PRUNE_AND_STALL = """
import os, sys, time
from datetime import UTC, datetime
from pathlib import Path
from fedciuic.audit.log import AuditLog
from fedciuic.crypto import load_keypair

def stall(src, dst):
    print("side file written", flush=True)
    time.sleep(600)

os.replace = stall
log = AuditLog(Path(sys.argv[1]), "eu", load_keypair(Path(sys.argv[2])))
log.prune(datetime.now(UTC), retention_days=1)
"""


def test_a_prune_killed_before_its_rename_leaves_no_side_file_after_the_next_open(
    federation, clock
):
    clock[0] = NOW - timedelta(days=2)
    log = AuditLog(federation.eu_log, "eu", federation.eu)
    for i in range(3000):
        log.append(Event.EVALUATED, run_id=1, server_round=i, loss=1.0)
    log.checkpoint(run_id=1)
    log.close()
    folder, key = federation.eu_log.parent, federation.keys / "eu.key.json"
    others = [folder / f"{REGION_LOG}.torn-1", folder / f"{REGION_LOG}{PRUNING_SUFFIX}notes"]
    for other in others:  # not a prune's side file: left alone
        other.write_bytes(b"x")
    child = subprocess.Popen(
        [sys.executable, "-c", PRUNE_AND_STALL, *map(str, (federation.eu_log, key))],
        stdout=subprocess.PIPE,
        cwd=ROOT,
    )
    try:
        assert child.stdout is not None
        ready, _, _ = select.select([child.stdout], [], [], 120)
        assert ready and child.stdout.readline() == b"side file written\n"
        (side,) = folder.glob(f"{REGION_LOG}{PRUNING_SUFFIX}[0-9]*")
        assert side.stat().st_size > 0
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    assert child.returncode == -signal.SIGKILL
    # The log is whole (its audit_pruned record and checkpoint written, not yet cut).
    assert load_records(federation.eu_log)[0]["seq"] == 0
    AuditLog(federation.eu_log, "eu", federation.eu).close()  # the next open
    assert not list(folder.glob(f"{REGION_LOG}{PRUNING_SUFFIX}[0-9]*"))
    assert all(other.exists() for other in others)
    assert verify(federation.eu_log, federation.eu.bundle).ok
    # Pruning again finishes it.
    clock[0] = NOW
    log = AuditLog(federation.eu_log, "eu", federation.eu)
    try:
        assert log.prune(NOW - timedelta(days=1), retention_days=1).records
    finally:
        log.close()
    assert verify(federation.eu_log, federation.eu.bundle).ok
    assert not list(folder.glob(f"{REGION_LOG}{PRUNING_SUFFIX}[0-9]*"))
