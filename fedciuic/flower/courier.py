"""The aggregator's loop over Flower's Grid: :class:`FlowerTransport` implements
:class:`~fedciuic.aggregator.loop.Transport`.

Each message is pushed once and its reply pulled by id whenever it comes: not
``Grid.send_and_receive``, which forgets late replies (a slow region is never heard).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from functools import partial

from flwr.app import ArrayRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from fedciuic.crypto import TaskKind
from fedciuic.flower import protocol
from fedciuic.flower.relay import HELLO_MESSAGE, SECAGG_MESSAGE
from fedciuic.wire import PULL_INTERVAL, Instruction, RunEndNotice, Unread

#: The Flower message type that carries each kind of task (signed into its instruction).
MESSAGE_TYPES = {
    TaskKind.TRAIN: MessageType.TRAIN,
    TaskKind.EVALUATE: MessageType.EVALUATE,
    TaskKind.SECAGG: SECAGG_MESSAGE,
}


def _messages(content: RecordDict, nodes: Sequence[int], message_type: str) -> list[Message]:
    return [Message(content, dst_node_id=node, message_type=message_type) for node in nodes]


def unread(message: Message, node: int) -> Unread:
    """A pulled reply, read later, filed under the node its message went to (an error the
    SuperLink writes names itself instead)."""
    return Unread(node, partial(protocol.read_reply, message, node))


class FlowerTransport:
    """Instructions as Flower Messages through the ServerApp's Grid."""

    def __init__(self, grid: Grid) -> None:
        self.grid = grid

    def nodes(self) -> list[int]:
        return sorted(self.grid.get_node_ids())

    def identify(self, nodes: Sequence[int], timeout: float) -> dict[int, str]:
        replies = self._exchange(_messages(RecordDict(), nodes, HELLO_MESSAGE), timeout)
        named = {m.metadata.src_node_id: protocol.read_hello(m) for m in replies}
        return {node: region for node, region in named.items() if region is not None}

    def _exchange(self, messages: Sequence[Message], timeout: float) -> list[Message]:
        """Push ``messages``, then pull their replies until all came or ``timeout``."""
        waiting = {i for i in self.grid.push_messages(messages) if i}
        replies: list[Message] = []
        deadline = time.monotonic() + timeout
        while waiting and time.monotonic() < deadline:
            for reply in self.grid.pull_messages(list(waiting)):
                if reply.metadata.reply_to_message_id in waiting:
                    waiting.discard(reply.metadata.reply_to_message_id)
                    replies.append(reply)
            if waiting:
                time.sleep(PULL_INTERVAL)
        return replies

    def push(self, instructions: Mapping[int, Instruction]) -> dict[str, int]:
        # Each node its own signed instruction; the adapter they share packed once.
        packed: dict[tuple[tuple[str, int], ...], ArrayRecord] = {}
        messages = []
        for node, task in instructions.items():
            same = tuple((name, id(array)) for name, array in task.adapter.items())
            if same not in packed:
                packed[same] = protocol.pack_arrays(task.adapter)
            content = protocol.instruction(packed[same], task)
            messages += _messages(content, [node], MESSAGE_TYPES[task.kind])
        ids = self.grid.push_messages(messages)
        return {
            message_id: message.metadata.dst_node_id
            for message_id, message in zip(ids, messages, strict=False)
            if message_id
        }

    def pull(self, in_flight: Mapping[str, int]) -> list[tuple[str, Unread]]:
        got = []
        for reply in self.grid.pull_messages(list(in_flight)):
            answers = reply.metadata.reply_to_message_id
            if answers in in_flight:
                got.append((answers, unread(reply, in_flight[answers])))
        return got

    def query(self, notices: Mapping[int, RunEndNotice], timeout: float) -> list[Unread]:
        messages = [
            m
            for node, notice in notices.items()
            for m in _messages(protocol.run_end_notice(notice), [node], MessageType.QUERY)
        ]
        return [unread(m, m.metadata.src_node_id) for m in self._exchange(messages, timeout)]
