"""What a run records: ``metrics.json`` per round, and how a run ends.


``metrics.json`` is rewritten atomically after every round, so a crash leaves the
last complete round on disk, never a half-written file.

A run ends with one of these statuses (``run.status`` in metrics.json):

* ``completed``: every round ran and at least one aggregate was published; the final
  global adapter is saved in ``adapter/``.
* ``no-aggregate``: every round ran but no aggregate was ever published (no region
  trained, or every aggregate was withheld); the global adapter is the initial one
  and is not saved. ``run.reasons`` says why, per region.
* ``failed``: the run stopped on an error (``run.error``).
* ``interrupted``: the run was stopped (a signal, or its process was killed) before
  it ended; what it recorded up to then stays.
* ``running``: still running, or its process died without a word (``fedciuic
  simulate`` and ``start.sh`` mark such a run ``interrupted`` when they stop it).
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

METRICS_FILE = "metrics.json"
ADAPTER_DIR = "adapter"
SUMMARY_FILE = "summary.txt"

RUNNING = "running"
COMPLETED = "completed"
NO_AGGREGATE = "no-aggregate"
FAILED = "failed"
INTERRUPTED = "interrupted"

_saves = itertools.count()


class RunRecorder:
    """Collects what happened in each round and writes it to ``directory``."""

    def __init__(
        self,
        directory: Path,
        run: dict[str, Any],
        *,
        summary: Callable[[dict[str, Any]], str] | None = None,
    ) -> None:
        self.directory = directory
        self.summary = summary  # writes SUMMARY_FILE when the run finishes
        directory.mkdir(parents=True, exist_ok=True)
        self.data: dict[str, Any] = {
            "run": {**run, "status": RUNNING, "started": utc_now()},
            "rounds": {},
        }
        # A signal handler may finish the run while the run's own thread saves it.
        self._lock = threading.RLock()
        self.save()

    def _round(self, server_round: int) -> dict[str, Any]:
        rounds: dict[str, dict[str, Any]] = self.data["rounds"]
        return rounds.setdefault(str(server_round), {"train": {}, "eval": {}})

    def record_train(self, server_round: int, region: str, entry: dict[str, Any]) -> None:
        """Record a region's train reply; a second reply from the same region (a replay)
        goes to ``duplicates`` and never overwrites the first."""
        current = self._round(server_round)
        if region in current["train"]:
            current.setdefault("duplicates", []).append({"region": region, **entry})
        else:
            current["train"][region] = entry

    def record_eval(self, server_round: int, region: str, entry: dict[str, Any]) -> None:
        """Record a region's evaluation; a second one goes to ``duplicates``."""
        current = self._round(server_round)
        if region in current["eval"]:
            current.setdefault("duplicates", []).append({"region": region, **entry})
        else:
            current["eval"][region] = entry

    def record_aggregate(self, server_round: int, entry: dict[str, Any]) -> None:
        self._round(server_round)["aggregate"] = entry

    def record_end(self, server_round: int) -> None:
        """When the round (training and evaluation) ended, as Unix time: per-round wall
        times are the differences."""
        self._round(server_round)["ended_at"] = time.time()

    def record_decision(self, server_round: int, decision: dict[str, Any]) -> None:
        """A policy decision (accept or reject, every reason, the policy hash)."""
        self._round(server_round).setdefault("decisions", []).append(decision)

    def finish(self, status: str, **extra: Any) -> None:
        with self._lock:
            self.data["run"].update(status=status, finished=utc_now(), **extra)
            self.save()
            if self.summary is not None:
                text = self.summary(self.data)
                (self.directory / SUMMARY_FILE).write_text(text + "\n", encoding="utf-8")

    def finish_unless_finished(self, status: str, **extra: Any) -> bool:
        """Finish with ``status`` only if the run has not finished yet (an exit handler
        that also runs after a normal end); True if it did."""
        with self._lock:
            if self.data["run"].get("status") != RUNNING:
                return False
            self.finish(status, **extra)
            return True

    def save(self) -> None:
        with self._lock:
            write_json(self.directory / METRICS_FILE, self.data)


def write_json(target: Path, data: Mapping[str, Any]) -> None:
    """Atomically: a temporary file of this writer's own, then a rename."""
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{next(_saves)}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True), encoding="utf-8")
    os.replace(tmp, target)


def published_rounds(data: Mapping[str, Any]) -> list[int]:
    """The rounds whose aggregate was published (the global adapter moved)."""
    return sorted(
        int(number)
        for number, rnd in data.get("rounds", {}).items()
        if isinstance(rnd, dict) and (rnd.get("aggregate") or {}).get("published") is True
    )


def no_aggregate_reasons(data: Mapping[str, Any]) -> list[str]:
    """Why nothing was published, one line per region (its last status and reason in
    each distinct form), then each withheld aggregate."""
    rounds = data.get("rounds", {})
    numbers = sorted(int(r) for r in rounds if int(r) > 0)
    lines: list[str] = []
    for region in data.get("run", {}).get("regions", []):
        seen: dict[tuple[str, str], list[int]] = {}
        for number in numbers:
            entry = rounds[str(number)].get("train", {}).get(region)
            if isinstance(entry, dict):
                key = (str(entry.get("status", "?")), str(entry.get("reason") or ""))
                seen.setdefault(key, []).append(number)
        if not seen:
            lines.append(f"{region}: no reply in any round")
        for (status, reason), where in seen.items():
            rounds_text = f"round{'s' if len(where) > 1 else ''} {', '.join(map(str, where))}"
            lines.append(f"{region}: {status} in {rounds_text}" + (f": {reason}" if reason else ""))
    for number in numbers:
        aggregate = rounds[str(number)].get("aggregate") or {}
        if aggregate and not aggregate.get("published", True):
            reasons = "; ".join(aggregate.get("reasons", [])) or "no reason recorded"
            lines.append(f"aggregate withheld in round {number}: {reasons}")
    return lines


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
