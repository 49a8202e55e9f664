"""RegionalFedAvg, Flower's side only: Messages unpacked into the aggregator's round and
its results packed, deadlines for regions, signed instructions, the round loop. The
round's own logic is tested with plain replies in tests/rounds/test_aggregator.py."""

# ruff: noqa: F811 - the fixtures imported from test_aggregator are parameters here

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from flwr.app import ConfigRecord, Error, Message, MessageType, MetricRecord, RecordDict

from fedciuic import wire
from fedciuic.aggregator.checkpoint import CheckpointError, load_checkpoint
from fedciuic.aggregator.round import AggregatorRound
from fedciuic.aggregator.run import restore
from fedciuic.compression import get_codec
from fedciuic.crypto.sealing import (
    NONCE_BYTES,
    NotSignedError,
    RegionKeys,
    TaskKind,
    Terms,
    config_digest,
)
from fedciuic.errors import FederationError
from fedciuic.flower import protocol
from fedciuic.wire import Instruction, Reply
from server.strategy import RegionalFedAvg
from tests.conftest import written
from tests.rounds.test_aggregator import (  # noqa: F401 - fixtures
    GLOBAL,
    Raw,
    encoded,
    make_round,
    sealed_reply_from,
    sealed_round,
    trained,
)

pytestmark = pytest.mark.usefixtures("task_identity")


@pytest.fixture
def strategy(run_config, tmp_path) -> RegionalFedAvg:
    return RegionalFedAvg(make_round(run_config, tmp_path / "run"))


def reply(node_id: int, content: RecordDict | Error, kind: str = MessageType.TRAIN) -> Message:
    instruction = Message(RecordDict(), dst_node_id=node_id, message_type=kind)
    return Message(content, reply_to=instruction)


def packed(raw: Raw) -> RecordDict:
    """A plain reply's fields in the records a region's Message carries."""
    assert raw.arrays is not None
    return protocol.content(wire.clear(raw.arrays, raw.metrics, raw.info))


def evaluation(region: str, loss: float, examples: int) -> RecordDict:
    """An evaluation reply as a region's Message carries it."""
    return protocol.content(wire.evaluated(region, examples, loss, float(np.exp(loss))))


def decline(region: str, reason: str) -> RecordDict:
    return protocol.content(wire.declined(region, reason))


def test_replies_are_unpacked_into_the_round_and_the_aggregate_packed(strategy):
    arrays, metrics = strategy.aggregate_train(
        1, [reply(11, packed(trained("eu", 1.0, 10))), reply(12, packed(trained("cn", 4.0, 30)))]
    )
    assert arrays is not None and metrics is not None
    np.testing.assert_allclose(protocol.unpack_arrays(arrays)["w"], 0.25 * 1 + 0.75 * 4)
    assert metrics["regions"] == 2 and metrics["num-examples"] == 40
    assert metrics["train-loss"] == pytest.approx(1.0)


def test_flower_errors_bad_records_and_silent_nodes_are_rejected_alone(strategy):
    strategy._asked = [11, 14, 15, 16]  # what configure_train sent to
    arrays, _ = strategy.aggregate_train(
        1,
        [
            reply(11, packed(trained("eu", 1.0, 10))),
            reply(14, Error(code=0, reason="process died")),
            reply(15, RecordDict({"junk": ConfigRecord({"x": 1})})),
        ],
    )
    assert arrays is not None
    np.testing.assert_allclose(protocol.unpack_arrays(arrays)["w"], 1.0)
    train = strategy.aggregator.recorder.data.rounds[1].train
    assert written(train["node-14"]) == {"status": "failed", "reason": "process died"}
    assert train["node-15"].status == "rejected"
    assert "MalformedReply" in train["node-15"].reason
    assert train["node-16"].status == "failed"
    assert "no reply within round-timeout" in train["node-16"].reason


def test_round_where_every_region_declines_packs_nothing(strategy):
    arrays, metrics = strategy.aggregate_train(1, [reply(11, decline("eu", "no"))])
    assert arrays is None and metrics is None
    np.testing.assert_array_equal(strategy.aggregator.global_adapter["w"], GLOBAL["w"])
    data = strategy.aggregator.recorder.data.rounds[1]
    assert written(data.train["eu"]) == {"status": "declined", "reason": "no"}
    assert data.aggregate is not None and data.aggregate.published is False


