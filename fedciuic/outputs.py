"""A run's output folder: per-round metrics as JSON, the final adapter, a summary.

``metrics.json`` is rewritten atomically after every round, so a crash leaves the
last complete round on disk, never a half-written file.
"""

from __future__ import annotations

import json
import math
import os
import time
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
        self._round(server_round)["train"][region] = entry

    def record_eval(self, server_round: int, region: str, entry: dict[str, Any]) -> None:
        self._round(server_round)["eval"][region] = entry

    def record_aggregate(self, server_round: int, entry: dict[str, Any]) -> None:
        self._round(server_round)["aggregate"] = entry

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


def _fmt(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, int | float) and math.isfinite(value) else "-"


def summarize(data: dict[str, Any]) -> str:
    """A short plain-text summary: per region, eval loss before round 1 and after the last."""
    run = data["run"]
    rounds = data["rounds"]
    numbers = sorted(int(r) for r in rounds)
    first = rounds.get("0", {}).get("eval", {})
    last_round = max((r for r in numbers if rounds[str(r)].get("eval")), default=0)
    last = rounds.get(str(last_round), {}).get("eval", {})
    lines = [
        f"fedciuic run {run.get('run_id', '?')}: {run['status']}, "
        f"{max(numbers, default=0)} round(s), regions {', '.join(run.get('regions', []))}",
        f"{'region':<10} {'eval loss before':>17} {'after round ' + str(last_round):>17} "
        f"{'change':>9}  status",
    ]
    for region in [*run.get("regions", []), "overall"]:
        before = first.get(region, {}).get("loss")
        after = last.get(region, {}).get("loss")
        change = after - before if before is not None and after is not None else None
        statuses = [
            rounds[str(r)]["train"][region]["status"]
            for r in numbers
            if region in rounds[str(r)].get("train", {})
        ]
        status = ", ".join(f"{s} x{statuses.count(s)}" for s in sorted(set(statuses)))
        lines.append(
            f"{region:<10} {_fmt(before):>17} {_fmt(after):>17} {_fmt(change):>9}  {status}"
        )
    if run.get("adapter"):
        lines.append(f"adapter: {run['adapter']}")
    lines.append(f"metrics: {Path(run.get('output_dir', '.')) / METRICS_FILE}")
    return "\n".join(lines)
