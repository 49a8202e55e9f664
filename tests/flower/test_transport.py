"""Flower's side of the aggregator's loop (``fedciuic.flower.courier.FlowerTransport``):
instructions pushed as Messages of the task's type, replies unpacked into plain ones
inside the round's boundary (a Flower error or malformed records refused alone), sealed
replies as regions pack them, and a whole run over a fake Grid. The loop itself is
tested over a Flower-free transport in tests/aggregator/."""

# ruff: noqa: F811 - the fixtures imported from test_aggregator are parameters here

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from flwr.app import ConfigRecord, Error, Message, MessageType, RecordDict

from fedciuic import wire
from fedciuic.aggregator.loop import SyncLoop
from fedciuic.crypto.parties import (
    NONCE_BYTES,
    NotSignedError,
    RegionKeys,
    TaskKind,
    Terms,
    config_digest,
)
from fedciuic.flower import protocol
from fedciuic.flower.courier import FlowerTransport
from fedciuic.flower.relay import HELLO_MESSAGE
from fedciuic.wire import PULL_INTERVAL, Instruction, MalformedReply, Reply, RunEndNotice
from tests.aggregator.fakes import Regions, looped
from tests.aggregator.test_aggregator import (  # noqa: F401 - fixtures
    GLOBAL,
    Raw,
    sealed_reply_from,
    sealed_round,
)

pytestmark = pytest.mark.usefixtures("task_identity")


def reply(node_id: int, content: RecordDict | Error, kind: str = MessageType.TRAIN) -> Message:
    instruction = Message(RecordDict(), dst_node_id=node_id, message_type=kind)
    return Message(content, reply_to=instruction)


def packed(raw: Raw) -> RecordDict:
    """A plain reply's fields in the records a region's Message carries."""
    return protocol.content(wire.Records(dict(raw.info), dict(raw.metrics), raw.arrays))


class Grid:
    """Flower's Grid for the regions of :class:`Regions` (the same answers, as Messages;
    the same clock): each pushed Message is answered by its node's fake region."""

    def __init__(self, regions: Regions | None = None) -> None:
        self.regions = regions or Regions()
        self.pushed: list[Message] = []
        self.replies: dict[str, Message] = {}

    def get_node_ids(self) -> list[int]:
        return self.regions.nodes()

    def push_messages(self, messages):
        ids = []
        for message in messages:
            message.metadata.__dict__["_message_id"] = f"m{len(self.pushed)}"
            self.pushed.append(message)
            node = message.metadata.dst_node_id
            if message.metadata.message_type == HELLO_MESSAGE:  # as the node's agent answers
                hello = protocol.hello_answer(self.regions.targets[node][0])
                self.replies[message.metadata.message_id] = Message(hello, reply_to=message)
                ids.append(message.metadata.message_id)
                continue
            if message.metadata.message_type == MessageType.QUERY:  # a run-end notice
                ids.append(message.metadata.message_id)  # not answered here
                continue
            task = protocol.read_instruction(message)
            answer: Any = self.regions.answer(node, task)  # also a test's Flower content
            if answer is not None:
                content = answer if isinstance(answer, RecordDict | Error) else packed(answer)
                self.replies[message.metadata.message_id] = Message(content, reply_to=message)
            ids.append(message.metadata.message_id)
        return ids

    def pull_messages(self, message_ids):
        self.regions.now += 1
        return [self.replies.pop(i) for i in message_ids if i in self.replies]


def test_a_run_over_flowers_grid_ends_where_it_does_over_any_transport(run_config, tmp_path):
    plain = looped(run_config, tmp_path / "plain", 2, Regions()).run(GLOBAL, 2)
    grid = Grid()
    loop = looped(run_config, tmp_path / "flower", 2, grid.regions)
    loop.transport = loop.courier.transport = FlowerTransport(grid)  # type: ignore[arg-type]
    final = loop.run(GLOBAL, 2)
    assert final["w"].tobytes() == plain["w"].tobytes()
    kinds = [(m.metadata.dst_node_id, m.metadata.message_type) for m in grid.pushed]
    assert kinds[:6] == [
        (11, HELLO_MESSAGE),  # each node says which region it serves, once
        (12, HELLO_MESSAGE),
        (11, MessageType.EVALUATE),
        (12, MessageType.EVALUATE),
        (11, MessageType.TRAIN),
        (12, MessageType.TRAIN),
    ]
    # the adapter each message carries is the one its signed instruction names
    task = protocol.read_instruction(grid.pushed[-1])
    np.testing.assert_array_equal(task.adapter["w"], final["w"])


