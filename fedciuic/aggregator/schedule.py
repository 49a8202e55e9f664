"""Who is asked what, and when, without Flower: which regions are available, and in
buffered mode each region's task count and the task it has in flight.

A region that misses ``max-missed-rounds`` rounds in a row is marked unavailable: rounds
stop waiting for it, but it is still asked, and any reply marks it available again. The
state travels in the checkpoint, so a resumed run knows who was unavailable and what each
region was doing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fedciuic.errors import FedciuicError


class ScheduleError(FedciuicError):
    """A checkpoint's schedule that does not fit this run."""


@dataclass(frozen=True)
class Changes:
    """Regions newly marked unavailable, and regions back, at the end of a round."""

    unavailable: list[str] = field(default_factory=list)
    rejoined: list[str] = field(default_factory=list)


class Availability:
    """Consecutive missed rounds per region, and those marked unavailable."""

    def __init__(self, regions: Iterable[str], max_missed: int) -> None:
        self.max_missed = max_missed  # 0: never marked
        self.missed = dict.fromkeys(regions, 0)
        self.unavailable: set[str] = set()

    def round_ended(self, answered: Iterable[str]) -> Changes:
        """Count a round: regions in ``answered`` replied (even a decline), the others missed it."""
        heard = set(answered)
        changes = Changes()
        for region in self.missed:
            if region in heard:
                self.missed[region] = 0
                if region in self.unavailable:
                    self.unavailable.discard(region)
                    changes.rejoined.append(region)
                continue
            self.missed[region] += 1
            gone = self.max_missed and self.missed[region] >= self.max_missed
            if gone and region not in self.unavailable:
                self.unavailable.add(region)
                changes.unavailable.append(region)
        return changes

    def state(self) -> dict[str, Any]:
        return {"missed": dict(self.missed), "unavailable": sorted(self.unavailable)}

    def restore(self, state: Mapping[str, Any]) -> None:
        """What a checkpoint saw; regions it does not know start afresh."""
        try:
            missed = {str(k): int(v) for k, v in dict(state["missed"]).items()}
            unavailable = {str(r) for r in state["unavailable"]}
        except (KeyError, TypeError, ValueError) as err:
            raise ScheduleError(f"checkpoint: unreadable availability state ({err})") from None
        for region in self.missed:
            self.missed[region] = missed.get(region, 0)
        self.unavailable = unavailable & set(self.missed)


@dataclass(frozen=True)
class InFlight:
    """A buffered task's number (what its reply is signed for) and its global version."""

    task: int
    version: int


class Tasks:
    """Buffered mode: at most ``limit`` tasks a region (its DP budget), one in flight."""

    def __init__(self, regions: Iterable[str], limit: int) -> None:
        self.limit = limit
        self.sent = dict.fromkeys(regions, 0)
        self.in_flight: dict[str, InFlight] = {}
        #: Tasks a checkpoint saw in flight, asked for again once after a resume.
        self.resend: dict[str, InFlight] = {}

    def can_send(self, region: str) -> bool:
        return (
            region in self.sent and region not in self.in_flight and self.sent[region] < self.limit
        )

    def send(self, region: str, version: int) -> InFlight:
        """The region's next task, from global ``version``."""
        if not self.can_send(region):
            raise ScheduleError(f"region {region} has a task in flight or none left")
        self.sent[region] += 1
        task = InFlight(self.sent[region], version)
        self.in_flight[region] = task
        return task

    def done(self, region: str) -> None:
        self.in_flight.pop(region, None)

    def finished(self) -> set[str]:
        """Regions with all their tasks done: nothing more is expected, so they miss nothing."""
        return {r for r, n in self.sent.items() if n >= self.limit and r not in self.in_flight}

    def state(self) -> dict[str, Any]:
        return {
            "sent": dict(self.sent),
            "in_flight": {r: [t.task, t.version] for r, t in self.in_flight.items()},
        }

    def restore(self, state: Mapping[str, Any]) -> None:
        """A checkpoint's tasks. One in flight is asked for again under the same number: the
        region resends the update it kept (no second release)."""
        try:
            sent = {str(k): int(v) for k, v in dict(state["sent"]).items()}
            flying = {
                str(r): InFlight(int(t), int(v)) for r, (t, v) in dict(state["in_flight"]).items()
            }
        except (KeyError, TypeError, ValueError) as err:
            raise ScheduleError(f"checkpoint: unreadable buffered tasks ({err})") from None
        for region in self.sent:
            self.sent[region] = sent.get(region, 0)
        self.resend = {r: t for r, t in flying.items() if r in self.sent}

    def send_again(self, region: str) -> InFlight | None:
        """The checkpointed task this region had in flight, once, for resending."""
        task = self.resend.pop(region, None)
        if task is not None:
            self.in_flight[region] = task
        return task
