"""What a run records: ``metrics.json`` per round, and how a run ends.

``metrics.json`` is rewritten atomically after every round, so a crash leaves the last
complete round, never a half-written file. ``run.status`` ``running`` means still running
or died without a word (``fedciuic simulate`` and ``start.sh`` mark it ``interrupted``).
"""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from fedciuic.record.metrics import (
    AggregateEntry,
    DecisionEntry,
    Duplicate,
    EvalEntry,
    RoundRecord,
    RunHeader,
    RunMetrics,
    RunStatus,
    TrainEntry,
)

METRICS_FILE = "metrics.json"
ADAPTER_DIR = "adapter"
SUMMARY_FILE = "summary.txt"


_saves = itertools.count()


class RunRecorder:
    """Collects what happened in each round and writes it to ``directory``; entries are
    validated here, so a field the model does not name fails at the writer, not a reader."""

    def __init__(
        self,
        directory: Path,
        run: dict[str, Any],
        *,
        summary: Callable[[RunMetrics], str] | None = None,
    ) -> None:
        self.directory = directory
        self.summary = summary  # writes SUMMARY_FILE when the run finishes
        directory.mkdir(parents=True, exist_ok=True)
        self.data = RunMetrics(
            run=RunHeader.model_validate(
                {**run, "status": RunStatus.RUNNING, "started": utc_now()}
            ),
            rounds={},
        )
        # A signal handler may finish the run while the run's own thread saves it.
        self._lock = threading.RLock()
        self.save()

    def _round(self, server_round: int) -> RoundRecord:
        return self.data.rounds.setdefault(server_round, RoundRecord(train={}, eval={}))

    def _duplicate(self, current: RoundRecord, region: str, entry: dict[str, Any]) -> None:
        current.duplicates = [
            *current.duplicates,
            Duplicate.model_validate({"region": region, **entry}),
        ]

    def record_train(self, server_round: int, region: str, entry: dict[str, Any]) -> None:
        """Record a region's train reply; a second reply from the same region (a replay)
        goes to ``duplicates`` and never overwrites the first."""
        current = self._round(server_round)
        if region in current.train:
            self._duplicate(current, region, entry)
        else:
            current.train[region] = TrainEntry.model_validate(entry)

    def record_eval(self, server_round: int, region: str, entry: dict[str, Any]) -> None:
        """Record a region's evaluation; a second one goes to ``duplicates``."""
        current = self._round(server_round)
        if region in current.eval:
            self._duplicate(current, region, entry)
        else:
            current.eval[region] = EvalEntry.model_validate(entry)

    def record_secure_bytes(self, server_round: int, sent: Mapping[str, int]) -> None:
        """What each region sent in the round's secure sum, beside its trained reply."""
        current = self._round(server_round)
        for region, size in sent.items():
            if region in current.train:
                current.train[region].secure_bytes = size

    def record_aggregate(self, server_round: int, entry: dict[str, Any]) -> None:
        self._round(server_round).aggregate = AggregateEntry.model_validate(entry)

    def record_availability(
        self, server_round: int, unavailable: list[str], rejoined: list[str]
    ) -> None:
        """Regions marked unavailable, or back, at the end of this round."""
        current = self._round(server_round)
        current.unavailable = [*current.unavailable, *unavailable]
        current.rejoined = [*current.rejoined, *rejoined]

    def record_end(self, server_round: int) -> None:
        """When the round (training and evaluation) ended, as Unix time."""
        self._round(server_round).ended_at = time.time()

    def record_decision(self, server_round: int, decision: dict[str, Any]) -> None:
        """A policy decision (accept or reject, every reason, the policy hash)."""
        current = self._round(server_round)
        current.decisions = [*current.decisions, DecisionEntry.model_validate(decision)]

    def finish(self, status: RunStatus, **extra: Any) -> None:
        """End the run with ``status`` and ``extra`` run fields, saved, then summed up."""
        with self._lock:
            run = self.data.run
            for name, value in {"status": status, "finished": utc_now(), **extra}.items():
                setattr(run, name, value)
            self.save()
            if self.summary is not None:
                text = self.summary(self.data)
                (self.directory / SUMMARY_FILE).write_text(text + "\n", encoding="utf-8")

    def finish_unless_finished(self, status: RunStatus, **extra: Any) -> bool:
        """Finish unless finished already (an exit handler); True if it did."""
        with self._lock:
            if self.data.run.status != RunStatus.RUNNING:
                return False
            self.finish(status, **extra)
            return True

    def save(self) -> None:
        with self._lock:
            save_metrics(self.directory / METRICS_FILE, self.data)


def save_metrics(target: Path, data: RunMetrics) -> None:
    """metrics.json, atomically (readers poll it): a temporary file of its own, renamed."""
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{next(_saves)}.tmp")
    tmp.write_text(json.dumps(data.dump(), indent=2, sort_keys=True), encoding="utf-8")
    os.replace(tmp, target)


def published_rounds(data: RunMetrics) -> list[int]:
    """The rounds whose aggregate was published (the global adapter moved)."""
    return sorted(n for n, rnd in data.rounds.items() if rnd.aggregate and rnd.aggregate.published)


def no_aggregate_reasons(data: RunMetrics) -> list[str]:
    """Why nothing was published: each region's distinct statuses and reasons, then each
    withheld aggregate."""
    numbers = sorted(n for n in data.rounds if n > 0)
    lines: list[str] = []
    for region in data.run.regions:
        seen: dict[tuple[str, str], list[int]] = {}
        for number, entry in data.trained(region):
            if number > 0:
                seen.setdefault((entry.status, entry.reason or ""), []).append(number)
        if not seen:
            lines.append(f"{region}: no reply in any round")
        for (status, reason), where in seen.items():
            rounds_text = f"round{'s' if len(where) > 1 else ''} {', '.join(map(str, where))}"
            lines.append(f"{region}: {status} in {rounds_text}" + (f": {reason}" if reason else ""))
    for number in numbers:
        aggregate = data.rounds[number].aggregate
        if aggregate is not None and not aggregate.published:
            reasons = "; ".join(aggregate.reasons) or "no reason recorded"
            lines.append(f"aggregate withheld in round {number}: {reasons}")
    return lines


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
