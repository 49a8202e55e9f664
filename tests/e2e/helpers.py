"""Shared checks for the end-to-end tests."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pickle
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import psutil

from fedciuic.agent.config import AgentConfig
from fedciuic.cluster.protocol import free_port
from fedciuic.crypto import AGGREGATOR
from fedciuic.crypto.tls import generate_supernode_key
from fedciuic.flower.launch import LocalFederation, Managed
from fedciuic.flower.relay import AGENT
from fedciuic.ops.layout import cpu_share
from fedciuic.processes import OWNER_ENV, owner_folder
from tests.conftest import SHARED_ENV

T = TypeVar("T")


def built_once(name: str, build: Callable[[Path], T]) -> T:
    """``build(folder)`` once per test run, whichever process asks first; the others
    wait for it and get its pickled result. ``--dist worksteal`` may hand a module's
    tests to both workers: a module fixture would otherwise build its federation twice."""
    with _shared_lock(name) as folder:
        done, failed = folder.with_suffix(".pickle"), folder.with_suffix(".failed")
        if failed.exists():
            raise RuntimeError(f"{name}: its build failed in another worker:\n{failed.read_text()}")
        if not done.exists():
            folder.mkdir(mode=0o711)
            try:
                value = build(folder)
            except BaseException as err:
                failed.write_text(f"{type(err).__name__}: {err}")
                raise
            done.write_bytes(pickle.dumps(value))
        result: T = pickle.loads(done.read_bytes())
        return result


@contextlib.contextmanager
def _shared_lock(name: str) -> Iterator[Path]:
    """``name`` in the run's shared folder, held under an exclusive lock (its ``.lock``
    file) by one process of the run at a time."""
    path = Path(os.environ[SHARED_ENV]) / name
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield path


def only_run(output_dir: Path) -> dict[str, Any]:
    runs = sorted(output_dir.glob("run-*/metrics.json"))
    assert len(runs) == 1, runs
    data: dict[str, Any] = json.loads(runs[0].read_text())
    return data


def eval_loss(data: dict[str, Any], server_round: int, region: str) -> float:
    return float(data["rounds"][str(server_round)]["eval"][region]["loss"])


def processes_under(folder: Path) -> list[psutil.Process]:
    """Live processes that belong to something started in ``folder``: their working
    directory or an argument is inside it, or they carry the mark of a launcher whose
    folder is inside it (``FEDCIUIC_LAUNCH``, which Ray's workers inherit wherever
    they were re-parented to)."""
    found = []
    me = psutil.Process().pid
    where = str(folder)
    for proc in psutil.process_iter():
        try:
            if proc.pid == me or proc.status() == psutil.STATUS_ZOMBIE:
                continue
            launcher = owner_folder(proc.environ().get(OWNER_ENV, ""))
            if (
                Path(proc.cwd()).is_relative_to(folder)
                or (launcher is not None and launcher.is_relative_to(folder))
                or any(where in arg for arg in proc.cmdline())
            ):
                found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


def running_under(folder: Path, command: str) -> list[psutil.Process]:
    """:func:`processes_under` ``folder`` whose command line holds ``command``; one that
    exits between the listing and the reading of its command line is not running."""
    found = []
    for proc in processes_under(folder):
        try:
            if command in " ".join(proc.cmdline()):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def stop_everything(folder: Path, pids: Iterable[int] = ()) -> None:
    """After a test failed half-way: kill the processes it started (``pids``, with their
    children) and whatever still belongs to ``folder`` (a SuperLink or Ray worker that
    a killed launcher left re-parented), and wait until they are gone."""
    targets: list[psutil.Process] = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            parent = psutil.Process(pid)
            targets += [parent, *parent.children(recursive=True)]
    targets += processes_under(folder)
    for proc in targets:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(targets, timeout=10)


def describe(processes: list[psutil.Process]) -> str:
    """PID and command line of each process (for an assertion message)."""
    lines = []
    for proc in processes:
        with contextlib.suppress(psutil.Error):
            lines.append(f"{proc.pid} {' '.join(proc.cmdline())[:160]}")
    return "\n".join(lines)


def alive(pids: list[int]) -> list[int]:
    live = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                live.append(pid)
        except psutil.NoSuchProcess:
            continue
    return live


class RecordingProxy:
    """A TCP relay on 127.0.0.1 that keeps every byte it forwards, both ways.

    SuperNodes connect to it instead of the SuperLink, so the test sees exactly the
    bytes that crossed the relay.
    """

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.captured = bytearray()
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        self.server.settimeout(0.5)
        while not self.stopped.is_set():
            try:
                client, _ = self.server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while chunk := source.recv(65536):
                with self.lock:
                    self.captured += chunk
                sink.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def stop(self) -> None:
        self.stopped.set()
        self.server.close()


#: Regions an end-to-end deployment starts on this machine: each agent takes its share.
REGIONS_HERE = 3


def agent_config(
    folder: Path, region: str, data: Path, states: Path, keys: Path, relay_user: str = ""
) -> Path:
    """A deployed region's agent config (:func:`deployed_node`'s files, its state in
    ``states/REGION``), written to ``folder/REGION.agent.toml``, with its socket in
    ``folder/REGION/`` and its share of this machine's cores."""
    values = {
        **deployed_node(region, data, states, keys),
        "peer-bundles": str(enrol_peers(keys, region, folder / f"{region}.peers")),
        "relay-user": relay_user,
        "cpu-threads": cpu_share(REGIONS_HERE),
    }
    config = AgentConfig.from_user_config(
        {**values, "socket": str(folder / region / "agent.sock")}, source="test"
    )
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{region}.agent.toml"
    path.write_text(config.toml())
    return path


