"""Messages in flight between the aggregator and its regions, over Flower's Grid.

``Grid.send_and_receive`` waits for a fixed set of replies and forgets the rest, so a
region that answers late is never heard and a slow one is sent a second task while it
still works on the first. The courier pushes each message once, remembers it by id
until its reply is pulled (whenever that is), and says which nodes are busy: the
aggregator sends a node nothing new while it has a message in flight, and a late reply
still shows that its region is alive.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial

from flwr.app import Message
from flwr.serverapp import Grid

from fedciuic.aggregator.round import Task
from fedciuic.flower import protocol
from fedciuic.wire import Unread


@dataclass(frozen=True)
class Sent:
    """A message in flight: to which node, what kind, in which round (or buffered
    aggregate) it was sent, the training task it carries, and when."""

    node: int
    kind: str
    server_round: int
    task: Task | None
    at: float


class Courier:
    """Push messages, pull whatever replies have come, know who is busy."""

    def __init__(
        self,
        grid: Grid,
        *,
        clock: Callable[[], float] = time.monotonic,
        interval: float = 0.5,
    ) -> None:
        self.grid = grid
        self.clock = clock
        self.interval = interval  # seconds between pulls while waiting
        self.in_flight: dict[str, Sent] = {}

    def busy(self, node: int) -> bool:
        return any(sent.node == node for sent in self.in_flight.values())

    def push(self, messages: Iterable[tuple[Message, Sent]]) -> list[Sent]:
        """Push each message; what the SuperLink took is in flight from now on."""
        batch = list(messages)
        ids = list(self.grid.push_messages([message for message, _ in batch]))
        pushed = []
        for message_id, (_, sent) in zip(ids, batch, strict=False):
            if message_id:
                self.in_flight[message_id] = sent
                pushed.append(sent)
        return pushed

    def pull(self) -> list[tuple[Sent, Message]]:
        """The replies that have arrived, each with the message it answers."""
        if not self.in_flight:
            return []
        got = []
        for reply in self.grid.pull_messages(list(self.in_flight)):
            sent = self.in_flight.pop(reply.metadata.reply_to_message_id, None)
            if sent is not None:
                got.append((sent, reply))
        return got

    def forget_gone(self, connected: Iterable[int]) -> None:
        """A node that left the federation will not answer: nothing of it is in flight."""
        alive = set(connected)
        self.in_flight = {k: s for k, s in self.in_flight.items() if s.node in alive}

    def wait(self) -> None:
        time.sleep(self.interval)


def unread(sent: Sent, message: Message) -> Unread:
    """A pulled reply, to be read inside the aggregator's per-reply boundary, filed under
    the node its message went to (an error the SuperLink writes names itself instead)."""
    return Unread(sent.node, partial(protocol.read_reply, message, sent.node))
