"""The aggregator's loop: which regions are asked what, when, and how long it waits for
them, over a :class:`Transport` (Flower's Grid in ``fedciuic.flower.courier``; tests use
a fake one with its own clock).

Waiting for regions has a deadline (node-wait-timeout); each message is pushed once and
its reply pulled whenever it comes, at most one in flight per node, so a late reply is
still judged and a slow region never gets a second task. A node silent past
round-timeout is a failed reply; a region that misses max-missed-rounds in a row is no
longer waited for. Every instruction is signed for the region its node names. What a
reply is worth, and what is published, is the round's
(:class:`~fedciuic.aggregator.round.AggregatorRound`): this module only schedules.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from fedciuic.aggregator.judge import Task, reason_of
from fedciuic.aggregator.round import AggregatorRound, Collecting, run_end_witnessed
from fedciuic.config import Schedule
from fedciuic.crypto import TaskKind, model_digest
from fedciuic.errors import FederationError
from fedciuic.secagg import (
    Phase,
    Refusal,
    Request,
    RingTooSmall,
    SecAggError,
    SecureSum,
    Session,
    SumWithheld,
    alignment,
    ring_bits,
    sum_bound,
    unpack_answer,
)
from fedciuic.wire import (
    DECLINED,
    FAILED,
    PULL_INTERVAL,
    SECAGG_ANSWER,
    SECAGG_REQUEST,
    SECURE,
    Arrival,
    Instruction,
    NoReply,
    RunEndNotice,
    Unread,
)

_logger = logging.getLogger("flwr")

#: Why a training reply that answers an earlier round is not used in a secure round.
LATE = "arrived after its round's secure sum; a secure round sums only its own updates"
#: Seconds a training round waits beyond twice the regions' timed local work: Flower's
#: polling, a ClientApp process per message, sealing and evaluation.
WAIT_MARGIN = 120.0


class Transport(Protocol):
    """How the loop reaches the regions; replies come back unread, for the round to read."""

    def nodes(self) -> list[int]: ...

    def identify(self, nodes: Sequence[int], timeout: float) -> dict[int, str]:
        """Each node's claimed region: unauthenticated, but instructions are signed for it."""
        ...

    def push(self, instructions: Mapping[int, Instruction]) -> dict[str, int]:
        """Message id -> node, for each message the federation took."""
        ...

    def pull(self, in_flight: Mapping[str, int]) -> list[tuple[str, Unread]]:
        """The replies come to ``in_flight`` (id -> node), each under the id it answers."""
        ...

    def query(self, notices: Mapping[int, RunEndNotice], timeout: float) -> list[Unread]: ...


@dataclass(frozen=True)
class Sent:
    """A message in flight; ``server_round`` is the round or buffered aggregate."""

    node: int
    kind: TaskKind
    server_round: int
    task: Task | None
    at: float


class Courier:
    """The bookkeeping of messages in flight, over any :class:`Transport`."""

    def __init__(
        self,
        transport: Transport,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        interval: float = PULL_INTERVAL,
    ) -> None:
        self.transport = transport
        self.clock = clock
        self.sleep = sleep
        self.interval = interval  # seconds between pulls while waiting
        self.in_flight: dict[str, Sent] = {}

    def busy(self, node: int) -> bool:
        return any(sent.node == node for sent in self.in_flight.values())

    def push(
        self, instructions: Mapping[int, Instruction], server_round: int, task: Task | None
    ) -> list[Sent]:
        now = self.clock()
        sent = {
            message_id: Sent(node, instructions[node].kind, server_round, task, now)
            for message_id, node in self.transport.push(instructions).items()
        }
        self.in_flight.update(sent)
        return list(sent.values())

    def pull(self) -> list[tuple[Sent, Unread]]:
        """The replies that have arrived, each with the message it answers."""
        if not self.in_flight:
            return []
        nodes = {message_id: sent.node for message_id, sent in self.in_flight.items()}
        got = [(self.in_flight.pop(i, None), reply) for i, reply in self.transport.pull(nodes)]
        return [(sent, reply) for sent, reply in got if sent is not None]

    def forget_gone(self, connected: Iterable[int]) -> None:
        """A node that left the federation will not answer: nothing of it is in flight."""
        alive = set(connected)
        self.in_flight = {k: s for k, s in self.in_flight.items() if s.node in alive}

    def wait(self) -> None:
        self.sleep(self.interval)


