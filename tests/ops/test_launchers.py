"""The scripts `fedciuic init` writes, run for real with Flower and the agent replaced.

Each deployment is rendered as a user gets it; only its ``BIN`` (the venv whose
executables the scripts run) points at a folder of stand-ins: a SuperLink that answers
``/health``, SuperNodes, agents and relays that sleep, a ``flwr run`` that records a
run (``FAKE_STATUS``) and streams on, a ``fedciuic report`` that writes a page, a
``fedciuic preflight`` that passes (tests/ops/test_preflight.py runs the real one).
``python`` is the real one, so every ``python -m fedciuic.ops.scripts`` step the scripts
take (health check, stop, settle, the relay's user) is the real one.

What is tested is how the scripts end: a closed stdout (``| head``, or a ``| tee``
that Ctrl-C stopped) stops nothing and cuts no clean-up short, Ctrl-C stops every
process they started and exits 130, and a Ctrl-C after the run ended leaves the run's
outcome and its report standing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from fedciuic.cluster.protocol import free_port
from fedciuic.errors import EXIT_NO_AGGREGATE
from fedciuic.flower.launch import relay_command
from fedciuic.ops import deploy, scripts, separation
from fedciuic.ops.separation import interpreter_paths
from fedciuic.record.metrics import RunStatus, load_metrics
from tests.e2e.helpers import (
    describe,
    open_folder,
    passable_to_others,
    processes_under,
    stop_everything,
)

ROOT = Path(__file__).resolve().parents[2]
REGIONS = ("eu", "cn")
#: A relay user of its own that every system has (its home here is made, as root, by
#: the scripts, and removed with the folder).
RELAY_USER = "nobody"
RUN_ID = 42

FAKE_SUPERLINK = """\
import http.server, sys

port = int(sys.argv[sys.argv.index("--port") + 1])


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""

FAKE_FLWR = f"""\
#!/usr/bin/env bash
# flwr run: a run that records FAKE_STATUS (running, completed, no-aggregate), then
# streams on (its ServerApp still at work) unless FAKE_EXIT is set; "none": no run.
[ "$1" = run ] || exit 2
[ "$FAKE_STATUS" != none ] || {{ echo "flwr run: the SuperLink refused the run" >&2; exit 1; }}
echo "Successfully started run {RUN_ID}"
record-run runs/run-{RUN_ID} "$FAKE_STATUS"
echo "INFO :      run {RUN_ID} $FAKE_STATUS"
[ -z "${{FAKE_EXIT:-}}" ] || exit 0
exec sleep 300
"""

#: ``record-run DIR STATUS``: a run's metrics.json saying STATUS.
RECORD_RUN = f"""\
import sys
from pathlib import Path

from fedciuic.ops.outputs import summarize
from fedciuic.record.metrics import RunStatus
from fedciuic.record.recorder import RunRecorder

run = {{"run_id": {RUN_ID}, "regions": {list(REGIONS)!r}, "config": {{}}}}
recorder = RunRecorder(Path(sys.argv[1]), run, summary=summarize)
if sys.argv[2] == RunStatus.COMPLETED:
    recorder.finish(RunStatus.COMPLETED)
elif sys.argv[2] == RunStatus.NO_AGGREGATE:
    recorder.finish(RunStatus.NO_AGGREGATE, adapter=None, reasons=["eu: declined in round 1"])
"""

#: A SuperNode that holds its port, as Flower's does: a second one on it fails at once.
FAKE_SUPERNODE = """\
import socket, sys, time

port = int(sys.argv[sys.argv.index("--port") + 1])
held = socket.socket()
try:
    held.bind(("127.0.0.1", port))
except OSError as err:
    sys.exit(f"flower-supernode: 127.0.0.1:{port}: {err.strerror}")
held.listen()
time.sleep(300)
"""

