"""The aggregator's production loop over a fake transport with a clock: regions waited
for within a deadline, each round's replies (failed, malformed, silent, declined) judged
alone, evaluations, and a resumed run that ends where an uninterrupted one does. The
judging itself is tested with plain replies in tests/aggregator/test_aggregator.py; Flower's
transport in tests/flower/test_transport.py."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest

from fedciuic.aggregator.checkpoint import CheckpointError, load_checkpoint
from fedciuic.aggregator.loop import BufferedLoop, SyncLoop
from fedciuic.aggregator.run import restore
from fedciuic.crypto.parties import TaskKind
from fedciuic.errors import FederationError
from fedciuic.wire import Instruction, MalformedReply, Reply, Unread, failed, parse_reply
from tests.aggregator.fakes import THREE, Answer, Regions, looped
from tests.aggregator.test_aggregator import GLOBAL, Raw, declined, evaluated
from tests.conftest import written


def test_the_schedule_is_chosen_once_from_the_aggregation_mode(run_config, tmp_path):
    assert type(looped(run_config, tmp_path / "s", 1, Regions())) is SyncLoop
    buffered = looped(run_config, tmp_path / "b", 1, Regions(), aggregation_mode="buffered")
    assert type(buffered) is BufferedLoop


def test_waiting_for_missing_regions_ends_at_the_deadline(run_config, tmp_path):
    regions = Regions(THREE)
    regions.connected = [11]
    loop = looped(run_config, tmp_path, 1, regions, min_regions=2, node_wait_timeout=5.0)
    loop.aggregator.use(run=loop.aggregator.run.updated(**{"regions": ("eu", "cn", "us")}))
    with pytest.raises(FederationError, match=r"only 1 of 3 regions connected within 5s"):
        loop.wait_for_regions()
    assert regions.now == pytest.approx(5.0, abs=1.0)


def test_enough_regions_after_the_deadline_go_ahead(run_config, tmp_path):
    regions = Regions(THREE)
    regions.connected = [13, 11]
    loop = looped(run_config, tmp_path, 1, regions, min_regions=2)
    assert loop.wait_for_regions() == [11, 13]


def test_only_the_first_round_waits_for_missing_regions(run_config, tmp_path):
    regions = Regions(THREE)
    regions.connected = [11, 12]
    loop = looped(run_config, tmp_path, 1, regions, min_regions=2)
    loop.wait_for_regions()
    waited = regions.now
    assert waited >= loop.aggregator.run.schedule.node_wait_timeout
    assert loop.wait_for_regions() == [11, 12]
    assert regions.now == waited  # no second wait


def test_a_round_aggregates_by_examples_and_every_region_evaluates_the_result(run_config, tmp_path):
    regions = Regions()
    loop = looped(run_config, tmp_path, 1, regions)
    final = loop.run(GLOBAL, 1)
    # eu moves 0 -> 0.5, cn 0 -> 1.5, with equal examples: the mean, 1.0
    np.testing.assert_allclose(final["w"], 1.0)
    rounds = loop.aggregator.recorder.data.rounds
    assert rounds[1].aggregate is not None and rounds[1].aggregate.published
    assert sorted(rounds[1].aggregate.regions) == ["cn", "eu"]
    for n in (0, 1):  # the initial adapter and round 1's
        assert rounds[n].eval["overall"].num_examples == 20
    kinds = [(node, i.kind, i.server_round) for node, i in regions.sent]
    assert kinds == [
        (11, "evaluate", 0),
        (12, "evaluate", 0),
        (11, "train", 1),
        (12, "train", 1),
        (11, "evaluate", 1),
        (12, "evaluate", 1),
    ]


def test_failed_malformed_and_silent_nodes_are_judged_alone(run_config, tmp_path):
    regions = Regions({11: ("eu", 1.0), 14: ("cn", 3.0), 15: ("us", 5.0), 16: ("sg", 7.0)})
    answers = regions.answer

    def answer(node, instruction):
        if instruction.kind == "train" and node == 14:
            return failed(14, "", "process died")
        if instruction.kind == "train" and node == 15:
            return Unread(15, partial(_malformed))
        if instruction.kind == "train" and node == 16:
            return None  # its process hangs
        return answers(node, instruction)

    regions.answer = answer  # type: ignore[method-assign]
    loop = looped(run_config, tmp_path, 1, regions, round_timeout=5.0, min_regions=1)
    final = loop.run(GLOBAL, 1, first_round=1)
    np.testing.assert_allclose(final["w"], 0.5)  # eu's update alone
    train = loop.aggregator.recorder.data.rounds[1].train
    # each filed under the region its node's evaluation named
    assert written(train["cn"]) == {"status": "failed", "reason": "process died"}
    assert train["us"].status == "rejected"
    assert "MalformedReply" in (train["us"].reason or "")
    assert train["sg"].status == "failed"
    assert "no reply within round-timeout" in (train["sg"].reason or "")


def _malformed():
    raise MalformedReply("malformed reply: records ['junk']")


def test_a_round_where_every_region_declines_publishes_nothing(run_config, tmp_path):
    regions = Regions()
    regions.answer = lambda node, i: (  # type: ignore[method-assign, assignment]
        declined(regions.targets[node][0], "no")
        if i.kind == "train"
        else evaluated(
            regions.targets[node][0], 2.0 if node == 11 else 4.0, 10 if node == 11 else 30
        )
    )
    loop = looped(run_config, tmp_path, 1, regions)
    final = loop.run(GLOBAL, 1)
    np.testing.assert_array_equal(final["w"], GLOBAL["w"])
    data = loop.aggregator.recorder.data.rounds[1]
    assert written(data.train["eu"]) == {"status": "declined", "reason": "no"}
    assert data.aggregate is not None and data.aggregate.published is False
    evals = loop.aggregator.recorder.data.rounds[0].eval
    assert evals["eu"].loss == 2.0 and evals["overall"].loss == pytest.approx(3.5)
    assert evals["overall"].num_examples == 40


@pytest.mark.parametrize("optimizer", ["none", "fedadam"])
def test_a_resumed_run_ends_where_an_uninterrupted_one_does(run_config, tmp_path, optimizer):
    whole = looped(run_config, tmp_path / "whole", 3, Regions(), optimizer)
    whole_final = whole.run(GLOBAL, 3)["w"]
    assert not np.allclose(whole_final, GLOBAL["w"])  # every round published an aggregate
    # "Killed" after round 1: a new loop resumes from round 1's checkpoint.
    looped(run_config, tmp_path / "cut", 3, Regions(), optimizer).run(GLOBAL, 1)
    saved = load_checkpoint(tmp_path / "cut")
    assert saved.round == 1 and saved.federation_run == 7
    assert saved.optimizer is not None and saved.optimizer.steps == 1

    def resume(folder, *, fresh: bool = False) -> np.ndarray:
        resumed = looped(run_config, folder, 3, Regions(), optimizer)
        resumed.aggregator.use(federation_run=saved.federation_run)
        resumed.aggregator.recorder.data.rounds = saved.rounds
        if not fresh:  # what open_run does with the checkpoint
            restore(resumed.aggregator, saved)
        return resumed.run(saved.adapter, 3, first_round=2)["w"]

    assert resume(tmp_path / "resumed").tobytes() == whole_final.tobytes()
    assert load_checkpoint(tmp_path / "resumed").round == 3
    ended = load_checkpoint(tmp_path / "resumed").optimizer
    assert ended is not None and ended.steps == 3 and ended.name == optimizer
    assert ended.meta() == load_checkpoint(tmp_path / "whole").optimizer.meta()  # type: ignore[union-attr]
    # Without its state (moments from zero), a fedadam run would end elsewhere.
    forgot = resume(tmp_path / "forgot", fresh=True)
    assert np.array_equal(forgot, whole_final) == (optimizer == "none")


def test_a_resume_under_another_server_optimizer_is_refused(run_config, tmp_path):
    looped(run_config, tmp_path / "cut", 3, Regions(), "fedadam").run(GLOBAL, 1)
    saved = load_checkpoint(tmp_path / "cut")
    other = looped(run_config, tmp_path / "other", 3, Regions(), "fedyogi")
    with pytest.raises(CheckpointError, match='run config:server-optimizer: "fedyogi"'):
        restore(other.aggregator, saved)
    plain = looped(run_config, tmp_path / "plain", 3, Regions(), "none")
    with pytest.raises(CheckpointError, match='server-optimizer = "fedadam"'):
        restore(plain.aggregator, saved)


def test_without_policies_every_decision_accepts_and_none_is_recorded_or_audited(
    run_config, tmp_path
):
    from fedciuic.audit.events import Event
    from fedciuic.audit.log import AuditLog, load_records

    loop = looped(run_config, tmp_path, 1, Regions())
    gate = loop.aggregator.policies
    decision = gate.check_aggregate({"eu": "EU"}, {"eu": 1})
    assert decision.accepted and not decision.enforced and decision.reasons == ()
    loop.aggregator.use(audit=AuditLog(tmp_path / "audit.jsonl", "aggregator", None))
    loop.run(GLOBAL, 1)
    assert loop.aggregator.recorder.data.rounds[1].decisions == []
    events = {r["event"] for r in load_records(tmp_path / "audit.jsonl")}
    assert Event.UPDATE_ACCEPTED in events and Event.POLICY_DECISION not in events


def test_without_an_audit_log_the_round_writes_and_witnesses_nothing(run_config, tmp_path):
    loop = looped(run_config, tmp_path, 1, Regions())
    loop.run(GLOBAL, 1)
    assert loop.aggregator.sign_run_end(["eu"]) == {}  # no head to hand the regions
    assert load_checkpoint(tmp_path).audit_seq == 0


def test_each_update_is_opened_as_it_arrives_while_a_slower_region_trains(run_config, tmp_path):
    regions = Regions(THREE)
    regions.delay = {13: 5}  # us answers 5 pulls after its instruction, the others at once
    answered = regions.answer
    pushed: dict[str, float] = {}
    opened: dict[str, float] = {}

    def answer(node: int, instruction: Instruction) -> Answer | None:
        given = answered(node, instruction)
        if instruction.kind != TaskKind.TRAIN or not isinstance(given, Raw):
            return given
        region = regions.targets[node][0]
        pushed[region] = regions.now

        def read(raw: Raw = given) -> Reply:
            opened[region] = regions.now
            return parse_reply(node, raw.info, raw.metrics, raw.arrays)

        return Unread(node, read)

    regions.answer = answer  # type: ignore[method-assign]
    final = looped(run_config, tmp_path, 1, regions).run(GLOBAL, 1)
    np.testing.assert_allclose(final["w"], 1.5)  # (0.5 + 1.5 + 2.5) / 3: all three counted
    ready = pushed["us"] + regions.delay[13]
    assert opened["eu"] < ready and opened["cn"] < ready <= opened["us"]
