"""The region agent with real keys, the tiny model and demo data: what it acts on (an
instruction the aggregator signed as it stands, once), what it refuses and audits
(everything else), and its server over a real Unix socket (many clients, silent or
half-sent or oversized requests, a relay that leaves mid-round, a second agent, a
launcher killed with SIGKILL, a user it does not serve)."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import psutil
import pytest
import torch

from fedciuic import __version__
from fedciuic.agent import channel, service
from fedciuic.agent.channel import Frame, Peer, ask, encode, send
from fedciuic.agent.config import AgentConfig
from fedciuic.agent.service import (
    AGENT_DIR,
    MAX_SESSIONS,
    SEEN_FILE,
    AgentError,
    AgentServer,
    RegionAgent,
    SeenInstructions,
    hello,
)
from fedciuic.audit.log import REGION_LOG, load_records, verify
from fedciuic.cluster.protocol import CORES_ENV, threads_per_rank
from fedciuic.config import EVALUATION, TRAINING, ModelSpec, RunConfig
from fedciuic.crypto.keys import Keypair, load_bundle
from fedciuic.crypto.parties import (
    NONCE_BYTES,
    AggregatorKeys,
    TaskKind,
    aggregator_keys,
    generate_federation_keys,
    sign_global,
    sign_run_end,
)
from fedciuic.digests import installed_code
from fedciuic.model.adapter import AdapterModel
from fedciuic.privacy.ledger import LEDGER_FILE, PrivacyLedger
from fedciuic.region.trainer import REGIONS
from fedciuic.releases import WITHHELD_REASON
from fedciuic.wire import (
    AGENT_CODE,
    AGENT_VERSION,
    CONFIG,
    ENVELOPE,
    INFO,
    KEY_ID,
    METRICS,
    RUN_CONFIG,
    SIGNATURE,
    Instruction,
    RunEndNotice,
    instruction_fields,
    signed_fields,
)
from tests.conftest import ROOT, record_level_policies, unit_config

FLOWER_RUN = 7
NOBODY = 65534
HEAD = "cd" * 32
#: The aggregator's run: sealed, two local steps, and a lifetime budget of 50 that the
#: agent's own (8, its default) overrides.
RUN = {**unit_config(), "local-steps": 2, "seal": True, "epsilon-budget": 50.0}
ME = Peer(os.getpid(), os.getuid(), os.getgid())


@pytest.fixture(autouse=True)
def _own_umask() -> Iterator[None]:
    """An agent started in this process makes the process's umask 0o077 (its files are
    private): each test gives the rest of the suite the umask it found."""
    umask = os.umask(0o022)
    os.umask(umask)
    yield
    os.umask(umask)


# -- the federation: keys, policies, model ---------------------------------------------------


@dataclass(frozen=True)
class Federation:
    keys: Path
    policies: Path
    data: Path
    aggregator: AggregatorKeys
    model: AdapterModel

    def agent_toml(self, folder: Path, socket_path: Path, extra: str = "") -> Path:
        """The agent config of region eu, its state in ``folder``."""
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / "agent.toml"
        path.write_text(
            f'region = "eu"\n'
            f'data-path = "{self.data / "eu"}"\n'
            f'state-path = "state"\n'
            f'key-file = "{self.keys / "eu.key.json"}"\n'
            f'aggregator-bundle = "{self.keys / "aggregator.pub.json"}"\n'
            f'policy = "{self.policies / "eu-gdpr.yaml"}"\n'
            # the shipped policy requires names: the region's dictionary of them
            f'deid-dictionary = "{self.data / "deid-dictionaries" / "eu.txt"}"\n'
            f'socket = "{socket_path}"\n' + extra,
            encoding="utf-8",
        )
        return path

    def instruction(
        self,
        *,
        kind: TaskKind = TaskKind.TRAIN,
        server_round: int = 1,
        run: dict[str, Any] | None = None,
        signer: Keypair | None = None,
        signed_run: int = FLOWER_RUN,
        signed_round: int | None = None,
        asked: str | None = None,
        recipient: str = "eu",
        adapter: dict[str, np.ndarray] | None = None,
    ) -> Frame:
        """A request as the relay forwards it: the instruction the aggregator signed
        (for ``signed_run`` and ``signed_round``, by ``signer``, for ``recipient``),
        asked as ``asked``; ``adapter``: the arrays it carries (default: the model's)."""
        keypair = signer or self.aggregator.keypair
        settings = RunConfig.from_user_config({**RUN, **(run or {})}, source="run config")
        adapter = self.model.adapter_state() if adapter is None else adapter
        task = Instruction(
            adapter=adapter,
            server_round=server_round,
            base_fingerprint=self.model.base_fingerprint,
            kind=kind,
            run_config=settings.canonical_json(),
            nonce=secrets.token_bytes(NONCE_BYTES),
            signer=keypair.bundle.key_id.hex(),
            recipient=recipient,
        )
        round_signed = server_round if signed_round is None else signed_round
        signature = sign_global(keypair, signed_run, round_signed, adapter, task.terms)
        task = replace(task, signature=signature)
        return Frame(
            meta={"kind": asked or str(kind), "flower-run": FLOWER_RUN},
            config={CONFIG: {**instruction_fields(task)}},
            arrays=adapter,
        )

    def run_end(self, recipient: str = "eu") -> Frame:
        settings = RunConfig.from_user_config(RUN, source="run config")
        notice = RunEndNotice(
            federation_run=0,
            witness=(9, HEAD),
            run_config=settings.canonical_json(),
            nonce=secrets.token_bytes(NONCE_BYTES),
            signer=self.aggregator.keypair.bundle.key_id.hex(),
            recipient=recipient,
        )
        signature = sign_run_end(
            self.aggregator.keypair,
            FLOWER_RUN,
            notice.terms,
            notice.witness,
            notice.receipts_digest,
        )
        notice = replace(notice, signature=signature)
        return Frame(
            meta={"kind": str(TaskKind.RUN_END), "flower-run": FLOWER_RUN},
            config={CONFIG: {**instruction_fields(notice)}},
        )


@pytest.fixture(scope="module")
def federation(tmp_path_factory: pytest.TempPathFactory, demo_root: Path) -> Federation:
    keys = generate_federation_keys(tmp_path_factory.mktemp("keys"), ("eu", "cn", "us"))
    return Federation(
        keys=keys,
        policies=record_level_policies(tmp_path_factory.mktemp("policies")),
        data=demo_root,
        aggregator=aggregator_keys(str(keys), 2**28),
        model=AdapterModel(ModelSpec()),
    )


@pytest.fixture(scope="module")
def config(federation: Federation, tmp_path_factory: pytest.TempPathFactory) -> AgentConfig:
    folder = tmp_path_factory.mktemp("region-eu")
    return AgentConfig.load(federation.agent_toml(folder, folder / "agent" / "agent.sock"))


@pytest.fixture(scope="module")
def agent(config: AgentConfig) -> RegionAgent:
    return RegionAgent(config)


# -- what the region's state says -------------------------------------------------------------


def audit(config: AgentConfig) -> list[dict[str, Any]]:
    return load_records(config.state_dir / REGION_LOG)


def events(config: AgentConfig, event: str) -> list[dict[str, Any]]:
    return [r for r in audit(config) if r["event"] == event]


def ledger(config: AgentConfig) -> list[str] | None:
    """The ledger's lines but its DP evaluations' (an evaluation is a release of its own,
    charged to the ledger, and trains nothing)."""
    path = config.state_dir / LEDGER_FILE
    if not path.exists():
        return None
    return [line for line in path.read_text().splitlines() if f'"{EVALUATION}"' not in line]


@contextlib.contextmanager
def nothing_trained(config: AgentConfig) -> Iterator[None]:
    before, trained = ledger(config), len(events(config, "trained"))
    yield
    assert ledger(config) == before
    assert len(events(config, "trained")) == trained


def refused(agent: RegionAgent, frame: Frame) -> str:
    """The agent's refusal of ``frame``, once it is in the audit log; nothing trained."""
    config = agent.config
    with nothing_trained(config):
        count = len(events(config, "request_refused"))
        answer = agent.answer(frame, ME)
    assert answer.error, answer
    assert answer.config == {} and answer.metrics == {} and answer.arrays is None
    records = events(config, "request_refused")
    assert len(records) == count + 1
    details = records[-1]["details"]
    assert details["reason"] == answer.error
    assert details["peer_uid"] == ME.uid and details["peer_pid"] == ME.pid
    assert audit(config)[-1]["event"] == "checkpoint"  # the refusal is signed into the log
    assert verify(
        config.state_dir / REGION_LOG, load_bundle(Path(config.key_file).parent / "eu.pub.json")
    ).ok
    return answer.error


def vouched(federation: Federation, answer: Frame, server_round: int) -> dict[str, Any]:
    """The answer's info, once the aggregator accepts the region's signature over it."""
    info = dict(answer.config[INFO])
    sender = federation.aggregator.reply_sender(
        str(info[KEY_ID]),
        bytes(info[SIGNATURE]),  # type: ignore[arg-type]
        run_id=FLOWER_RUN,
        server_round=server_round,
        fields=signed_fields(info, answer.metrics.get(METRICS, {})),
    )
    assert sender.party == "eu"
    assert info[AGENT_VERSION] == __version__ and info[AGENT_CODE] == installed_code()
    return info


# -- RegionAgent.answer: what it acts on ------------------------------------------------------


@pytest.fixture(scope="module")
def trained(federation: Federation, agent: RegionAgent) -> tuple[Frame, Frame]:
    """One signed train instruction for round 1, and the agent's answer."""
    frame = federation.instruction()
    return frame, agent.answer(frame, ME)


def test_a_signed_train_instruction_is_trained_and_answered_sealed_and_signed(
    federation, config, trained
):
    _, answer = trained
    assert answer.error == ""
    info = vouched(federation, answer, server_round=1)
    assert info["status"] == "sealed" and info["region"] == "eu"
    assert answer.arrays is not None and set(answer.arrays) == {ENVELOPE}
    opened = federation.aggregator.open_update(
        answer.arrays[ENVELOPE].tobytes(), run_id=FLOWER_RUN, server_round=1
    )
    assert opened.sender.party == "eu" and opened.metrics["steps"] == 2
    # The lifetime budget is the agent's (8), not the 50 the run config names.
    assert opened.metrics["epsilon-budget"] == 8.0
    assert 0 < opened.metrics["epsilon"] <= 8.0
    released = PrivacyLedger.load(config.state_dir / LEDGER_FILE).rounds
    assert [(r.run_id, r.round) for r in released if r.purpose == TRAINING] == [(FLOWER_RUN, 1)]
    seen = (config.state_dir / AGENT_DIR / SEEN_FILE).read_text().splitlines()
    nonce = trained[0].config[CONFIG]["nonce"]
    assert isinstance(nonce, bytes)
    assert json.loads(seen[-1]) == {
        "nonce": nonce.hex(),
        "kind": "train",
        "flower_run": FLOWER_RUN,
        "round": 1,
    }


def test_the_same_instruction_twice_is_refused_as_a_replay_even_after_a_restart(
    agent, config, trained
):
    frame, _ = trained
    nonce = frame.config[CONFIG]["nonce"]
    assert isinstance(nonce, bytes)
    reason = refused(agent, frame)
    assert reason.startswith(f"a replayed train instruction (nonce {nonce.hex()} was acted on")
    assert "replayed" in refused(RegionAgent(config), frame)  # the nonces are on disk


def test_a_signed_evaluate_instruction_is_evaluated(federation, agent, config):
    frame = federation.instruction(kind=TaskKind.EVALUATE, server_round=2)
    with nothing_trained(config):
        answer = agent.answer(frame, ME)
    info = vouched(federation, answer, server_round=2)
    assert info["status"] == "evaluated" and answer.metrics[METRICS]["num-examples"] > 0


def test_a_signed_run_end_notice_is_witnessed_once(federation, agent, config):
    frame = federation.run_end()
    with nothing_trained(config):
        answer = agent.answer(frame, ME)
    assert vouched(federation, answer, server_round=0)["status"] == "witnessed"
    assert events(config, "witness")[-1]["details"]["head"] == HEAD
    assert "a replayed run-end instruction" in refused(agent, frame)


def test_hello_answers_region_pid_version_and_code(agent):
    answer = agent.answer(Frame(meta={"kind": "hello"}), ME)
    assert answer.error == ""
    assert answer.config == {
        "status": {
            "region": "eu",
            "pid": os.getpid(),
            "fedciuic": __version__,
            "code": installed_code(),
        }
    }


# -- RegionAgent.answer: what it refuses ------------------------------------------------------


def altered_run_config(frame: Frame, **changes: Any) -> Frame:
    """The frame with its run config changed after it was signed (as a relay could)."""
    fields = dict(frame.config[CONFIG])
    settings = json.loads(str(fields[RUN_CONFIG]))
    settings.update(changes)
    fields[RUN_CONFIG] = json.dumps(settings, sort_keys=True, separators=(",", ":"))
    return replace(frame, config={CONFIG: fields})


def altered_adapter(frame: Frame) -> Frame:
    assert frame.arrays is not None
    arrays = {k: v.copy() for k, v in frame.arrays.items()}
    first = next(iter(arrays))
    arrays[first].flat[0] += 1.0
    return replace(frame, arrays=arrays)


def altered_fields(frame: Frame, **changes: Any) -> Frame:
    return replace(frame, config={CONFIG: {**frame.config[CONFIG], **changes}})


NOT_SIGNED: list[Any] = [  # each: the federation -> a frame the agent must refuse
    pytest.param(lambda f: f.instruction(signed_run=FLOWER_RUN + 1), id="another-flower-run"),
    pytest.param(lambda f: f.instruction(signed_round=2), id="another-round"),
    pytest.param(
        lambda f: altered_run_config(f.instruction(), **{"epsilon-budget": 1000.0}),
        id="raised-epsilon-budget",
    ),
    pytest.param(lambda f: altered_run_config(f.instruction(), dp=False), id="dp-off"),
    pytest.param(
        lambda f: altered_run_config(f.instruction(), **{"local-steps": 500}), id="more-steps"
    ),
    pytest.param(lambda f: altered_adapter(f.instruction()), id="altered-adapter"),
    pytest.param(
        lambda f: f.instruction(signer=Keypair.generate("aggregator", "EU")), id="another-key"
    ),
    pytest.param(
        lambda f: altered_fields(
            f.instruction(signer=Keypair.generate("aggregator", "EU")),
            **{"aggregator-key-id": f.aggregator.keypair.bundle.key_id.hex()},
        ),
        id="another-key-claiming-the-aggregators-id",
    ),
    pytest.param(
        lambda f: altered_fields(
            f.instruction(), **{"model-signature": b"", "aggregator-key-id": ""}
        ),
        id="unsigned",
    ),
    pytest.param(
        lambda f: altered_fields(f.instruction(), **{"server-round": 2}), id="round-changed"
    ),
    pytest.param(
        lambda f: altered_fields(f.instruction(), nonce=secrets.token_bytes(NONCE_BYTES)),
        id="nonce-changed",
    ),
    pytest.param(lambda f: altered_fields(f.instruction(), task="evaluate"), id="kind-changed"),
    # The run the region files its ledger and log under, and the base it trains on.
    pytest.param(
        lambda f: altered_fields(f.instruction(), **{"federation-run": 12345}),
        id="federation-run-changed",
    ),
    pytest.param(
        lambda f: altered_fields(f.instruction(), **{"base-fingerprint": "0" * 64}),
        id="base-changed",
    ),
    pytest.param(
        lambda f: altered_fields(f.instruction(recipient="cn"), recipient="eu"),
        id="recipient-changed",
    ),
]


@pytest.mark.parametrize("make", NOT_SIGNED)
def test_an_instruction_not_signed_as_it_stands_is_refused_and_audited(federation, agent, make):
    frame = make(federation)
    reason = refused(agent, frame)
    assert "is not signed by the aggregator key" in reason and reason.endswith("refusing it")


@pytest.mark.parametrize(
    ("kind", "says"),
    [
        ("sign", "a request of kind 'sign'"),
        ("train-on-file", "a request of kind 'train-on-file'"),
        ("", "a request of kind ''"),
        ("TRAIN", "a request of kind 'TRAIN'"),
        (7, "a request of kind '7'"),
        (None, "a request of kind 'None'"),
    ],
)
def test_a_request_of_an_unknown_kind_is_refused_and_audited(federation, agent, config, kind, says):
    frame = federation.instruction()
    meta = {"flower-run": FLOWER_RUN} if kind is None else {**frame.meta, "kind": kind}
    reason = refused(agent, replace(frame, meta=meta))
    assert reason.startswith(says)
    assert "acts only on what the aggregator signs (train, evaluate, run-end, secagg)" in reason
    assert events(config, "request_refused")[-1]["details"]["kind"] == (
        "" if kind is None else str(kind)
    )


def test_a_signed_evaluate_instruction_asked_as_train_is_refused(federation, agent):
    frame = federation.instruction(kind=TaskKind.EVALUATE, asked="train")
    assert refused(agent, frame) == "a train request carries a signed evaluate instruction"


def test_a_signed_train_instruction_asked_as_run_end_is_refused(federation, agent):
    assert "malformed run-end notice" in refused(agent, federation.instruction(asked="run-end"))


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"meta": {"kind": "train"}}, "malformed request: flower-run: a run id expected"),
        ({"meta": {"kind": "train", "flower-run": "7"}}, "malformed request: flower-run"),
        ({"meta": {"kind": "train", "flower-run": True}}, "malformed request: flower-run"),
        ({"meta": {"kind": "train", "flower-run": -1}}, "malformed request: flower-run"),
        ({"config": {}}, "malformed request: no config record"),
        ({"config": {CONFIG: {"task": "train"}}}, "malformed instruction"),
        ({"arrays": None}, "is not signed by the aggregator key"),
    ],
)
def test_a_malformed_request_is_refused_and_audited(federation, agent, change, says):
    reason = refused(agent, replace(federation.instruction(), **change))
    assert says in reason


