"""A secure sum on the deployment `fedciuic init` writes, run by its own `start.sh`.

Three regions, each with its real agent, SuperNode and relay (as an OS user of its own
where the test runs as root), a real SuperLink, `secure-aggregation = true`. Each
region trusts as peers only the bundles init enrolled in its `peers/` (nothing the
aggregator hands out). The run kills one region's `start-supernode.sh` (kill -9: no
clean-up runs) once its masked vector is in: nothing of that region keeps running, and
the aggregator still publishes the mean of the three updates the regions kept,
recovered with the others' shares; every party's log verifies and agrees.

One run proves the deployment init writes (TLS, each SuperNode admitted by its key,
start.sh's report of every party's verified log, plain text, nothing left running), its
secure round and the dropout: a round in which every region reveals is the
simulation's (tests/e2e/test_secure.py), through the same code on each side.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fedciuic.agent.service import STOP_GRACE
from fedciuic.audit.events import Event
from fedciuic.audit.log import AGGREGATOR_LOG, REGION_LOG, load_records
from fedciuic.crypto import load_bundle
from fedciuic.ops.separation import interpreter_paths
from tests.conftest import record_level_policies
from tests.e2e.helpers import (
    alive,
    describe,
    init_demo,
    open_folder,
    passable_to_others,
    processes_under,
    stop_everything,
)
from tests.e2e.pace import patient
from tests.e2e.test_secure import check_secure_round

pytestmark = [pytest.mark.e2e, pytest.mark.scenario]
REGIONS = ("eu", "cn", "us")
#: The region the second run kills once its masked vector is in.
DROPPED = "cn"
#: A relay user of this test's own, made by the deployment's scripts (as root) and
#: removed afterwards if this test made it; without root the relay runs as the region.
RELAY = "fedciuic-e2e-secagg"
AS_ROOT = os.geteuid() == 0
#: What start.sh passes to the run. A dead region's node is refused by Flower once its
#: heartbeats stop, or waited for up to round-timeout.
SECURE = {
    "secure-aggregation": True,
    "num-server-rounds": 1,
    "local-steps": 4,
    "target-epsilon": 2.0,
    "round-timeout": 240.0,
}


@pytest.fixture(scope="module")
def place() -> Iterator[Path]:
    """A folder other users may pass through, the relay's user (where root) able to run
    this install, and that user removed afterwards if the deployment's scripts made it."""
    existed = True
    try:
        pwd.getpwnam(RELAY)
    except KeyError:
        existed = False
    with contextlib.ExitStack() as stack:
        if AS_ROOT:
            stack.enter_context(passable_to_others(interpreter_paths()))
        yield stack.enter_context(open_folder("fedciuic-secure-"))
    if AS_ROOT and not existed:
        subprocess.run(["userdel", RELAY], capture_output=True, check=False)


def _init(folder: Path) -> Path:
    """`fedciuic init` of three demo regions in ``folder``/federation."""
    directory = folder / "federation"
    policies = record_level_policies(folder / "policies")
    done = init_demo(directory, REGIONS, policies, RELAY if AS_ROOT else "")
    assert done.returncode == 0, done.stderr
    return directory


def _start(directory: Path, folder: Path) -> subprocess.Popen[str]:
    overrides = " ".join(f"{k}={str(v).lower()}" for k, v in SECURE.items())
    return subprocess.Popen(
        ["bash", str(directory / "start.sh"), "--run-config", overrides],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "FLWR_HOME": str(folder / "flwr-home")},
        cwd=folder,
        start_new_session=True,
    )


def _finish(start: subprocess.Popen[str]) -> str:
    """start.sh's output once it ends (SIGTERM, which its trap turns into stopping
    everything, if it runs too long)."""
    try:
        output, _ = start.communicate(timeout=patient(900))
    except subprocess.TimeoutExpired:
        start.send_signal(signal.SIGTERM)
        output, _ = start.communicate(timeout=patient(60))
        pytest.fail(f"start.sh did not finish within 900 s:\n{output[-4000:]}")
    return output


