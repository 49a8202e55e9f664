"""A run's output folder: per-round metrics as JSON, the final adapter, a summary.

``metrics.json`` is rewritten atomically after every round, so a crash leaves the
last complete round on disk, never a half-written file.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.json"
ADAPTER_DIR = "adapter"
SUMMARY_FILE = "summary.txt"


class RunRecorder:
    """Collects what happened in each round and writes it to ``directory``."""

    def __init__(self, directory: Path, run: dict[str, Any]) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.data: dict[str, Any] = {
            "run": {**run, "status": "running", "started": _now()},
            "rounds": {},
        }
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
        self._round(server_round)["eval"][region] = entry

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
        self.data["run"].update(status=status, finished=_now(), **extra)
        self.save()
        (self.directory / SUMMARY_FILE).write_text(summarize(self.data) + "\n", encoding="utf-8")

    def save(self) -> None:
        target = self.directory / METRICS_FILE
        tmp = target.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.data, indent=2, sort_keys=True), encoding="utf-8")
        os.replace(tmp, target)


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
