"""``fedciuic init``: a deployment folder, laid out per party, with the scripts that run it.

A user should not need to know Flower's commands, certificates or node configs to run
a federation. :func:`init_deployment` checks everything before it writes anything (a
refused deployment leaves nothing behind), then writes one folder per party, so each
can be copied to its own machine: private keys never leave their party's folder.
The scripts call ``python -m fedciuic.ops.deploy ACTION`` for what is easier to get
right in Python (health checks, stopping process trees, reading a run's outcome).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import shutil
import sys
import time
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil

from fedciuic.config import RunConfig
from fedciuic.crypto import AGGREGATOR, NAME_PATTERN
from fedciuic.errors import EXIT_NO_AGGREGATE, ConfigError, FedciuicError
from fedciuic.flower import (
    STARTED_RUN,
    healthy,
    running,
    stage_app,
    stop_process_trees,
    tail,
    toml_pairs,
)
from fedciuic.jurisdictions import JURISDICTIONS, simulated_jurisdiction
from fedciuic.ops.layout import (
    DeployedRegion,
    Deployment,
    region_socket,
    relay_home,
    run_overrides,
    start_owner,
    write_deployment,
)
from fedciuic.ops.outputs import mark_unfinished
from fedciuic.ops.separation import (
    SeparationError,
    check_runs,
    default_relay_user,
    ensure_user,
    exec_tied,
    reach_problem,
    reachability_problem,
    relay_folders,
    run_as,
)
from fedciuic.policy import LoadedPolicy, PolicyError, PolicySet, load_policies
from fedciuic.record import (
    METRICS_FILE,
    MetricsError,
    RunStatus,
    load_metrics,
    no_aggregate_reasons,
)

DEFAULT_PORT = 9092


# -- checks ---------------------------------------------------------------------------


def parse_regions(regions: str | Sequence[str]) -> tuple[list[tuple[str, str]], list[str]]:
    """``eu,cn,paris=EU`` as (name, jurisdiction) pairs, and every problem found."""
    specs = regions.split(",") if isinstance(regions, str) else list(regions)
    parsed: list[tuple[str, str]] = []
    problems: list[str] = []
    for spec in (s.strip() for s in specs):
        if not spec:
            continue
        name, sep, jurisdiction = spec.partition("=")
        name = name.strip()
        jurisdiction = jurisdiction.strip().upper() if sep else simulated_jurisdiction(name)
        if not re.match(NAME_PATTERN, name):
            problems.append(
                f"--regions:{name}: not a region name; use a lower-case letter, then up to 31 "
                "lower-case letters, digits, - or _ (e.g. eu, paris)"
            )
        elif name == AGGREGATOR:
            problems.append(f"--regions:{name}: the aggregator's name; call the region otherwise")
        elif any(name == other for other, _ in parsed):
            problems.append(f"--regions:{name}: listed twice; list each region once")
        else:
            parsed.append((name, jurisdiction))
    if not parsed and not problems:
        problems.append("--regions: empty; list the regions, e.g. --regions eu,cn,us")
    return parsed, problems


def _app_defaults(app: Path) -> tuple[dict[str, Any], list[str]]:
    """The app's run-config defaults, or why ``app`` is not a Flower app folder."""
    from fedciuic.ops.runconfig import app_run_config

    try:
        return app_run_config(app), []
    except ConfigError as err:
        return {}, list(err.problems)


def _check_directory(directory: Path) -> list[str]:
    if directory.exists() and not directory.is_dir():
        return [f"{directory}: exists and is not a folder; choose another DIR"]
    if directory.is_dir() and any(directory.iterdir()):
        return [
            f"{directory}: exists and is not empty; choose another DIR or remove it "
            "(init never writes over a deployment's keys)"
        ]
    if any(c in str(directory) for c in "\"'\n"):
        # Flower parses --run-config "k='v'" with a regular expression that quotes break.
        return [f"{directory}: a quote or line break in the path; choose a plainer DIR"]
    return []


