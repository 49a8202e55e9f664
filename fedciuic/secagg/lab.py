"""A secure sum run in one process, each request and answer passed as it travels: what
the tests and the benchmark drive, with regions that stop answering at a chosen phase.
In a federation Flower carries them (``fedciuic.aggregator.loop.SecureLoop``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from fedciuic.crypto import PublicBundle
from fedciuic.secagg.aggregator import Refusal, SecureSum
from fedciuic.secagg.messages import (
    FromRegion,
    Phase,
    Request,
    SecAggError,
    Session,
    pack_answer,
    unpack_answer,
)
from fedciuic.secagg.region import SecureSumRegion

#: Between a region's reply and the aggregator: a relay may alter what it carries.
Tamper = Callable[[Phase, str, bytes], bytes | None]


def honest(phase: Phase, region: str, data: bytes) -> bytes | None:
    return data


@dataclass
class Run:
    """The aggregator's end, bytes sent and received, seconds per phase, and refusals."""

    aggregator: SecureSum
    sent: dict[str, int] = field(default_factory=dict)
    #: Bytes each region sent in each phase.
    by_phase: dict[str, dict[str, int]] = field(default_factory=dict)
    received: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    refusals: dict[str, str] = field(default_factory=dict)


def run_secure_sum(
    session: Session,
    regions: Mapping[str, SecureSumRegion],
    encoded: Mapping[str, np.ndarray],
    bundles: Mapping[str, PublicBundle],
    *,
    silent: Mapping[Phase, set[str]] | None = None,
    relay: Tamper = honest,
) -> tuple[np.ndarray, Run]:
    """Every phase over ``regions`` (``silent[phase]`` stop answering); the sum and the run."""
    quiet: set[str] = set()
    run = Run(SecureSum(session, bundles))
    agg = run.aggregator

    #: The phase whose answers the aggregator is taking, and since when.
    taking: list[tuple[Phase, float]] = []

    def settle() -> None:
        """The aggregator's time in the last phase asked, until the next one's requests."""
        if taking:
            phase, since = taking.pop()
            run.seconds[f"aggregator {phase.value}"] = time.perf_counter() - since

    def ask(phase: Phase, requests: Mapping[str, Request]) -> list[object]:
        """Each region its request; the answers packed, relayed and unpacked as in a loop."""
        settle()
        start = time.perf_counter()
        quiet.update((silent or {}).get(phase, set()))
        replies: list[object] = []
        for region, request in requests.items():
            if region in quiet:
                continue
            run.received[region] = run.received.get(region, 0) + len(request.model_dump_json())
            try:
                message = answer(regions[region], request)
            except SecAggError as err:
                run.refusals[region] = str(err)
                continue
            packed = pack_answer(message)
            run.sent[region] = run.sent.get(region, 0) + len(packed)
            run.by_phase.setdefault(phase.value, {})[region] = len(packed)
            data = relay(phase, region, packed)
            if data is None:
                continue
            try:
                replies.append(unpack_answer(data, phase))
            except SecAggError as err:
                run.aggregator.refused.append(Refusal(phase, region, str(err)))
        run.seconds[phase.value] = time.perf_counter() - start
        taking.append((phase, time.perf_counter()))
        return replies

    def answer(region: SecureSumRegion, request: Request) -> FromRegion:
        match request.phase:
            case Phase.ADVERT:
                return region.advertise(session, encoded[region.me])
            case Phase.SHARES:
                return region.share(session, request.adverts)
            case Phase.MASKED:
                return region.masked(session, request.shared, request.items)
            case Phase.CONSENT:
                return region.consent(session, request.survivors)
        return region.reveal(session, request.survivors, request.consents)

    try:
        total = agg.run(ask)
    finally:
        settle()
    return total, run
