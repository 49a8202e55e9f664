"""Start and stop real Flower processes on 127.0.0.1: a SuperLink, SuperNodes, ``flwr run``.

A Ray worker whose raylet exits first leaves the process tree, so every process a
federation starts carries ``FEDCIUIC_LAUNCH=<nonce>:<workdir>`` (Ray passes it on) and
:meth:`LocalFederation.stop` stops all that do. Ray gets a temporary folder of its own.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
import zipfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import psutil

from fedciuic.agent import AgentConfig, AgentError, hello
from fedciuic.cluster import free_port
from fedciuic.crypto import ServerTls
from fedciuic.errors import FederationError
from fedciuic.processes import (
    OWNER_ENV,
    STARTED_RUN,
    healthy,
    owned_processes,
    owner_tag,
    stop_process_trees,
    tail,
    toml_pairs,
    toml_value,
)

CONNECTION = "fedciuic"

#: Keep Flower offline and quiet: no `uv sync` of a CUDA torch, no telemetry, no update check.
FLOWER_ENV = {
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "PYTHONUNBUFFERED": "1",
}
#: The folder of a FAB that Flower writes itself (the manifest), not the app's.
FAB_INFO = ".info/"


def stage_app(app: Path, into: Path) -> Path:
    """``into`` holding only the files of ``app`` that Flower packs into its FAB (the same
    hash), without entering the folders ``.gitignore`` ignores (``.venv``), as Flower does."""
    from flwr.cli.build import build_fab_from_files
    from flwr.cli.utils import build_pathspec, load_gitignore_patterns

    root = app.expanduser().resolve()
    patterns = load_gitignore_patterns(root / ".gitignore")
    # A negated pattern may bring back a file below an ignored folder: enter them all.
    spec = build_pathspec(() if any(p.lstrip().startswith("!") for p in patterns) else patterns)
    files: dict[str, bytes | Path] = {}
    for folder, subfolders, names in os.walk(root, followlinks=False):
        here = Path(folder)
        rel = here.relative_to(root).as_posix()
        subfolders[:] = [
            d
            for d in subfolders
            if d != ".git" and not spec.match_file(f"{d}/" if rel == "." else f"{rel}/{d}/")
        ]
        for name in names:
            path = here / name
            if not path.is_symlink() and path.resolve().is_relative_to(root):
                files[path.relative_to(root).as_posix()] = path
    try:
        fab, _ = build_fab_from_files(files)
    except ValueError as err:  # no or a bad pyproject.toml, a pattern matching nothing
        raise FederationError(
            f"app {root}: Flower cannot build its app from it ({err}); pass the fedciuic "
            "app folder, the one whose pyproject.toml has [tool.flwr.app]"
        ) from None
    shutil.rmtree(into, ignore_errors=True)
    with zipfile.ZipFile(io.BytesIO(fab)) as packed:
        for member in packed.namelist():
            if not member.startswith(FAB_INFO):
                target = into / member
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(packed.read(member))
    return into


def _bin(name: str) -> str:
    """The executable of the interpreter we run in (the project's venv), if it has one."""
    candidate = Path(sys.executable).with_name(name)
    return str(candidate) if candidate.exists() else name


@dataclass
class Managed:
    name: str
    process: subprocess.Popen[bytes]
    log_path: Path


class LocalFederation:
    """Flower processes on loopback, owned by this object and stopped on exit."""

    def __init__(self, workdir: Path, app_dir: Path) -> None:
        self.workdir = workdir.resolve()
        self.app_dir = app_dir.resolve()
        self.flwr_home = self.workdir / "flwr-home"
        self.logs = self.workdir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.processes: list[Managed] = []
        self.runs = 0
        self.superlink_address = ""
        self.tls: ServerTls | None = None
        self.owner = owner_tag(uuid.uuid4().hex[:12], self.workdir)
        # Ray's sockets live in its temporary folder: /tmp keeps their paths short.
        short = "/tmp" if os.path.isdir("/tmp") and os.access("/tmp", os.W_OK) else None
        self.ray_tmp = Path(tempfile.mkdtemp(prefix="fedciuic-ray-", dir=short))
        # Flower starts helpers by name: from our venv.
        path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
        self.env = {
            **{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"},
            **FLOWER_ENV,
            "FLWR_HOME": str(self.flwr_home),
            "PATH": path,
            OWNER_ENV: self.owner,
            "RAY_TMPDIR": str(self.ray_tmp),
        }

    def __enter__(self) -> LocalFederation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _spawn(self, name: str, cmd: Sequence[str]) -> Managed:
        log_path = self.logs / f"{name}.log"
        with open(log_path, "wb") as handle:  # the child keeps its own copy
            process = subprocess.Popen(
                list(cmd),
                stdout=handle,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.workdir,
                start_new_session=True,
            )
        managed = Managed(name, process, log_path)
        self.processes.append(managed)
        return managed

    def pids(self) -> list[int]:
        return [m.process.pid for m in self.processes]

    def stop(self, grace: float = 10.0) -> list[psutil.Process]:
        """Stop everything this federation started or marked, and remove Ray's folder;
        returns what could not be stopped."""
        left = stop_process_trees(self.pids()[::-1], grace, owner=self.owner)
        for managed in self.processes:
            if managed.process.poll() is None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    managed.process.wait(timeout=5)
        self.processes.clear()
        if not left:
            shutil.rmtree(self.ray_tmp, ignore_errors=True)
        return left

    def owned(self) -> list[psutil.Process]:
        """The live processes that carry this federation's mark."""
        return owned_processes(self.owner)

    def kill(self, managed: Managed) -> None:
        """SIGKILL one process and everything it started (a crash, for fault tests)."""
        if managed in self.processes:
            self.processes.remove(managed)
        # Flower detaches some helpers into sessions of their own: list descendants first.
        try:
            parent = psutil.Process(managed.process.pid)
            targets = [parent, *parent.children(recursive=True)]
        except psutil.NoSuchProcess:
            targets = []
        for proc in targets:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(managed.process.pid, signal.SIGKILL)
        psutil.wait_procs(targets, timeout=10)
        managed.process.wait(timeout=10)

    def crash(self) -> None:
        """SIGKILL every process, as a power cut would (fault tests)."""
        for managed in list(self.processes):
            self.kill(managed)

    def expect_exit(self, managed: Managed, timeout: float) -> int:
        """Wait for a process that must exit (a refused SuperNode), stop what it left
        behind, and return its exit code."""
        try:
            code = managed.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise FederationError(
                f"{managed.name} was expected to exit within {timeout:.0f}s; see {managed.log_path}"
            ) from None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(managed.process.pid, signal.SIGKILL)
        self.processes.remove(managed)
        return code

    def check_alive(self, processes: list[Managed] | None = None) -> None:
        """Raise, with the end of its log, if a process we started has exited."""
        for managed in self.processes if processes is None else processes:
            if (code := managed.process.poll()) is not None:
                raise FederationError(
                    f"{managed.name} exited with code {code}; see {managed.log_path}:\n"
                    + tail(managed.log_path)
                )

    def start_superlink(
        self,
        *,
        simulation: bool,
        timeout: float = 60.0,
        tls: ServerTls | None = None,
        supernode_auth: bool = False,
    ) -> str:
        """Start ``flower-superlink`` on a free port and wait until it answers."""
        port = free_port()
        self.tls = tls
        cmd = [
            _bin("flower-superlink"),
            *(_tls_args(tls) if tls else ["--insecure"]),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--disable-runtime-dependency-installation",
        ]
        if supernode_auth:
            cmd.append("--enable-supernode-auth")
        if simulation:
            cmd.append("--simulation")
        managed = self._spawn("superlink", cmd)
        url = f"{'https' if tls else 'http'}://127.0.0.1:{port}/health"
        self.superlink_address = f"127.0.0.1:{port}"
        self.flwr_home.mkdir(parents=True, exist_ok=True)
        (self.flwr_home / "config.toml").write_text(
            connection_toml(self.superlink_address, tls.ca_cert if tls else None), encoding="utf-8"
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive()
            if healthy(url, str(tls.ca_cert) if tls else None):
                return self.superlink_address
            time.sleep(0.3)
        raise FederationError(
            f"flower-superlink did not answer on {self.superlink_address} within "
            f"{timeout:.0f}s; see {managed.log_path}"
        )

    def register_supernode(self, public_key: Path, name: str) -> None:
        """``flwr supernode register``: allow the SuperNode holding this key to connect."""
        done = subprocess.run(
            [_bin("flwr"), "supernode", "register", str(public_key), CONNECTION, "--name", name],
            capture_output=True,
            text=True,
            env=self.env,
            cwd=self.workdir,
            timeout=120,
        )
        if done.returncode != 0:
            raise FederationError(
                f"flwr supernode register {public_key} failed:\n{done.stdout}{done.stderr}"
            )

    def start_supernode(
        self,
        name: str,
        node_config: Mapping[str, Any],
        *,
        superlink: str = "",
        auth_key: Path | None = None,
        relay_user: str | None = None,
        relay_home: Path | None = None,
    ) -> Managed:
        """Start one ``flower-supernode``; with ``relay_user``, in ``--isolation process``
        with the relay run as that user ("": as ourselves), ``relay_home`` its FLWR_HOME."""
        security = ["--root-certificates", str(self.tls.ca_cert)] if self.tls else ["--insecure"]
        if auth_key is not None:
            security += ["--auth-supernode-private-key", str(auth_key)]
        runtime_port = free_port()
        isolation = ["--isolation", "process"] if relay_user is not None else []
        cmd = [
            _bin("flower-supernode"),
            *security,
            "--superlink",
            superlink or self.superlink_address,
            "--host",
            "127.0.0.1",
            "--port",
            str(runtime_port),
            *isolation,
            "--node-config",
            toml_pairs(node_config),
        ]
        managed = self._spawn(f"supernode-{name}", cmd)
        if relay_user is not None:
            home = relay_home or self.workdir / f"relay-{name}"
            self._spawn(
                f"relay-{name}", relay_command(relay_user, home, f"127.0.0.1:{runtime_port}")
            )
        return managed

    def start_script(self, name: str, script: Path, *args: str) -> Managed:
        """Run one of a deployment's generated scripts in the background (marked as ours)."""
        return self._spawn(name, ["bash", str(script), *args])

    def start_agent(self, name: str, config: Path, timeout: float = 120.0) -> Managed:
        """Start a region's ``fedciuic agent`` and wait until it answers on its socket."""
        managed = self._spawn(f"agent-{name}", [_bin("fedciuic"), "agent", "--config", str(config)])
        try:
            hello(Path(AgentConfig.load(config).socket), timeout, pid=managed.process.pid)
        except AgentError as err:
            log = managed.log_path
            raise FederationError(f"{err}; see {log}:\n{tail(log)}") from None
        return managed

    def run_app(
        self,
        run_config: Mapping[str, Any],
        *,
        federation_config: Mapping[str, Any] | None = None,
        timeout: float,
        echo: IO[str] | None = None,
        app: Path | None = None,
        on_poll: Callable[[Path], None] | None = None,
    ) -> tuple[int, str]:
        """``flwr run APP fedciuic --stream`` to the run's end: its id and log. ``echo`` gets
        the log as it grows; ``on_poll`` its path twice a second."""
        overrides = self.workdir / f"run-overrides-{self.runs + 1}.toml"
        overrides.write_text(
            "".join(f"{k} = {toml_value(v)}\n" for k, v in run_config.items()), encoding="utf-8"
        )
        cmd = [
            _bin("flwr"),
            "run",
            str(stage_app(app or self.app_dir, self.workdir / "app")),
            CONNECTION,
            "--stream",
            "--run-config",
            str(overrides),
        ]
        if federation_config:
            cmd += ["--federation-config", toml_pairs(federation_config)]
        self.runs += 1
        managed = self._spawn(f"flwr-run-{self.runs}", cmd)
        deadline = time.monotonic() + timeout
        shown = 0
        while managed.process.poll() is None:
            shown = _echo(managed.log_path, shown, echo)
            if on_poll is not None:
                on_poll(managed.log_path)
            if time.monotonic() > deadline:
                raise FederationError(
                    f"flwr run did not finish within {timeout:.0f}s; see {managed.log_path}"
                )
            self.check_alive([m for m in list(self.processes) if m is not managed])
            time.sleep(0.5)
        # A finished `flwr run` is not a server: later liveness checks skip it.
        if managed in self.processes:
            self.processes.remove(managed)
        _echo(managed.log_path, shown, echo)
        text = managed.log_path.read_text(encoding="utf-8", errors="replace")
        match = STARTED_RUN.search(text)
        if managed.process.returncode != 0 or not match:
            raise FederationError(
                f"flwr run failed; see {managed.log_path}:\n" + tail(managed.log_path)
            )
        return int(match.group(1)), text


def relay_command(user: str, home: Path, runtime_address: str) -> list[str]:
    """Flower's ``flower-superexec`` (the relay) run as ``user`` as a deployment does,
    tied to this process."""
    return [
        sys.executable,
        "-m",
        "fedciuic.ops.scripts",
        "relay",
        user,
        str(home),
        str(os.getpid()),
        "--",
        _bin("flower-superexec"),
        "--insecure",
        "--runtime-api-address",
        runtime_address,
    ]


def _echo(path: Path, shown: int, stream: IO[str] | None) -> int:
    if stream is None:
        return shown
    data = path.read_bytes()
    if len(data) > shown:
        stream.write(data[shown:].decode("utf-8", errors="replace"))
        stream.flush()
    return len(data)


def _tls_args(tls: ServerTls) -> list[str]:
    return [
        "--ssl-ca-certfile",
        str(tls.ca_cert),
        "--ssl-certfile",
        str(tls.server_cert),
        "--ssl-keyfile",
        str(tls.server_key),
    ]


def connection_toml(address: str, ca_cert: Path | None) -> str:
    """``$FLWR_HOME/config.toml`` with the ``fedciuic`` connection as the default."""
    security = (
        f"root-certificates = {json.dumps(str(ca_cert))}\ninsecure = false\n"
        if ca_cert
        else "insecure = true\n"
    )
    return (
        f'[superlink]\ndefault = "{CONNECTION}"\n\n'
        f'[superlink.{CONNECTION}]\naddress = "{address}"\n{security}'
    )