class Loop:
    """What every schedule shares; each implements :meth:`one` and :meth:`finish`."""

    def __init__(
        self,
        aggregator: AggregatorRound,
        transport: Transport,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        interval: float = PULL_INTERVAL,
    ) -> None:
        self.aggregator = aggregator
        self.transport = transport
        self.clock = clock
        self.sleep = sleep
        self.courier = Courier(transport, clock=clock, sleep=sleep, interval=interval)
        self.timeout = aggregator.schedule.round_timeout
        self._waited = False
        self._wait_said = False
        #: Replies pulled but not yet judged; the next aggregate takes them.
        self._carried: list[tuple[Sent, Unread]] = []
        #: The region each node said it serves; the round each unknown node was last asked.
        self._claimed: dict[int, str] = {}
        self._asked: dict[int, int] = {}

    @property
    def schedule(self) -> Schedule:
        return self.aggregator.schedule

    def run(
        self, adapter: Mapping[str, np.ndarray], num_rounds: int, first_round: int = 1
    ) -> dict[str, np.ndarray]:
        """Evaluate ``adapter`` (unless resuming), run the rounds; the final global adapter."""
        a = self.aggregator
        a.global_adapter = dict(adapter)
        if first_round == 1:
            _logger.info("[ROUND 0] evaluating the initial adapter in every region")
            a.heard(0, self._evaluate(0, self.wait_for_regions()))
            a.end(0)
        for server_round in range(first_round, num_rounds + 1):
            _logger.info("[ROUND %d/%d]", server_round, num_rounds)
            self.one(server_round)
        self.finish(num_rounds)
        return a.global_adapter

    def one(self, server_round: int) -> None:
        raise NotImplementedError

    def finish(self, num_rounds: int) -> None:
        """Updates still arriving after the last aggregate are logged and refused."""
        if self._refuse_late(num_rounds):
            self.aggregator.end(num_rounds)

    def _refuse_late(self, num_rounds: int) -> bool:
        """Refuse every update carried past the last aggregate; whether there was any."""
        late, self._carried = self._carried, []
        after_end = f"arrived after the run's last aggregate (round {num_rounds}); not used"
        self._late(num_rounds, late, self.aggregator.collecting(), refuse=after_end)
        return bool(late)

    def train_wait(self) -> float:
        """round-timeout, or twice the slowest region's timed local work (capped by
        local-time-budget) plus :data:`WAIT_MARGIN` where longer, so that an update a
        region spent privacy on is not lost to the clock. Warned of once."""
        local, timeout = self.aggregator.run.training, self.timeout
        timed = self.aggregator.step_seconds
        if not timed:
            return timeout
        region, slowest = max(timed.items(), key=lambda item: item[1])
        work = slowest * local.local_steps
        if local.local_time_budget > 0:
            work = min(work, local.local_time_budget)
        wait = max(timeout, 2 * work + WAIT_MARGIN)
        if wait > timeout and not self._wait_said:
            self._wait_said = True
            _logger.warning(
                "round-timeout %gs is shorter than the regions' local work: %s takes %.1fs per "
                "DP-SGD step x %d step(s) (timed on its hardware); training rounds wait up to "
                "%.0fs for updates. Raise round-timeout, or lower local-steps or set "
                "local-time-budget, to change it",
                timeout,
                region,
                slowest,
                local.local_steps,
                wait,
            )
        return wait

    def wait_for_regions(self) -> list[int]:
        """All connected nodes; only the first call waits for every region, until the deadline."""
        schedule = self.schedule
        expected = len(self.aggregator.run.regions)
        wait = 0.0 if self._waited else schedule.node_wait_timeout
        self._waited = True
        deadline = self.clock() + wait
        nodes = self.transport.nodes()
        while len(nodes) < expected and self.clock() < deadline:
            _logger.info("Waiting for regions: %d of %d connected", len(nodes), expected)
            self.sleep(1.0)
            nodes = self.transport.nodes()
        if len(nodes) < schedule.min_regions:
            raise FederationError(
                f"run config:node-wait-timeout: only {len(nodes)} of {expected} regions "
                f"connected within {wait:.0f}s (min-regions is "
                f"{schedule.min_regions}); start a SuperNode for each of "
                f"{', '.join(self.aggregator.run.regions)} or lower min-regions"
            )
        return sorted(nodes)

    def addresses(self, nodes: Sequence[int], server_round: int) -> dict[int, str]:
        """Each node's region; an unknown node is asked (once a round) and left out till it says."""
        unknown = [
            n for n in nodes if self.region_at(n) is None and self._asked.get(n) != server_round
        ]
        if unknown:
            self._asked.update(dict.fromkeys(unknown, server_round))
            for node, region in self.transport.identify(unknown, self.timeout).items():
                if region in self.aggregator.run.regions:
                    self._claimed[node] = region
                else:
                    _logger.warning(
                        "node %d says it serves %r, not a region of this run", node, region
                    )
        return {n: r for n in nodes if (r := self.region_at(n))}

    def region_at(self, node: int) -> str | None:
        """The region its signed replies name, else the one it said it serves."""
        return self.aggregator.regions_by_node.get(node) or self._claimed.get(node)

    def _send(
        self, kind: TaskKind, server_round: int, nodes: Sequence[int], task: Task | None = None
    ) -> list[int]:
        """The global adapter to each of ``nodes`` whose region is known, signed for its
        region and for ``task``'s own number where there is one; the nodes it went to."""
        a = self.aggregator
        signed_round = task.round if task is not None else server_round
        addressed = self.addresses(nodes, server_round)
        # hashed once for every region (nothing to sign without sealing)
        digest = model_digest(a.global_adapter) if addressed and a.sealing.signer else None
        instructions = {
            node: a.sign_instruction(signed_round, kind, a.global_adapter, region, digest)
            for node, region in addressed.items()
        }
        return [s.node for s in self.courier.push(instructions, server_round, task)]

    def _collect(
        self,
        asked: list[int],
        kind: TaskKind,
        server_round: int,
        timeout: float,
        take: Callable[[Arrival], None] | None = None,
    ) -> tuple[list[Arrival], list[tuple[Sent, Unread]], set[int]]:
        """Replies to this round's ``kind`` until every node waited for has answered or
        ``timeout`` has passed (a :class:`NoReply` for each that did not), what else
        arrived meanwhile, and every node heard from. ``take`` gets each reply instead."""
        deadline = self.clock() + timeout
        waiting = {n for n in asked if self.aggregator.waits_for(n)}
        answered: set[int] = set()
        mine: list[Arrival] = []
        other: list[tuple[Sent, Unread]] = []
        while True:
            for sent, reply in self.courier.pull():
                answered.add(sent.node)
                if sent.kind == kind and sent.server_round == server_round:
                    if take is None:
                        mine.append(reply)
                    else:
                        take(reply)
                    waiting.discard(sent.node)
                else:
                    other.append((sent, reply))
            if not waiting or self.clock() >= deadline:
                break
            self.courier.wait()
        mine += [NoReply(n, timeout) for n in sorted(waiting)]
        return mine, other, answered

    def _evaluate(self, server_round: int, nodes: list[int]) -> set[int]:
        """Every node evaluates the global adapter; the nodes heard from."""
        asked = self._send(TaskKind.EVALUATE, server_round, nodes)
        arrivals, late, heard = self._collect(asked, TaskKind.EVALUATE, server_round, self.timeout)
        self._carried += late  # updates among them count in the next round
        self.aggregator.evaluate(server_round, arrivals)
        return heard

    def _late(
        self,
        server_round: int,
        late: list[tuple[Sent, Unread]],
        into: Collecting,
        *,
        refuse: str = "",
    ) -> None:
        """Earlier messages' updates, judged into ``into`` or refused, so every one is logged."""
        for sent, reply in late:
            if sent.task is not None:  # a late evaluation only showed its node is alive
                self.aggregator.judge_train(server_round, reply, sent.task, into, refuse=refuse)

    def witness_run_end(self, timeout: float) -> None:
        """Send each region the signed ``run_end`` head and record its answer (best effort)."""
        a = self.aggregator
        # a node whose region is unknown took no part
        known = {n: r for n in sorted(self.transport.nodes()) if (r := self.region_at(n))}
        notices = a.sign_run_end(set(known.values()))
        if notices:
            replies = self.transport.query({n: notices[r] for n, r in known.items()}, timeout)
            run_end_witnessed(a, replies)