def _region_policy(
    name: str, jurisdiction: str, policies_dir: Path, policies: PolicySet | None, aggregator: str
) -> tuple[LoadedPolicy | None, list[str]]:
    if policies is None:
        return None, []
    loaded = policies.get(jurisdiction)
    if loaded is None:
        have = ", ".join(sorted(policies.by_jurisdiction)) or "none"
        unreadable = "".join(f"; unreadable: {p}" for p in policies.problems)
        if jurisdiction in JURISDICTIONS:
            fix = "add one or pass --policies DIR"
        else:
            fix = (
                f"{jurisdiction} is not a jurisdiction fedciuic knows: name the region's as "
                f"{name}=JUR (an ISO 3166-1 code, EU or EEA), e.g. paris=EU"
            )
        return None, [
            f"--regions:{name}: no policy for jurisdiction {jurisdiction} in {policies_dir} "
            f"(have {have}){unreadable}; {fix}"
        ]
    allowed = loaded.policy.transfers.aggregator_jurisdictions
    if aggregator in JURISDICTIONS and aggregator not in allowed:
        return loaded, [
            f"--aggregator-jurisdiction: {aggregator}, but region {name}'s policy "
            f"({loaded.path.name}) lets its updates go only to {', '.join(allowed)} "
            "(transfers.aggregator_jurisdictions); choose one of those or leave the region out"
        ]
    return loaded, []


def _relay_problems(user: str, folders: dict[str, Path]) -> list[str]:
    """Why ``user`` cannot be the relay's user here: it must run this Python and reach
    ``folders``."""
    if not re.fullmatch(r"[a-z_][a-z0-9_-]{0,31}", user):
        return [f"--relay-user: {user!r} is not a user name (lower-case, at most 32 characters)"]
    try:
        if pwd.getpwnam(user).pw_uid in (0, os.geteuid()):
            return [f"--relay-user: {user} is root or yourself; the relay needs a user of its own"]
    except KeyError:
        if os.geteuid() != 0:
            return [
                f"--relay-user: no user {user}; create it (as root), or run init as root so "
                "that start-supernode.sh creates it"
            ]
    problems = [reachability_problem(user), reach_problem(user, folders, "--relay-user")]
    return [p for p in problems if p]


# -- init -----------------------------------------------------------------------------


def init_deployment(
    directory: Path,
    regions: str | Sequence[str],
    aggregator_jurisdiction: str = "EU",
    app_dir: Path = Path("."),
    policies_dir: Path | None = None,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    tls: bool = True,
    demo_data: bool = False,
    supernode_port_base: int | None = None,
    relay_user: str | None = None,
) -> Deployment:
    """Check everything, then write the deployment folder; raise ConfigError with every
    problem. ``relay_user`` None: :func:`default_relay_user`."""
    from fedciuic.data import FAMILIES

    directory = Path(os.path.abspath(directory.expanduser()))
    app = app_dir.expanduser().resolve()
    policies_path = (policies_dir.expanduser() if policies_dir else app / "policies").resolve()
    aggregator = aggregator_jurisdiction.strip().upper()
    problems = _check_directory(directory)
    parsed, region_problems = parse_regions(regions)
    problems += region_problems
    defaults, app_problems = _app_defaults(app)
    problems += app_problems
    if aggregator not in JURISDICTIONS:
        problems.append(
            f"--aggregator-jurisdiction: {aggregator or '(empty)'} is not a jurisdiction "
            "fedciuic knows; use an ISO 3166-1 code, EU or EEA"
        )
    if not host or any(c.isspace() or c in "\"'/" for c in host):
        problems.append(
            f"--host: {host!r} is not a name or address; give the one SuperNodes reach the "
            "SuperLink at, e.g. 127.0.0.1 or superlink.example.org"
        )
    base = port + 1 if supernode_port_base is None else supernode_port_base
    ports = [base + i for i in range(len(parsed))]
    for option, value, top in (
        ("--port", port, 65535),
        ("--supernode-port-base", base, 65536 - max(len(parsed), 1)),
    ):
        if not 0 < value <= top:
            problems.append(f"{option}: {value} is not a usable TCP port; pick one in 1-{top}")
    if port in ports:
        problems.append(
            f"--supernode-port-base: {base} gives a SuperNode the SuperLink's --port {port}; "
            f"pick a base above {port} or below {port - len(parsed)}"
        )
    relay = default_relay_user() if relay_user is None else relay_user.strip()
    if demo_data:
        problems += [
            f"--demo-data: no demo corpus for region {name} (have {', '.join(FAMILIES)}); "
            f"leave out --demo-data and put {name}'s data in its data/ folder"
            for name, _ in parsed
            if name not in FAMILIES
        ]
    try:
        policies = load_policies(policies_path)
    except PolicyError:
        policies = None
        problems.append(
            f"--policies:{policies_path}: no such folder; pass --policies DIR with one policy "
            "YAML per jurisdiction (the shipped ones are in the app's policies/)"
        )
    loaded: list[DeployedRegion] = []
    for (name, jurisdiction), node_port in zip(parsed, ports, strict=True):
        policy, policy_problems = _region_policy(
            name, jurisdiction, policies_path, policies, aggregator
        )
        problems += policy_problems
        if policy is not None:
            loaded.append(DeployedRegion(name, jurisdiction, policy, node_port))
    deployment = Deployment(
        directory=directory,
        app=app,
        regions=tuple(loaded),
        aggregator_jurisdiction=aggregator,
        host=host,
        port=port,
        tls=tls,
        demo_data=demo_data,
        bin_dir=Path(sys.executable).parent,
        relay_user=relay,
    )
    if relay:
        # Each region's relay home and agent socket (in folders init makes passable):
        # the folders above them must let the relay's user through too.
        folders: dict[str, Path] = {}
        for region in deployment.regions:
            folders |= relay_folders(
                relay_home(deployment, region.name), region_socket(deployment, region.name)
            )
        problems += _relay_problems(relay, folders)
    if not problems:
        # The run config the aggregator will submit must be one the ServerApp accepts.
        try:
            RunConfig.from_user_config(
                {**defaults, **run_overrides(deployment)}, source="run config"
            )
        except ConfigError as err:
            problems += err.problems
    if problems:
        raise ConfigError(problems)

    existed = directory.is_dir()
    made = [f for f in (directory, *directory.parents) if not f.exists()]
    directory.mkdir(parents=True, exist_ok=True)
    for folder in made:  # whatever the umask: the relay's user passes through them
        folder.chmod(0o755)
    try:
        write_deployment(deployment, policies)
    except BaseException:
        # No half-written deployment: remove what this call wrote, and only that.
        if existed:  # it was empty: everything in it is ours
            for child in directory.iterdir():
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child)
                else:
                    child.unlink()
        else:
            shutil.rmtree(directory, ignore_errors=True)
        raise
    return deployment


