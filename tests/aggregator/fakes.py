"""A federation of fake regions behind the aggregator's Transport, with a clock: the
production loop (``fedciuic.aggregator.loop``) runs over it without Flower."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from fedciuic.aggregator.loop import Loop, loop_for
from fedciuic.aggregator.round import AggregatorRound
from fedciuic.compression import get_codec
from fedciuic.crypto.parties import TaskKind
from fedciuic.wire import Instruction, Reply, RunEndNotice, Unread, parse_reply
from tests.aggregator.test_aggregator import Raw, evaluated, make_round, trained

#: What a fake region answers: fields as a region sends them, a reply already read, or
#: one still to read (inside the round's boundary).
Answer = Raw | Reply | Unread
#: Two regions and the value each one's training moves the adapter towards.
TWO = {11: ("eu", 1.0), 12: ("cn", 3.0)}
THREE = {**TWO, 13: ("us", 5.0)}


class Regions:
    """Regions that each move the adapter half-way towards their own target. A region's
    reply is ready ``delay`` pulls after its instruction (the clock, ``now``, ticks once
    per pull); ``silent`` nodes never answer. ``sent`` lists every (node, instruction)."""

    def __init__(self, targets: Mapping[int, tuple[str, float]] | None = None) -> None:
        self.targets = dict(targets or TWO)
        self.connected = list(self.targets)
        self.delay: dict[int, int] = {}
        self.silent: set[int] = set()
        self.now = 0.0
        self.pending: dict[str, tuple[float, int, Answer]] = {}
        self.sent: list[tuple[int, Instruction]] = []
        self.identified: list[int] = []  # every node that said its region, each time

    def nodes(self) -> list[int]:
        return list(self.connected)

    def sleep(self, seconds: float) -> None:
        self.now += seconds

    def answer(self, node: int, instruction: Instruction) -> Answer | None:
        """What ``node`` answers: fields as a region sends them, or (a test's own
        answer) a reply already read, or one still to read, or nothing."""
        region, target = self.targets[node]
        if instruction.kind == TaskKind.TRAIN:
            return trained(region, float(0.5 * (target - instruction.adapter["w"][0])), 10)
        return evaluated(region, 1.0, 10)

    def identify(self, nodes: Sequence[int], timeout: float) -> dict[int, str]:
        """Each node's region (a silent one says nothing)."""
        self.identified += [n for n in nodes if n not in self.silent]
        return {n: self.targets[n][0] for n in nodes if n not in self.silent}

    def push(self, instructions: Mapping[int, Instruction]) -> dict[str, int]:
        taken = {}
        for node, instruction in instructions.items():
            message_id = f"m{len(self.sent)}"
            self.sent.append((node, instruction))
            answer = None if node in self.silent else self.answer(node, instruction)
            if answer is not None:
                self.pending[message_id] = (self.now + self.delay.get(node, 0), node, answer)
            taken[message_id] = node
        return taken

    def pull(self, in_flight: Mapping[str, int]) -> list[tuple[str, Unread]]:
        self.now += 1
        ready = [i for i in in_flight if i in self.pending and self.pending[i][0] <= self.now]
        got = []
        for message_id in ready:
            _, node, answer = self.pending.pop(message_id)
            if isinstance(answer, Reply):
                answer = Unread(node, partial(lambda given: given, answer))
            elif isinstance(answer, Raw):
                answer = Unread(
                    node, partial(parse_reply, node, answer.info, answer.metrics, answer.arrays)
                )
            got.append((message_id, answer))
        return got

    def query(self, notices: Mapping[int, RunEndNotice], timeout: float) -> list[Unread]:
        return []

    def trains(self) -> list[tuple[int, Instruction]]:
        return [(n, i) for n, i in self.sent if i.kind == TaskKind.TRAIN]


def looped(
    run_config: Any,
    folder: Path,
    rounds: int,
    regions: Regions,
    optimizer: str = "none",
    **settings: Any,
) -> Loop:
    """The production loop of a run of ``rounds`` over ``regions``, on their clock."""
    run = run_config.updated(
        **{
            "codec": get_codec("dense"),  # model_copy does not validate: not "dense"
            "num_server_rounds": rounds,
            "regions": tuple(region for region, _ in regions.targets.values()),
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
    return loop_for(
        aggregator, regions, clock=lambda: regions.now, sleep=regions.sleep, interval=0.0
    )
