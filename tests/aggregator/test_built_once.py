"""The round's judge and journal are built once, not on every use; ``use`` replaces one
of what they are built from (a stage, the run config) and builds them again, so they
never judge or write with a stage the round no longer has."""

from __future__ import annotations

import pytest

from fedciuic.audit.log import AuditLog
from fedciuic.policy.binding import NotEnforced
from tests.aggregator.test_aggregator import make_round


def test_judge_and_journal_are_built_once(run_config, tmp_path):
    a = make_round(run_config, tmp_path)
    judge, journal = a.judge, a.journal
    assert a.judge is judge and a.journal is journal
    a.version += 1  # not what they are built from
    a.regions_by_node[3] = "eu"  # read by reference: seen without a rebuild
    assert a.judge is judge and a.journal is journal
    assert judge.labels[3] == "eu"


def test_use_builds_them_again_from_the_new_stage(run_config, tmp_path):
    a = make_round(run_config, tmp_path)
    judge, journal = a.judge, a.journal
    a.use(policies=NotEnforced())
    assert a.judge is not judge and a.judge.policies is a.policies
    a.use(audit=AuditLog(tmp_path / "aggregator.audit.jsonl", "aggregator", None))
    assert a.journal is not journal and a.journal.audit is a.audit


def test_use_refuses_what_they_are_not_built_from(run_config, tmp_path):
    a = make_round(run_config, tmp_path)
    with pytest.raises(TypeError, match="'version' is not one of"):
        a.use(version=3)