def test_evaluation_replies_are_unpacked_and_the_overall_loss_packed(strategy):
    replies = [
        reply(11, evaluation("eu", 2.0, 10), MessageType.EVALUATE),
        reply(12, evaluation("cn", 4.0, 30), MessageType.EVALUATE),
    ]
    metrics = strategy.aggregate_evaluate(0, replies)
    assert isinstance(metrics, MetricRecord) and metrics["eval-loss"] == pytest.approx(3.5)
    assert metrics["num-examples"] == 40
    evals = strategy.aggregator.recorder.data.rounds[0].eval
    assert evals["eu"].loss == 2.0 and evals["overall"].num_examples == 40
    none = strategy.aggregate_evaluate(1, [reply(11, decline("eu", "no"))])
    assert none is None


def test_read_reply_gives_the_plain_reply(sealed_round):
    cn = sealed_round[1]["cn"]
    content = protocol.content(
        wire.declined("cn", "budget spent").sign(cn, run_id=7, server_round=1)
    )
    got = protocol.read_reply(reply(12, content))
    assert isinstance(got, Reply)
    assert (got.node_id, got.region, got.status) == (12, "cn", "declined")
    assert got.reason == "budget spent" and got.info["key-id"] == cn.bundle.key_id.hex()
    assert got.signature and got.signed["metrics"] == {"num-examples": 0}


class FakeGrid:
    def __init__(self, nodes: list[int]) -> None:
        self.nodes = nodes

    def get_node_ids(self) -> list[int]:
        return self.nodes


def test_waiting_for_missing_regions_ends_at_the_deadline(strategy, monkeypatch):
    now = [0.0]
    monkeypatch.setattr("server.strategy.time.sleep", lambda s: now.__setitem__(0, now[0] + s))
    strategy.clock = lambda: now[0]
    a = strategy.aggregator
    a.run = a.run.model_copy(update={"min_regions": 2, "node_wait_timeout": 5.0})
    with pytest.raises(FederationError, match=r"only 1 of 3 regions connected within 5s"):
        strategy.wait_for_regions(FakeGrid([1]))
    assert now[0] == pytest.approx(5.0, abs=1.0)


def test_enough_regions_after_the_deadline_go_ahead(strategy, monkeypatch):
    now = [0.0]
    monkeypatch.setattr("server.strategy.time.sleep", lambda s: now.__setitem__(0, now[0] + s))
    strategy.clock = lambda: now[0]
    assert strategy.wait_for_regions(FakeGrid([3, 1])) == [1, 3]


def test_instruction_round_trip():
    sent = Instruction(
        adapter=GLOBAL,
        server_round=3,
        base_fingerprint="abc",
        kind=TaskKind.EVALUATE,
        run_config='{"local-steps":2}',
        nonce=bytes(range(NONCE_BYTES)),
        signature=b"sig",
        signer="ab" * 16,
        federation_run=5,
        witness=(4, "cd" * 32),
    )
    content = protocol.instruction(protocol.pack_arrays(GLOBAL), sent)
    message = Message(content, dst_node_id=2, message_type=MessageType.EVALUATE)
    task = protocol.read_instruction(message)
    assert task.server_round == 3 and task.base_fingerprint == "abc"
    np.testing.assert_array_equal(task.adapter["w"], GLOBAL["w"])
    assert task.kind == TaskKind.EVALUATE and task.run_settings() == {"local-steps": 2}
    assert (task.nonce, task.signature, task.signer) == (sent.nonce, sent.signature, sent.signer)
    assert (task.federation_run, task.witness) == (5, (4, "cd" * 32))
    assert task.terms == sent.terms


def test_only_the_first_round_waits_for_missing_regions(strategy, monkeypatch):
    now = [0.0]
    monkeypatch.setattr("server.strategy.time.sleep", lambda s: now.__setitem__(0, now[0] + s))
    strategy.clock = lambda: now[0]
    strategy.wait_for_regions(FakeGrid([1, 2]))
    waited = now[0]
    assert waited >= strategy.aggregator.run.node_wait_timeout
    assert strategy.wait_for_regions(FakeGrid([1, 2])) == [1, 2]
    assert now[0] == waited  # no second wait