#: A relay that runs (or, with FAKE_RELAY_FAILS, says why it cannot and exits 1), with
#: a ClientApp of its own that the SuperExec's end does not reach; with STUCK, it ignores
#: SIGTERM and SIGINT too, as a ClientApp blocked in a call to a SuperNode that is gone.
FAKE_SUPEREXEC = """\
import os, subprocess, sys, time

if os.environ.get("FAKE_RELAY_FAILS"):
    sys.exit("flower-superexec: " + os.environ["FAKE_RELAY_FAILS"])
subprocess.Popen([sys.executable, "-c", FAKE_CLIENTAPP, "flwr-clientapp"])
time.sleep(300)
"""
FAKE_CLIENTAPP = """\
import os, signal, time

if os.environ.get("STUCK"):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
time.sleep(300)
"""
STUCK = {"STUCK": "1"}

FAKE_FEDCIUIC = """\
#!/usr/bin/env bash
case "$1" in
  preflight) exit 0;;
  agent)
    for arg in "$@"; do
      if [ "$arg" = --ping ]; then
        # FAKE_CLOSE: a folder closed to other users once the agent is up (before the relay)
        [ -z "${FAKE_CLOSE:-}" ] || chmod 700 "$FAKE_CLOSE"
        exit 0
      fi
    done
    # As the real agent (tests/agent/test_service.py): it stops once its launcher is gone,
    # which it reads only after its imports (seconds): a launcher killed before then
    # leaves it to the parent-death signal start-supernode.sh ties it with.
    exec "$(dirname "$0")/python" -c '
import os, time
time.sleep(1.0)
parent = os.getppid()
while os.getppid() == parent:
    time.sleep(0.2)' fake-agent "$@";;
  report)
    if [ -n "${FAKE_REPORT_SLOW:-}" ] && [ ! -e "$2/report-started" ]; then
      touch "$2/report-started"
      sleep 60  # the first report: long enough for a Ctrl-C
    fi
    touch "$2/report.html"
    echo "report: ${2%/}/report.html"
    exit "${FAKE_REPORT_RC:-0}";;
esac
exit 2
"""


def record(run_dir: Path, status: str) -> None:
    """A run's metrics.json saying ``status``, as the fake ``flwr run`` leaves it."""
    subprocess.run([sys.executable, "-c", RECORD_RUN, str(run_dir), status], check=True)


def _script(path: Path, text: str) -> None:
    path.write_text(text, encoding="utf-8")
    path.chmod(0o755)