class SyncLoop(Loop):
    """Rounds: every region trains from the same global adapter, then evaluates it."""

    #: Why an update that answers an earlier round is refused ("": it joins this one).
    late_refusal = ""

    def one(self, server_round: int) -> None:
        """Every idle region trains; the round waits, aggregates, then idle regions evaluate."""
        a, courier = self.aggregator, self.courier
        nodes = self.wait_for_regions()
        courier.forget_gone(nodes)
        idle = [n for n in nodes if not courier.busy(n)]
        task = Task(server_round, a.version)
        asked = self._send(TaskKind.TRAIN, server_round, idle, task)
        into = a.collecting()
        carried, self._carried = self._carried, []
        self._late(server_round, carried, into, refuse=self.late_refusal)

        def judge(arrival: Arrival) -> None:
            a.judge_train(server_round, arrival, task, into)

        # Each update is opened and judged as it arrives, while slower regions train.
        unheard, late, heard = self._collect(
            asked, TaskKind.TRAIN, server_round, self.train_wait(), take=judge
        )
        self._late(server_round, late, into, refuse=self.late_refusal)
        for arrival in unheard:
            judge(arrival)
        heard |= self.aggregate(server_round, into)
        idle = [n for n in nodes if not courier.busy(n)]
        heard |= self._evaluate(server_round, idle)
        a.heard(server_round, heard)
        a.end(server_round)

    def aggregate(self, server_round: int, into: Collecting) -> set[int]:
        """Publish the round's aggregate (or withhold it); the nodes heard from doing so."""
        self.aggregator.publish(server_round, into)
        return set()