def test_a_refused_instruction_does_not_use_up_its_nonce(federation, agent, config):
    """A relay that mislabels an instruction cannot burn it: asked as it was signed, it
    is acted on."""
    frame = federation.instruction(kind=TaskKind.EVALUATE, server_round=3, asked="train")
    refused(agent, frame)
    answer = agent.answer(replace(frame, meta={**frame.meta, "kind": "evaluate"}), ME)
    assert answer.error == "" and answer.config[INFO]["status"] == "evaluated"


@pytest.mark.parametrize(
    ("run", "says"),
    [
        ({"regions": "cn,us"}, "agent config:region: 'eu' is not a region of this run (cn, us)"),
        ({"seal": False}, "run config:seal: false; a region's agent sends only sealed"),
        (
            {"insecure-reproducible-noise": True, "secure-mode": False},
            "run config:insecure-reproducible-noise: true",
        ),
    ],
    ids=["not-a-region-of-the-run", "unsealed", "reproducible-noise"],
)
def test_a_signed_instruction_for_a_run_the_region_does_not_take_is_declined(
    federation, agent, config, run, says
):
    frame = federation.instruction(server_round=4, run=run)
    declines = len(events(config, "declined"))
    with nothing_trained(config):
        answer = agent.answer(frame, ME)
    assert answer.error == ""  # a signed decline, not a refusal
    info = vouched(federation, answer, server_round=4)
    assert info["status"] == "declined" and says in str(info["reason"])
    assert answer.arrays is None and answer.metrics[METRICS] == {"num-examples": 0}
    assert len(events(config, "declined")) == declines + 1
    assert "replayed" in refused(agent, frame)  # declined, but acted on: once


