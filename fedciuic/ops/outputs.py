"""A run's output folder: per-round metrics as JSON, the final adapter, a summary.

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
import math
import os
import threading
import time
from collections.abc import Mapping
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

    def __init__(self, directory: Path, run: dict[str, Any]) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.data: dict[str, Any] = {
            "run": {**run, "status": RUNNING, "started": _now()},
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
            self.data["run"].update(status=status, finished=_now(), **extra)
            self.save()
            _write_summary(self.directory, self.data)

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
            _write_json(self.directory / METRICS_FILE, self.data)


def _write_json(target: Path, data: Mapping[str, Any]) -> None:
    """Atomically: a temporary file of this writer's own, then a rename."""
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{next(_saves)}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True), encoding="utf-8")
    os.replace(tmp, target)


def _write_summary(directory: Path, data: dict[str, Any]) -> None:
    (directory / SUMMARY_FILE).write_text(summarize(data) + "\n", encoding="utf-8")


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


def mark_unfinished(run_dir: Path, reason: str) -> bool:
    """Mark a run whose metrics.json still says ``running`` as ``interrupted`` (its
    process is gone: a launcher stopped or lost it). True if it did."""
    path = run_dir / METRICS_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    run = data.get("run") if isinstance(data, dict) else None
    if not isinstance(run, dict) or run.get("status") != RUNNING:
        return False
    run.update(status=INTERRUPTED, finished=_now(), error=reason)
    _write_json(path, data)
    _write_summary(run_dir, data)
    return True


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def fmt_number(value: Any) -> str:
    """A loss or similar to 4 decimals, or "-" where there is none."""
    return f"{value:.4f}" if isinstance(value, int | float) and math.isfinite(value) else "-"


def fmt_epsilon(epsilon: Any, budget: Any) -> str:
    """Epsilon spent against the budget ("7.99 of 8"), or "-" without DP."""
    if not isinstance(epsilon, int | float):
        return "-"
    return f"{epsilon:.2f} of {budget if isinstance(budget, int | float) else float('nan'):g}"


def final_eval(data: Mapping[str, Any]) -> tuple[int, dict[str, Any]]:
    """The last round with evaluation results and those results."""
    rounds = data["rounds"]
    last = max((int(r) for r in rounds if rounds[r].get("eval")), default=0)
    return last, rounds.get(str(last), {}).get("eval", {})


def epsilon_spent(data: Mapping[str, Any], region: str) -> tuple[float | None, float | None]:
    """A region's cumulative epsilon after its last DP round in this run, and its budget."""
    rounds = data["rounds"]
    for number in sorted((int(r) for r in rounds), reverse=True):
        entry = rounds[str(number)].get("train", {}).get(region, {})
        if "epsilon" in entry:
            return float(entry["epsilon"]), float(entry.get("epsilon_budget", "nan"))
    return None, None


def upload_bytes(data: Mapping[str, Any], region: str) -> list[int]:
    """Bytes a region's accepted updates took on the wire, one entry per round."""
    return [
        int(entry["upload_bytes"])
        for _, rnd in sorted(data["rounds"].items(), key=lambda kv: int(kv[0]))
        if "upload_bytes" in (entry := rnd.get("train", {}).get(region, {}))
    ]