class BufferedLoop(Loop):
    """FedBuff: an aggregate as soon as buffer-size updates are in, weighted by staleness."""

    def one(self, server_round: int) -> None:
        """Each idle region not yet heard in this aggregate gets its next task; publish once
        buffer-size updates are accepted and allowed, or at round-timeout or when no more can
        come."""
        a, schedule, courier = self.aggregator, self.schedule, self.courier
        into = a.collecting()
        heard: set[int] = set()
        contributed: set[str] = set()  # one reply per region and aggregate
        deadline = self.clock() + self.train_wait()
        nodes = self.wait_for_regions()
        while True:
            courier.forget_gone(nodes)
            self.addresses(nodes, server_round)  # nodes new to the run say their region
            for node in nodes:
                if not courier.busy(node):
                    self._dispatch(server_round, node, contributed)
            pulled, self._carried = self._carried + courier.pull(), []
            for i, (sent, reply) in enumerate(pulled):
                if len(into.accepted) >= schedule.buffer_size and a.may_publish(into):
                    self._carried = pulled[i:]  # the next aggregate's, against the new version
                    break
                heard.add(sent.node)
                if sent.task is None:  # an evaluation's reply, late
                    a.evaluate(server_round, [reply], overall=False)
                    continue
                judged = a.judge_train(server_round, reply, sent.task, into)
                a.tasks.done(judged.label)
                contributed.add(judged.label)
            if len(into.accepted) >= schedule.buffer_size and a.may_publish(into):
                break
            expected = any(a.waits_for(s.node) for s in courier.in_flight.values())
            more = expected or self._can_dispatch(nodes, contributed)
            if not more or self.clock() >= deadline:
                break
            courier.wait()
            nodes = sorted(self.transport.nodes())
        a.publish(server_round, into)
        # A region still within round-timeout of its task has not missed anything: a
        # buffered aggregate is often shorter than a slow region's task.
        now = self.clock()
        wait = self.train_wait()
        working = {s.node for s in courier.in_flight.values() if now - s.at < wait}
        finished = {n for n in nodes if a.regions_by_node.get(n) in a.tasks.finished()}
        a.heard(server_round, heard | working | finished)
        a.end(server_round)

    def finish(self, num_rounds: int) -> None:
        """Every region evaluates the final adapter; updates in flight are awaited and refused."""
        _logger.info("[END] evaluating the final adapter in every region")
        self._evaluate(num_rounds, sorted(self.transport.nodes()))
        a, courier = self.aggregator, self.courier
        deadline = self.clock() + self.train_wait()
        while self.clock() < deadline:
            self._carried += courier.pull()
            if not any(
                s.task is not None and a.waits_for(s.node) for s in courier.in_flight.values()
            ):
                break
            courier.wait()
        self._refuse_late(num_rounds)
        a.end(num_rounds)

    def _can_dispatch(self, nodes: list[int], contributed: set[str]) -> bool:
        """Whether some idle node could still be sent something in this aggregate."""
        return any(
            (region := self.region_at(node)) is not None
            and region not in contributed
            and self.aggregator.tasks.can_send(region)
            for node in nodes
            if not self.courier.busy(node)
        )

    def _dispatch(self, server_round: int, node: int, contributed: set[str]) -> None:
        """An idle node's region's next task, unless none is left or it answered this aggregate."""
        a = self.aggregator
        region = self.region_at(node)
        if region is None or region in contributed:
            return
        task = a.tasks.send_again(region)
        if task is None:
            if not a.tasks.can_send(region):
                return
            task = a.tasks.send(region, a.version)
        if not self._send(TaskKind.TRAIN, server_round, [node], Task(task.task, task.version)):
            a.tasks.done(region)