def test_a_damaged_ledger_declines_each_round_with_the_reason_and_the_agent_serves_on(
    federation, agent, config
):
    path = config.state_dir / LEDGER_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('{"kind": "header"}\n')
    for server_round in (5, 6):
        frame = federation.instruction(server_round=server_round)
        with nothing_trained(config):
            answer = agent.answer(frame, ME)
        assert answer.error == ""  # a signed decline: the relay and aggregator go on
        info = vouched(federation, answer, server_round=server_round)
        assert info["status"] == "declined"  # under the EU policy the reason stays home
        assert info["reason"] == WITHHELD_REASON
        said = events(config, "declined")[-1]["details"]["reason"]
        assert f"{LEDGER_FILE}:1: corrupted ledger record" in said
    assert path.read_text() == '{"kind": "header"}\n'  # kept as evidence


def test_a_run_config_that_allows_pickle_weights_does_not_make_the_region_load_them(
    federation, agent, config, tiny_checkpoints, tmp_path
):
    """Loading pickle runs code: the aggregator's run config may say allow, but the
    region goes by its own agent config (allow-pickle-weights, default false)."""
    from tests.model.test_checkpoint_checks import pickle_only

    assert config.allow_pickle_weights is False
    pickled = pickle_only(tiny_checkpoints["qwen2"], tmp_path / "pickled")
    run = {"model-path": str(pickled), "allow-pickle-weights": True}
    frame = federation.instruction(server_round=5, run=run)
    with nothing_trained(config):
        answer = agent.answer(frame, ME)
    info = vouched(federation, answer, server_round=5)
    assert info["status"] == "declined" and info["reason"] == WITHHELD_REASON  # EU: dp_only
    said = events(config, "declined")[-1]["details"]["reason"]
    assert f"{pickled}: its weights are only pickle files" in said