# -- helpers the scripts call ---------------------------------------------------------


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
    status = data.run.status
    say(f"run.sh: run {match.group(1)} {status}; results in {metrics.parent}")
    if status == RunStatus.NO_AGGREGATE:
        say(
            f"run.sh: run {match.group(1)} published no aggregate in any round, so nothing was "
            "trained and no adapter was saved. Why:\n"
            + "\n".join(f"  {line}" for line in data.run.reasons or no_aggregate_reasons(data)),
            err=True,
        )
        return EXIT_NO_AGGREGATE
    return 0 if status == RunStatus.COMPLETED else 1


def last_run(runs_dir: Path, since: float) -> tuple[Path | None, int]:
    """The newest run in ``runs_dir`` written since ``since`` (start.sh's start), and its
    outcome as run.sh gives it (1: not ended, or no such run)."""
    found: list[tuple[float, Path]] = []
    for metrics in runs_dir.glob(f"run-*/{METRICS_FILE}"):
        with contextlib.suppress(OSError):
            if (mtime := metrics.stat().st_mtime) >= since - 1.0:
                found.append((mtime, metrics.parent))
    if not found:
        return None, 1
    run_dir = max(found)[1]
    try:
        status = load_metrics(run_dir / METRICS_FILE).run.status
    except MetricsError:
        return run_dir, 1
    return run_dir, {RunStatus.COMPLETED: 0, RunStatus.NO_AGGREGATE: EXIT_NO_AGGREGATE}.get(
        status, 1
    )


def settle_runs(runs_dir: Path, since: float) -> list[Path]:
    """Mark ``interrupted`` each run written since ``since`` that still says ``running``
    once every process start.sh started is gone: it can no longer end."""
    marked = []
    for metrics in sorted(runs_dir.glob(f"run-*/{METRICS_FILE}")):
        try:
            fresh = metrics.stat().st_mtime >= since - 1.0
            status = load_metrics(metrics).run.status
        except (OSError, MetricsError):
            continue
        if (
            fresh
            and status == RunStatus.RUNNING
            and mark_unfinished(
                metrics.parent, "start.sh stopped the federation before the run ended"
            )
        ):
            marked.append(metrics.parent)
    return marked


def tracked(pids_dir: Path) -> list[psutil.Process]:
    """The live processes named in ``pids_dir/*.pid``, less reused PIDs (a process that
    started after its PID file was written)."""
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
    problem = reach_problem(user, relay_folders(home, socket))
    if problem:
        raise SeparationError(problem)
    ensure_user(user, home)
    check_runs(user)
    return 0


def _main(argv: Sequence[str]) -> int:
    """``python -m fedciuic.ops.deploy ACTION ARGS``, for the generated scripts."""
    action, *args = argv or ["help"]
    if action == "run-config" and len(args) == 1:
        print(run_config_pairs(Path(args[0])))
        return 0
    if action == "stage-app" and len(args) == 2:
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
        "usage: python -m fedciuic.ops.deploy run-config FILE | stage-app APP INTO "
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
