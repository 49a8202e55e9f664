"""A region as a cluster in a real simulation: one region trains with two gloo processes
(its base whole in each, or sharded across them)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from fedciuic.audit import REGION_LOG, Event, load_records
from fedciuic.data.demo import write_demo_corpora
from fedciuic.privacy.ledger import LEDGER_FILE
from fedciuic.releases import WITHHELD_REASON
from tests.e2e.helpers import describe, only_run, processes_under, stop_everything
from tests.e2e.pace import patient
from tests.e2e.test_simulation import _command, exact_releases

pytestmark = [pytest.mark.e2e, pytest.mark.scenario]

#: How a region's training worker shows in a process list (``python -m WORKER``).
WORKER = "fedciuic.cluster.worker"
FAST = ("--run-config", "local-steps=4", "--run-config", "collective-timeout=60.0")


def _ledger_rounds(data_root: Path, region: str) -> list[dict[str, object]]:
    path = data_root / region / ".fedciuic" / LEDGER_FILE
    if not path.exists():
        return []
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [line for line in lines[1:] if "round" in line]


def _workers(folder: Path) -> list[psutil.Process]:
    found = []
    for p in processes_under(folder):
        try:
            if WORKER in " ".join(p.cmdline()):
                found.append(p)
        except psutil.NoSuchProcess:  # exited (or a zombie) since it was listed
            continue
    return found


def _run(tmp_path: Path, name: str, *args: str) -> tuple[dict[str, object], Path]:
    folder = tmp_path / name
    data_root = folder / "data"
    write_demo_corpora(data_root, ("eu", "cn"))
    command = _command(
        folder, "--rounds", "1", "--regions", "eu,cn", "--data-root", str(data_root), *FAST, *args
    )
    folder.mkdir(exist_ok=True)
    done = subprocess.run(command, capture_output=True, text=True, timeout=patient(900), cwd=folder)
    assert done.returncode == 0, done.stdout + done.stderr
    left = processes_under(folder)
    assert not left, "the simulation left processes running:\n" + describe(left)
    return only_run(folder / "runs"), data_root


def test_a_region_of_two_gloo_processes_trains_at_the_one_process_epsilon(tmp_path):
    # The exact count: a DP one differs between the two runs, and so would the rate.
    exact = exact_releases(tmp_path, "count-noise", "eval-noise")
    two, data_two = _run(tmp_path, "two", "--run-config", "region-train-processes='eu=2'", *exact)
    one, data_one = _run(tmp_path, "one", *exact)
    for data in (two, one):
        assert data["run"]["status"] == "completed"  # type: ignore[index]
        for region in ("eu", "cn"):
            entry = data["rounds"]["1"]["train"][region]  # type: ignore[index]
            assert entry["status"] == "trained", entry
    eu_two = two["rounds"]["1"]["train"]["eu"]  # type: ignore[index]
    eu_one = one["rounds"]["1"]["train"]["eu"]  # type: ignore[index]
    # Same global batch and steps: the same sample rate, noise and epsilon.
    assert eu_two["epsilon"] == pytest.approx(eu_one["epsilon"], rel=1e-6)
    (rec_two,), (rec_one,) = _ledger_rounds(data_two, "eu"), _ledger_rounds(data_one, "eu")
    for key in ("noise_multiplier", "sample_rate", "steps", "epsilon"):
        assert rec_two[key] == pytest.approx(rec_one[key], rel=1e-9), key


def test_a_killed_worker_makes_its_region_decline_the_round_and_the_run_goes_on(tmp_path):
    """With eu's base sharded over its two processes (train-sharding = "shard"): a rank
    killed mid-round fails that round for eu alone, and eu trains again after."""
    data_root = tmp_path / "data"
    write_demo_corpora(data_root, ("eu", "cn"))
    command = _command(
        tmp_path,
        "--rounds",
        "3",
        "--regions",
        "eu,cn",
        "--data-root",
        str(data_root),
        "--run-config",
        "local-steps=60",  # long enough a round to kill a worker in it
        "--run-config",
        "region-train-processes='eu=2'",
        "--run-config",
        "train-sharding='shard'",
    )
    rank_log = data_root / "eu" / ".fedciuic" / "cluster" / "rank-1.log"
    sim = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path
    )
    killed: list[int] = []
    try:
        deadline = time.monotonic() + patient(600)
        while time.monotonic() < deadline and sim.poll() is None:
            # Kill eu's worker while it trains round 2.
            workers = _workers(tmp_path)
            text = rank_log.read_text() if rank_log.exists() else ""
            if "round 2: training" in text and workers:
                for worker in workers:
                    os.kill(worker.pid, signal.SIGKILL)
                    killed.append(worker.pid)
                break
            time.sleep(0.05)
        output, _ = sim.communicate(timeout=patient(900))
    except BaseException:  # SIGKILL to simulate alone would orphan its SuperLink and Ray
        stop_everything(tmp_path, [sim.pid])
        raise
    assert killed, "no worker process was seen training eu's round 2"
    assert sim.returncode == 0, output
    # Sharded at the first round, and again over the processes started after the kill
    # (the run's log, where the regions' lines go; more often where Ray ran eu's messages
    # in another actor too, which builds the region and its processes of its own).
    (log,) = (tmp_path / "runs" / ".flower").glob("*/logs/flwr-run-*.log")
    assert log.read_text().count("region eu: base sharded over 2 training processes") >= 2
    data = only_run(tmp_path / "runs")
    assert data["run"]["status"] == "completed"
    train = {r: data["rounds"][str(r)]["train"] for r in (1, 2, 3)}
    assert train[1]["eu"]["status"] == "trained"
    assert train[2]["eu"]["status"] == "declined", train[2]
    # EU's policy lets out only DP releases: the reason stays in its own log.
    assert train[2]["eu"]["reason"] == WITHHELD_REASON
    (reason,) = [
        r["details"]["reason"]
        for r in load_records(data_root / "eu" / ".fedciuic" / REGION_LOG)
        if r["event"] == Event.DECLINED
    ]
    assert "training process" in reason and "rank 1" in reason, reason
    assert all(train[r]["cn"]["status"] == "trained" for r in (1, 2, 3)), train
    # The cluster is rebuilt: eu trains again in a later round.
    assert train[3]["eu"]["status"] == "trained", train[3]
    left = processes_under(tmp_path)
    assert not left, "the simulation left processes running:\n" + describe(left)