def test_flower_errors_and_malformed_records_are_read_inside_the_boundary():
    regions = Regions({14: ("cn", 0.0), 15: ("us", 0.0), 16: ("sg", 0.0)})
    regions.answer = lambda node, task: {  # type: ignore[method-assign, assignment, return-value]
        14: Error(code=0, reason="process died"),
        15: RecordDict({"junk": ConfigRecord({"x": 1})}),
    }.get(node)
    grid = Grid(regions)
    transport = FlowerTransport(grid)  # type: ignore[arg-type]
    taken = transport.push(dict.fromkeys([14, 15, 16], INSTRUCTION))
    assert sorted(taken.values()) == [14, 15, 16]
    pulled = {taken[mid]: unread for mid, unread in transport.pull(taken)}
    assert set(pulled) == {14, 15}  # 16 has not answered (yet)
    died = pulled[14].read()
    assert (died.node_id, died.status, died.reason) == (14, "failed", "process died")
    assert pulled[15].node_id == 15
    with pytest.raises(MalformedReply, match="malformed reply: records"):
        pulled[15].read()


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


#: An instruction as the aggregator signs it (the signature a stand-in).
INSTRUCTION = Instruction(
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
    recipient="cn",
)


def test_instruction_round_trip():
    sent = INSTRUCTION
    content = protocol.instruction(protocol.pack_arrays(GLOBAL), sent)
    message = Message(content, dst_node_id=2, message_type=MessageType.EVALUATE)
    task = protocol.read_instruction(message)
    assert task.server_round == 3 and task.base_fingerprint == "abc"
    np.testing.assert_array_equal(task.adapter["w"], GLOBAL["w"])
    assert task.kind == TaskKind.EVALUATE and task.run_settings() == {"local-steps": 2}
    assert (task.nonce, task.signature, task.signer) == (sent.nonce, sent.signature, sent.signer)
    assert (task.federation_run, task.witness, task.recipient) == (5, (4, "cd" * 32), "cn")
    assert task.terms == sent.terms


# -- sealed updates --------------------------------------------------------------------


def test_sealed_replies_as_regions_pack_them_are_opened_and_aggregated(sealed_round):
    a, keys = sealed_round
    agg = a.sealing.keys.keypair.bundle
    regions = Regions()

    def answer(node: int, task: Instruction):
        region, value = regions.targets[node]
        if task.kind == TaskKind.EVALUATE:
            records = wire.evaluated(region, 10, 1.0, float(np.exp(1.0)))
        else:
            raw = sealed_reply_from(keys[region], agg, value)
            assert raw.arrays is not None
            records = wire.sealed(
                region, raw.arrays["envelope"].tobytes(), keys[region].bundle.key_id.hex()
            )
        return protocol.content(
            records.sign(keys[region], run_id=7, server_round=task.server_round)
        )

    regions.answer = answer  # type: ignore[method-assign, assignment]
    a.use(run=a.run.updated(**{"regions": ("eu", "cn")}))
    transport = FlowerTransport(Grid(regions))  # type: ignore[arg-type]
    loop = SyncLoop(a, transport, clock=lambda: regions.now, sleep=regions.sleep, interval=0.0)
    final = loop.run(GLOBAL, 1)
    np.testing.assert_allclose(final["w"], 2.0)


def test_global_adapter_is_signed_for_each_round(sealed_round):
    a, regions = sealed_round
    grid = Grid()
    FlowerTransport(grid).push(  # type: ignore[arg-type]
        {n: a.sign_instruction(4, TaskKind.TRAIN, GLOBAL, r) for n, r in ((11, "eu"), (12, "cn"))}
    )
    task = protocol.read_instruction(grid.pushed[0])
    assert [protocol.read_instruction(m).recipient for m in grid.pushed] == ["eu", "cn"]
    assert grid.pushed[0].metadata.message_type == MessageType.TRAIN
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
    FlowerTransport(grid).push({11: a.sign_instruction(4, TaskKind.TRAIN, GLOBAL, "eu")})  # type: ignore[arg-type]
    again = grid.pushed[-1]
    assert protocol.read_instruction(again).nonce != task.nonce


def test_a_run_end_notice_is_answered_as_soon_as_the_replies_are_in(monkeypatch):
    """Pulled every PULL_INTERVAL seconds, not Grid.send_and_receive's 3: the run ends as soon as
    the regions have answered; a reply to anything else is not taken for one."""
    grid = Grid()
    pulls = 0
    slept: list[float] = []
    monkeypatch.setattr("fedciuic.flower.courier.time.sleep", slept.append)

    def pull_messages(message_ids):
        nonlocal pulls
        pulls += 1
        if pulls < 3:
            return []
        stray = Message(RecordDict(), dst_node_id=12, message_type=MessageType.QUERY)
        stray.metadata.__dict__["_message_id"] = "stray"
        return [Message(RecordDict(), reply_to=m) for m in grid.pushed] + [
            Message(RecordDict(), reply_to=stray)
        ]

    grid.pull_messages = pull_messages  # type: ignore[method-assign]
    notice = RunEndNotice(federation_run=7, witness=(3, "ab" * 32))
    transport = FlowerTransport(grid)  # type: ignore[arg-type]
    answers = transport.query(dict.fromkeys([11, 12], notice), timeout=30)
    assert pulls == 3 and slept == [PULL_INTERVAL, PULL_INTERVAL]
    assert sorted(a.node_id for a in answers) == [11, 12]
