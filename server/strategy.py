"""RegionalFedAvg: Flower's Message-API FedAvg template adapted to the aggregator's
round in ``fedciuic.aggregator.round``, which judges, records and aggregates plain
replies. Here: instructions built into Messages, replies unpacked (inside the round's
per-reply boundary), results packed, and Flower's own concerns:

* waiting for regions to connect has a deadline (``node-wait-timeout``), so a run
  that expects more regions than exist stops with a message instead of hanging;
* messages go through a :class:`~fedciuic.flower.courier.Courier`: pushed once,
  pulled whenever their reply comes, at most one in flight per node, so a late reply
  is still judged (and logged) and a slow region is never sent a second task;
* a node asked this round that does not answer within round-timeout is a failed
  reply; a region that misses max-missed-rounds in a row is no longer waited for;
* ``aggregation-mode = "buffered"``: FedBuff's loop instead of rounds
  (docs/heterogeneity.md);
* every region evaluates the initial adapter before round 1, so the run reports
  eval loss before and after training.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from functools import partial
from logging import INFO

import numpy as np
from flwr.app import ArrayRecord, Message, MessageType, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg
from flwr.supercore import log

from fedciuic.aggregator.round import AggregatorRound, Collecting, Published, Task
from fedciuic.crypto.sealing import TaskKind
from fedciuic.errors import FederationError
from fedciuic.flower import protocol
from fedciuic.flower.courier import Courier, Sent, unread
from fedciuic.wire import ARRAYS, CONFIG, Arrival, NoReply, Unread

#: The task each Flower message type asks of a region (signed into its instruction).
_TASKS = {MessageType.TRAIN: TaskKind.TRAIN, MessageType.EVALUATE: TaskKind.EVALUATE}


class RegionalFedAvg(FedAvg):
    """FedAvg's template over :class:`AggregatorRound`, with deadlines for regions."""

    def __init__(
        self, aggregator: AggregatorRound, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        run = aggregator.run
        super().__init__(
            min_train_nodes=run.min_regions,
            min_evaluate_nodes=run.min_regions,
            min_available_nodes=run.min_regions,
            arrayrecord_key=ARRAYS,
            configrecord_key=CONFIG,
        )
        self.aggregator = aggregator
        self.clock = clock
        self.interval = 0.5  # seconds between pulls while waiting for replies
        self.timeout = aggregator.run.round_timeout  # start() takes the run's
        #: The nodes a round's replies are expected from, for Flower's Strategy
        #: interface (aggregate_train/aggregate_evaluate with a round's replies at once).
        self._asked: list[int] = []
        self._waited = False
        #: Replies pulled but not yet judged: after a buffered aggregate filled, or
        #: updates that arrived during an evaluation; the next aggregate takes them.
        self._carried: list[tuple[Sent, Message]] = []

    def wait_for_regions(self, grid: Grid) -> list[int]:
        """All connected nodes, once every region is there or the deadline has passed.

        Only the first call waits the full ``node-wait-timeout``; later rounds take
        the regions that are connected, so one region gone does not stall each round.
        """
        run = self.aggregator.run
        expected = len(run.regions)
        wait = 0.0 if self._waited else run.node_wait_timeout
        self._waited = True
        deadline = self.clock() + wait
        nodes = list(grid.get_node_ids())
        while len(nodes) < expected and self.clock() < deadline:
            log(INFO, "Waiting for regions: %d of %d connected", len(nodes), expected)
            time.sleep(1.0)
            nodes = list(grid.get_node_ids())
        if len(nodes) < run.min_regions:
            raise FederationError(
                f"run config:node-wait-timeout: only {len(nodes)} of {expected} regions "
                f"connected within {wait:.0f}s (min-regions is "
                f"{run.min_regions}); start a SuperNode for each of "
                f"{', '.join(run.regions)} or lower min-regions"
            )
        return sorted(nodes)

    def _messages(
        self,
        grid: Grid,
        arrays: ArrayRecord,
        server_round: int,
        kind: str,
        nodes: Iterable[int],
        adapter: Callable[[], Mapping[str, np.ndarray]] | None = None,
    ) -> list[Message]:
        """The instruction for ``server_round`` (a buffered region's own task number) to
        each of ``nodes``; ``adapter``: the arrays already unpacked, when they are
        (signing needs them as NumPy)."""
        task = self.aggregator.sign_instruction(
            server_round, _TASKS[kind], adapter() if adapter else protocol.unpack_arrays(arrays)
        )
        content = protocol.instruction(arrays, task)
        return list(self._construct_messages(content, list(nodes), kind))

    def _send(
        self,
        courier: Courier,
        messages: Iterable[Message],
        server_round: int,
        task: Task | None = None,
    ) -> list[int]:
        """Push ``messages``; the nodes they went to."""
        now = self.clock()
        sent = courier.push(
            (m, Sent(m.metadata.dst_node_id, m.metadata.message_type, server_round, task, now))
            for m in messages
        )
        return [s.node for s in sent]

    def _collect(
        self, courier: Courier, asked: list[int], kind: str, server_round: int, timeout: float
    ) -> tuple[list[Arrival], list[tuple[Sent, Message]], set[int]]:
        """Replies to this round's ``kind`` from ``asked`` until every node the round
        waits for has answered or ``timeout`` has passed; a node it waited for in vain
        is a :class:`NoReply` (its message stays in flight). Also returns what else
        arrived meanwhile (late replies to earlier rounds) and every node heard from."""
        deadline = self.clock() + timeout
        waiting = {n for n in asked if self.aggregator.waits_for(n)}
        answered: set[int] = set()
        mine: list[Arrival] = []
        other: list[tuple[Sent, Message]] = []
        while True:
            for sent, message in courier.pull():
                answered.add(sent.node)
                if sent.kind == kind and sent.server_round == server_round:
                    mine.append(unread(sent, message))
                    waiting.discard(sent.node)
                else:
                    other.append((sent, message))
            if not waiting or self.clock() >= deadline:
                break
            courier.wait()
        mine += [NoReply(n, timeout) for n in sorted(waiting)]
        return mine, other, answered

    def _evaluate(
        self, courier: Courier, grid: Grid, server_round: int, arrays: ArrayRecord, nodes: list[int]
    ) -> set[int]:
        """Every node in ``nodes`` evaluates ``arrays``; the nodes heard from."""
        messages = self._messages(grid, arrays, server_round, MessageType.EVALUATE, nodes)
        asked = self._send(courier, messages, server_round)
        arrivals, late, heard = self._collect(
            courier, asked, MessageType.EVALUATE, server_round, self.timeout
        )
        self._carried += late  # updates among them count in the next round
        self.aggregator.evaluate(server_round, arrivals)
        return heard

    def _late(
        self,
        server_round: int,
        late: list[tuple[Sent, Message]],
        into: Collecting,
        *,
        after_end: bool = False,
    ) -> None:
        """Updates that answer earlier messages, judged (against the version they were
        computed from) into this round's aggregate, or, ``after_end``, recorded as
        arrived and refused: the run has no aggregate left for them. Every update that
        arrives is logged as received, so the regions' and the aggregator's logs agree."""
        for sent, message in late:
            if sent.task is None:  # a late evaluation only showed that its node is alive
                continue
            arrival = unread(sent, message)
            self.aggregator.judge_train(server_round, arrival, sent.task, into, after_end=after_end)

    def _sync_round(self, courier: Courier, grid: Grid, server_round: int) -> None:
        """Every connected region with nothing in flight trains from the current global
        adapter; the round waits for all but the unavailable ones (up to round-timeout),
        aggregates, then every idle region evaluates the result."""
        a = self.aggregator
        nodes = self.wait_for_regions(grid)
        courier.forget_gone(nodes)
        idle = [n for n in nodes if not courier.busy(n)]
        arrays = protocol.pack_arrays(a.global_adapter)
        task = Task(server_round, a.version)
        messages = self._messages(
            grid, arrays, server_round, MessageType.TRAIN, idle, lambda: a.global_adapter
        )
        asked = self._send(courier, messages, server_round, task)
        arrivals, late, heard = self._collect(
            courier, asked, MessageType.TRAIN, server_round, a.train_wait(self.timeout)
        )
        into = a.collecting()
        late, self._carried = self._carried + late, []
        self._late(server_round, late, into)
        for arrival in arrivals:
            a.judge_train(server_round, arrival, task, into)
        a.publish(server_round, into)
        arrays = protocol.pack_arrays(a.global_adapter)
        idle = [n for n in nodes if not courier.busy(n)]
        heard |= self._evaluate(courier, grid, server_round, arrays, idle)
        a.heard(server_round, heard)
        a.end(server_round)

    def _arrivals(self, replies: Iterable[Message]) -> Iterator[Unread | NoReply]:
        """Each reply, unread (the round reads it inside its boundary), then each node
        asked this round that did not answer within round-timeout (its process died)."""
        answered: set[int] = set()
        for message in replies:
            answered.add(message.metadata.src_node_id)
            yield Unread(message.metadata.src_node_id, partial(protocol.read_reply, message))
        yield from (NoReply(node) for node in self._asked if node not in answered)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        result = self.aggregator.train(server_round, self._arrivals(replies))
        if not isinstance(result.aggregate, Published):
            return None, None
        published = result.aggregate
        figures: dict[str, int | float | list[int] | list[float]] = {
            "num-examples": published.examples,
            "regions": len(published.regions),
        }
        if published.train_loss is not None:  # None: every region's steps were noise only
            figures["train-loss"] = published.train_loss
        metrics = MetricRecord(figures)
        return protocol.pack_arrays(published.adapter), metrics

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        result = self.aggregator.evaluate(server_round, self._arrivals(replies))
        if result.loss is None:
            return None
        return MetricRecord({"eval-loss": result.loss, "num-examples": result.num_examples})

    def witness_run_end(self, grid: Grid, timeout: float) -> None:
        """Once ``run_end`` is in the aggregator's log and signed: send each region that
        head (signed), and record the head each one answers with (best effort)."""
        notice = self.aggregator.sign_run_end()
        if notice is None:
            return
        nodes = sorted(grid.get_node_ids())
        messages = self._construct_messages(
            protocol.run_end_notice(notice), nodes, MessageType.QUERY
        )
        replies = grid.send_and_receive(messages, timeout=timeout)
        self.aggregator.run_end_witnessed(
            Unread(m.metadata.src_node_id, partial(protocol.read_reply, m)) for m in replies
        )

    def _buffered(self, courier: Courier, grid: Grid, server_round: int) -> None:
        """One buffered aggregate (FedBuff): every idle region that has not answered
        since the last one is sent its next task from the current global adapter. The
        aggregate is published as soon as buffer-size updates are accepted and the
        policies allow it; after round-timeout without that, or once nothing more can
        come, with what has arrived (if the policies allow). Each update is weighted by
        its staleness (fedciuic.aggregation)."""
        a, run = self.aggregator, self.aggregator.run
        into = a.collecting()
        heard: set[int] = set()
        contributed: set[str] = set()  # one reply per region and aggregate
        deadline = self.clock() + a.train_wait(self.timeout)
        nodes = self.wait_for_regions(grid)
        while True:
            courier.forget_gone(nodes)
            for node in nodes:
                if not courier.busy(node):
                    self._dispatch(courier, grid, server_round, node, contributed)
            pulled, self._carried = self._carried + courier.pull(), []
            for i, (sent, message) in enumerate(pulled):
                if len(into.accepted) >= run.buffer_size and a.may_publish(into):
                    self._carried = pulled[i:]  # the next aggregate's, against the new version
                    break
                heard.add(sent.node)
                arrival = unread(sent, message)
                if sent.task is None:  # an evaluation: how a new node says who it is
                    a.evaluate(server_round, [arrival], overall=False)
                    continue
                judged = a.judge_train(server_round, arrival, sent.task, into)
                a.tasks.done(judged.label)
                contributed.add(judged.label)
            if len(into.accepted) >= run.buffer_size and a.may_publish(into):
                break
            expected = any(a.waits_for(s.node) for s in courier.in_flight.values())
            more = expected or self._can_dispatch(nodes, courier, contributed)
            if not more or self.clock() >= deadline:
                break
            courier.wait()
            nodes = sorted(grid.get_node_ids())
        a.publish(server_round, into)
        # A region still within round-timeout of its task has not missed anything: a
        # buffered aggregate is often shorter than a slow region's task.
        now = self.clock()
        wait = a.train_wait(self.timeout)
        working = {s.node for s in courier.in_flight.values() if now - s.at < wait}
        finished = {n for n in nodes if a.regions_by_node.get(n) in a.tasks.finished()}
        a.heard(server_round, heard | working | finished)
        a.end(server_round)

    def _drain(self, courier: Courier) -> None:
        """Buffered mode's end: wait (up to round-timeout) for the updates still in
        flight from available regions, so that each is logged as received (and refused:
        no aggregate is left) rather than sent by the region and never heard of."""
        deadline = self.clock() + self.aggregator.train_wait(self.timeout)
        while self.clock() < deadline:
            self._carried += courier.pull()
            if not any(
                s.task is not None and self.aggregator.waits_for(s.node)
                for s in courier.in_flight.values()
            ):
                return
            courier.wait()

    def _can_dispatch(self, nodes: list[int], courier: Courier, contributed: set[str]) -> bool:
        """Whether some idle node could still be sent something in this aggregate."""
        a = self.aggregator
        for node in nodes:
            region = a.regions_by_node.get(node)
            if courier.busy(node):
                continue
            if region is None or (region not in contributed and a.tasks.can_send(region)):
                return True
        return False

    def _dispatch(
        self, courier: Courier, grid: Grid, server_round: int, node: int, contributed: set[str]
    ) -> None:
        """An idle node's next message: an evaluation when its region is not known yet
        (its signed answer says which region it is), else its region's next task, if it
        has one left and has not answered since the last aggregate."""
        a = self.aggregator
        region = a.regions_by_node.get(node)
        arrays = protocol.pack_arrays(a.global_adapter)
        if region is None:
            messages = self._messages(grid, arrays, server_round, MessageType.EVALUATE, [node])
            self._send(courier, messages, server_round)
            return
        if region in contributed:
            return
        task = a.tasks.send_again(region)
        if task is None:
            if not a.tasks.can_send(region):
                return
            task = a.tasks.send(region, a.version)
        messages = self._messages(
            grid, arrays, task.task, MessageType.TRAIN, [node], lambda: a.global_adapter
        )
        if not self._send(courier, messages, server_round, Task(task.task, task.version)):
            a.tasks.done(region)

    def start(  # type: ignore[override]
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int,
        timeout: float,
        first_round: int = 1,
    ) -> ArrayRecord:
        """Evaluate the initial adapter in every region (unless resuming), then run
        rounds (sync) or aggregates (buffered) ``first_round`` to ``num_rounds``,
        checkpointing after each; a buffered run ends with every region evaluating the
        final adapter. Returns the final global adapter."""
        a = self.aggregator
        a.global_adapter = protocol.unpack_arrays(initial_arrays)
        self.timeout = timeout
        courier = Courier(grid, clock=self.clock, interval=self.interval)
        if first_round == 1:
            log(INFO, "[ROUND 0] evaluating the initial adapter in every region")
            nodes = self.wait_for_regions(grid)
            a.heard(0, self._evaluate(courier, grid, 0, initial_arrays, nodes))
            a.end(0)
        for server_round in range(first_round, num_rounds + 1):
            log(INFO, "[ROUND %d/%d]", server_round, num_rounds)
            if a.buffered:
                self._buffered(courier, grid, server_round)
            else:
                self._sync_round(courier, grid, server_round)
        if a.buffered:
            log(INFO, "[END] evaluating the final adapter in every region")
            final = protocol.pack_arrays(a.global_adapter)
            self._evaluate(courier, grid, num_rounds, final, sorted(grid.get_node_ids()))
            self._drain(courier)
        late, self._carried = self._carried, []
        self._late(num_rounds, late, a.collecting(), after_end=True)
        if a.buffered or late:
            a.end(num_rounds)
        return protocol.pack_arrays(a.global_adapter)
