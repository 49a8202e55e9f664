"""The region agent: the region's own long-lived process, the only one that reads its
data, state, keys, ledger, policy and audit log.

Flower's ClientApp only relays each message to it over a Unix socket. The agent acts only
on what the aggregator signed, for the run and kind the relay names, with a nonce never
seen before (across restarts), applying the signed run config with its own node facts;
each refusal goes to the audit log and it keeps serving. Only its own user and the relay's
are answered (SO_PEERCRED), and it refuses to start while the relay's user can read the
region's files. It stops when its launcher exits, so no stale agent holds its lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import signal
import socket
import stat
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

from fedciuic import __version__
from fedciuic.agent.access import Account, check_private
from fedciuic.agent.channel import (
    HELLO,
    HELLO_RECORD,
    HELLO_REGION,
    IO_TIMEOUT,
    ChannelError,
    Frame,
    Peer,
    ask,
    bind,
    peer_of,
    receive,
    send,
)
from fedciuic.agent.config import AgentConfig
from fedciuic.audit import Event, enforce_at_start
from fedciuic.cluster import share_cores
from fedciuic.config import RunConfig
from fedciuic.crypto import RegionKeys, TaskKind, load_bundle, load_keypair
from fedciuic.digests import installed_code
from fedciuic.errors import FedciuicError
from fedciuic.policy import load_policy
from fedciuic.stages import SealingRegion
from fedciuic.wire import (
    CONFIG,
    INFO,
    METRICS,
    Instruction,
    MalformedInstruction,
    RunEndNotice,
    parse_instruction,
    parse_run_end,
)

#: The agent's own files: ``STATE/agent/`` (mode 0700).
AGENT_DIR = "agent"
LOCK_FILE = "agent.lock"
SEEN_FILE = "instructions.jsonl"
#: Connections served at once (one trains; the others wait, or say hello).
MAX_SESSIONS = 8
#: How long a stopping agent lets the request in hand finish.
STOP_GRACE = 30.0

_LOG = logging.getLogger("flwr")  # the region's lines go where Flower's do


class AgentError(FedciuicError):
    """The region's agent cannot start, or cannot be reached."""


class Refused(FedciuicError):
    """A request the agent will not act on: not signed, replayed, or of another kind."""


