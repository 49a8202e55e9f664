"""The region's long-lived trainer: the model held once per run in a deployment.

Flower 1.41 starts one ``flwr-clientapp`` process per message in both of its isolation
modes (``subprocess`` and ``process``; ``flwr/supernode/runtime/run_clientapp.py``
handles one message and exits), so a ClientApp that trains itself reloads the
checkpoint, re-verifies the base and re-tokenises the corpus for every train and
evaluate message. With node config ``trainer = "service"`` the ClientApp hands each
message to ``fedciuic trainer --state-path STATE`` instead: a process started next to
the SuperNode that runs :func:`~fedciuic.rounds.region_round.handle_instruction` in
itself, so ``open_region``'s cache (model, adapter, tokenised data, verified base),
the audit log, the keys and the privacy ledger live in one process for the whole run.

The channel is a Unix socket in ``STATE/trainer/`` (folder 0700, socket 0600) with a
random key (``STATE/trainer/authkey``, 0600, new at every start): only the region's
own user on the region's own host reaches it, and both ends prove they hold the key
(multiprocessing's HMAC challenge, both ways) before either unpickles anything. What
crosses it is what the ClientApp already holds (the run and node configs, the
aggregator's instruction) and the reply as Flower records (the outcome and the audit
head); never a private key: the answer says whether the reply is to be signed, and
the ClientApp signs it with its own copy of the region's key (as it does without the
service). A ClientApp in this mode imports no torch (``fedciuic.rounds`` and
``region_round`` import the model where a round trains): its process, started anew
for every message, starts in about a second.

Protocol (version :data:`PROTOCOL`): one connection per message; after the handshake
the ClientApp sends one :class:`Request`, the service answers one :class:`Answer`.
Requests are served one at a time (a region's rounds are sequential); a bad request
gets an answer with ``error`` set and the service keeps serving.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import signal
import socket
import struct
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import psutil

from fedciuic.crypto.keys import write_private
from fedciuic.errors import FedciuicError

if TYPE_CHECKING:  # the round code imports torch: the service imports it once it serves
    from flwr.app import RecordDict

    from fedciuic.config import NodeConfig, RunConfig
    from fedciuic.rounds.wire import Instruction, RunEndNotice

#: Where the service keeps its socket, key and lock: ``STATE/trainer/`` (mode 0700).
TRAINER_DIR = "trainer"
SOCKET_FILE = "trainer.sock"
AUTHKEY_FILE = "authkey"
LOCK_FILE = "trainer.lock"
#: Bumped when :class:`Request` or :class:`Answer` change: both ends must agree.
PROTOCOL = 1
#: How long the ClientApp waits for the service's socket to accept (seconds).
CONNECT_TIMEOUT = 10.0
#: Each read or write on the channel once connected (the handshake, the request, the
#: answer's bytes once they flow); the wait for the answer is the run's round-timeout.
IO_TIMEOUT = 30.0
#: How long a stopping service lets the request in hand finish.
STOP_GRACE = 30.0
#: A Unix socket path holds at most 107 bytes (108 with the terminating NUL).
MAX_SOCKET_PATH = 107

_LOG = logging.getLogger("flwr")  # the region's warnings go where Flower's do


class TrainerError(FedciuicError):
    """The region's trainer service cannot start, or refused a request."""


class TrainerUnreachable(TrainerError):
    """No trainer answers on the region's socket (not started, stopped, or too slow)."""


@dataclass(frozen=True)
class TrainerPaths:
    """The service's files inside a region's state dir."""

    state_dir: Path

    @classmethod
    def of(cls, state_dir: Path | str) -> TrainerPaths:
        return cls(Path(state_dir).expanduser().resolve())

    @property
    def folder(self) -> Path:
        return self.state_dir / TRAINER_DIR

    @property
    def socket(self) -> Path:
        return self.folder / SOCKET_FILE

    @property
    def authkey(self) -> Path:
        return self.folder / AUTHKEY_FILE

    @property
    def lock(self) -> Path:
        return self.folder / LOCK_FILE

    @property
    def fix(self) -> str:
        return (
            f"start `fedciuic trainer --state-path {self.state_dir}` on this host (the "
            "region's start-supernode.sh does), or set node config trainer='in-process'"
        )


