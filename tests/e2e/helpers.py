"""Shared checks for the end-to-end tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import psutil


def only_run(output_dir: Path) -> dict[str, Any]:
    runs = sorted(output_dir.glob("run-*/metrics.json"))
    assert len(runs) == 1, runs
    data: dict[str, Any] = json.loads(runs[0].read_text())
    return data


def eval_loss(data: dict[str, Any], server_round: int, region: str) -> float:
    return float(data["rounds"][str(server_round)]["eval"][region]["loss"])


def processes_under(folder: Path) -> list[psutil.Process]:
    """Live processes whose working directory is inside ``folder``."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.status() != psutil.STATUS_ZOMBIE and Path(proc.cwd()).is_relative_to(folder):
                found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


def alive(pids: list[int]) -> list[int]:
    live = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                live.append(pid)
        except psutil.NoSuchProcess:
            continue
    return live