class SeenInstructions:
    """The nonce of every instruction acted on, fsync'ed first: replays are refused even
    after a restart."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.nonces: set[str] = set()
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            lines = []
        except (OSError, UnicodeDecodeError) as err:
            raise AgentError(f"{path}: cannot read the instructions seen ({err})") from None
        for number, line in enumerate(lines, 1):
            try:
                nonce = json.loads(line)["nonce"]
                bytes.fromhex(nonce)
            except (ValueError, KeyError, TypeError):
                raise AgentError(
                    f"{path}:{number}: not an instruction record; the agent refuses to guess "
                    "which instructions it has acted on (restore the file from a backup)"
                ) from None
            self.nonces.add(nonce)

    def admit(self, nonce: bytes, **facts: object) -> bool:
        """Record ``nonce`` and return True, or False when it was seen before."""
        key = nonce.hex()
        if key in self.nonces:
            return False
        line = json.dumps({"nonce": key, **facts}, sort_keys=True) + "\n"
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        self.nonces.add(key)
        return True


def _error(reason: str) -> Frame:
    return Frame(meta={"error": reason})


def _run_of(frame: Frame) -> int:
    run = frame.meta.get("flower-run")
    if type(run) is not int or not 0 <= run < 2**64:
        raise Refused("malformed request: flower-run: a run id expected")
    return run


class RegionAgent:
    """One request (no sockets here): refused unless the aggregator signed it, else
    handed to the region's round."""

    def __init__(self, config: AgentConfig) -> None:
        from fedciuic.region import region_log

        self.config = config
        self.keypair = load_keypair(Path(config.key_file))
        if self.keypair.bundle.party != config.region:
            raise AgentError(
                f"agent config:key-file: {config.key_file} is {self.keypair.bundle.party!r}'s "
                f"key, this is region {config.region!r}; name the region's own key"
            )
        aggregator = load_bundle(Path(config.aggregator_bundle))
        # Checks signatures only: the round seals with the suite its run config names.
        self.verifier = SealingRegion(RegionKeys(self.keypair, aggregator, "xwing-aes256gcm"))
        self.policy = load_policy(Path(config.policy))
        self.policy.check_agent(__version__)
        folder = config.state_dir / AGENT_DIR
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.seen = SeenInstructions(folder / SEEN_FILE)
        audit = region_log(config)
        if audit is None:
            raise AgentError(
                f"agent config:data-path: {config.data_path} is not a folder; put the "
                "region's data there"
            )
        audit.keypair = self.keypair
        self.audit = audit

    def close(self) -> None:
        """Stop the region's training processes (a cluster region's ranks)."""
        from fedciuic.region import close_regions

        close_regions()

    def started(self, relay: str) -> None:
        """The agent's start on the record, its log first pruned to the policy's retention."""
        enforce_at_start(self.audit, self.policy, _LOG, f"region {self.config.region}")
        self.audit.append(
            Event.AGENT_STARTED,
            run_id=0,
            version=__version__,
            code=installed_code(),
            pid=os.getpid(),
            relay_user=relay,
        )
        self.audit.checkpoint(run_id=0)

    def hello(self) -> Frame:
        return Frame(
            config={
                HELLO_RECORD: {
                    HELLO_REGION: self.config.region,
                    "pid": os.getpid(),
                    "fedciuic": __version__,
                    "code": installed_code(),
                }
            }
        )

    def answer(self, frame: Frame, peer: Peer) -> Frame:
        """The answer to one request; never raises."""
        kind = frame.meta.get("kind")
        if kind == HELLO:
            return self.hello()
        try:
            return self._answer(frame, kind)
        except Refused as err:
            self._refused(frame, peer, str(err))
            return _error(str(err))
        except Exception as err:  # one bad request must not end the agent
            _LOG.exception("fedciuic: agent: the request failed")
            return _error(f"the agent failed ({type(err).__name__}: {err}); see its log")

    def _refused(self, frame: Frame, peer: Peer, reason: str) -> None:
        _LOG.warning("fedciuic: agent: refused a request from pid %d: %s", peer.pid, reason)
        claimed = frame.config.get(CONFIG, {})
        try:
            self.audit.append(
                Event.REQUEST_REFUSED,
                run_id=0,
                kind=str(frame.meta.get("kind", ""))[:32],
                flower_run=frame.meta.get("flower-run"),
                claimed_round=claimed.get("server-round"),
                reason=reason,
                peer_uid=peer.uid,
                peer_pid=peer.pid,
            )
            self.audit.checkpoint(run_id=0)
        except FedciuicError as err:
            _LOG.warning("fedciuic: agent: cannot write the audit log: %s", err)

    def _verified(self, frame: Frame, kind: TaskKind) -> Instruction | RunEndNotice:
        """The frame's instruction, once signed for this run and kind, its nonce new."""
        flower_run = _run_of(frame)
        config = frame.config.get(CONFIG)
        if config is None:
            raise Refused("malformed request: no config record")
        try:
            task: Instruction | RunEndNotice
            if kind == TaskKind.RUN_END:
                task = parse_run_end(config)
                self.verifier.check_run_end(task, flower_run)
            else:
                task = parse_instruction(config, frame.arrays or {})
                self.verifier.check_global(task, flower_run)
        except FedciuicError as err:  # malformed, or not signed as it stands
            raise Refused(str(err)) from None
        if task.kind != kind:
            raise Refused(f"a {kind} request carries a signed {task.kind} instruction")
        facts = {"kind": str(kind), "flower_run": flower_run}
        if isinstance(task, Instruction):
            facts["round"] = task.server_round
        if not self.seen.admit(task.nonce, **facts):
            raise Refused(
                f"a replayed {kind} instruction (nonce {task.nonce.hex()} was acted on "
                "before); each instruction is acted on once"
            )
        return task

    def _answer(self, frame: Frame, kind: object) -> Frame:
        from fedciuic.region import (
            decline_signed,
            handle_instruction,
            read_run,
            region_records,
            witness_run_end,
        )

        if kind not in set(TaskKind):
            raise Refused(
                f"a request of kind {str(kind)[:32]!r}: this agent acts only on what the "
                f"aggregator signs ({', '.join(TaskKind)}) and answers {HELLO!r}"
            )
        task = self._verified(frame, TaskKind(str(kind)))
        flower_run = _run_of(frame)
        try:
            run = read_run(task)
            node = self.config.node_for(run)
            _check_run(run)
        except FedciuicError as err:  # signed, but not a run this region takes part in
            reply = decline_signed(self.config, self.keypair, task, flower_run, err)
        else:
            if isinstance(task, RunEndNotice):
                reply = witness_run_end(run, node, task, flower_run=flower_run)
            else:
                reply = handle_instruction(
                    run, node, task, asked=task.kind, flower_run=flower_run, simulated=False
                )
        records = region_records(reply)
        return Frame(
            config={INFO: dict(records.info)},
            metrics={METRICS: dict(records.metrics)},
            arrays=records.arrays,
        )