def enrol_peers(keys: Path, region: str, folder: Path) -> Path:
    """``folder`` holding copies of the other regions' public bundles in ``keys`` (not
    the region's own, not the aggregator's): its operator's enrolment of its peers."""
    folder.mkdir(parents=True, exist_ok=True)
    for bundle in keys.glob("*.pub.json"):
        if bundle.name not in (f"{region}.pub.json", f"{AGGREGATOR}.pub.json"):
            shutil.copyfile(bundle, folder / bundle.name)
    return folder


def start_region(
    federation: LocalFederation,
    region: str,
    data: Path,
    states: Path,
    keys: Path,
    *,
    superlink: str = "",
    auth_folder: Path | None = None,
) -> tuple[Managed, Managed]:
    """A deployed region (its state in ``states/REGION``): its agent (holding its data,
    state, keys and policy), then a SuperNode whose node config names only the agent's
    socket (registered with the SuperLink first when ``auth_folder`` is given). Returns
    (agent, SuperNode)."""
    agents = states.parent / "agents"
    agent = federation.start_agent(region, agent_config(agents, region, data, states, keys))
    node = {AGENT: str(agents / region / "agent.sock")}
    if auth_folder is None:
        return agent, federation.start_supernode(region, node, superlink=superlink)
    return agent, secure_supernode(federation, auth_folder, region, node, superlink)


def secure_supernode(
    federation: LocalFederation,
    folder: Path,
    region: str,
    node_config: dict[str, str],
    superlink: str = "",
) -> Managed:
    """A SuperNode with its own key, registered with the SuperLink before it starts."""
    private, public = generate_supernode_key(folder, region)
    federation.register_supernode(public, region)
    return federation.start_supernode(region, node_config, superlink=superlink, auth_key=private)


def lab_policies_dir(state: Path) -> Path:
    """The policies of a deployed lab federation whose regions keep their state in
    ``state``: the shipped ones as record-level lab copies (the aggregator's
    policies-dir, and each region's own file)."""
    from tests.conftest import record_level_policies

    return record_level_policies(state.parent / "policies")


