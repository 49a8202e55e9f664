"""The aggregator's schedules over a fake transport with a clock: buffered aggregation (FedBuff),
one task in flight per region, policy minimums per aggregate, and regions marked
unavailable after missed rounds and back when they answer."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from fedciuic.aggregator.aggregation import Checked, staleness_weight
from fedciuic.aggregator.round import Collecting
from fedciuic.aggregator.schedule import Availability, Tasks
from fedciuic.audit.events import Event
from fedciuic.audit.log import AuditLog
from fedciuic.crypto.parties import TaskKind
from fedciuic.policy.binding import NotEnforced
from fedciuic.policy.rules import Decision
from tests.aggregator.fakes import THREE, Regions, looped
from tests.aggregator.test_aggregator import GLOBAL


class OneInFlight(Regions):
    """Fails the test if a node is sent a training task while one is still in flight."""

    def __init__(self, targets) -> None:
        super().__init__(targets)
        self.training: dict[int, str] = {}

    def push(self, instructions):
        taken = super().push(instructions)
        for mid, node in taken.items():
            if instructions[node].kind == TaskKind.TRAIN:
                assert node not in self.training, f"node {node} got a second task in flight"
                self.training[node] = mid
        return taken

    def pull(self, in_flight):
        replies = super().pull(in_flight)
        answered = {mid for mid, _ in replies}
        self.training = {n: m for n, m in self.training.items() if m not in answered}
        return replies


def buffered(run_config, tmp_path, grid, rounds=4, **settings):
    return looped(
        run_config,
        tmp_path,
        rounds,
        grid,
        aggregation_mode="buffered",
        buffer_size=2,
        max_staleness=3,
        **settings,
    )


def test_buffered_publishes_every_k_updates_and_the_slow_region_arrives_stale(run_config, tmp_path):
    grid = OneInFlight(THREE)
    grid.delay = {11: 1, 12: 1, 13: 3}  # us is slow
    s = buffered(run_config, tmp_path, grid)
    s.run(GLOBAL, 4)
    rounds = s.aggregator.recorder.data.rounds
    for n in (1, 2, 3, 4):
        aggregate = rounds[n].aggregate
        assert aggregate is not None and aggregate.published and aggregate.version == n
        assert len(aggregate.regions) == 2  # K = 2, one update per region and aggregate
    assert s.aggregator.version == 4
    # the fast regions fill the first aggregates; us's update, computed against version
    # 0, lands later, with its version and staleness recorded
    assert sorted(rounds[1].aggregate.regions) == ["cn", "eu"]
    stale = [(n, e) for n in (2, 3, 4) for r, e in rounds[n].train.items() if r == "us"]
    assert stale and stale[0][1].status == "trained"
    n, entry = stale[0]
    assert entry.global_version == 0 and entry.staleness == n - 1 >= 1
    # every region evaluates the final adapter
    assert {"eu", "cn", "us", "overall"} <= set(rounds[4].eval)


def test_a_stale_update_is_weighted_one_over_root_one_plus_staleness(run_config, tmp_path):
    grid = Regions(THREE)
    grid.delay = {11: 1, 12: 1, 13: 3}
    s: Any = buffered(run_config, tmp_path, grid, rounds=3)
    added: list[tuple[int, float]] = []
    make = s.aggregator.collecting

    def spying() -> Collecting:
        into: Collecting = make()
        inner = into.accumulator.add

        def add(checked: Checked) -> None:
            added.append((checked.staleness, staleness_weight(checked.staleness)))
            inner(checked)

        into.accumulator.add = add  # type: ignore[method-assign]
        return into

    s.aggregator.collecting = spying
    before, after = {}, {}
    publish = s.aggregator.publish

    def publishing(server_round: int, into: Collecting) -> Any:
        before[server_round] = float(s.aggregator.global_adapter["w"][0])
        result = publish(server_round, into)
        after[server_round] = float(s.aggregator.global_adapter["w"][0])
        return result

    s.aggregator.publish = publishing
    s.run(GLOBAL, 3)
    rounds = s.aggregator.recorder.data.rounds
    n, us = next((n, rounds[n].train["us"]) for n in (2, 3) if "us" in rounds[n].train)
    assert us.status == "trained" and us.staleness == n - 1 >= 1
    assert (us.staleness, 1 / np.sqrt(1 + us.staleness)) in added
    # the aggregate: sum of n_i w(s_i) delta_i over sum n_i (equal examples and steps);
    # us moves half-way from version 0 (w = 0) to its target 5: a delta of 2.5
    other = next(r for r in rounds[n].train if r != "us")
    target = {"eu": 1.0, "cn": 3.0}[other]
    base = before[n]
    fresh = 0.5 * (target - base)  # computed against the current version
    expected = base + (fresh + 2.5 / np.sqrt(1 + us.staleness)) / 2
    assert after[n] == pytest.approx(expected, rel=1e-6)


def test_buffered_aggregates_wait_for_the_policies_minimum_regions(run_config, tmp_path):
    grid = OneInFlight(THREE)
    grid.delay = {11: 1, 12: 1, 13: 5}
    s = buffered(run_config, tmp_path, grid, rounds=3)

    class AtLeastThree(NotEnforced):
        def check_aggregate(self, participants, examples):
            if len(participants) >= 3:
                return Decision("aggregator", "aggregate", "accept", (), "")
            return Decision("aggregator", "aggregate", "reject", ("fewer than 3 regions",), "")

    s.aggregator.use(policies=AtLeastThree())
    s.run(GLOBAL, 3)
    for n in (1, 2, 3):
        aggregate = s.aggregator.recorder.data.rounds[n].aggregate
        assert aggregate is not None and aggregate.published
        assert sorted(aggregate.regions) == ["cn", "eu", "us"]  # K = 2 was not enough


def test_buffered_run_ends_when_regions_have_no_tasks_left(run_config, tmp_path):
    grid = OneInFlight(THREE)
    s = buffered(run_config, tmp_path, grid, rounds=2)
    s.run(GLOBAL, 2)
    trains = grid.trains()
    per_node = {n: sum(1 for node, _ in trains if node == n) for n in THREE}
    assert max(per_node.values()) <= 2  # each region's noise is calibrated for 2 rounds


def test_a_silent_region_is_marked_unavailable_and_rejoins_when_it_answers(run_config, tmp_path):
    grid = Regions()
    audit = AuditLog(tmp_path / "audit.jsonl", "aggregator", None)
    s: Any = looped(run_config, tmp_path, 5, grid, max_missed_rounds=2)
    s.aggregator.use(audit=audit)
    held: list[tuple[str, tuple[float, int, Any]]] = []
    original = grid.push

    def push(instructions):
        taken = original(instructions)
        if 1 <= round_now[0] <= 2:  # cn goes quiet in rounds 1-2: its replies are held
            for mid in list(grid.pending):
                if grid.pending[mid][1] == 12:
                    held.append((mid, grid.pending.pop(mid)))
        return taken

    grid.push = push  # type: ignore[method-assign]
    round_now = [0]
    ticks: dict[int, float] = {}
    real_end = s.aggregator.end

    def end(server_round):
        ticks[server_round] = grid.now
        real_end(server_round)
        round_now[0] = server_round + 1
        if server_round == 2:  # cn is back: its round-1 reply arrives in round 3
            grid.pending.update({mid: (grid.now, node, a) for mid, (_, node, a) in held})

    s.aggregator.end = end
    s.run(GLOBAL, 5)
    rounds = s.aggregator.recorder.data.rounds
    assert rounds[1].train["cn"].status == "failed"  # waited round-timeout for it
    assert rounds[2].unavailable == ["cn"]
    assert ticks[3] - ticks[2] < 50  # round 3 did not wait for the unavailable cn
    # its late round-1 update is judged in round 3 and refused (a sync round takes only
    # updates against the current version); answering at all brings it back
    late = rounds[3].train["cn"]
    assert late.status == "rejected" and "current global adapter" in (late.reason or "")
    assert late.global_version == 0 and late.staleness == 2
    assert rounds[3].rejoined == ["cn"]
    assert rounds[4].train["cn"].status == "trained"
    events = [json.loads(line) for line in audit.path.read_text().splitlines()]
    kinds = [(e["event"], e.get("details", e).get("region")) for e in events]
    assert (Event.REGION_UNAVAILABLE, "cn") in kinds and (Event.REGION_REJOINED, "cn") in kinds


def test_availability_counts_consecutive_misses_only():
    a = Availability(["eu", "cn"], 2)
    assert a.round_ended({"eu"}).unavailable == []
    assert a.round_ended({"eu", "cn"}).unavailable == []  # the count starts again
    a.round_ended({"eu"})
    assert a.round_ended({"eu"}).unavailable == ["cn"]
    assert a.round_ended({"eu"}).unavailable == []  # marked once
    assert a.round_ended({"cn", "eu"}).rejoined == ["cn"]
    never = Availability(["eu"], 0)
    for _ in range(5):
        assert never.round_ended(set()).unavailable == []


def test_tasks_keep_one_in_flight_and_stop_at_the_limit():
    t = Tasks(["eu"], 2)
    first = t.send("eu", 0)
    assert (first.task, first.version) == (1, 0) and not t.can_send("eu")
    t.done("eu")
    assert t.send("eu", 3).task == 2
    assert t.finished() == set()  # its last task is still in flight
    t.done("eu")
    assert not t.can_send("eu") and t.finished() == {"eu"}


def test_a_resumed_buffered_run_continues_versions_and_task_numbers(run_config, tmp_path):
    from fedciuic.aggregator.checkpoint import load_checkpoint
    from fedciuic.aggregator.run import restore

    grid = OneInFlight(THREE)
    grid.delay = {11: 1, 12: 1, 13: 3}
    cut = buffered(run_config, tmp_path / "cut", grid, rounds=4)
    cut.run(GLOBAL, 2)  # "killed" after aggregate 2
    saved = load_checkpoint(tmp_path / "cut")
    assert saved.round == 2 and saved.extra["version"] == 2
    flying = saved.extra["tasks"]["in_flight"]
    assert flying  # us (slow) was still training when the checkpoint was taken

    again = OneInFlight(THREE)  # a new SuperLink: new message ids, nodes not known yet
    resumed = buffered(run_config, tmp_path / "resumed", again, rounds=4)
    resumed.aggregator.recorder.data.rounds = saved.rounds
    restore(resumed.aggregator, saved)
    resumed.run(saved.adapter, 4, first_round=3)
    a = resumed.aggregator
    assert a.version == 4
    # each node is asked once which region it serves, then sent instructions for it
    assert sorted(again.identified) == sorted(THREE)
    assert all(i.recipient == THREE[node][0] for node, i in again.sent)
    trains = [(node, instruction.server_round) for node, instruction in again.trains()]
    for region, (task, _version) in flying.items():
        node = next(n for n, (r, _) in THREE.items() if r == region)
        assert (node, task) == next(t for t in trains if t[0] == node)  # asked again
    sent_before = saved.extra["tasks"]["sent"]
    for node, (region, _) in THREE.items():
        numbers = [t for n, t in trains if n == node]
        assert numbers == sorted(numbers) and max(numbers, default=0) <= 4  # the noise's rounds
        if numbers:  # numbering goes on from the checkpoint's, never from 1 again
            assert numbers[0] == sent_before[region] + (0 if region in flying else 1)


def test_an_update_arriving_after_the_last_aggregate_is_logged_and_refused(run_config, tmp_path):
    grid = OneInFlight(THREE)
    grid.delay = {11: 1, 12: 1, 13: 6}  # us answers only after the last aggregate
    audit = AuditLog(tmp_path / "audit.jsonl", "aggregator", None)
    s = buffered(run_config, tmp_path, grid, rounds=2)
    s.aggregator.use(audit=audit)
    s.run(GLOBAL, 2)
    us = s.aggregator.recorder.data.rounds[2].train["us"]
    assert us.status == "rejected" and "after the run's last aggregate" in (us.reason or "")
    events = [json.loads(line) for line in audit.path.read_text().splitlines()]
    received = [e for e in events if e["event"] == "update_received"]
    assert "us" in {e["details"]["region"] for e in received}  # the logs agree it arrived
    assert [e["round"] for e in received if e["details"]["region"] == "us"] == [1]  # its task
