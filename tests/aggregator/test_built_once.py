"""The round's judge and journal are built once, not on every use; swapping one of what
they are built from (a stage, the run config) builds them again, so they never judge or
write with a stage the round no longer has."""

from __future__ import annotations

from fedciuic.audit.log import AuditLog
from fedciuic.policy.binding import NotEnforced
from tests.rounds.test_aggregator import make_round


def test_judge_and_journal_are_built_once(run_config, tmp_path):
    a = make_round(run_config, tmp_path)
    judge, journal = a.judge, a.journal
    assert a.judge is judge and a.journal is journal
    a.version += 1  # not what they are built from
    a.regions_by_node[3] = "eu"  # read by reference: seen without a rebuild
    assert a.judge is judge and a.journal is journal
    assert judge.labels[3] == "eu"


def test_swapping_a_stage_builds_them_again(run_config, tmp_path):
    a = make_round(run_config, tmp_path)
    judge, journal = a.judge, a.journal
    a.policies = NotEnforced()
    assert a.judge is not judge and a.judge.policies is a.policies
    a.audit = AuditLog(tmp_path / "aggregator.audit.jsonl", "aggregator", None)
    assert a.journal is not journal and a.journal.audit is a.audit