def deployed_node(region: str, data: Path, state: Path, keys: Path) -> dict[str, str]:
    """A deployed region's own facts (its agent's, never its ClientApp's): its data,
    state, keys, its jurisdiction's policy (a record-level lab copy of the shipped
    one, :func:`lab_policies_dir`) and its dictionary of names (the demo's, which the
    CN and EU policies' names require)."""
    from tests.conftest import SHIPPED_POLICIES

    return {
        "region": region,
        "data-path": str(data / region),
        "state-path": str(state / region),
        "key-file": str(keys / f"{region}.key.json"),
        "aggregator-bundle": str(keys / "aggregator.pub.json"),
        "policy": str(lab_policies_dir(state) / SHIPPED_POLICIES[region.upper()]),
        "deid-dictionary": str(data / "deid-dictionaries" / f"{region}.txt"),
    }


#: What :func:`passable_to_others` opened, and for how many holders, in the shared folder.
PASSABLE_STATE = "passable.json"


def _passable(paths: Iterable[Path], change: int) -> None:
    """Count ``change`` (+1, -1) holders of every folder on the way to ``paths`` that
    other users could not pass through (o+x) before: the first opens it, remembering its
    mode; the last puts the mode back."""
    steps = {str(step) for path in paths for step in path.parents}
    with _shared_lock(PASSABLE_STATE) as state:
        held: dict[str, dict[str, int]] = json.loads(state.read_text()) if state.exists() else {}
        for step in sorted(steps, key=len):  # a folder before what it holds
            if step in held:
                held[step]["holders"] += change
                if held[step]["holders"] <= 0:
                    Path(step).chmod(held.pop(step)["mode"])
            elif change > 0 and not (mode := stat.S_IMODE(os.stat(step).st_mode)) & stat.S_IXOTH:
                held[step] = {"mode": mode, "holders": 1}
                Path(step).chmod(mode | stat.S_IXOTH)
        state.write_text(json.dumps(held))


def restore_passable(held: dict[str, dict[str, int]]) -> None:
    """Put back every mode :func:`passable_to_others` changed."""
    for step, entry in held.items():
        with contextlib.suppress(OSError):
            Path(step).chmod(entry["mode"])


@contextlib.contextmanager
def passable_to_others(paths: Iterable[Path]) -> Iterator[None]:
    """Let other users pass through (o+x) every folder on the way to ``paths`` that does
    not let them (a Python under /root, say), and restore each mode once no test of the
    run (in any xdist worker) needs it any longer: what a relay user of its own needs to
    run this install."""
    paths = list(paths)
    _passable(paths, +1)
    try:
        yield
    finally:
        _passable(paths, -1)


@contextlib.contextmanager
def open_folder(prefix: str) -> Iterator[Path]:
    """A fresh folder in /tmp that other users may pass through (not list), removed
    afterwards: a deployment whose relay runs as its own user lives in one (pytest's
    tmp_path is closed to other users)."""
    folder = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    folder.chmod(0o711)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def init_demo(
    directory: Path, regions: Iterable[str], policies: Path, relay_user: str
) -> subprocess.CompletedProcess[str]:
    """`fedciuic init` of ``regions`` with the demo data into ``directory``, under
    ``policies`` (a run that is record-level: lab copies of the shipped ones), on free
    loopback ports, the relay as ``relay_user`` ("": the region's own user)."""
    from tests.conftest import ROOT
    from tests.e2e.pace import patient

    names = list(regions)
    return subprocess.run(
        [
            str(Path(sys.executable).with_name("fedciuic")),
            "init",
            str(directory),
            "--app",
            str(ROOT),
            "--regions",
            ",".join(names),
            "--demo-data",
            "--policies",
            str(policies),
            "--port",
            str(free_port()),
            "--supernode-port-base",
            str(free_ports(len(names))),
            "--relay-user",
            relay_user,
        ],
        capture_output=True,
        text=True,
        timeout=patient(120),
    )


def free_ports(count: int) -> int:
    """The first of ``count`` consecutive free ports on 127.0.0.1 (``fedciuic init``'s
    SuperNode ports are BASE + i)."""
    for _ in range(100):
        base = free_port()
        try:
            with contextlib.ExitStack() as stack:
                for port in range(base, base + count):
                    sock = stack.enter_context(socket.socket())
                    sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError("no free port range")