class SecureLoop(SyncLoop):
    """Sync rounds whose aggregate is the mean of a secure sum (docs/secure-aggregation.md):
    each trained reply carries what its policy checks and no update; the accepted regions
    then run :mod:`fedciuic.secagg` through five more signed exchanges, and the survivors'
    unweighted mean is published or the round withheld; one ``secure_sum`` record."""

    late_refusal = LATE
    #: How far the run's last unmasked sum reached against its regions' norms
    #: (:func:`~fedciuic.secagg.ddp.alignment`); None before one, and after a sum is
    #: withheld: the next is scaled for a sum that cannot wrap.
    reach: float | None = None

    def aggregate(self, server_round: int, into: Collecting) -> set[int]:
        """The accepted regions' secure sum, published or withheld; the nodes heard from."""
        a = self.aggregator
        accepted = sorted(acc.region for acc in into.accepted)
        details: dict[str, object] = {"accepted": accepted, "threshold": a.run.unmask_threshold}
        heard: set[int] = set()
        sent: dict[str, int] = {}  # bytes of each region's answers, every phase
        mean, reasons = None, []
        survivors: tuple[str, ...] = ()
        secure: SecureSum | None = None
        try:
            norms = {acc.region: acc.metrics.update_norm for acc in into.accepted}
            session = self._session(server_round, norms, into.n)
            details |= {"session": session.sid().hex(), "scale": session.scale}
            if session.bound:
                details["bound"] = session.bound
            secure = SecureSum(session, a.sealing.bundles())
            total = secure.run(
                lambda phase, requests: self._exchange(
                    server_round, phase, requests, secure, heard, sent
                )
            )
            survivors = tuple(sorted(secure.masked))
            mean = secure.mean(total)
            if session.bound:  # how far this sum reached: the next one's scale
                reached = float(np.linalg.norm(mean)) * len(survivors)
                self.reach = alignment(reached, [norms[r] or 0.0 for r in survivors])
                details["reach"] = self.reach
        except (SumWithheld, SecAggError, RingTooSmall) as err:
            reasons = [f"secure sum: {err}"]
            survivors = ()
            self.reach = None
        if secure is not None:
            details |= secure.record()
        details["outcome"] = "withheld" if reasons else "unmasked"
        if reasons:
            details["reasons"] = reasons
        details["bytes"] = dict(sorted(sent.items()))
        a.journal.secure_sum(server_round, details, sent)
        summed = Collecting(into.accumulator, into.n, into.labels, into.judged)
        summed.accepted = [acc for acc in into.accepted if acc.region in survivors]
        a.publish(server_round, summed, mean=mean, withheld=reasons)
        return heard

    def _session(self, server_round: int, norms: Mapping[str, float | None], size: int) -> Session:
        """This round's session, scaled by the norms the regions sent, or by the clip."""
        a = self.aggregator
        settings = a.run.secure
        regions = sorted(norms)
        if len(regions) < a.run.unmask_threshold:
            raise SumWithheld(Phase.ADVERT, len(regions), a.run.unmask_threshold)
        normed = a.run.secure_norms and all(norms[r] is not None for r in regions)
        return Session.propose(
            run_id=a.federation_run,
            server_round=server_round,
            regions=tuple(regions),
            threshold=a.run.unmask_threshold,
            bits=ring_bits(
                settings.secure_ring_bits,
                regions=len(a.run.regions),
                size=size,
                distributed_dp=settings.distributed_noise_multiplier > 0,
                normed=a.run.secure_norms,
                measured=normed and self.reach is not None,
            ),
            size=size,
            clip=a.run.compression.max_update_norm,
            noise=settings.distributed_noise_multiplier,
            bound=sum_bound([norms[r] or 0.0 for r in regions], self.reach) if normed else 0.0,
        )

    def _exchange(
        self,
        server_round: int,
        phase: Phase,
        requests: Mapping[str, Request],
        secure: SecureSum,
        heard: set[int],
        sent: dict[str, int],
    ) -> list[object]:
        """Each region its signed request; the messages answered within round-timeout and
        signed by that region (bytes in ``sent``), any other answer refused on the record."""
        a, courier = self.aggregator, self.courier
        node_of = {region: node for node, region in a.regions_by_node.items()}
        pushed: dict[int, str] = {}
        for region, req in requests.items():
            node = node_of.get(region)
            if node is None or courier.busy(node):
                secure.refused.append(Refusal(phase, region, "not reachable (busy or gone)"))
                continue
            data = np.frombuffer(req.model_dump_json().encode(), dtype=np.uint8)
            instruction = a.sign_instruction(
                server_round, TaskKind.SECAGG, {SECAGG_REQUEST: data}, region
            )
            for message in courier.push({node: instruction}, server_round, None):
                pushed[message.node] = region
        arrivals, late, answered = self._collect(
            list(pushed), TaskKind.SECAGG, server_round, self.timeout
        )
        self._carried += late
        heard |= answered
        messages: list[object] = []
        for arrival in arrivals:
            region = pushed[arrival.node_id]
            if isinstance(arrival, NoReply):
                secure.refused.append(Refusal(phase, region, "no answer within round-timeout"))
                continue
            try:
                reply = arrival.read() if isinstance(arrival, Unread) else arrival
                if reply.status == FAILED:  # Flower's error: the node or its relay failed
                    raise SecAggError(f"no answer: {reply.reason}")
                sender = a.judge.authenticate(reply, server_round)
                if sender != region:
                    raise SecAggError(f"the answer is signed by {sender!r}")
                if reply.status == DECLINED:
                    raise SecAggError(f"declined: {reply.reason}")
                if reply.status != SECURE or reply.arrays is None:
                    raise SecAggError(f"a {reply.status!r} reply")
                answer = reply.arrays[SECAGG_ANSWER].tobytes()
                sent[region] = sent.get(region, 0) + len(answer)
                messages.append(unpack_answer(answer, phase))
            except Exception as err:  # one region's answer, refused alone
                secure.refused.append(Refusal(phase, region, reason_of(err)))
        return messages


def loop_for(
    aggregator: AggregatorRound,
    transport: Transport,
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    interval: float = PULL_INTERVAL,
) -> Loop:
    """The run's schedule, chosen once from ``aggregation-mode``."""
    kind: type[Loop] = BufferedLoop if aggregator.schedule.buffered else SyncLoop
    if aggregator.run.secure.secure_aggregation:  # sync rounds only (the run config checks)
        kind = SecureLoop
    return kind(aggregator, transport, clock=clock, sleep=sleep, interval=interval)
