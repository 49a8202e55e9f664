"""The region's trainer service (``fedciuic trainer``) in a subprocess, without Flower:
requests round-trip and keep the model loaded; bad requests are refused and the service
keeps serving; an unreachable service is a one-line decline; every process is gone."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
from collections.abc import Callable, Iterator
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client
from pathlib import Path
from typing import Any

import psutil
import pytest

from fedciuic.cluster import service
from fedciuic.cluster.service import (
    Answer,
    Request,
    TrainerPaths,
    TrainerUnreachable,
    ask,
    delegate,
    ping,
    request_for,
)
from fedciuic.crypto.keys import load_bundle
from fedciuic.crypto.sealing import aggregator_keys, generate_federation_keys, sign_global
from fedciuic.flower import protocol
from fedciuic.model.adapter import AdapterModel, ModelSpec
from fedciuic.rounds.region_round import model_loads, read_configs
from fedciuic.rounds.wire import (
    AUDIT_HEAD,
    DECLINED,
    EVALUATED,
    KEY_ID,
    SEALED,
    SIGNATURE,
    Instruction,
)
from tests.conftest import ROOT, app_config, lab_policies

FLOWER_RUN = 11

Start = Callable[..., subprocess.Popen[str]]


def _command(state: Path, *extra: str) -> list[str]:
    entry = "from fedciuic.ops.cli import main; raise SystemExit(main())"
    return [sys.executable, "-c", entry, "trainer", "--state-path", str(state), *extra]


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Start]:
    """Start ``fedciuic trainer`` on a state dir (ready when this returns, unless told
    not to wait); every service started is stopped, and must be gone, at the end."""
    started: list[subprocess.Popen[str]] = []
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def launch(state: Path, *, wait: bool = True) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            _command(state),
            env=env,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        started.append(proc)
        if wait:
            ping(state, timeout=60, pid=proc.pid)
        return proc

    yield launch
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)
    assert all(not psutil.pid_exists(p.pid) for p in started), "a trainer service survived"


def _stop(proc: subprocess.Popen[str], signum: int = signal.SIGTERM) -> str:
    proc.send_signal(signum)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    return out


@pytest.fixture(scope="module")
def model() -> AdapterModel:
    return AdapterModel(ModelSpec())


def _region(demo_root: Path, tmp_path: Path, state: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    keys = generate_federation_keys(tmp_path / "keys", ("cn",))
    policies = lab_policies(tmp_path / "policies")
    run_config = {**app_config(), "local-steps": 2, "seal": True, "keys-dir": str(keys)}
    node_config = {
        "region": "cn",
        "data-path": str(demo_root / "cn"),
        "state-path": str(state),
        "policy": str(policies / "cn.yaml"),
        "trainer": "service",
    }
    return run_config, node_config


def _instruction(model: AdapterModel, keys: Path, server_round: int) -> Instruction:
    signer = aggregator_keys(str(keys), 2**28).keypair
    adapter = model.adapter_state()
    return Instruction(
        adapter=adapter,
        server_round=server_round,
        base_fingerprint=model.base_fingerprint,
        signature=sign_global(signer, FLOWER_RUN, server_round, adapter, None),
        signer=signer.bundle.key_id.hex(),
    )


def test_rounds_go_through_the_service_which_loads_the_model_once(
    start: Start, demo_root: Path, tmp_path: Path, model: AdapterModel
) -> None:
    state = tmp_path / "state"
    proc = start(state)
    run_config, node_config = _region(demo_root, tmp_path, state)
    run, node = read_configs(run_config, node_config)
    keys = Path(run.keys_dir)
    replies = []
    for server_round, training in ((1, True), (1, False), (2, True)):
        task = _instruction(model, keys, server_round)
        request = request_for(
            run_config, node_config, node, task, flower_run=FLOWER_RUN, training=training
        )
        replies.append(delegate(run, node, request).config_records[protocol.INFO])
    assert [r["status"] for r in replies] == [SEALED, EVALUATED, SEALED], replies
    # Signed here, with the region's own key (no private key crossed the socket), and
    # carrying the head of the service's audit log.
    own = load_bundle(keys / "cn.pub.json")
    for info in replies:
        assert info[KEY_ID] == own.key_id.hex() and info[SIGNATURE] and info[AUDIT_HEAD]
    assert model_loads(state, FLOWER_RUN) == 1
    assert "fedciuic: region cn: model loaded (1 in this process)" in _stop(proc)
    paths = TrainerPaths.of(state)
    assert not paths.socket.exists() and not paths.authkey.exists()


def test_files_are_private_and_bad_requests_leave_the_service_serving(
    start: Start, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    proc = start(state)
    paths = TrainerPaths.of(state)
    assert stat.S_IMODE(paths.folder.stat().st_mode) == 0o700
    assert stat.S_IMODE(paths.socket.stat().st_mode) == 0o600
    assert stat.S_IMODE(paths.authkey.stat().st_mode) == 0o600
    # A wrong key: refused in the handshake, before anything is unpickled.
    with pytest.raises(AuthenticationError):
        Client(str(paths.socket), family="AF_UNIX", authkey=b"not the key")
    key = paths.authkey.read_bytes()
    # Not a request, bytes that do not unpickle: an answer with the reason.
    with Client(str(paths.socket), family="AF_UNIX", authkey=key) as conn:
        conn.send({"run": 1})
        assert "malformed request (a dict)" in conn.recv().error
    with Client(str(paths.socket), family="AF_UNIX", authkey=key) as conn:
        conn.send_bytes(b"\x80\x05garbage")
        assert "unreadable request" in conn.recv().error
    # Another region's state dir, and configs that do not validate.
    other = ask(state, Request(str(tmp_path / "other"), {}, {}), timeout=30)
    assert f"serves state-path {paths.state_dir}" in other.error
    assert f"--state-path {tmp_path / 'other'}" in other.error
    task = Instruction(adapter={}, server_round=1, base_fingerprint="")
    broken = ask(state, Request(str(state), {"regions": 3}, {}, task=task), timeout=30)
    assert broken.error and broken.content is None
    answer = ping(state, timeout=5)
    assert answer == Answer(state_path=str(paths.state_dir), pid=proc.pid)
    assert "refused a connection with a wrong key" in _stop(proc, signal.SIGINT)


def test_an_unreachable_service_is_a_one_line_decline_and_a_stale_socket_is_replaced(
    start: Start, demo_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(service, "CONNECT_TIMEOUT", 0.5)
    state = tmp_path / "state"
    run_config, node_config = _region(demo_root, tmp_path, state)
    run, node = read_configs(run_config, node_config)
    task = Instruction(adapter={}, server_round=1, base_fingerprint="")
    request = request_for(run_config, node_config, node, task, flower_run=FLOWER_RUN)
    paths = TrainerPaths.of(state)

    def declined() -> str:
        info = delegate(run, node, request).config_records[protocol.INFO]
        assert info["status"] == DECLINED and SIGNATURE not in info
        reason = str(info["reason"])
        assert "\n" not in reason and str(paths.socket) in reason
        assert f"start `fedciuic trainer --state-path {paths.state_dir}`" in reason
        return reason

    assert "no socket" in declined()
    proc = start(state)
    proc.kill()  # no clean stop: its socket stays behind
    proc.wait(timeout=30)
    assert paths.socket.exists()
    assert "connection refused" in declined()
    with pytest.raises(TrainerUnreachable, match="no trainer answers"):
        ask(state, request, timeout=5)
    again = start(state)  # the stale socket is replaced
    assert ping(state, timeout=5).pid == again.pid
    _stop(again)


def test_a_second_service_on_the_same_state_dir_is_refused(start: Start, tmp_path: Path) -> None:
    state = tmp_path / "state"
    first = start(state)
    second = start(state, wait=False)
    out, _ = second.communicate(timeout=60)
    assert second.returncode == 2
    assert out.strip().splitlines()[-1] == (
        f"fedciuic: error: trainer --state-path: a trainer already serves {state} (pid "
        f"{first.pid}, socket {TrainerPaths.of(state).socket}); stop it first, or let the "
        "SuperNode use it"
    )
    # A start script's check that its own trainer serves: not this one.
    check = subprocess.run(
        _command(state, "--ping", "--pid", str(second.pid), "--timeout", "5"),
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert check.returncode == 2
    assert f"served by another trainer (pid {first.pid}), not pid {second.pid}" in check.stderr
    assert ping(state, timeout=5).pid == first.pid  # the first one still serves
    _stop(first)


def test_a_state_path_deeper_than_a_socket_address_is_served(start: Start, tmp_path: Path) -> None:
    state = tmp_path / ("deep-" * 20) / "state"
    assert len(str(TrainerPaths.of(state).socket)) > service.MAX_SOCKET_PATH
    proc = start(state)
    assert ping(state, timeout=5).pid == proc.pid
    _stop(proc)
