"""`fedciuic init`, then `bash DIR/start.sh`, stopped by Ctrl-C. A whole run of the
generated folder (TLS, SuperNode authentication, start.sh's report, nothing left
running) is tests/e2e/test_init_secure.py's, whose run is secure and loses a region."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from fedciuic.cluster.protocol import free_port
from fedciuic.ops.deploy import init_deployment
from fedciuic.record.metrics import load_metrics
from tests.conftest import ROOT
from tests.e2e.helpers import (
    describe,
    free_ports,
    processes_under,
    running_under,
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
            and len(running_under(directory, "flower-supernode")) >= len(REGIONS)
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
