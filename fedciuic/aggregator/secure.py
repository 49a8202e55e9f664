"""Secure rounds (``secure-aggregation = true``; docs/secure-aggregation.md): the
aggregator learns the sum of the regions' updates and nothing else.

A secure round is a sync round in which each region's trained reply carries what its
policy is checked against (metrics, privacy figures, its policy's hash) and no update.
The regions accepted then run a secure sum (:mod:`fedciuic.secagg`) in five more
messages, each an instruction the aggregator signs: adverts, shares, masked vectors,
consents, reveals. The aggregator relays what the regions send each other, checks every
message, and publishes the survivors' mean (unweighted: weights would need each
update); fewer survivors than the threshold withhold the round. Everything is on the
aggregator's record as one ``secure_sum`` event.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from fedciuic.aggregator.judge import Task, reason_of
from fedciuic.aggregator.loop import SyncLoop
from fedciuic.aggregator.round import Collecting
from fedciuic.audit import Event
from fedciuic.crypto import TaskKind
from fedciuic.secagg import (
    Phase,
    Refusal,
    Ring,
    RingTooSmall,
    SecAggError,
    SecureSum,
    Session,
    SumWithheld,
    from_ring,
)
from fedciuic.secagg.ddp import DistributedDp, scale_for
from fedciuic.secagg.messages import Request
from fedciuic.wire import DECLINED, SECAGG_ANSWER, SECAGG_REQUEST, SECURE, NoReply, Unread

#: Why a training reply that answers an earlier round is not used in a secure round.
LATE = "arrived after its round's secure sum; a secure round sums only its own updates"
#: Standard deviations of the noise a sum's norm may carry before it is out of range.
_SPREAD = 6.0


class SecureLoop(SyncLoop):
    """Sync rounds whose aggregate is the mean of a secure sum."""

    def one(self, server_round: int) -> None:
        a, courier = self.aggregator, self.courier
        nodes = self.wait_for_regions()
        courier.forget_gone(nodes)
        idle = [n for n in nodes if not courier.busy(n)]
        task = Task(server_round, a.version)
        asked = self._send(TaskKind.TRAIN, server_round, idle, task)
        arrivals, late, heard = self._collect(
            asked, TaskKind.TRAIN, server_round, self.train_wait()
        )
        into = a.collecting()
        late, self._carried = self._carried + late, []
        self._late(server_round, late, into, refuse=LATE)
        for arrival in arrivals:
            a.judge_train(server_round, arrival, task, into)
        heard |= self.secure_sum(server_round, into)
        idle = [n for n in nodes if not courier.busy(n)]
        heard |= self._evaluate(server_round, idle)
        a.heard(server_round, heard)
        a.end(server_round)

    def secure_sum(self, server_round: int, into: Collecting) -> set[int]:
        """The secure sum of the accepted regions' updates, published or withheld; the
        nodes heard from."""
        a = self.aggregator
        settings = a.run.secure
        accepted = sorted(acc.region for acc in into.accepted)
        details: dict[str, object] = {"accepted": accepted, "threshold": settings.threshold}
        heard: set[int] = set()
        mean, reasons = None, []
        survivors: tuple[str, ...] = ()
        secure: SecureSum | None = None
        try:
            session = self._session(server_round, accepted, into.n)
            details |= {"session": session.sid().hex(), "scale": session.scale}
            secure = SecureSum(session, a.sealing.bundles())
            survivors, total = self._phases(server_round, session, secure, heard)
            mean = self._mean(session, survivors, total)
        except (SumWithheld, SecAggError, RingTooSmall) as err:
            reasons = [f"secure sum: {err}"]
            survivors = ()
        if secure is not None:
            details |= _taken(secure)
        details["outcome"] = "withheld" if reasons else "unmasked"
        if reasons:
            details["reasons"] = reasons
        a.journal.note(server_round, Event.SECURE_SUM, **details)
        summed = Collecting(into.accumulator, into.n, into.labels, into.judged)
        summed.accepted = [acc for acc in into.accepted if acc.region in survivors]
        a.publish(server_round, summed, mean=mean, withheld=reasons)
        return heard

    def _session(self, server_round: int, regions: list[str], size: int) -> Session:
        a = self.aggregator
        settings = a.run.secure
        if len(regions) < settings.threshold:
            raise SumWithheld(Phase.ADVERT, len(regions), settings.threshold)
        ring = Ring(settings.ring_bits)
        scale = scale_for(
            regions=len(regions),
            threshold=settings.threshold,
            clip=settings.clip,
            noise=settings.noise_multiplier,
            dim=size,
            ring=ring,
        )
        return Session(
            run_id=a.federation_run,
            server_round=server_round,
            regions=tuple(regions),
            threshold=settings.threshold,
            bits=ring.bits,
            size=size,
            clip=settings.clip,
            scale=scale,
            noise=settings.noise_multiplier,
        )

    def _phases(
        self, server_round: int, session: Session, secure: SecureSum, heard: set[int]
    ) -> tuple[tuple[str, ...], np.ndarray]:
        """The five exchanges; the survivors and their sum (ring elements)."""

        def ask(phase: Phase, requests: Mapping[str, Request]) -> list[bytes]:
            return self._exchange(server_round, phase, requests, secure, heard)

        def request(phase: Phase, **fields: object) -> Request:
            return Request.model_validate({"phase": phase, "session": session, **fields})

        adverts = secure.take_adverts(
            ask(Phase.ADVERT, {r: request(Phase.ADVERT) for r in session.regions})
        )
        shared = secure.take_shares(
            ask(Phase.SHARES, {v.region: request(Phase.SHARES, adverts=adverts) for v in adverts})
        )
        survivors = secure.take_masked(
            ask(
                Phase.MASKED,
                {
                    r: request(Phase.MASKED, shared=shared, items=secure.items_for(r))
                    for r in shared
                },
            )
        )
        # every region that shared is shown the survivors: one that sent its masked vector
        # and is named dropped refuses, and says so on its record
        consents = secure.take_consents(
            ask(Phase.CONSENT, {r: request(Phase.CONSENT, survivors=survivors) for r in shared})
        )
        total = secure.take_reveals(
            ask(
                Phase.REVEAL,
                {
                    c.region: request(Phase.REVEAL, survivors=survivors, consents=consents)
                    for c in consents
                },
            )
        )
        return survivors, total

    def _exchange(
        self,
        server_round: int,
        phase: Phase,
        requests: Mapping[str, Request],
        secure: SecureSum,
        heard: set[int],
    ) -> list[bytes]:
        """Each region its request, signed; the messages of those that answer within
        round-timeout, each from the region its signature names. A region that declines,
        or whose answer is not what it should be, is refused on the record."""
        a, courier = self.aggregator, self.courier
        node_of = {region: node for node, region in a.regions_by_node.items()}
        pushed: dict[int, str] = {}
        for region, req in requests.items():
            node = node_of.get(region)
            if node is None or courier.busy(node):
                secure.refused.append(Refusal(phase, region, "not reachable (busy or gone)"))
                continue
            data = np.frombuffer(req.model_dump_json().encode(), dtype=np.uint8)
            instruction = a.sign_instruction(server_round, TaskKind.SECAGG, {SECAGG_REQUEST: data})
            for sent in courier.push(instruction, [node], server_round, None):
                pushed[sent.node] = region
        arrivals, late, answered = self._collect(
            list(pushed), TaskKind.SECAGG, server_round, self.timeout
        )
        self._carried += late
        heard |= answered
        messages = []
        for arrival in arrivals:
            region = pushed[arrival.node_id]
            if isinstance(arrival, NoReply):
                secure.refused.append(Refusal(phase, region, "no answer within round-timeout"))
                continue
            try:
                reply = arrival.read() if isinstance(arrival, Unread) else arrival
                sender = a.judge.authenticate(reply, server_round)
                if sender != region:
                    raise SecAggError(f"the answer is signed by {sender!r}")
                if reply.status == DECLINED:
                    raise SecAggError(f"declined: {reply.reason}")
                if reply.status != SECURE or reply.arrays is None:
                    raise SecAggError(f"a {reply.status!r} reply")
                messages.append(reply.arrays[SECAGG_ANSWER].tobytes())
            except Exception as err:  # one region's answer, refused alone
                secure.refused.append(Refusal(phase, region, reason_of(err)))
        return messages

    def _mean(self, session: Session, survivors: tuple[str, ...], total: np.ndarray) -> np.ndarray:
        """The survivors' mean update, once their sum is in range: each region clipped its
        update before masking, so a sum past ``survivors`` clipped updates and the noise
        means some region's vector was not what it declared."""
        ring = Ring(session.bits)
        summed = from_ring(total, scale=1.0, ring=ring)  # ring units
        ddp = DistributedDp(
            session.clip, session.scale, session.noise, session.threshold, session.size
        )
        n = len(survivors)
        bound = n * ddp.l2 + _SPREAD * math.sqrt(session.size * n * ddp.share_variance)
        norm = float(np.linalg.norm(summed))
        if norm > bound:
            raise SecAggError(
                f"the sum of {n} updates has norm {norm / session.scale:.4g}, over the "
                f"{bound / session.scale:.4g} that {n} updates clipped to {session.clip:g} "
                "(and their noise) can reach: some region's masked vector is not what it "
                "declared; not published"
            )
        return summed / session.scale / n


def _taken(secure: SecureSum) -> dict[str, object]:
    """Who took part in each phase, and what was refused, for the record."""
    return {
        "joined": sorted(secure.adverts),
        "shared": sorted(secure.shares),
        "survivors": sorted(secure.vectors),
        "dropped": sorted(set(secure.shares) - set(secure.vectors)),
        "consents": sorted(secure.consents),
        "revealed": sorted(secure.reveals),
        "refused": [
            {"phase": r.phase.value, "region": r.region, "reason": r.reason[:300]}
            for r in secure.refused
        ],
    }