@pytest.mark.parametrize(
    "lines",
    [
        ['{"nonce": "00ff"}', "not json"],
        ['{"nonce": "00ff"}', '{"nonce": "zz"}'],
        ['{"nonce": "00ff"}', '{"kind": "train"}'],
        ['{"nonce": "00ff"}', '["00ff"]'],
        ['{"nonce": "00ff"}', '{"nonce": 5}'],
    ],
    ids=["not-json", "not-hex", "no-nonce", "not-an-object", "not-text"],
)
def test_a_corrupted_record_of_seen_instructions_is_refused_naming_file_and_line(tmp_path, lines):
    path = tmp_path / SEEN_FILE
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(
        AgentError, match=f"^{path}:2: not an instruction record; the agent refuses"
    ):
        SeenInstructions(path)


def test_seen_instructions_are_kept_across_loads(tmp_path):
    path = tmp_path / SEEN_FILE
    seen = SeenInstructions(path)
    assert seen.admit(b"\x01" * 16, kind="train") and not seen.admit(b"\x01" * 16)
    again = SeenInstructions(path)
    assert not again.admit(b"\x01" * 16) and again.admit(b"\x02" * 16)
    assert path.stat().st_mode & 0o777 == 0o600


def test_an_agent_given_another_regions_key_refuses_to_start(federation, tmp_path):
    toml = federation.agent_toml(tmp_path, tmp_path / "agent.sock")
    toml.write_text(toml.read_text().replace("eu.key.json", "cn.key.json"))
    with pytest.raises(AgentError, match="is 'cn''s key, this is region 'eu'"):
        RegionAgent(AgentConfig.load(toml))


