"""The compliance report says which code made each update, and what a region's agent
refused for the run."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedciuic.audit.events import Event
from fedciuic.audit.log import AuditLog, verify
from fedciuic.audit.report import Section, build_report, open_logs
from fedciuic.crypto.keys import Keypair

RUN = 41
CODE, OTHER = "a" * 64, "b" * 64


@pytest.fixture(scope="module")
def keys() -> dict[str, Keypair]:
    return {party: Keypair.generate(party, "EU") for party in ("aggregator", "eu", "cn")}


def _section(sections: list[Section], title: str) -> Section:
    (section,) = [s for s in sections if s.title == title]
    return section


def _logs(tmp_path: Path, keys: dict[str, Keypair]) -> list[Path]:
    agg = AuditLog(tmp_path / "aggregator.audit.jsonl", "aggregator", keys["aggregator"])
    agg.append(Event.RUN_START, run_id=RUN, regions=["eu", "cn"], config_hash="c" * 64)
    for region, code in (("eu", CODE), ("cn", OTHER)):
        agg.append(
            Event.UPDATE_RECEIVED,
            run_id=RUN,
            server_round=1,
            region=region,
            digest=f"{len(region):064x}",
            bytes=2300,
            suite="sealed",
            agent_version="0.1.0",
            agent_code=code,
        )
    agg.checkpoint(run_id=RUN)
    agg.close()
    paths = [tmp_path / "aggregator.audit.jsonl"]
    for region in ("eu", "cn"):
        log = AuditLog(tmp_path / f"{region}.jsonl", region, keys[region])
        log.append(Event.AGENT_STARTED, run_id=0, version="0.1.0", code=CODE, relay_user="r")
        log.append(Event.RUN_JOINED, run_id=RUN, config_hash="c" * 64, code=CODE)
        log.append(
            Event.REQUEST_REFUSED,
            run_id=0,
            kind="sign",
            flower_run=RUN,
            claimed_round=1,
            reason="a request of kind 'sign': this agent acts only on what the aggregator signs",
            peer_uid=999,
            peer_pid=4242,
        )
        log.append(
            Event.REQUEST_REFUSED, run_id=0, kind="train", flower_run=RUN + 1, reason="other run"
        )
        log.checkpoint(run_id=RUN)
        log.close()
        paths.append(tmp_path / f"{region}.jsonl")
    return paths


def test_the_code_section_names_each_updates_agent_and_whether_the_region_recorded_it(
    tmp_path, keys
):
    paths = _logs(tmp_path, keys)
    parties = ("aggregator", "eu", "cn")
    verdicts = {p: verify(p, keys[party].bundle) for p, party in zip(paths, parties, strict=True)}
    report = build_report(open_logs(paths, verdicts), RUN)
    code = _section(report.sections, "Code")
    rows = {row[1]: row for row in code.rows}
    assert rows["eu"] == ("1", "eu", "0.1.0", CODE[:16], "yes")
    # cn's reply named code other than what cn's own log recorded for the run.
    assert rows["cn"] == ("1", "cn", "0.1.0", OTHER[:16], "NO")
    refusals = _section(report.sections, "Refusals").rows
    refused = [row for row in refusals if "refused a sign request" in row[2]]
    assert {row[1] for row in refused} == {"eu", "cn"}
    assert all("pid 4242" in row[2] and "acts only on" in row[3] for row in refused)
    assert not any("other run" in row[3] for row in refusals)  # another run's: not this one's


def test_a_release_that_never_reached_the_aggregator_is_spent_not_delivered_not_agreement(
    tmp_path, keys
):
    """The round timed out: eu released (epsilon spent) and the aggregator logged eu's
    reply as failed (then Flower's late error for it too). The report must say so, with
    the reason the round acted on, not "agree" and move on; a release the aggregator has
    no record of at all stays a disagreement."""
    agg = AuditLog(tmp_path / "aggregator.audit.jsonl", "aggregator", keys["aggregator"])
    agg.append(Event.RUN_START, run_id=RUN, regions=["eu", "cn"], config_hash="c" * 64)
    # The round's timeout, then Flower's own error for the same reply (the round had moved
    # on): the report keeps the reason the round acted on, as metrics.json does.
    for reason in ("no reply within round-timeout (600s)", "Error: Node Unavailable"):
        agg.append(Event.REPLY_FAILED, run_id=RUN, server_round=1, region="eu", reason=reason)
    agg.checkpoint(run_id=RUN)
    agg.close()
    paths = [tmp_path / "aggregator.audit.jsonl"]
    for region, digest in (("eu", "e" * 64), ("cn", "f" * 64)):
        log = AuditLog(tmp_path / f"{region}.jsonl", region, keys[region])
        log.append(Event.RUN_JOINED, run_id=RUN, config_hash="c" * 64)
        log.append(Event.TRAINED, run_id=RUN, server_round=1, epsilon=2.6, epsilon_budget=8.0)
        log.append(
            Event.UPDATE_SEALED, run_id=RUN, server_round=1, region=region, digest=digest, bytes=9
        )
        if region == "eu":
            log.append(Event.UPDATE_UNDELIVERED, run_id=RUN, server_round=1, digest=digest)
        log.checkpoint(run_id=RUN)
        log.close()
        paths.append(tmp_path / f"{region}.jsonl")
    parties = ("aggregator", "eu", "cn")
    verdicts = {p: verify(p, keys[party].bundle) for p, party in zip(paths, parties, strict=True)}
    report = build_report(open_logs(paths, verdicts), RUN)
    (row,) = _section(report.sections, "Spent, not delivered").rows
    assert row == ("1", "eu", "2.600", "e" * 16, "no reply within round-timeout (600s)", "yes")
    agreement = _section(report.sections, "Agreement between the logs").paragraphs
    assert any("1 update(s) left a region" in p for p in agreement), agreement
    # cn's release has no record at the aggregator at all: that is a disagreement.
    assert len(report.disagreements) == 1 and "cn logged sending" in report.disagreements[0]
