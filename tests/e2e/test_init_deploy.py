"""`fedciuic init`, then `bash DIR/start.sh`: a TLS federation from the generated folder alone."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from fedciuic.cluster.protocol import free_port
from fedciuic.ops.deploy import init_deployment
from fedciuic.record.metrics import load_metrics
from tests.conftest import ROOT, record_level_policies
from tests.e2e.helpers import (
    alive,
    describe,
    free_ports,
    init_demo,
    processes_under,
    stop_everything,
)
from tests.e2e.pace import patient

pytestmark = pytest.mark.e2e
REGIONS = ("eu", "cn")


def _pids(directory: Path) -> list[int]:
    return [int(p.read_text()) for p in sorted((directory / "pids").glob("*.pid"))]


def _kill_everything(directory: Path) -> None:
    """Whatever start.sh left behind, even when the test failed half-way."""
    stop_everything(directory, _pids(directory) if (directory / "pids").is_dir() else [])


def test_init_then_start_sh_runs_a_tls_federation_and_stops_everything(tmp_path):
    directory = tmp_path / "federation"
    # The relay as the region's own user: this test is about TLS and start.sh; the
    # relay's own OS user is test_trust_boundary.py's.
    init = init_demo(directory, REGIONS, record_level_policies(tmp_path / "policies"), "")
    assert init.returncode == 0, init.stderr
    assert f"bash {directory / 'start.sh'}" in init.stdout

    env = {**os.environ, "FLWR_HOME": str(tmp_path / "flwr-home")}
    start = subprocess.Popen(
        ["bash", str(directory / "start.sh"), "--run-config", "num-server-rounds=1 local-steps=2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=tmp_path,
        start_new_session=True,
    )
    try:
        try:
            output, _ = start.communicate(timeout=patient(300))
        except subprocess.TimeoutExpired:
            start.send_signal(signal.SIGTERM)  # its trap stops what it started
            output, _ = start.communicate(timeout=patient(60))
            pytest.fail(f"start.sh did not finish within 300 s:\n{output[-4000:]}")
        assert start.returncode == 0, output[-4000:]
        (metrics,) = sorted((directory / "aggregator" / "runs").glob("run-*/metrics.json"))
        data = json.loads(metrics.read_text())
        assert data["run"]["status"] == "completed"
        for region in REGIONS:
            assert data["rounds"]["1"]["train"][region]["status"] == "trained"
            assert (directory / "regions" / region / "state" / "audit.jsonl").exists()
        assert (directory / "aggregator" / "audit").is_dir()
        pids = _pids(directory)
        assert len(pids) == 2 + len(REGIONS)  # SuperLink, SuperNodes, the run
        assert not alive(pids), "start.sh left processes running"
        assert not processes_under(directory), "start.sh left Flower helpers running"
        # TLS with SuperNode authentication: each SuperNode was admitted by its key.
        assert "--insecure" not in (directory / "aggregator" / "start-superlink.sh").read_text()
        assert output.count("registered successfully") == len(REGIONS)
        # start.sh ends with the run report, from every party's audit log, verified by its key.
        assert f"report: {metrics.parent / 'report.html'}\n" in output
        assert "not verified" not in output
        # The same audit verdicts as `fedciuic simulate` prints, one per party's log.
        assert output.count("audit: OK: ") == 1 + len(REGIONS), output[-4000:]
        # Plain text: Flower's colour codes stay out of the output and the logs.
        assert "\x1b[" not in output
        for log in (directory / "logs").glob("*.log"):
            assert "\x1b[" not in log.read_text(errors="replace"), log
        page = (metrics.parent / "report.html").read_text()
        assert "<b>completed</b>" in page and "not verified" not in page
        series = json.loads((metrics.parent / "report" / "series.json").read_text())
        assert {(d["subject"], d["outcome"]) for d in series["decisions"]} == {
            ("eu", "accepted"),
            ("cn", "accepted"),
            ("aggregate", "published"),
        }
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(start.pid, signal.SIGKILL)
        _kill_everything(directory)


def test_ctrl_c_on_start_sh_whose_output_is_gone_stops_every_process_and_exits_130(tmp_path):
    """`start.sh | tee log`, then Ctrl-C: tee is gone before start.sh cleans up (here its
    stdout is closed from the start). Every process it started stops, the run that had
    begun is marked interrupted, and start.sh exits 130 (not 141 from a SIGPIPE)."""
    directory = init_deployment(
        tmp_path / "federation",
        ",".join(REGIONS),
        app_dir=ROOT,
        port=free_port(),
        supernode_port_base=free_ports(len(REGIONS)),
        tls=False,
        demo_data=True,
        relay_user="",
    ).directory
    err = tmp_path / "stderr"
    with open(err, "wb") as stderr:
        start = subprocess.Popen(
            ["bash", str(directory / "start.sh")],
            stdout=subprocess.PIPE,
            stderr=stderr,
            env={**os.environ, "FLWR_HOME": str(tmp_path / "flwr-home")},
            cwd=tmp_path,
            start_new_session=True,  # a terminal's foreground job: Ctrl-C goes to its group
        )
    assert start.stdout is not None
    start.stdout.close()
    try:
        # As soon as the SuperNodes are up and the run is submitted: no training.
        deadline = time.monotonic() + patient(45)
        while not (
            (directory / "pids" / "flwr-run.pid").exists()
            and sum("flower-supernode" in " ".join(p.cmdline()) for p in processes_under(directory))
            >= len(REGIONS)
        ):
            assert start.poll() is None, f"start.sh exited {start.returncode}:\n{err.read_text()}"
            assert time.monotonic() < deadline, err.read_text()
            time.sleep(0.2)
        os.killpg(start.pid, signal.SIGINT)
        assert start.wait(timeout=patient(60)) == 130, err.read_text()
        left = processes_under(directory)
        assert not left, "start.sh left processes running:\n" + describe(left)
        assert "start.sh: stopping every process it started" in err.read_text()
        for metrics in (directory / "aggregator" / "runs").glob("run-*/metrics.json"):
            assert load_metrics(metrics).run.status == "interrupted"
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(start.pid, signal.SIGKILL)
        _kill_everything(directory)