# -- sealed updates --------------------------------------------------------------------


def test_sealed_replies_as_regions_pack_them_are_opened_and_aggregated(sealed_round):
    a, regions = sealed_round
    agg = a.sealing.keys.keypair.bundle

    def sealed(region: str, value: float) -> RecordDict:
        raw = sealed_reply_from(regions[region], agg, value)
        assert raw.arrays is not None
        records = wire.sealed(
            region, raw.arrays["envelope"].tobytes(), regions[region].bundle.key_id.hex()
        )
        return protocol.content(records.sign(regions[region], run_id=7, server_round=1))

    arrays, _ = RegionalFedAvg(a).aggregate_train(
        1, [reply(11, sealed("eu", 1.0)), reply(12, sealed("cn", 3.0))]
    )
    assert arrays is not None
    np.testing.assert_allclose(protocol.unpack_arrays(arrays)["w"], 2.0)


def test_global_adapter_is_signed_for_each_round(sealed_round):
    a, regions = sealed_round
    s = RegionalFedAvg(a)
    content = s._messages(
        FakeGrid([1, 2, 3]),  # type: ignore[arg-type]
        protocol.pack_arrays(GLOBAL),
        4,
        MessageType.TRAIN,
        [1, 2, 3],
    )[0].content
    task = protocol.read_instruction(Message(content, dst_node_id=1, message_type="train"))
    assert task.kind == TaskKind.TRAIN and task.run_config == a.run.canonical_json()
    keys = RegionKeys(regions["eu"], a.sealing.keys.keypair.bundle, "xwing-aes256gcm")

    def check(server_round: int, terms: Terms) -> None:
        keys.check_global(
            task.signature, task.signer, 7, server_round, task.adapter, terms, task.witness
        )

    check(4, task.terms)  # valid
    with pytest.raises(NotSignedError, match="not signed by the aggregator"):
        check(5, task.terms)  # another round
    with pytest.raises(NotSignedError, match="not signed by the aggregator"):
        check(4, replace(task.terms, kind=TaskKind.EVALUATE))  # another kind of task
    other_nonce = bytes(b ^ 1 for b in task.nonce)
    with pytest.raises(NotSignedError, match="not signed by the aggregator"):
        check(4, replace(task.terms, nonce=other_nonce))  # another nonce
    other_config = config_digest(task.run_config + " ")
    with pytest.raises(NotSignedError, match="not signed by the aggregator"):
        check(4, replace(task.terms, config_digest=other_config))  # another run config
    # every instruction has a nonce of its own
    again = s._messages(
        FakeGrid([1]),  # type: ignore[arg-type]
        protocol.pack_arrays(GLOBAL),
        4,
        MessageType.TRAIN,
        [1],
    )[0]
    assert protocol.read_instruction(again).nonce != task.nonce


# -- the round loop, checkpoints and resume --------------------------------------------


class RegionsGrid(FakeGrid):
    """Regions that each move the adapter half-way towards their own target; a region's
    reply is ready ``delay`` pulls after its instruction (the grid's clock ticks once
    per pull), and ``silent`` nodes never answer."""

    def __init__(self, targets: dict[int, tuple[str, float]] | None = None) -> None:
        self.targets = targets or {11: ("eu", 1.0), 12: ("cn", 3.0)}
        super().__init__(list(self.targets))
        self.delay: dict[int, int] = {}
        self.silent: set[int] = set()
        self.now = 0.0
        self.pending: dict[str, tuple[float, Message]] = {}
        self.sent: list[Message] = []

    def _answer(self, message: Message) -> Message:
        region, target = self.targets[message.metadata.dst_node_id]
        if message.metadata.message_type == MessageType.TRAIN:
            w = protocol.unpack_arrays(message.content.array_records["arrays"])["w"]
            content = packed(trained(region, float(0.5 * (target - w[0])), 10))
        else:
            content = evaluation(region, 1.0, 10)
        return Message(content, reply_to=message)

    def push_messages(self, messages):
        ids = []
        for message in messages:
            message.metadata.__dict__["_message_id"] = f"m{len(self.sent)}"
            self.sent.append(message)
            node = message.metadata.dst_node_id
            if node not in self.silent:
                ready = self.now + self.delay.get(node, 0)
                self.pending[message.metadata.message_id] = (ready, self._answer(message))
            ids.append(message.metadata.message_id)
        return ids

    def pull_messages(self, message_ids):
        self.now += 1
        ready = [i for i in message_ids if i in self.pending and self.pending[i][0] <= self.now]
        return [self.pending.pop(i)[1] for i in ready]

    def send_and_receive(self, messages, timeout):
        ids = self.push_messages(messages)
        self.now += 10**6
        return self.pull_messages(ids)