# -- AgentServer over a real socket -------------------------------------------------------------


@dataclass
class Served:
    server: AgentServer
    config: AgentConfig
    thread: threading.Thread

    @property
    def socket(self) -> Path:
        return Path(self.config.socket)

    def hello(self, timeout: float = 10.0) -> Frame:
        return ask(self.socket, Frame(meta={"kind": "hello"}), timeout=timeout, connect_timeout=5)


@pytest.fixture(scope="module")
def served(federation: Federation, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """An agent serving in this process (``serve()`` on a thread, its signal handlers
    left out), its socket under a folder every user may pass through, requests of at
    most 64 KiB."""
    folder = tmp_path_factory.mktemp("region-eu-served")
    socket_root = Path(tempfile.mkdtemp(prefix="fedciuic-agent-", dir="/tmp"))
    socket_root.chmod(0o711)
    toml = federation.agent_toml(
        folder, socket_root / "agent" / "agent.sock", "max-request-bytes = 65536\ncpu-threads = 1\n"
    )
    config = AgentConfig.load(toml)
    threads = torch.get_num_threads()
    server = AgentServer(config, exit_with_parent=False)
    failed: list[BaseException] = []
    umask = os.umask(0o022)  # the agent makes its own 0o077: give the process its own back
    os.umask(umask)

    def run() -> None:
        try:
            server.serve()
        except BaseException as err:
            failed.append(err)
            raise

    no_signals = SimpleNamespace(
        signal=lambda *_: None, SIGTERM=signal.SIGTERM, SIGINT=signal.SIGINT
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(service, "signal", no_signals)
        thread = threading.Thread(target=run, name="agent", daemon=True)
        thread.start()
        try:
            hello(Path(config.socket), 60)
        except AgentError:
            thread.join(1)
            raise AssertionError(f"the agent did not start: {failed}") from None
    try:
        yield Served(server, config, thread)
    finally:
        server.stopping.set()
        thread.join(30)
        shutil.rmtree(socket_root, ignore_errors=True)
        os.umask(umask)
        torch.set_num_threads(threads)  # the agent's share was this process's
        os.environ.pop(CORES_ENV, None)
    assert not thread.is_alive() and not failed
    assert not Path(config.socket).exists()  # removed at a clean stop


def alive(served: Served) -> None:
    """The agent still serves: it answers hello, and its thread runs."""
    assert served.thread.is_alive()
    answer = served.hello()
    assert answer.error == "" and answer.config["status"]["pid"] == os.getpid()


def test_the_agent_trains_on_its_cpu_threads_and_its_ranks_share_them(served):
    assert served.config.cpu_threads == 1
    seen: list[int] = []  # on a thread of its own, as each connection is served
    worker = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    worker.start()
    worker.join()
    assert seen == [1]
    assert os.environ[CORES_ENV] == "1"  # inherited by the training processes it starts
    assert threads_per_rank(1) == threads_per_rank(2) == 1


def test_the_server_refuses_to_serve_while_another_agent_holds_the_state(served):
    second = AgentServer(served.config, exit_with_parent=False)
    with pytest.raises(AgentError) as caught:
        second.start()
    message = str(caught.value)
    assert f"another agent (pid {os.getpid()}) serves {served.config.state_dir}" in message
    assert "one agent per region" in message
    alive(served)


def test_many_connections_at_once_are_each_answered_or_told_the_agent_is_busy(served):
    def hello_once(_: int) -> str:
        answer = ask(served.socket, Frame(meta={"kind": "hello"}), timeout=10, connect_timeout=10)
        if answer.error:
            return answer.error
        return str(answer.config["status"]["region"])

    began = time.monotonic()
    with ThreadPoolExecutor(20) as pool:
        answers = list(pool.map(hello_once, range(20), timeout=30))
    assert time.monotonic() - began < 20
    busy = f"the agent is serving {MAX_SESSIONS} connections"
    assert all(a in ("eu", busy) for a in answers), answers
    assert answers.count("eu") >= MAX_SESSIONS
    alive(served)


@pytest.fixture
def short_io(monkeypatch: pytest.MonkeyPatch) -> float:
    """The agent drops a silent client after 1 s, not 30."""
    monkeypatch.setattr(service, "IO_TIMEOUT", 1.0)
    monkeypatch.setattr(channel, "IO_TIMEOUT", 1.0)
    return 1.0


def test_a_silent_client_is_dropped_after_the_io_timeout_while_others_are_served(served, short_io):
    silent = channel.connect(served.socket, 5)
    with silent:
        began = time.monotonic()
        answer = served.hello()  # served meanwhile, not after the silent one
        assert answer.error == "" and time.monotonic() - began < short_io
        dropped = channel.receive(silent, wait=10)
        waited = time.monotonic() - began
    assert dropped.error == f"no answer within {short_io:g}s (frame prefix)"
    assert short_io * 0.8 < waited < short_io + 3
    alive(served)


def test_a_ninth_connection_while_eight_are_held_is_told_the_agent_is_busy(served, short_io):
    held = [channel.connect(served.socket, 5) for _ in range(MAX_SESSIONS)]
    busy = f"the agent is serving {MAX_SESSIONS} connections"
    try:
        # Once the agent has admitted all eight (each to a session of its own), it
        # answers no ninth; the eight stay silent for longer than this takes.
        deadline = time.monotonic() + short_io * 0.6
        answer = served.hello(timeout=5)
        while answer.error != busy and time.monotonic() < deadline:
            time.sleep(0.02)
            answer = served.hello(timeout=5)
        assert answer.error == busy
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + short_io + 5
    while served.hello().error and time.monotonic() < deadline:  # the sessions end
        time.sleep(0.2)
    alive(served)


def test_a_client_that_sends_half_a_frame_then_closes_leaves_the_agent_serving(served):
    head, _ = encode(Frame(meta={"kind": "hello"}))
    for cut in (3, len(head) - 5):
        sock = channel.connect(served.socket, 5)
        sock.sendall(head[:cut])
        sock.close()
    sock = channel.connect(served.socket, 5)
    sock.sendall(b"GET / HTTP/1.1\r\n\r\n")  # not a frame at all
    with sock:
        assert "bad magic" in channel.receive(sock, wait=5).error
    alive(served)


def test_an_oversized_request_is_refused_with_an_error_answer(federation, served):
    config = served.config
    before = ledger(config)
    big = replace(federation.instruction(), arrays={"a": np.zeros(70_000, np.uint8)})
    answer = ask(served.socket, big, timeout=10, connect_timeout=5)
    assert answer.error == "frame body of 70000 bytes (at most 65536)"
    assert ledger(config) == before
    alive(served)


def test_a_relay_that_leaves_mid_round_leaves_the_round_recorded_once(federation, served):
    config = served.config
    frame = federation.instruction(server_round=3)
    count = served.server.served
    sock = channel.connect(served.socket, 5)
    send(sock, frame)
    sock.close()  # before the answer
    deadline = time.monotonic() + 120
    while served.server.served == count and time.monotonic() < deadline:
        time.sleep(0.1)
    assert served.server.served == count + 1
    with served.server.busy:  # the round is over once the agent lets go of it
        pass
    releases = PrivacyLedger.load(config.state_dir / LEDGER_FILE).rounds
    assert [(r.run_id, r.round) for r in releases if r.purpose == TRAINING] == [(FLOWER_RUN, 3)]
    assert len(events(config, "update_sealed")) == 1
    bundle = load_bundle(federation.keys / "eu.pub.json")
    assert verify(config.state_dir / REGION_LOG, bundle).ok
    # The relay sends it again: acted on once.
    again = ask(served.socket, frame, timeout=30, connect_timeout=5)
    assert again.error.startswith("a replayed train instruction")
    trainings = PrivacyLedger.load(config.state_dir / LEDGER_FILE).rounds
    assert [(r.run_id, r.round) for r in trainings if r.purpose == TRAINING] == [(FLOWER_RUN, 3)]
    assert events(config, "request_refused")[-1]["details"]["reason"] == again.error
    alive(served)


def test_a_connection_from_a_user_the_agent_does_not_serve_is_closed(served):
    if os.geteuid() != 0:
        pytest.skip(f"connecting as another user needs root; this test runs as uid {os.geteuid()}")
    request, _ = encode(Frame(meta={"kind": "hello"}))
    reading, writing = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: only the socket module and os, then _exit
        outcome = b"?"
        try:
            os.close(reading)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(10)
            sock.connect(str(served.socket))
            got = b""
            try:  # the agent may close before the request is all sent
                sock.sendall(request)
                while chunk := sock.recv(1 << 16):
                    got += chunk
            except (BrokenPipeError, ConnectionResetError):
                pass
            outcome = b"closed:%d" % len(got)
        except BaseException as err:
            outcome = repr(err).encode()[:300]
        finally:
            os.write(writing, outcome)
            os._exit(0)
    os.close(writing)
    with os.fdopen(reading, "rb") as pipe:
        outcome = pipe.read()
    os.waitpid(pid, 0)
    assert outcome == b"closed:0"  # no answer, not even a refusal
    alive(served)


def test_hello_names_both_pids_when_another_agent_answers(served):
    other = subprocess.Popen(["sleep", "30"])
    try:
        with pytest.raises(AgentError) as caught:
            hello(served.socket, 5, pid=other.pid)
    finally:
        other.kill()
        other.wait()
    message = str(caught.value)
    assert f"is served by another agent (pid {os.getpid()}), not pid {other.pid}" in message


def test_hello_gives_up_once_the_agent_it_waits_for_has_exited(tmp_path):
    gone = subprocess.Popen(["true"])
    gone.wait()
    began = time.monotonic()
    with pytest.raises(
        AgentError, match=f"the agent \\(pid {gone.pid}\\) exited before it listened"
    ):
        hello(tmp_path / "agent.sock", 30, pid=gone.pid)
    assert time.monotonic() - began < 5


# -- an agent in its own process -------------------------------------------------------------------


def exited(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True


def test_an_agent_whose_launcher_is_killed_stops_and_a_new_one_can_start(federation, tmp_path):
    toml = federation.agent_toml(tmp_path / "region", tmp_path / "agent" / "agent.sock")
    config = AgentConfig.load(toml)
    log = tmp_path / "agent.log"
    launcher = subprocess.Popen(
        [
            "bash",
            "-c",
            '"$0" -m fedciuic.ops.cli agent --config "$1" >"$2" 2>&1 & echo $!; wait',
            sys.executable,
            str(toml),
            str(log),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert launcher.stdout is not None
    pid = int(launcher.stdout.readline())
    try:
        status = hello(Path(config.socket), 60, pid=pid)
        assert status["region"] == "eu" and status["pid"] == pid
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(10)
        deadline = time.monotonic() + 10
        while not exited(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert exited(pid), log.read_text()
        output = log.read_text()
        assert "its launcher exited; stopping" in output and "agent stopped" in output
        assert not Path(config.socket).exists()
        # The state is free: a new agent takes it.
        again = AgentServer(config, exit_with_parent=False)
        again.start()
        try:
            assert again.agent is not None and again.agent.hello().error == ""
        finally:
            again.close()
        started = events(config, "agent_started")
        assert [r["details"]["pid"] for r in started] == [pid, os.getpid()]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        launcher.kill()
        launcher.wait()


def test_a_region_of_two_training_processes_trains_through_its_agent(federation, tmp_path):
    """train-processes is the agent's own (its hardware): the round runs as two gloo
    ranks started by the agent, whatever the aggregator's run config says."""
    config = AgentConfig.load(
        federation.agent_toml(tmp_path, tmp_path / "agent" / "agent.sock", "train-processes = 2\n")
    )
    agent = RegionAgent(config)
    try:
        answer = agent.answer(federation.instruction(run={"train-processes": 1}), ME)
        assert answer.error == "" and vouched(federation, answer, 1)["status"] == "sealed"
        (record,) = events(config, "trained")
        assert record["details"]["steps"] == RUN["local-steps"]
        ranks = sorted(p.name for p in (config.state_dir / "cluster").glob("rank-*.log"))
        assert ranks == ["rank-1.log"], ranks  # rank 0 is the agent itself; rank 1 its worker
        assert torch.distributed.is_initialized()  # the ranks stay up for the next round
    finally:
        agent.close()  # what a stopping agent does: its ranks go, this process leaves the world
    assert not torch.distributed.is_initialized()


def test_a_sharded_region_trains_through_its_agent_as_one_process_does(federation, tmp_path):
    """train-sharding = "shard" is the agent's own, as train-processes is: the round runs
    with the base sharded over two gloo ranks, sealed, with the audit events, policy
    record and ledger accounting of one process holding the whole base. (The noise
    differs: an agent's is never reproducible; tests/cluster/test_sharding.py compares
    the updates themselves.)"""
    seen = {}
    for name, extra in (
        ("one", ""),
        ("sharded", 'train-processes = 2\ntrain-sharding = "shard"\n'),
    ):
        folder = tmp_path / name
        config = AgentConfig.load(federation.agent_toml(folder, folder / "agent.sock", extra))
        agent = RegionAgent(config)
        try:
            run = {"train-sharding": "replicate"}  # the agent's word wins
            answer = agent.answer(federation.instruction(run=run), ME)
            assert answer.error == "" and vouched(federation, answer, 1)["status"] == "sealed"
            region, _ = next(reversed(REGIONS.entries.values()))  # the one just used
            assert region.model.sharded == (name == "sharded")
        finally:
            agent.close()
        records = audit(config)
        (trained,) = events(config, "trained")
        lines = [json.loads(x) for x in ledger(config) or [] if '"round"' in x]
        seen[name] = (
            [r["event"] for r in records],
            trained["details"].keys(),
            trained["details"]["steps"],
            # The DP count's release, then the round's steps (its rate and epsilon follow
            # from the noisy count, which differs between the two).
            [{k: x[k] for k in ("noise_multiplier", "sample_rate", "steps")} for x in lines[:1]],
            [x["steps"] for x in lines],
        )
    assert seen["sharded"] == seen["one"]


def test_what_the_agent_writes_later_is_private_whatever_its_umask(federation, tmp_path):
    """The start-up check sees the files that exist; the agent makes sure that what a
    round writes afterwards (its state folder, ledger, audit log) is private too."""
    config = AgentConfig.load(federation.agent_toml(tmp_path, tmp_path / "agent" / "agent.sock"))
    previous = os.umask(0o022)
    try:
        server = AgentServer(config, exit_with_parent=False)
        server.start()
        try:
            server.agent.answer(federation.instruction(), ME)  # type: ignore[union-attr]
        finally:
            server.close()
    finally:
        os.umask(previous)
    written = [config.state_dir, *config.state_dir.rglob("*")]
    assert len(written) > 3
    loose = [p for p in written if p.stat().st_mode & 0o077 and not p.is_socket()]
    assert not loose, loose
