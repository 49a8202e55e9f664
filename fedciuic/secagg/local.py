"""A secure sum run in one process, its messages passed as their JSON: what the tests
and the benchmark drive, with regions that stop answering at a chosen phase. Flower's
relay takes its place in a federation; the two ends are the same objects."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
from pydantic import BaseModel

from fedciuic.crypto import PublicBundle
from fedciuic.secagg.aggregator import SecureSum
from fedciuic.secagg.messages import Phase, SecAggError, Session
from fedciuic.secagg.region import SecureSumRegion

_T = TypeVar("_T")

#: Between a region's reply and the aggregator: a relay may alter what it carries.
Tamper = Callable[[Phase, str, bytes], bytes | None]


def honest(phase: Phase, region: str, data: bytes) -> bytes | None:
    return data


def wire_size(message: object) -> int:
    """The bytes a message carries, as a binary wire would: each byte field as is, each
    share 66 bytes, each name as text (JSON's base64 is not counted)."""
    if isinstance(message, BaseModel):
        return sum(wire_size(getattr(message, name)) for name in type(message).model_fields)
    if isinstance(message, bytes):
        return len(message)
    if isinstance(message, str):
        return len(message.encode())
    if isinstance(message, int):
        return 66 if message.bit_length() > 64 else 8
    if isinstance(message, dict):
        return sum(wire_size(k) + wire_size(v) for k, v in message.items())
    if isinstance(message, tuple | list):
        return sum(wire_size(v) for v in message)
    return 0


@dataclass
class Run:
    """What one in-process secure sum did: the aggregator's end, the bytes each region
    sent and was sent, seconds per phase, and the regions' refusals."""

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
    """Run every phase over ``regions``; a region named in ``silent[phase]`` answers
    nothing from that phase on. Returns the survivors' sum (ring elements) and the run;
    raises :class:`~fedciuic.secagg.aggregator.SumWithheld` when a phase falls short."""
    quiet: set[str] = set()
    run = Run(SecureSum(session, bundles))
    agg = run.aggregator

    def ask(phase: Phase, who: list[str], call: Callable[[str], object], given: int) -> list[bytes]:
        start = time.perf_counter()
        quiet.update((silent or {}).get(phase, set()))
        replies = []
        for region in who:
            if region in quiet:
                continue
            run.received[region] = run.received.get(region, 0) + given
            try:
                message = call(region)
            except SecAggError as err:
                run.refusals[region] = str(err)
                continue
            size = wire_size(message)
            run.sent[region] = run.sent.get(region, 0) + size
            run.by_phase.setdefault(phase.value, {})[region] = size
            data = relay(phase, region, message.model_dump_json().encode())  # type: ignore[attr-defined]
            if data is not None:
                replies.append(data)
        run.seconds[phase.value] = time.perf_counter() - start
        return replies

    def timed(phase: Phase, take: Callable[[list[bytes]], _T], replies: list[bytes]) -> _T:
        """The aggregator's part of a phase, timed apart from the regions'."""
        start = time.perf_counter()
        try:
            return take(replies)
        finally:
            run.seconds[f"aggregator {phase.value}"] = time.perf_counter() - start

    joined = list(session.regions)
    adverts = timed(
        Phase.ADVERT,
        agg.take_adverts,
        ask(Phase.ADVERT, joined, lambda r: regions[r].advertise(session, encoded[r]), 0),
    )
    to_share = [a.region for a in adverts]
    shared = timed(
        Phase.SHARES,
        agg.take_shares,
        ask(
            Phase.SHARES, to_share, lambda r: regions[r].share(session, adverts), wire_size(adverts)
        ),
    )
    survivors = timed(
        Phase.MASKED,
        agg.take_masked,
        ask(
            Phase.MASKED,
            list(shared),
            lambda r: regions[r].masked(session, shared, agg.items_for(r)),
            wire_size(shared) + max(wire_size(agg.items_for(r)) for r in shared),
        ),
    )
    # every region that shared is shown the survivors: one named dropped that did send
    # refuses, and says so on its record
    consents = timed(
        Phase.CONSENT,
        agg.take_consents,
        ask(Phase.CONSENT, list(shared), lambda r: regions[r].consent(session, survivors), 0),
    )
    total = timed(
        Phase.REVEAL,
        agg.take_reveals,
        ask(
            Phase.REVEAL,
            [c.region for c in consents],
            lambda r: regions[r].reveal(session, survivors, consents),
            wire_size(consents),
        ),
    )
    return total, run
