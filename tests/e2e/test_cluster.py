"""A region as a cluster in a real simulation: one region trains with two gloo processes
(its base whole in each, or sharded across them)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from fedciuic.audit import REGION_LOG, Event, load_records
from fedciuic.data.demo import write_demo_corpora
from fedciuic.data.demo_pii import DEMO_DICTIONARIES
from fedciuic.privacy.ledger import LEDGER_FILE
from fedciuic.releases import WITHHELD_REASON
from tests.e2e.helpers import (
    describe,
    only_run,
    processes_under,
    running_under,
    stop_everything,
)
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


def test_a_region_of_two_gloo_processes_trains_at_the_one_process_epsilon(tmp_path):
    """eu trains with two processes, cn with one, on the same corpus (a copy of eu's) in
    one run: the same global batch and steps give the same sample rate, noise and
    epsilon."""
    data_root = tmp_path / "data"
    write_demo_corpora(data_root, ("eu",))
    shutil.copytree(data_root / "eu", data_root / "cn")
    names = data_root / DEMO_DICTIONARIES
    shutil.copy(names / "eu.txt", names / "cn.txt")
    # The exact count: a DP one differs between the two regions, and so would the rate.
    exact = exact_releases(tmp_path, "count-noise", "eval-noise")
    command = _command(
        tmp_path,
        *("--rounds", "1", "--regions", "eu,cn", "--data-root", str(data_root)),
        *FAST,
        *("--run-config", "region-train-processes='eu=2'", *exact),
    )
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=patient(900), cwd=tmp_path
    )
    assert done.returncode == 0, done.stdout + done.stderr
    left = processes_under(tmp_path)
    assert not left, "the simulation left processes running:\n" + describe(left)
    data = only_run(tmp_path / "runs")
    assert data["run"]["status"] == "completed"
    train = data["rounds"]["1"]["train"]
    for region in ("eu", "cn"):
        assert train[region]["status"] == "trained", train[region]
    assert train["eu"]["epsilon"] == pytest.approx(train["cn"]["epsilon"], rel=1e-6)
    (two,), (one,) = _ledger_rounds(data_root, "eu"), _ledger_rounds(data_root, "cn")
    for key in ("noise_multiplier", "sample_rate", "steps", "epsilon"):
        assert two[key] == pytest.approx(one[key], rel=1e-9), key
    # eu's second process trained; cn started none.
    assert (data_root / "eu" / ".fedciuic" / "cluster" / "rank-1.log").exists()
    assert not (data_root / "cn" / ".fedciuic" / "cluster").exists()


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
        "local-steps=20",  # long enough a round to kill a worker in it
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
            workers = running_under(tmp_path, WORKER)
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