def regions_grid() -> Any:
    return RegionsGrid()


def looped(
    run_config, folder, rounds: int, optimizer: str = "none", grid: Any = None, **settings: Any
) -> RegionalFedAvg:
    run = run_config.model_copy(
        update={
            "codec": get_codec("dense"),  # model_copy does not validate: not "dense"
            "num_server_rounds": rounds,
            "regions": ("eu", "cn"),
            "server_optimizer": optimizer,
            "server_learning_rate": 0.3 if optimizer == "fedadam" else 1.0,
            "round_timeout": 50.0,
            **settings,
        }
    )
    aggregator = AggregatorRound(
        run,
        base_fingerprint="f" * 64,
        recorder=make_round(run, folder).recorder,
        run_id=7,
        checkpoints=folder / "checkpoint",
    )
    strategy = RegionalFedAvg(aggregator)
    strategy.interval = 0.0
    if grid is not None:
        strategy.clock = lambda: grid.now
    return strategy


@pytest.mark.parametrize("optimizer", ["none", "fedadam"])
def test_a_resumed_run_ends_where_an_uninterrupted_one_does(run_config, tmp_path, optimizer):
    start = protocol.pack_arrays(GLOBAL)
    whole = looped(run_config, tmp_path / "whole", 3, optimizer)
    whole_final = protocol.unpack_arrays(whole.start(regions_grid(), start, 3, 10.0))["w"]
    assert not np.allclose(whole_final, GLOBAL["w"])  # every round published an aggregate
    # "Killed" after round 1: a new strategy resumes from round 1's checkpoint.
    looped(run_config, tmp_path / "cut", 3, optimizer).start(regions_grid(), start, 1, 10.0)
    saved = load_checkpoint(tmp_path / "cut")
    assert saved.round == 1 and saved.federation_run == 7
    assert saved.optimizer is not None and saved.optimizer.steps == 1

    def resume(folder, *, fresh: bool = False) -> np.ndarray:
        resumed = looped(run_config, folder, 3, optimizer)
        resumed.aggregator.federation_run = saved.federation_run
        resumed.aggregator.recorder.data.rounds = saved.rounds
        if not fresh:  # what open_run does with the checkpoint
            restore(resumed.aggregator, saved)
        final = resumed.start(regions_grid(), protocol.pack_arrays(saved.adapter), 3, 10.0, 2)
        return protocol.unpack_arrays(final)["w"]

    assert resume(tmp_path / "resumed").tobytes() == whole_final.tobytes()
    assert load_checkpoint(tmp_path / "resumed").round == 3
    ended = load_checkpoint(tmp_path / "resumed").optimizer
    assert ended is not None and ended.steps == 3 and ended.name == optimizer
    assert ended.meta() == load_checkpoint(tmp_path / "whole").optimizer.meta()  # type: ignore[union-attr]
    # Without its state (moments from zero), a fedadam run would end elsewhere.
    forgot = resume(tmp_path / "forgot", fresh=True)
    assert np.array_equal(forgot, whole_final) == (optimizer == "none")


def test_a_resume_under_another_server_optimizer_is_refused(run_config, tmp_path):
    looped(run_config, tmp_path / "cut", 3, "fedadam").start(
        regions_grid(), protocol.pack_arrays(GLOBAL), 1, 10.0
    )
    saved = load_checkpoint(tmp_path / "cut")
    other = looped(run_config, tmp_path / "other", 3, "fedyogi")
    with pytest.raises(CheckpointError, match='run config:server-optimizer: "fedyogi"'):
        restore(other.aggregator, saved)
    plain = looped(run_config, tmp_path / "plain", 3, "none")
    with pytest.raises(CheckpointError, match='server-optimizer = "fedadam"'):
        restore(plain.aggregator, saved)