@dataclass(frozen=True)
class Request:
    """One message for the region, as the ClientApp read it. ``task`` None: a ping."""

    state_path: str
    run_config: dict[str, Any]
    node_config: dict[str, Any]
    flower_run: int = 0
    task: Instruction | RunEndNotice | None = None
    training: bool = False
    simulated: bool = False
    protocol: int = PROTOCOL


@dataclass(frozen=True)
class Answer:
    """The region's reply as Flower carries it (``content``, with its audit head) but
    unsigned: ``sign`` says the ClientApp signs it for ``flower_run`` and
    ``server_round`` with its own copy of the region's key; or ``error``: why the
    service could not handle the request. Flower records only, so that the ClientApp
    unpickles no class that would import torch."""

    content: RecordDict | None = None
    sign: bool = False
    flower_run: int = 0
    server_round: int = 0
    error: str = ""
    state_path: str = ""
    pid: int = 0


# -- the ClientApp's end ------------------------------------------------------------------


@contextlib.contextmanager
def _address(path: Path) -> Iterator[str]:
    """``path`` as a Unix socket address: a path longer than a socket address may be
    (a deep state-path) goes through its folder's descriptor (``/proc/self/fd/N/NAME``,
    Linux), so the socket stays in the state dir, under its permissions."""
    if len(os.fsencode(path)) <= MAX_SOCKET_PATH:
        yield str(path)
        return
    if not Path("/proc/self/fd").is_dir():
        raise TrainerError(
            f"the socket {path} is longer than a Unix socket path may be ({MAX_SOCKET_PATH} "
            "bytes); use a shorter state-path"
        )
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{fd}/{path.name}"
    finally:
        os.close(fd)


def _set_timeouts(sock: socket.socket, seconds: float) -> None:
    """Bound every blocking read and write on ``sock`` (its fd is used by a Connection,
    which knows no timeouts)."""
    timeval = struct.pack("ll", int(seconds), int((seconds % 1) * 1_000_000))
    for option in (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO):
        sock.setsockopt(socket.SOL_SOCKET, option, timeval)


def _connect(paths: TrainerPaths, timeout: float) -> Connection:
    """A connection to the service, both ends authenticated; waits up to ``timeout``
    for the socket to appear and accept (a service still starting)."""
    deadline = time.monotonic() + timeout
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(max(deadline - time.monotonic(), 0.1))
            with _address(paths.socket) as address:
                sock.connect(address)
            break
        except (FileNotFoundError, ConnectionRefusedError) as err:
            sock.close()
            if time.monotonic() >= deadline:
                what = "no socket" if isinstance(err, FileNotFoundError) else "connection refused"
                raise TrainerUnreachable(
                    f"no trainer answers at {paths.socket} ({what} for {timeout:g}s); {paths.fix}"
                ) from None
            time.sleep(0.2)
        except OSError as err:
            sock.close()
            raise TrainerUnreachable(
                f"cannot connect to the trainer at {paths.socket} ({err}); {paths.fix}"
            ) from None
    try:
        key = paths.authkey.read_bytes()
    except OSError as err:
        sock.close()
        raise TrainerUnreachable(
            f"cannot read the trainer's key {paths.authkey} ({err.strerror}); {paths.fix}"
        ) from None
    sock.setblocking(True)
    _set_timeouts(sock, IO_TIMEOUT)
    conn = Connection(sock.detach())
    try:
        answer_challenge(conn, key)
        deliver_challenge(conn, key)
    except AuthenticationError:
        conn.close()
        raise TrainerError(
            f"the trainer at {paths.socket} refused the key in {paths.authkey} (or proved "
            "none); restart `fedciuic trainer` for this state-path"
        ) from None
    except (OSError, EOFError) as err:
        conn.close()
        raise TrainerUnreachable(
            f"the trainer at {paths.socket} dropped the connection during the handshake "
            f"({err or type(err).__name__}); {paths.fix}"
        ) from None
    return conn