def _check_run(run: RunConfig) -> None:
    """What a region's agent takes from no aggregator, whatever the policy says."""
    if not run.sealing.seal:
        raise MalformedInstruction(
            "run config:seal: false; a region's agent sends only sealed, signed updates"
        )
    if run.privacy.insecure_reproducible_noise:
        raise MalformedInstruction(
            "run config:insecure-reproducible-noise: true; noise derived from the "
            "aggregator's seed is no privacy against it (tests only)"
        )


class AgentServer:
    """Serves one region until SIGTERM, SIGINT or its launcher exits."""

    def __init__(self, config: AgentConfig, *, exit_with_parent: bool = True) -> None:
        self.config = config
        self.socket_path = Path(config.socket).expanduser().absolute()
        self.lock_path = config.state_dir / AGENT_DIR / LOCK_FILE
        self.stopping = threading.Event()
        self.busy = threading.Lock()  # one request at a time
        self.sessions = threading.BoundedSemaphore(MAX_SESSIONS)
        self.parent = os.getppid() if exit_with_parent else 0
        self.served = 0
        self._lock_fd = -1
        self._listener: socket.socket | None = None
        #: Who may talk to the agent: its own user and, when it has one, the relay's.
        self.relay = Account.named(config.relay_user) if config.relay_user else None
        self.relay_label = self.relay.name if self.relay else "(the agent's own user)"
        self.agent: RegionAgent | None = None

    def _private_paths(self) -> list[Path]:
        c = self.config
        paths = [Path(c.data_path), c.state_dir, Path(c.key_file), c.deid_secret_path]
        # The names the region scrubs are personal data too.
        return paths + ([Path(c.deid_dictionary)] if c.deid_dictionary else [])

    def start(self) -> None:
        """Check the region's files against the relay's user, lock, load and listen (the
        umask keeps what the agent writes later private too)."""
        os.umask(0o077)
        self.config.state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        if self.relay is not None:
            check_private(self._private_paths(), self.relay)
        else:
            _LOG.warning(
                "fedciuic: agent: relay-user is not set: the relay (code the aggregator "
                "ships) runs as this agent's user and can read the region's files; set "
                "relay-user to an unprivileged user of its own (docs/cluster.md)"
            )
        self._lock()
        share_cores(self.config.cpu_threads)
        self.agent = RegionAgent(self.config)
        self._listen()
        self.agent.started(self.relay_label)

    def _lock(self) -> None:
        self.lock_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._lock_fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(self._lock_fd, 32).decode(errors="replace").strip() or "?"
            os.close(self._lock_fd)
            self._lock_fd = -1
            raise AgentError(
                f"agent: another agent (pid {holder}) serves {self.config.state_dir}; "
                "stop it first (one agent per region)"
            ) from None
        os.ftruncate(self._lock_fd, 0)
        os.pwrite(self._lock_fd, f"{os.getpid()}\n".encode(), 0)

    def _listen(self) -> None:
        path = self.socket_path
        folder = path.parent
        folder.mkdir(mode=0o711, parents=True, exist_ok=True)
        if folder.stat().st_uid != os.getuid():
            raise AgentError(
                f"agent config:socket: {folder} belongs to another user; give the agent a "
                "socket folder of its own"
            )
        folder.chmod(0o711)  # others may pass through to the socket, not list or write
        # We hold the lock: a socket left here was left by an agent that was killed.
        with contextlib.suppress(FileNotFoundError):
            if not stat.S_ISSOCK(path.lstat().st_mode):
                raise AgentError(f"agent config:socket: {path} exists and is not a socket")
            path.unlink()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        bind(listener, path)
        # Anyone may connect; the agent answers only the users it allows (kernel's word).
        path.chmod(0o666)
        listener.listen(MAX_SESSIONS)
        listener.settimeout(0.5)  # the accept loop looks at `stopping` this often
        self._listener = listener

    def close(self) -> None:
        """Stop listening, let the request in hand finish (up to :data:`STOP_GRACE`)."""
        self.stopping.set()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            self.socket_path.unlink(missing_ok=True)
        if self.busy.acquire(timeout=STOP_GRACE):
            self.busy.release()
        if self.agent is not None:
            self.agent.close()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self.stopping.set()

    def serve(self) -> int:
        """Accept connections until stopped, each on a thread of its own (a slow client
        cannot hold up the others); the work is serialised."""
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._on_signal)
        self.start()
        assert self._listener is not None
        print(
            f"fedciuic: agent for region {self.config.region} listening on {self.socket_path} "
            f"(pid {os.getpid()}, fedciuic {__version__}, relay user {self.relay_label})",
            flush=True,
        )
        try:
            while not self.stopping.is_set():
                if self.parent and os.getppid() != self.parent:
                    print("fedciuic: agent: its launcher exited; stopping", flush=True)
                    break
                try:
                    client, _ = self._listener.accept()
                except TimeoutError:
                    continue
                self._admit(client)
        finally:
            self.close()
        print(f"fedciuic: agent stopped ({self.served} request(s) served)", flush=True)
        return 0

    def _admit(self, client: socket.socket) -> None:
        peer = peer_of(client)
        if peer.uid != os.getuid() and (self.relay is None or peer.uid != self.relay.uid):
            _LOG.warning("fedciuic: agent: refused a connection from uid %d", peer.uid)
            client.close()
            return
        if not self.sessions.acquire(blocking=False):
            client.settimeout(1.0)
            with contextlib.suppress(OSError, ChannelError):
                send(client, _error(f"the agent is serving {MAX_SESSIONS} connections"))
            client.close()
            return
        threading.Thread(target=self._session, args=(client, peer), daemon=True).start()

    def _session(self, client: socket.socket, peer: Peer) -> None:
        try:
            with client:
                client.settimeout(IO_TIMEOUT)
                try:
                    frame = receive(client, max_body=self.config.max_request_bytes)
                except ChannelError as err:
                    _LOG.warning("fedciuic: agent: an unreadable request: %s", err)
                    with contextlib.suppress(OSError, ChannelError):
                        send(client, _error(str(err)))
                    return
                answer = self._answer(frame, peer)
                try:
                    send(client, answer)
                except OSError as err:
                    _LOG.warning(
                        "fedciuic: agent: the relay left before the answer (%s); what the "
                        "round did stays recorded",
                        err,
                    )
                except ChannelError as err:
                    _LOG.error("fedciuic: agent: the answer cannot be sent (%s)", err)
        finally:
            self.sessions.release()

    def _answer(self, frame: Frame, peer: Peer) -> Frame:
        assert self.agent is not None
        if frame.meta.get("kind") == HELLO or self.stopping.is_set():
            return self.agent.hello() if not self.stopping.is_set() else _error("stopping")
        with self.busy:
            began = time.monotonic()
            answer = self.agent.answer(frame, peer)
            self.served += 1
        _LOG.info(
            "fedciuic: agent: %s handled in %.2f s%s",
            str(frame.meta.get("kind"))[:32],
            time.monotonic() - began,
            f" (refused: {answer.error})" if answer.error else "",
        )
        return answer