def _kill_everything(start: subprocess.Popen[str], directory: Path) -> None:
    """Whatever start.sh left behind, even when the test failed half-way."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(start.pid, signal.SIGKILL)
    pids = [int(p.read_text()) for p in (directory / "pids").glob("*.pid")]
    stop_everything(directory, pids)


def _the_run(directory: Path) -> tuple[dict[str, Any], Path]:
    (metrics,) = sorted((directory / "aggregator" / "runs").glob("run-*/metrics.json"))
    data: dict[str, Any] = json.loads(metrics.read_text())
    return data, metrics.parent


def _secure_sum(directory: Path) -> dict[str, Any]:
    log = directory / "aggregator" / "audit" / AGGREGATOR_LOG
    (summed,) = [r["details"] for r in load_records(log) if r["event"] == Event.SECURE_SUM]
    details: dict[str, Any] = summed
    return details


def _events(directory: Path, region: str) -> list[str]:
    try:
        return [
            r["event"] for r in load_records(directory / "regions" / region / "state" / REGION_LOG)
        ]
    except Exception:  # not written yet, or mid-write
        return []


def test_a_region_killed_after_its_masked_vector_is_in_leaves_the_survivors_sum(place):
    """kill -9 of the region's start-supernode.sh once the aggregator has its masked
    vector (it was asked to consent: only a region whose masked vector arrived is): the
    others' shares recover the sum of all three, and nothing of the region runs on."""
    directory = _init(place / "dropout")
    readme = (directory / "README.md").read_text()
    for region in REGIONS:
        peers = directory / "regions" / region / "peers"
        assert sorted(p.name for p in peers.iterdir()) == sorted(
            f"{r}.pub.json" for r in REGIONS if r != region
        )
        key_id = load_bundle(directory / "regions" / region / "keys" / f"{region}.pub.json")
        assert f"| {region} | `{key_id.key_id.hex()}` |" in readme
    here = directory / "regions" / DROPPED
    killed: dict[str, Any] = {}
    # The agent lets the request in hand finish (up to STOP_GRACE) before it exits.
    window = STOP_GRACE + patient(15)

    def kill_once_masked() -> None:
        deadline = time.monotonic() + patient(900)
        while time.monotonic() < deadline:
            if Event.SECURE_CONSENTED in _events(directory, DROPPED):
                script = int((directory / "pids" / f"supernode-{DROPPED}.pid").read_text())
                os.kill(script, signal.SIGKILL)  # the script alone: it runs no clean-up
                at = time.monotonic()
                while processes_under(here) and time.monotonic() - at < window:
                    time.sleep(0.1)
                killed["left"] = describe(processes_under(here))
                killed["took"] = time.monotonic() - at
                return
            time.sleep(0.1)

    start = _start(directory, place / "dropout")
    watcher = threading.Thread(target=kill_once_masked, daemon=True)
    watcher.start()
    try:
        output = _finish(start)
        watcher.join(timeout=window + 30)
        assert "took" in killed, f"{DROPPED} never consented:\n{output[-4000:]}"
        assert not killed["left"], f"left running after the kill:\n{killed['left']}"
        data, run_dir = _the_run(directory)
        assert data["run"]["status"] == "completed", output[-4000:]
        others = tuple(r for r in REGIONS if r != DROPPED)
        check_secure_round(
            run_dir, {r: directory / "regions" / r / "state" for r in REGIONS}, others
        )
        # Its masked vector is in (check_secure_round: all three survived), and the sum
        # was recovered without its reveal.
        summed = _secure_sum(directory)
        assert summed["revealed"] == sorted(others), summed
        # The run completed and every party's log (the killed region's too) verifies.
        assert start.returncode == 0, output[-4000:]
        assert output.count("audit: OK: ") == 1 + len(REGIONS), output[-4000:]
        assert not processes_under(directory), describe(processes_under(directory))
        assert not alive([int(p.read_text()) for p in (directory / "pids").glob("*.pid")])
        # TLS with SuperNode authentication: each SuperNode was admitted by its key.
        assert "--insecure" not in (directory / "aggregator" / "start-superlink.sh").read_text()
        assert output.count("registered successfully") == len(REGIONS), output[-4000:]
        # start.sh ends with the run report, from every party's audit log, verified by
        # its key; plain text: Flower's colour codes stay out of the output and the logs.
        assert f"report: {run_dir / 'report.html'}\n" in output, output[-4000:]
        assert "not verified" not in output and "\x1b[" not in output
        for log in (directory / "logs").glob("*.log"):
            assert "\x1b[" not in log.read_text(errors="replace"), log
        page = (run_dir / "report.html").read_text()
        assert "<b>completed</b>" in page and "not verified" not in page
        series = json.loads((run_dir / "report" / "series.json").read_text())
        assert ("aggregate", "published") in {
            (d["subject"], d["outcome"]) for d in series["decisions"]
        }, series["decisions"]
    finally:
        _kill_everything(start, directory)
