"""What the deployment's scripts ask of Python: ``python -m fedciuic.ops.scripts ACTION``.

Health checks, stopping process trees, the run's outcome, the relay's user: easier to
get right in Python than in bash. Each step is a new process, so this module imports
little (psutil and the standard library; a run's metrics only where an action reads
them), never the config, Flower and policies that ``fedciuic init`` needs.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

from fedciuic.errors import EXIT_NO_AGGREGATE, FedciuicError
from fedciuic.ops.separation import (
    SeparationError,
    check_runs,
    ensure_user,
    exec_tied,
    reach_problem,
    relay_folders,
    run_as,
)
from fedciuic.processes import (
    STARTED_RUN,
    healthy,
    owner_tag,
    running,
    stop_process_trees,
    tail,
    toml_pairs,
)

if TYPE_CHECKING:  # the record's import is heavier: only the actions that read it
    from fedciuic.record import RunStatus


def start_owner(directory: Path) -> str:
    """The ``FEDCIUIC_LAUNCH`` value start.sh gives every process it starts."""
    return owner_tag("start.sh", directory)


def say(message: str, *, err: bool = False) -> None:
    """Print one line for the scripts' user. A closed output (a ``| tee`` that Ctrl-C
    stopped) loses the line, never the work it reports nor the exit status."""
    stream = sys.stderr if err else sys.stdout
    try:
        print(message, file=stream, flush=True)
    except OSError:
        # Python would fail again flushing it at exit (and exit 120): write nowhere.
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())


def run_config_pairs(path: Path) -> str:
    """A run-config TOML file as ``k=v`` pairs for ``flwr run --run-config``."""
    with open(path, "rb") as handle:
        return toml_pairs(tomllib.load(handle))


def wait_healthy(url: str, ca: str, pid_file: Path, log: Path, timeout: float = 60.0) -> int:
    """Wait until the SuperLink answers on ``/health``; 1 with its log's end if it exits."""
    try:
        superlink = psutil.Process(int(pid_file.read_text().strip()))
    except psutil.Error:
        superlink = None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if superlink is None or not running(superlink):
            say(f"start.sh: flower-superlink exited; {log}:\n{tail(log)}", err=True)
            return 1
        if healthy(url, ca or None):
            return 0
        time.sleep(0.3)
    say(
        f"start.sh: flower-superlink did not answer at {url} within {timeout:.0f}s; see {log}",
        err=True,
    )
    return 1


def check_run_log(log: Path, config: Path) -> int:
    """0 if the run that ``flwr run`` started (its log) completed, else 1 with why."""
    from fedciuic.record import METRICS_FILE, MetricsError, load_metrics, no_aggregate_reasons

    match = STARTED_RUN.search(log.read_text(errors="replace"))
    if not match:
        say("run.sh: flwr run started no run; see its output above", err=True)
        return 1
    with open(config, "rb") as handle:
        output = Path(tomllib.load(handle)["output-dir"])
    metrics = output / f"run-{match.group(1)}" / METRICS_FILE
    try:
        data = load_metrics(metrics)
    except MetricsError as err:
        say(
            f"run.sh: run {match.group(1)} wrote no usable metrics ({err}; output-dir "
            "overridden?); see the SuperLink's log",
            err=True,
        )
        return 1
    say(f"run.sh: run {match.group(1)} {data.run.status}; results in {metrics.parent}")
    outcome = run_outcome(data.run.status)
    if outcome == EXIT_NO_AGGREGATE:
        say(
            f"run.sh: run {match.group(1)} published no aggregate in any round, so nothing was "
            "trained and no adapter was saved. Why:\n"
            + "\n".join(f"  {line}" for line in data.run.reasons or no_aggregate_reasons(data)),
            err=True,
        )
    return outcome


def run_outcome(status: RunStatus) -> int:
    """run.sh's exit status for a run that ended so: 0 completed, 3 no aggregate, else 1."""
    from fedciuic.record import RunStatus

    return {RunStatus.COMPLETED: 0, RunStatus.NO_AGGREGATE: EXIT_NO_AGGREGATE}.get(status, 1)


def runs_since(runs_dir: Path, since: float) -> list[tuple[float, Path]]:
    """(mtime, folder) of each run in ``runs_dir`` written since ``since``, oldest first."""
    from fedciuic.record import METRICS_FILE

    found: list[tuple[float, Path]] = []
    for metrics in runs_dir.glob(f"run-*/{METRICS_FILE}"):
        with contextlib.suppress(OSError):
            if (mtime := metrics.stat().st_mtime) >= since - 1.0:
                found.append((mtime, metrics.parent))
    return sorted(found)


def last_run(runs_dir: Path, since: float) -> tuple[Path | None, int]:
    """The newest run written since ``since``, and run.sh's exit status for it (1: none yet)."""
    from fedciuic.record import METRICS_FILE, MetricsError, load_metrics

    found = runs_since(runs_dir, since)
    if not found:
        return None, 1
    run_dir = found[-1][1]
    try:
        status = load_metrics(run_dir / METRICS_FILE).run.status
    except MetricsError:
        return run_dir, 1
    return run_dir, run_outcome(status)