def serve(config_path: Path | str, *, exit_with_parent: bool = True) -> int:
    """``fedciuic agent --config FILE``; 0 on a clean stop."""
    import flwr.common.logger  # noqa: F401 - its handler prints the region's lines

    return AgentServer(AgentConfig.load(config_path), exit_with_parent=exit_with_parent).serve()


def hello(socket_path: Path, timeout: float, pid: int = 0) -> dict[str, Any]:
    """The agent's status on ``socket_path``, waiting up to ``timeout`` for it; with
    ``pid``, only that process will do, and its exit ends the wait."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            answer = ask(
                socket_path, Frame(meta={"kind": HELLO}), timeout=IO_TIMEOUT, connect_timeout=1.0
            )
            break
        except ChannelError as err:
            if pid and not _alive(pid):
                raise AgentError(
                    f"the agent (pid {pid}) exited before it listened on {socket_path}; "
                    "see its output"
                ) from None
            if time.monotonic() >= deadline:
                raise AgentError(f"no agent answers on {socket_path}: {err}") from None
            time.sleep(0.3)
    if answer.error:
        raise AgentError(f"the agent on {socket_path}: {answer.error}")
    status = dict(answer.config.get(HELLO_RECORD, {}))
    if pid and status.get("pid") != pid:
        raise AgentError(
            f"{socket_path} is served by another agent (pid {status.get('pid')!r}), not pid "
            f"{pid}; stop the other one first"
        )
    return status


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError):
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    return True