def summarize(data: dict[str, Any], baseline: dict[str, Any] | None = None) -> str:
    """A short plain-text summary per region: eval loss before round 1 and after the last,
    epsilon spent against the budget and, given a ``baseline`` run without DP, the gap."""
    run = data["run"]
    rounds = data["rounds"]
    numbers = sorted(int(r) for r in rounds)
    first = rounds.get("0", {}).get("eval", {})
    last_round, last = final_eval(data)
    base = final_eval(baseline)[1] if baseline else {}
    dp = run.get("config", {}).get("dp", False)
    header = (
        f"{'region':<8} {'eval before':>11} {'after r' + str(last_round):>9} {'change':>8}"
        + (f" {'no-DP':>8} {'DP gap':>8}" if baseline else "")
        + (f" {'epsilon':>15}" if dp else "")
        + f" {'bytes/round':>11}"
        + "  rounds"
    )
    lines = [
        f"fedciuic run {run.get('run_id', '?')}: {run['status']}, "
        f"{max(numbers, default=0)} round(s), regions {', '.join(run.get('regions', []))}, "
        + (
            f"DP on (target epsilon {run['config'].get('target-epsilon')}, delta "
            f"{run['config'].get('target-delta')}, secure-mode "
            f"{'on' if run['config'].get('secure-mode') else 'OFF'})"
            if dp
            else "DP off"
        )
        + f", codec {run.get('config', {}).get('codec', 'dense')}",
        header,
    ]
    for region in [*run.get("regions", []), "overall"]:
        before = first.get(region, {}).get("loss")
        after = last.get(region, {}).get("loss")
        change = after - before if before is not None and after is not None else None
        row = f"{region:<8} {fmt_number(before):>11} {fmt_number(after):>9} {fmt_number(change):>8}"
        if baseline:
            other = base.get(region, {}).get("loss")
            gap = after - other if after is not None and other is not None else None
            row += f" {fmt_number(other):>8} {fmt_number(gap):>8}"
        if dp:
            eps, budget = epsilon_spent(data, region)
            row += f" {fmt_epsilon(eps, budget) if region != 'overall' else '':>15}"
        sent = upload_bytes(data, region)
        row += f" {(f'{sum(sent) / len(sent):.0f}' if sent and region != 'overall' else ''):>11}"
        statuses = [
            rounds[str(r)]["train"][region]["status"]
            for r in numbers
            if region in rounds[str(r)].get("train", {})
        ]
        row += "  " + ", ".join(f"{s} x{statuses.count(s)}" for s in sorted(set(statuses)))
        lines.append(row.rstrip())
    lines += _policy_notes(data)
    lines += outcome_lines(data)
    if run.get("adapter"):
        lines.append(f"adapter: {run['adapter']}")
    lines.append(f"metrics: {Path(run.get('output_dir', '.')) / METRICS_FILE}")
    return "\n".join(lines)


def _policy_notes(data: dict[str, Any]) -> list[str]:
    """The policies applied, aggregates withheld, and why regions sent nothing usable."""
    run = data["run"]
    notes = []
    if "policies" in run:
        held = run["policies"]
        where = run.get("config", {}).get("aggregator-jurisdiction", "?")
        notes.append(
            f"policies (aggregator in {where}): "
            + (
                ", ".join(f"{j} {p['hash'][:12]}" for j, p in held.items())
                if held is not None
                else "OFF (enforce-policies = false: a lab baseline)"
            )
        )
    if run.get("status") == NO_AGGREGATE:
        return notes  # outcome_lines says why, per region
    seen = set()
    for number, rnd in sorted(data["rounds"].items(), key=lambda kv: int(kv[0])):
        aggregate = rnd.get("aggregate", {})
        if aggregate and not aggregate.get("published", True):
            reasons = "; ".join(aggregate.get("reasons", []))
            notes.append(f"round {number}: aggregate withheld, global adapter unchanged: {reasons}")
        for region, entry in rnd.get("train", {}).items():
            key = (region, entry.get("status"), entry.get("reason"))
            if entry.get("reason") and key not in seen:
                seen.add(key)
                notes.append(f"round {number}: {region} {entry['status']}: {entry['reason']}")
    return notes


def outcome_lines(data: Mapping[str, Any]) -> list[str]:
    """What a run that did not complete achieved, in words (nothing for a completed one)."""
    run = data["run"]
    status = run.get("status")
    if status == NO_AGGREGATE:
        total = run.get("config", {}).get("num-server-rounds", "?")
        return [
            f"NO AGGREGATE: none was published in {total} round(s), so nothing was trained: "
            "the global adapter is still the initial one and was not saved. Why:",
            *(f"  {line}" for line in run.get("reasons") or no_aggregate_reasons(data)),
        ]
    if status in (FAILED, INTERRUPTED):
        rounds = data["rounds"]
        ended = max((int(r) for r, v in rounds.items() if v.get("ended_at")), default=None)
        begun = max((int(r) for r in rounds), default=None)
        total = run.get("config", {}).get("num-server-rounds", "?")
        where = (
            "before round 0 ended"
            if ended is None
            else f"in round {begun} of {total}"
            if begun is not None and begun > ended
            else f"after round {ended} of {total}"
        )
        return [f"{status.upper()} {where}: {run.get('error') or 'no reason recorded'}"]
    if status == RUNNING:
        return ["RUNNING: the run has not finished (or its process died without a word)"]
    return []