def _fake_deployment(folder: Path, relay_user: str = "") -> Path:
    """An insecure demo deployment in ``folder`` whose scripts run the stand-ins."""
    d = deploy.init_deployment(
        folder / "fed",
        ",".join(REGIONS),
        app_dir=ROOT,
        tls=False,
        demo_data=True,
        relay_user=relay_user,
        port=free_port(),
    )
    fake = folder / "bin"
    fake.mkdir()
    _script(fake / "python", f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    _script(fake / "flower-superlink", f"#!{sys.executable}\n{FAKE_SUPERLINK}")
    _script(fake / "flower-supernode", f"#!{sys.executable}\n{FAKE_SUPERNODE}")
    _script(
        fake / "flower-superexec",
        f"#!{sys.executable}\nFAKE_CLIENTAPP = {FAKE_CLIENTAPP!r}\n{FAKE_SUPEREXEC}",
    )
    _script(fake / "flwr", FAKE_FLWR)
    _script(fake / "record-run", f"#!{sys.executable}\n{RECORD_RUN}")
    _script(fake / "fedciuic", FAKE_FEDCIUIC)
    for script in d.directory.rglob("*.sh"):
        text = script.read_text()
        assert str(d.bin_dir) in text, script
        script.write_text(text.replace(str(d.bin_dir), str(fake)))
    return d.directory


def _stop(directory: Path) -> None:
    """Whatever a test left running."""
    pids = [int(p.read_text()) for p in (directory / "pids").glob("*.pid")]
    stop_everything(directory, pids)


@pytest.fixture
def federation(tmp_path: Path) -> Iterator[Path]:
    """An insecure demo deployment whose scripts run the stand-ins, its relay as the
    region's own user; whatever a test leaves running is stopped after it."""
    directory = _fake_deployment(tmp_path)
    try:
        yield directory
    finally:
        _stop(directory)


@pytest.fixture
def relayed(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The same, with a relay user of its own (``nobody``), in a folder other users may
    pass through."""
    monkeypatch.setattr(separation, "interpreter_paths", lambda: [Path("/")])  # checked below
    with open_folder("fedciuic-launchers-") as folder:
        directory = _fake_deployment(folder, RELAY_USER)
        try:
            yield directory
        finally:
            _stop(directory)


def _start(script: Path, **options: Any) -> subprocess.Popen[bytes]:
    """``bash SCRIPT`` as a terminal's foreground job: a process group of its own."""
    options["env"] = {**os.environ, **options.get("env", {})}
    return subprocess.Popen(["bash", str(script)], start_new_session=True, **options)


def _until(what: str, ready: Callable[[], bool], process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while not ready():
        code = process.poll()
        assert code is None, f"{process.args!r} exited {code} before {what}"
        assert time.monotonic() < deadline, f"no {what} within 60 s"
        time.sleep(0.1)


def _status(directory: Path) -> str | None:
    metrics = directory / "aggregator" / "runs" / f"run-{RUN_ID}" / "metrics.json"
    with contextlib.suppress(Exception):
        return str(load_metrics(metrics).run.status)
    return None


def _ctrl_c(process: subprocess.Popen[bytes]) -> int:
    """SIGINT to the job's process group, as Ctrl-C sends it; its exit status."""
    os.killpg(process.pid, signal.SIGINT)
    return process.wait(timeout=60)


def _nothing_left(directory: Path) -> None:
    left = processes_under(directory)
    assert not left, "left running:\n" + describe(left)


def test_start_sh_with_its_output_closed_at_once_runs_and_stops_everything_on_ctrl_c(federation):
    """`start.sh |& head -c 0`: its stdout and stderr are gone before it prints a word."""
    start = _start(
        federation / "start.sh",
        env={"FAKE_STATUS": "running"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    assert start.stdout is not None
    start.stdout.close()
    _until("the run", lambda: _status(federation) == "running", start)
    assert _ctrl_c(start) == 130
    _nothing_left(federation)
    assert _status(federation) == "interrupted"  # settled, as a run stopped half-way is
    assert not (federation / "aggregator" / "runs" / f"run-{RUN_ID}" / "report.html").exists()


def test_start_sh_under_a_tee_that_ctrl_c_stopped_stops_everything(federation, tmp_path):
    """`start.sh | tee log`, Ctrl-C: tee goes first, and start.sh's clean-up writes into a
    closed pipe; what it says goes to stderr."""
    err = tmp_path / "stderr"
    with open(err, "wb") as stderr:
        start = _start(
            federation / "start.sh",
            env={"FAKE_STATUS": "running"},
            stdout=subprocess.PIPE,
            stderr=stderr,
        )
    assert start.stdout is not None
    seen = b""
    while b"Successfully started run" not in seen:
        line = start.stdout.readline()
        assert line, f"start.sh exited {start.wait(timeout=60)}:\n{seen.decode()}"
        seen += line
    _until("the run", lambda: _status(federation) == "running", start)
    start.stdout.close()  # tee, stopped by the Ctrl-C
    assert _ctrl_c(start) == 130, err.read_text()
    _nothing_left(federation)
    assert "start.sh: stopping every process it started" in err.read_text()
    assert "interrupted during clean-up" not in err.read_text()
    assert _status(federation) == "interrupted"


@pytest.mark.parametrize(
    ("status", "report_rc", "code"),
    # The run's outcome first, then the report's (a log that fails verification).
    [(RunStatus.COMPLETED, 0, 0), (RunStatus.NO_AGGREGATE, 1, EXIT_NO_AGGREGATE)],
)
def test_ctrl_c_after_the_run_ended_still_reports_it_and_exits_by_its_outcome(
    federation, tmp_path, status, report_rc, code
):
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with open(out, "wb") as stdout, open(err, "wb") as stderr:
        start = _start(
            federation / "start.sh",
            env={"FAKE_STATUS": str(status), "FAKE_REPORT_RC": str(report_rc)},
            stdout=stdout,
            stderr=stderr,
        )
    _until("the run's end", lambda: _status(federation) == status, start)
    assert _ctrl_c(start) == code, err.read_text()
    _nothing_left(federation)
    run_dir = federation / "aggregator" / "runs" / f"run-{RUN_ID}"
    assert f"start.sh: interrupted during clean-up; the run had ended: {run_dir}" in (
        err.read_text()
    )
    assert (run_dir / "report.html").exists()
    assert out.read_text().count(f"report: {run_dir}/report.html") == 1
    assert _status(federation) == status  # not marked interrupted


def test_a_ctrl_c_that_cuts_start_shs_report_short_gets_it_written_whole(federation, tmp_path):
    """Ctrl-C reaches the report too (a foreground job, in start.sh's process group):
    the clean-up writes it again, to its end, and start.sh exits by the run's outcome."""
    err = tmp_path / "stderr"
    with open(err, "wb") as stderr:
        start = _start(
            federation / "start.sh",
            env={
                "FAKE_STATUS": str(RunStatus.COMPLETED),
                "FAKE_EXIT": "1",
                "FAKE_REPORT_SLOW": "1",
            },
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
    run_dir = federation / "aggregator" / "runs" / f"run-{RUN_ID}"
    _until("the report", (run_dir / "report-started").exists, start)
    assert _ctrl_c(start) == 0, err.read_text()
    assert (run_dir / "report.html").exists()
    assert "interrupted during clean-up" in err.read_text()
    _nothing_left(federation)


@pytest.mark.parametrize(
    ("status", "code"), [(RunStatus.NO_AGGREGATE, EXIT_NO_AGGREGATE), ("none", 1)]
)
def test_start_sh_reports_the_run_it_started_and_exits_by_its_outcome(federation, status, code):
    """No signal: the run ends, and flwr run with it. An older run in runs/ is never
    reported as this one, also when flwr run started none."""
    old = federation / "aggregator" / "runs" / "run-7"
    record(old, RunStatus.COMPLETED)
    os.utime(old / "metrics.json", (time.time() - 3600,) * 2)
    done = subprocess.run(
        ["bash", str(federation / "start.sh")],
        env={**os.environ, "FAKE_STATUS": str(status), "FAKE_EXIT": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == code, done.stderr
    run_dir = federation / "aggregator" / "runs" / f"run-{RUN_ID}"
    assert (f"report: {run_dir}/report.html" in done.stdout) == (status != "none")
    assert "report: " not in done.stdout.replace(f"report: {run_dir}/", "")
    assert "interrupted" not in done.stderr
    assert not (old / "report.html").exists()
    _nothing_left(federation)


#: A region's three processes, by the mark in their command lines once they run.
ROLES = {"agent": "fake-agent", "SuperNode": "flower-supernode", "relay": "flower-superexec"}
#: And the ClientApp the relay's SuperExec started, which must end with the region.
MARKS = {**ROLES, "ClientApp": "flwr-clientapp"}
#: How start-supernode.sh names each when it stops (its relay as the region's own user).
STOPPED = {
    "agent": "its agent",
    "SuperNode": "its SuperNode (flower-supernode)",
    "relay": "its relay (flower-superexec)",
}


def _roles(here: Path) -> dict[str, psutil.Process]:
    """The region's agent, SuperNode, relay and ClientApp that run (each once it has
    exec'd: not the wrapper that starts it)."""
    found = {}
    for process in processes_under(here):
        with contextlib.suppress(psutil.Error):  # one may end between list and look
            line = " ".join(process.cmdline())
            for role, mark in MARKS.items():
                if mark in line and "fedciuic.ops.scripts" not in line and "--ping" not in line:
                    found[role] = process
    return found


def _until_up(here: Path, region: subprocess.Popen[bytes]) -> None:
    """Until the region's agent, SuperNode, relay and ClientApp all run."""
    _until(", ".join(MARKS), lambda: _roles(here).keys() == MARKS.keys(), region)


def _gone(here: Path, within: float = 15.0) -> float:
    """Seconds until nothing of the region runs (fails after ``within``)."""
    started = time.monotonic()
    while processes_under(here):
        if time.monotonic() - started > within:
            _nothing_left(here)
        time.sleep(0.1)
    return time.monotonic() - started


def _last_line(path: Path) -> str:
    return path.read_text().rstrip("\n").splitlines()[-1]


def test_start_supernode_sh_with_its_output_closed_stops_its_three_processes_on_ctrl_c(
    federation,
):
    here = federation / "regions" / "eu"
    region = _start(here / "start-supernode.sh", stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert region.stdout is not None
    region.stdout.close()
    _until_up(here, region)
    assert _ctrl_c(region) == 130
    _nothing_left(here)


@pytest.mark.parametrize("role", list(ROLES))
def test_when_one_of_a_regions_three_processes_dies_the_script_stops_the_others_saying_which(
    federation, tmp_path, role
):
    """A region that looks alive but cannot answer keeps a round waiting to its timeout:
    once its agent, SuperNode or relay is gone, the other two stop too, at once."""
    here = federation / "regions" / "eu"
    err = tmp_path / "stderr"
    with open(err, "wb") as stderr:
        region = _start(
            here / "start-supernode.sh", stdout=subprocess.DEVNULL, stderr=stderr, env=STUCK
        )
    _until_up(here, region)
    _roles(here)[role].kill()
    assert region.wait(timeout=30) == 128 + signal.SIGKILL
    assert _last_line(err) == (
        f"start-supernode.sh: region eu stops: {STOPPED[role]} exited (killed by SIGKILL); "
        "stopping the others so that Flower sees the node offline"
    )
    assert _gone(here) < 5


def test_a_relay_that_exits_stops_the_region_after_its_own_line(federation, tmp_path):
    here = federation / "regions" / "eu"
    err = tmp_path / "stderr"
    with open(err, "wb") as stderr:
        region = _start(
            here / "start-supernode.sh",
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            env={"FAKE_RELAY_FAILS": "cannot start: this is why"},
        )
    assert region.wait(timeout=30) == 1
    lines = err.read_text().splitlines()
    assert lines[-2:] == [
        "flower-superexec: cannot start: this is why",
        "start-supernode.sh: region eu stops: its relay (flower-superexec) exited (exit status "
        "1; its own lines above say why); stopping the others so that Flower sees the node "
        "offline",
    ]
    assert _gone(here) < 5


@pytest.mark.parametrize("moment", [0.0, 0.5, 1.0, 1.5, "all up"])
def test_a_kill_9_of_start_supernode_sh_at_any_moment_leaves_nothing_and_it_starts_again_at_once(
    federation, moment
):
    """kill -9 runs no clean-up: the SuperNode and the relay carry the kernel's
    parent-death signal, the agent watches its launcher, the relay ends the ClientApps its
    SuperExec started (one that ignores SIGTERM too); the SuperNode's port is free for
    the next start (a SuperNode left running would hold it: "address already in use")."""
    here = federation / "regions" / "eu"
    script = here / "start-supernode.sh"
    region = _start(script, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=STUCK)
    if moment == "all up":
        _until_up(here, region)
    else:
        time.sleep(float(moment))
    region.kill()
    region.wait(timeout=10)
    _gone(here)
    again = _start(script, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _until_up(here, again)
    assert _ctrl_c(again) == 130
    _nothing_left(here)


def test_a_region_whose_relay_cannot_reach_its_home_stops_at_start_naming_the_folder(relayed):
    """A folder closed to other users since init: the start script says which, and how to
    open it, in one line and within seconds, before it starts anything."""
    here = relayed / "regions" / "eu"
    relayed.chmod(0o700)
    started = time.monotonic()
    done = subprocess.run(
        ["bash", str(here / "start-supernode.sh")], capture_output=True, text=True, timeout=60
    )
    took = time.monotonic() - started
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        f"fedciuic: relay-user {RELAY_USER}: cannot reach its home {here / 'relay'}: {relayed} "
        f"is closed to other users; chmod o+x {relayed} (let others pass through it), or keep "
        "the deployment in a folder others may pass through"
    ]
    assert took < 15, took
    _nothing_left(here)


@pytest.mark.skipif(os.geteuid() != 0, reason="not root: the relay cannot run as another user")
def test_a_relay_that_cannot_start_stops_its_region_within_seconds_naming_the_folder(
    relayed, tmp_path
):
    """The folder closed once the agent is up: the relay (as its own user) refuses in one
    line naming the folder and the fix, and the script stops the agent and the SuperNode
    at once (not at the aggregator's round-timeout), saying that the relay stopped."""
    here = relayed / "regions" / "eu"
    err = tmp_path / "stderr"
    with contextlib.ExitStack() as stack:
        stack.enter_context(passable_to_others(interpreter_paths()))
        stderr = stack.enter_context(open(err, "wb"))
        region = _start(
            here / "start-supernode.sh",
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            env={"FAKE_CLOSE": str(relayed)},
        )
        assert region.wait(timeout=60) == 1, err.read_text()
    lines = err.read_text().splitlines()
    assert lines[-2:] == [
        f"fedciuic: relay-user {RELAY_USER}: cannot reach its home {here / 'relay'}: {relayed} "
        f"is closed to other users; chmod o+x {relayed} (let others pass through it), or keep "
        "the deployment in a folder others may pass through",
        f"start-supernode.sh: region eu stops: its relay (flower-superexec as {RELAY_USER}) "
        "exited (exit status 1; its own lines above say why); stopping the others so that "
        "Flower sees the node offline",
    ], "\n".join(lines)  # whole: a line after these once ended "Broken pipe" (flaky)
    assert _gone(here) < 5


def test_run_sh_with_its_output_closed_streams_the_run_to_its_end_and_exits_by_it(federation):
    """`run.sh | head -c 1`: head is gone after one byte; the run's outcome still counts."""
    done = subprocess.run(
        f"set -o pipefail; bash {federation / 'aggregator' / 'run.sh'} | head -c 1",
        shell=True,
        executable="bash",
        env={**os.environ, "FAKE_STATUS": str(RunStatus.COMPLETED), "FAKE_EXIT": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (done.returncode, done.stdout) == (0, "S"), done.stderr


def test_stop_sh_with_its_output_closed_stops_and_exits_0(federation):
    sleeper = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        (federation / "pids").mkdir()
        (federation / "pids" / "sleeper.pid").write_text(f"{sleeper.pid}\n")
        stop = subprocess.Popen(
            ["bash", str(federation / "stop.sh")],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        assert stop.stdout is not None
        stop.stdout.close()
        assert stop.wait(timeout=60) == 0
        assert sleeper.wait(timeout=10) == -signal.SIGTERM
    finally:
        with contextlib.suppress(ProcessLookupError):
            sleeper.kill()
        sleeper.wait()


@pytest.mark.parametrize("closed", ["stdout", "stderr"])
def test_say_to_a_closed_output_drops_the_line_and_keeps_the_exit_status(closed):
    code = (
        "import sys; from fedciuic.ops.scripts import say; "
        "say('one'); say('two'); say('three', err=True); sys.exit(7)"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert child.stdout is not None and child.stderr is not None
    gone, kept = (
        (child.stdout, child.stderr) if closed == "stdout" else (child.stderr, child.stdout)
    )
    gone.close()  # before the child writes a word
    assert child.wait(timeout=60) == 7
    assert kept.read() == ("three\n" if closed == "stdout" else "one\ntwo\n")


def test_last_run_is_the_newest_written_since_with_its_outcome(tmp_path):
    runs = tmp_path / "runs"
    assert scripts.last_run(runs, time.time()) == (None, 1)
    record(runs / "run-1", RunStatus.COMPLETED)
    os.utime(runs / "run-1" / "metrics.json", (time.time() - 3600,) * 2)
    since = time.time()
    assert scripts.last_run(runs, since) == (None, 1)  # before this start
    record(runs / "run-2", "running")
    # A file's time is the kernel's coarse clock, which may lag time.time() by a tick.
    os.utime(runs / "run-2" / "metrics.json", (since + 1,) * 2)
    assert scripts.last_run(runs, since) == (runs / "run-2", 1)
    record(runs / "run-3", RunStatus.NO_AGGREGATE)
    os.utime(runs / "run-3" / "metrics.json", (since + 5,) * 2)
    assert scripts.last_run(runs, since) == (runs / "run-3", EXIT_NO_AGGREGATE)
    record(runs / "run-4", RunStatus.COMPLETED)
    os.utime(runs / "run-4" / "metrics.json", (since + 9,) * 2)
    assert scripts.last_run(runs, since) == (runs / "run-4", 0)


# -- the README's stop of Flower's own local SuperLink ----------------------------------


def _readme_stop_line() -> str:
    """The last line of the README's `flwr run` block: what stops the SuperLink that
    `flwr run` started."""
    readme = (ROOT / "README.md").read_text()
    block = readme.split("flwr run . --stream", 1)[1].split("```", 1)[0]
    return block.strip().splitlines()[-1].split("#", 1)[0].strip()


def _flower_local_superlink(home: Path, fake_bin: Path) -> int:
    """The SuperLink `flwr run` starts for the `local` connection, started by Flower's own
    code as `flwr run` does (detached), with FLWR_HOME ``home``; the `flower-superlink`
    it runs is the stand-in that answers /health. Returns its PID."""
    env = {
        **os.environ,
        "FLWR_HOME": str(home),
        "PATH": f"{fake_bin}{os.pathsep}{os.environ['PATH']}",
        "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(free_port()),
        "FLWR_LOCAL_CONTROL_API_PORT": str(free_port()),
    }
    code = "from flwr.cli.local_superlink import _start_local_superlink; _start_local_superlink()"
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if f"{home}/local-superlink/superlink.log" in " ".join(proc.cmdline()):
                found.append(int(proc.pid))
    (pid,) = found
    return pid


def test_the_readme_stops_the_superlink_flwr_run_started_by_its_pid_and_no_other(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    _script(fake / "flower-superlink", f"#!{sys.executable}\n{FAKE_SUPERLINK}")
    ours = _flower_local_superlink(tmp_path / "flwr-home", fake)
    # Another user's (or another FLWR_HOME's) local SuperLink, with the same options.
    other = _flower_local_superlink(tmp_path / "other-home", fake)
    try:
        line = _readme_stop_line()
        # (A pkill by pattern would stop every such SuperLink here: never run it.)
        assert "pkill" not in line and "killall" not in line
        done = subprocess.run(
            ["bash", "-c", line],
            env={**os.environ, "FLWR_HOME": str(tmp_path / "flwr-home")},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        psutil.wait_procs([psutil.Process(ours)], timeout=10)
        assert not psutil.pid_exists(ours) or psutil.Process(ours).status() == "zombie"
        assert psutil.Process(other).is_running()
    finally:
        for pid in (ours, other):
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).kill()


def test_the_lab_federations_relay_command_is_one_the_deploy_module_runs(tmp_path):
    """LocalFederation starts a relay as the start script does: the same action, its
    launcher's PID, and the command after ``--`` (here one that exits 7)."""
    command = relay_command("", tmp_path / "relay", "127.0.0.1:1")
    command[command.index("--") + 1 :] = [sys.executable, "-c", "raise SystemExit(7)"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 7, done.stderr