def ask(
    state_dir: Path | str,
    request: Request,
    *,
    timeout: float,
    connect_timeout: float | None = None,
) -> Answer:
    """Send ``request`` to the trainer serving ``state_dir`` and wait up to ``timeout``
    seconds for its answer; :class:`TrainerUnreachable` (one line, naming the socket
    and the fix) when there is none."""
    paths = TrainerPaths.of(state_dir)
    conn = _connect(paths, CONNECT_TIMEOUT if connect_timeout is None else connect_timeout)
    try:
        conn.send(request)
        if not conn.poll(timeout):
            raise TrainerUnreachable(
                f"the trainer at {paths.socket} did not answer within {timeout:g}s (run config "
                "round-timeout); see its log"
            )
        answer = conn.recv()
    except (OSError, EOFError) as err:
        raise TrainerUnreachable(
            f"the trainer at {paths.socket} dropped the connection "
            f"({err or type(err).__name__}); {paths.fix}"
        ) from None
    finally:
        conn.close()
    if not isinstance(answer, Answer):
        raise TrainerError(
            f"the trainer at {paths.socket} answered with a {type(answer).__name__}; the "
            "ClientApp and `fedciuic trainer` must run the same fedciuic version"
        )
    return answer


def _alive(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


def ping(state_dir: Path | str, timeout: float, pid: int = 0) -> Answer:
    """The answer of the trainer serving ``state_dir``, waiting up to ``timeout`` seconds
    for it to come up (a start script waits so before it starts the SuperNode); with
    ``pid``, only that process will do, and its exit ends the wait."""
    paths = TrainerPaths.of(state_dir)
    request = Request(str(paths.state_dir), {}, {})
    deadline = time.monotonic() + timeout
    while True:
        try:
            wait = min(1.0, max(deadline - time.monotonic(), 0.0))
            answer = ask(paths.state_dir, request, timeout=IO_TIMEOUT, connect_timeout=wait)
            break
        except TrainerUnreachable:
            if pid and not _alive(pid):
                raise TrainerError(
                    f"the trainer (pid {pid}) exited before it served {paths.state_dir}; "
                    "see its output"
                ) from None
            if time.monotonic() >= deadline:
                raise
    if answer.error:
        raise TrainerError(f"the trainer at {paths.socket}: {answer.error}")
    if pid and answer.pid != pid:
        raise TrainerError(
            f"{paths.state_dir} is served by another trainer (pid {answer.pid}), not pid "
            f"{pid}; stop the other one first"
        )
    return answer


def delegate(run: RunConfig, node: NodeConfig, request: Request) -> RecordDict:
    """The region's reply, handled by its trainer service and signed here with the
    region's key as this ClientApp loads it; a decline naming the socket and the fix
    when the service cannot be reached or refuses the request."""
    from fedciuic.flower import protocol
    from fedciuic.rounds.region_round import signing_keypair

    try:
        answer = ask(node.state_dir, request, timeout=run.round_timeout)
        if answer.error or answer.content is None:
            socket_path = TrainerPaths.of(node.state_dir).socket
            raise TrainerError(
                f"region {node.region}: the trainer at {socket_path} refused the request: "
                f"{answer.error or 'no reply'}"
            )
        keypair = signing_keypair(run, node) if answer.sign else None
    except FedciuicError as err:
        _LOG.warning("fedciuic: region declines: %s", err)
        return protocol.decline_reply(node.region, str(err))
    if keypair is None:
        return answer.content
    return protocol.sign_reply(
        answer.content, keypair, run_id=answer.flower_run, server_round=answer.server_round
    )


def request_for(
    run_config: Mapping[str, Any],
    node_config: Mapping[str, Any],
    node: NodeConfig,
    task: Instruction | RunEndNotice,
    *,
    flower_run: int,
    training: bool = False,
    simulated: bool = False,
) -> Request:
    """The request for one message: the configs as Flower gave them (the service
    validates them again), the parsed message and its flags."""
    return Request(
        str(TrainerPaths.of(node.state_dir).state_dir),
        dict(run_config),
        dict(node_config),
        flower_run,
        task,
        training,
        simulated,
    )


# -- the service ----------------------------------------------------------------------------


def _write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` (mode 0600 from the start), replacing it atomically."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    write_private(tmp, data)
    os.replace(tmp, path)


def _describe(request: object) -> str:
    """What a request asks, for the service's log."""
    if not isinstance(request, Request):
        return f"a malformed request ({type(request).__name__})"
    kind = type(request.task).__name__
    if kind == "Instruction":
        what = "train" if request.training else "evaluate"
        return f"{what} round {getattr(request.task, 'server_round', '?')}"
    return "run-end notice" if kind == "RunEndNotice" else f"a {kind} task"


class TrainerService:
    """``fedciuic trainer``: serves one region's state dir until SIGTERM or SIGINT."""

    def __init__(self, state_dir: Path | str) -> None:
        self.paths = TrainerPaths.of(state_dir)
        self.stopping = threading.Event()
        self.busy = threading.Lock()  # one request at a time
        self.served = 0
        self._lock_fd = -1
        self._key = b""
        self._listener: socket.socket | None = None

    # -- start and stop ----------------------------------------------------------------

    def start(self) -> None:
        """Own the state dir's trainer folder (one service per state dir), write a new
        key, replace a stale socket, and listen."""
        paths = self.paths
        paths.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        if paths.folder.stat().st_uid != os.getuid():
            raise TrainerError(
                f"trainer --state-path: {paths.folder} belongs to another user; run the "
                "trainer as the region's user"
            )
        paths.folder.chmod(0o700)
        self._lock_fd = os.open(paths.lock, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(self._lock_fd, 32).decode(errors="replace").strip() or "?"
            os.close(self._lock_fd)
            self._lock_fd = -1
            raise TrainerError(
                f"trainer --state-path: a trainer already serves {paths.state_dir} (pid "
                f"{holder}, socket {paths.socket}); stop it first, or let the SuperNode use it"
            ) from None
        os.ftruncate(self._lock_fd, 0)
        os.pwrite(self._lock_fd, f"{os.getpid()}\n".encode(), 0)
        self._key = secrets.token_bytes(32)
        _write_private(paths.authkey, self._key)
        # We hold the lock: a socket file here was left by a service that was killed.
        paths.socket.unlink(missing_ok=True)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            with _address(paths.socket) as address:
                listener.bind(address)
        finally:
            os.umask(old)
        paths.socket.chmod(0o600)
        listener.listen(8)
        listener.settimeout(0.5)  # the accept loop looks at `stopping` this often
        self._listener = listener

    def close(self) -> None:
        """Stop listening, let the request in hand finish (up to :data:`STOP_GRACE`),
        remove the socket and the key."""
        self.stopping.set()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            self.paths.socket.unlink(missing_ok=True)
            self.paths.authkey.unlink(missing_ok=True)
        if self.busy.acquire(timeout=STOP_GRACE):
            self.busy.release()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self.stopping.set()

    def serve(self) -> int:
        """Accept connections until SIGTERM or SIGINT; each is served on a thread of its
        own (a slow client cannot hold up the accept loop); the work is serialised."""
        self.start()
        assert self._listener is not None
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._on_signal)
        print(
            f"fedciuic: trainer for {self.paths.state_dir} listening on {self.paths.socket} "
            f"(pid {os.getpid()})",
            flush=True,
        )
        try:
            while not self.stopping.is_set():
                try:
                    client, _ = self._listener.accept()
                except TimeoutError:
                    continue
                threading.Thread(target=self._session, args=(client,), daemon=True).start()
        finally:
            self.close()
        print(f"fedciuic: trainer stopped ({self.served} request(s) served)", flush=True)
        return 0

    # -- one connection ---------------------------------------------------------------

    def _session(self, client: socket.socket) -> None:
        client.setblocking(True)
        _set_timeouts(client, IO_TIMEOUT)
        with Connection(client.detach()) as conn:
            try:
                try:
                    deliver_challenge(conn, self._key)
                    answer_challenge(conn, self._key)
                except AuthenticationError:
                    _LOG.warning("fedciuic: trainer: refused a connection with a wrong key")
                    return
                if not conn.poll(IO_TIMEOUT):
                    return
                try:
                    request = conn.recv()
                except (OSError, EOFError):
                    raise
                except Exception as err:  # whatever the bytes unpickle to
                    answer = Answer(error=f"unreadable request ({type(err).__name__}: {err})")
                else:
                    if isinstance(request, Request) and request.task is None:
                        answer = self._answer(request)  # a ping: answered even while busy
                    else:
                        with self.busy:
                            began = time.monotonic()
                            answer = self._answer(request)
                            self.served += 1
                        _LOG.info(
                            "fedciuic: trainer: %s handled in %.2f s%s",
                            _describe(request),
                            time.monotonic() - began,
                            f" (refused: {answer.error})" if answer.error else "",
                        )
                try:
                    conn.send(answer)
                except (OSError, EOFError):
                    raise
                except Exception as err:  # an outcome that does not pickle
                    conn.send(Answer(error=f"the answer cannot be sent ({err})"))
            except (OSError, EOFError) as err:
                why = err or type(err).__name__
                _LOG.warning("fedciuic: trainer: connection dropped (%s)", why)

    def _answer(self, request: object) -> Answer:
        """The region's reply to one request, or why there is none (never raises)."""
        if not isinstance(request, Request):
            return Answer(
                error=f"malformed request (a {type(request).__name__}); the ClientApp and "
                "`fedciuic trainer` must run the same fedciuic version"
            )
        if request.protocol != PROTOCOL:
            return Answer(
                error=f"request protocol {request.protocol}, this trainer speaks {PROTOCOL}; "
                "run the same fedciuic version on both sides"
            )
        if self.stopping.is_set():
            return Answer(error="the trainer is stopping")
        try:
            return self._handle(request)
        except FedciuicError as err:
            return Answer(error=str(err))
        except Exception as err:  # one bad request must not end the service
            _LOG.exception("fedciuic: trainer: the request failed")
            return Answer(error=f"the request failed ({type(err).__name__}: {err}); see its log")

    def _handle(self, request: Request) -> Answer:
        own = self.paths.state_dir
        asked = TrainerPaths.of(request.state_path).state_dir if request.state_path else None
        if asked != own:
            raise TrainerError(
                f"this trainer serves state-path {own}, the request is for {asked}; start "
                f"`fedciuic trainer --state-path {asked}` for that region"
            )
        if request.task is None:
            return Answer(state_path=str(own), pid=os.getpid())
        from fedciuic.flower import protocol
        from fedciuic.rounds import region_round as rr
        from fedciuic.rounds.wire import Instruction, RunEndNotice

        run, node = rr.read_configs(request.run_config, request.node_config)
        if TrainerPaths.of(node.state_dir).state_dir != own:
            raise TrainerError(
                f"this trainer serves state-path {own}, the node config's is {node.state_dir}; "
                "start one trainer per region, with its node config's state-path"
            )
        task = request.task
        if isinstance(task, Instruction):
            reply = rr.handle_instruction(
                run,
                node,
                task,
                training=request.training,
                flower_run=request.flower_run,
                simulated=request.simulated,
            )
        elif isinstance(task, RunEndNotice):
            reply = rr.witness_run_end(run, node, task, flower_run=request.flower_run)
        else:
            raise TrainerError(f"malformed request: a task of type {type(task).__name__}")
        # No private key crosses the socket: the ClientApp signs with its own copy.
        return Answer(
            protocol.region_reply(reply),
            sign=reply.keypair is not None,
            flower_run=reply.flower_run,
            server_round=reply.server_round,
        )


def serve(state_dir: Path | str) -> int:
    """``fedciuic trainer --state-path STATE``: serve until stopped; 0 on a clean stop."""
    import flwr.common.logger  # noqa: F401 - its handler prints the region's lines, as in a ClientApp

    return TrainerService(state_dir).serve()


__all__ = [
    "AUTHKEY_FILE",
    "PROTOCOL",
    "SOCKET_FILE",
    "TRAINER_DIR",
    "Answer",
    "Request",
    "TrainerError",
    "TrainerPaths",
    "TrainerService",
    "TrainerUnreachable",
    "ask",
    "delegate",
    "ping",
    "request_for",
    "serve",
]