def settle_runs(runs_dir: Path, since: float) -> list[Path]:
    """Mark each run since ``since`` still ``running`` interrupted: start.sh's processes ended."""
    from fedciuic.ops.outputs import mark_unfinished

    why = "start.sh stopped the federation before the run ended"
    return [run_dir for _, run_dir in runs_since(runs_dir, since) if mark_unfinished(run_dir, why)]


def tracked(pids_dir: Path) -> list[psutil.Process]:
    """The live processes in ``pids_dir/*.pid``, less reused PIDs (started after their file)."""
    found = []
    for pid_file in sorted(pids_dir.glob("*.pid")):
        try:
            proc = psutil.Process(int(pid_file.read_text().strip()))
            if running(proc) and proc.create_time() <= pid_file.stat().st_mtime + 1.0:
                found.append(proc)
        except (ValueError, OSError, psutil.Error):
            continue
    return found


def stop_processes(pids_dir: Path, grace: float = 10.0) -> list[int]:
    """Stop every process named in ``pids_dir/*.pid`` and its descendants; return them."""
    roots = [proc.pid for proc in tracked(pids_dir)]
    # Also what outlived its parent: every process start.sh started carries its mark.
    stop_process_trees(roots, grace, owner=start_owner(Path(os.path.abspath(pids_dir.parent))))
    return roots


def relay_setup(user: str, home: Path, socket: Path) -> int:
    """Before a region's agent starts: the relay's user (made if missing) can reach its
    home and the agent's socket and run the relay; without a user, a warning."""
    if not user:
        home.mkdir(mode=0o700, parents=True, exist_ok=True)
        say(
            "start-supernode.sh: relay-user is empty: Flower's ClientApp (code the aggregator "
            "ships) runs as this user and could read the region's files; run fedciuic init "
            "as root (or with --relay-user) for a relay of its own",
            err=True,
        )
        return 0
    if problem := reach_problem(user, relay_folders(home, socket)):
        raise SeparationError(problem)
    ensure_user(user, home)
    check_runs(user)
    return 0


def _main(argv: Sequence[str]) -> int:
    """``python -m fedciuic.ops.scripts ACTION ARGS``, for the generated scripts."""
    action, *args = argv or ["help"]
    if action == "run-config" and len(args) == 1:
        print(run_config_pairs(Path(args[0])))
        return 0
    if action == "stage-app" and len(args) == 2:
        from fedciuic.flower import stage_app  # Flower's build: heavy, this step only

        stage_app(Path(args[0]), Path(args[1]))
        return 0
    if action == "wait-healthy" and len(args) == 4:
        return wait_healthy(args[0], args[1], Path(args[2]), Path(args[3]))
    if action == "check-run" and len(args) == 2:
        return check_run_log(Path(args[0]), Path(args[1]))
    if action == "running" and len(args) == 1:  # exit 1 if any tracked process is alive
        live = tracked(Path(args[0]))
        for proc in live:
            say(f"{args[0]}: process {proc.pid} ({proc.name()}) is running", err=True)
        return 1 if live else 0
    if action == "settle" and len(args) == 2:
        for run_dir in settle_runs(Path(args[0]), float(args[1])):
            say(f"start.sh: {run_dir.name} did not end; marked interrupted")
        return 0
    if action == "last-run" and len(args) == 2:  # its folder, if any; exit: its outcome
        last, outcome = last_run(Path(args[0]), float(args[1]))
        if last is not None:
            say(str(last))
        return outcome
    if action == "relay-setup" and len(args) == 3:
        return relay_setup(args[0], Path(args[1]), Path(args[2]))
    # PARENT: the launcher's PID ($$), which the command dies with (tied: returns only by
    # raising; relay: its group's exit status)
    if action == "relay" and len(args) >= 5 and args[3] == "--" and args[2].isdigit():
        return run_as(args[0], Path(args[1]), args[4:], parent=int(args[2]))
    if action == "tied" and len(args) >= 3 and args[1] == "--" and args[0].isdigit():
        exec_tied(args[2:], parent=int(args[0]))
    if action == "stop" and len(args) == 1:
        stopped = stop_processes(Path(args[0]))
        say(f"stopped {len(stopped)} process group(s) named in {args[0]}")
        return 0
    print(
        "usage: python -m fedciuic.ops.scripts run-config FILE | stage-app APP INTO "
        "| wait-healthy URL CA PIDFILE LOG "
        "| check-run LOG FILE | settle RUNS_DIR SINCE | last-run RUNS_DIR SINCE "
        "| running PIDS_DIR | stop PIDS_DIR "
        "| relay-setup USER HOME SOCKET | relay USER HOME PARENT -- COMMAND... "
        "| tied PARENT -- COMMAND...",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    try:
        code = _main(sys.argv[1:])
    except FedciuicError as err:
        say(f"fedciuic: {err}", err=True)
        code = 1
    raise SystemExit(code)
