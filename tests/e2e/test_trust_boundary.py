"""A region's guarantees do not run on code its counterparty ships.

One deployment written by ``fedciuic init`` and started with its own scripts (each
region: its agent, its SuperNode, and Flower's ClientApp as the relay's own OS user)
serves three apps submitted to the same SuperLink:

1. an app the aggregator altered: its ClientApp tries to read the region's data and
   key files, asks the agent to act on a request of its own making, and replays every
   instruction it relays; its copy of ``fedciuic`` plants markers in the DP, ledger,
   sealing and signing modules;
2. a foreign Flower app (nothing of fedciuic), as whoever runs the relay could submit;
3. the honest app.

Run as root, the relay is an unprivileged user of its own: it reads none of the
region's files. Without root that part is skipped with its reason, and the rest runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import subprocess
import textwrap
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from fedciuic.audit.events import Event
from fedciuic.audit.log import AGGREGATOR_LOG, REGION_LOG, load_records, verify
from fedciuic.cluster.protocol import free_port
from fedciuic.config import TRAINING
from fedciuic.crypto.keys import load_bundle
from fedciuic.digests import installed_code
from fedciuic.flower.launch import LocalFederation
from fedciuic.ops.deploy import init_deployment
from fedciuic.ops.layout import Deployment
from fedciuic.ops.separation import interpreter_paths
from fedciuic.policy.rules import load_policy
from fedciuic.privacy.ledger import LEDGER_FILE, PrivacyLedger
from fedciuic.processes import healthy
from tests.conftest import ROOT, record_level_policies
from tests.e2e import pace
from tests.e2e.helpers import built_once, passable_to_others, processes_under
from tests.e2e.pace import patient

pytestmark = pytest.mark.e2e
REGIONS = ("eu", "cn")
#: A user of this test's own, removed afterwards (only as root).
RELAY = "fedciuic-e2e-relay"
AS_ROOT = os.geteuid() == 0
NO_ROOT = "not root: no second OS user for the relay here (CI runs as root and checks it)"
#: The modules that train, account, seal and sign: markers in the altered app's copy.
MARKED = (
    "fedciuic/privacy/dpsgd.py",
    "fedciuic/privacy/ledger.py",
    "fedciuic/crypto/parties.py",
    "fedciuic/crypto/envelope.py",
    "fedciuic/crypto/keys.py",
    "fedciuic/region/round.py",
)
RUN = {"num-server-rounds": 1, "local-steps": 2, "target-epsilon": 2.0, "node-wait-timeout": 180}


def _targets(d: Deployment) -> list[str]:
    """What a hostile ClientApp would read: each region's data, keys and state."""
    paths = []
    for region in REGIONS:
        here = d.region_dir(region)
        paths += [str(p) for p in sorted((here / "data").glob("*"))] or [str(here / "data")]
        paths += [str(here / "data"), str(here / "keys" / f"{region}.key.json")]
        paths += [str(here / "state" / LEDGER_FILE), str(here / "state" / REGION_LOG)]
    return paths


MARKER = """
import os as _fm_os, sys as _fm_sys
try:
    with open(f"{MARKERS}/{__name__}.{_fm_os.getpid()}", "w") as _fm:
        _fm.write("\\x00".join(_fm_sys.argv))
except OSError:
    pass
"""

ALTERED_CLIENT = """
'''A ClientApp altered by the aggregator: it relays, and tries what it should not.'''
import json
import os
from pathlib import Path

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from fedciuic.agent.channel import Frame, ask
from fedciuic.flower.relay import agent_socket, forward, request

MARKERS = Path(MARKERS_DIR)
TARGETS = TARGET_PATHS
app = ClientApp()


def _try_everything(msg: Message, context: Context) -> None:
    files = {}
    for path in TARGETS:
        try:
            Path(path).read_bytes() if Path(path).is_file() else os.listdir(path)
            files[path] = "read"
        except OSError as err:
            files[path] = type(err).__name__
    sock = agent_socket(dict(context.node_config))
    forged = Frame(
        meta={"kind": "sign", "flower-run": context.run_id},
        config={"payload": {"bytes": b"sign me"}},
    )
    asked = ask(sock, forged, timeout=120).error
    replayed = ask(sock, request(msg, context.run_id), timeout=120).error
    record = {"uid": os.getuid(), "files": files, "sign": asked, "replay": replayed}
    (MARKERS / f"relay-{os.getpid()}-{msg.metadata.message_id[:12]}.json").write_text(
        json.dumps(record)
    )


def _handle(msg: Message, context: Context) -> Message:
    reply = forward(msg, context)
    _try_everything(msg, context)
    return reply


app.train()(_handle)
app.evaluate()(_handle)
app.query()(_handle)
app.query("hello")(forward)  # which region the node serves: the aggregator asks first
"""

FOREIGN_CLIENT = """
'''A Flower app with nothing of fedciuic in it, as a relay could submit.'''
import json
import os
import socket
import struct
from pathlib import Path

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

MARKERS = Path(MARKERS_DIR)
TARGETS = TARGET_PATHS
app = ClientApp()


def _ask_agent(path: str, run_id: int) -> str:
    header = json.dumps({
        "protocol": 2, "fedciuic": "foreign", "meta": {"kind": "train", "flower-run": run_id},
        "config": {"config": {"server-round": 1, "task": "train"}}, "metrics": {}, "arrays": [],
    }).encode()
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(60)
        sock.connect(path)
        sock.sendall(b"FCAG" + struct.pack(">IQ", len(header), 0) + header)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    size = struct.unpack(">I", data[4:8])[0]
    return json.loads(data[16:16 + size])["meta"].get("error", "")


@app.train()
def train(msg: Message, context: Context) -> Message:
    files = {}
    for path in TARGETS:
        try:
            Path(path).read_bytes() if Path(path).is_file() else os.listdir(path)
            files[path] = "read"
        except OSError as err:
            files[path] = type(err).__name__
    agent = _ask_agent(str(context.node_config.get("agent", "")), context.run_id)
    record = {"uid": os.getuid(), "files": files, "agent": agent}
    (MARKERS / f"foreign-{os.getpid()}.json").write_text(json.dumps(record))
    return Message(RecordDict({"result": ConfigRecord({"done": 1})}), reply_to=msg)
"""

FOREIGN_SERVER = """
import time

from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.serverapp import Grid, ServerApp

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    deadline = time.monotonic() + 120
    nodes = list(grid.get_node_ids())
    while len(nodes) < REGION_COUNT and time.monotonic() < deadline:
        time.sleep(1)
        nodes = list(grid.get_node_ids())
    asks = [
        Message(RecordDict({"config": ConfigRecord({"give": "everything"})}), dst_node_id=n,
                message_type=MessageType.TRAIN)
        for n in nodes
    ]
    grid.send_and_receive(asks, timeout=180)
"""

FOREIGN_PYPROJECT = """
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "foreign"
version = "1.0.0"
dependencies = ["flwr"]

[tool.flwr.app]
publisher = "intruder"

[tool.flwr.app.components]
serverapp = "foreign.server:app"
clientapp = "foreign.client:app"

[tool.flwr.app.config]
"""


def _fill(text: str, markers: Path, targets: list[str]) -> str:
    filled = text.replace("MARKERS_DIR", repr(str(markers)))
    filled = filled.replace("TARGET_PATHS", repr(targets)).replace("REGION_COUNT", "2")
    return textwrap.dedent(filled).lstrip()


def _altered_app(folder: Path, markers: Path, targets: list[str]) -> Path:
    """The repository's app with a hostile ClientApp and a marked copy of fedciuic in
    its FAB."""
    app = folder / "altered-app"
    shutil.copytree(ROOT / "clients", app / "clients")
    shutil.copytree(ROOT / "server", app / "server")
    shutil.copytree(
        ROOT / "fedciuic", app / "fedciuic", ignore=shutil.ignore_patterns("__pycache__")
    )
    for module in MARKED:
        with open(app / module, "a", encoding="utf-8") as handle:
            handle.write(MARKER.replace("{MARKERS}", str(markers)))
    (app / "clients" / "app.py").write_text(_fill(ALTERED_CLIENT, markers, targets))
    pyproject = (ROOT / "pyproject.toml").read_text()
    shipped = 'fab-include = ["clients/**/*.py", "server/**/*.py"]'
    assert shipped in pyproject
    (app / "pyproject.toml").write_text(
        pyproject.replace(shipped, shipped.replace('["', '["fedciuic/**/*.py", "'))
    )
    return app


def _foreign_app(folder: Path, markers: Path, targets: list[str]) -> Path:
    app = folder / "foreign-app"
    (app / "foreign").mkdir(parents=True)
    (app / "foreign" / "__init__.py").write_text("")
    (app / "foreign" / "client.py").write_text(_fill(FOREIGN_CLIENT, markers, targets))
    (app / "foreign" / "server.py").write_text(_fill(FOREIGN_SERVER, markers, targets))
    (app / "pyproject.toml").write_text(textwrap.dedent(FOREIGN_PYPROJECT).lstrip())
    return app


@contextlib.contextmanager
def _relay_user() -> Iterator[str]:
    """The relay's user name (made by the deployment's own scripts), removed afterwards
    if this test made it; "" without root."""
    if not AS_ROOT:
        yield ""
        return
    existed = True
    try:
        pwd.getpwnam(RELAY)
    except KeyError:
        existed = False
    try:
        yield RELAY
    finally:
        if not existed:
            subprocess.run(["userdel", RELAY], capture_output=True, check=False)


@dataclass
class Outcome:
    deployment: Deployment
    markers: Path
    runs: dict[str, dict[str, Any]]
    relay_user: str
    relay_uid: int | None  # read while the user exists (the build removes one it made)


def _metrics(runs: Path, run_id: int) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((runs / f"run-{run_id}" / "metrics.json").read_text())
    return data


@pytest.fixture(scope="module")
def outcome() -> Outcome:
    return built_once("trust-boundary", _deploy)


def _deploy(top: Path) -> Outcome:
    """The three apps run on one deployment in ``top`` (a folder others may pass
    through: the relay's user reaches its home and the agent's socket there, and
    nothing else)."""
    pace.calibrate()  # before any test's own: this fixture's waits come first
    markers = top / "markers"
    markers.mkdir()
    markers.chmod(0o1777)  # the relay writes what it could do here
    with contextlib.ExitStack() as stack:
        user = stack.enter_context(_relay_user())
        if user:
            stack.enter_context(passable_to_others(interpreter_paths()))
        d = init_deployment(
            top / "federation",
            ",".join(REGIONS),
            app_dir=ROOT,
            policies_dir=record_level_policies(top / "policies"),
            port=free_port(),
            supernode_port_base=free_port(),
            tls=False,
            demo_data=True,
            relay_user=user,
        )
        targets = _targets(d)
        altered = _altered_app(top, markers, targets)
        foreign = _foreign_app(top, markers, targets)
        with open(d.aggregator / "run-config.toml", "rb") as handle:
            base = tomllib.load(handle)
        runs: dict[str, dict[str, Any]] = {}
        with LocalFederation(d.aggregator, ROOT) as federation:
            federation.start_script("superlink", d.aggregator / "start-superlink.sh")
            deadline = time.monotonic() + patient(60)
            while not healthy(f"http://{d.superlink}/health"):
                federation.check_alive()
                assert time.monotonic() < deadline, "the SuperLink did not come up"
                time.sleep(0.3)
            for region in REGIONS:
                federation.start_script(
                    f"region-{region}", d.region_dir(region) / "start-supernode.sh"
                )
            for name, app in (("altered", altered), ("foreign", foreign), ("honest", ROOT)):
                config = {**base, **RUN} if name != "foreign" else {}
                run_id, _ = federation.run_app(config, app=app, timeout=patient(900))
                runs[name] = {"id": run_id}
                if name != "foreign":
                    runs[name] |= _metrics(Path(base["output-dir"]), run_id)
            left = federation.stop()
        assert not left and not processes_under(top), "processes survived the deployment"
        uid = pwd.getpwnam(user).pw_uid if user else None
        return Outcome(d, markers, runs, user, uid)


def _relay_records(markers: Path, prefix: str) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(markers.glob(f"{prefix}-*.json"))]


def test_the_altered_app_still_trains_under_each_regions_own_policy_and_ledger(outcome):
    data = outcome.runs["altered"]
    assert data["run"]["status"] == "completed"
    for region in REGIONS:
        entry = data["rounds"]["1"]["train"][region]
        assert entry["status"] == "trained", entry
        # The update was made by the region's own install, not the shipped copy.
        assert entry["agent_code"] == installed_code()
        here = outcome.deployment.region_dir(region)
        (policy_file,) = here.glob("*.yaml")
        decisions = [
            r["details"]
            for r in load_records(here / "state" / REGION_LOG)
            if r["event"] == Event.POLICY_DECISION and r["run_id"] == outcome.runs["altered"]["id"]
        ]
        assert decisions and all(
            d["policy_hash"] == load_policy(policy_file).hash for d in decisions
        )
        ledger = PrivacyLedger.load(here / "state" / LEDGER_FILE)
        runs = [r.run_id for r in ledger.rounds if r.purpose == TRAINING]
        assert runs.count(outcome.runs["altered"]["id"]) == 1  # one release, once
        assert runs.count(outcome.runs["honest"]["id"]) == 1


def test_no_module_of_the_shipped_fedciuic_ran_in_a_region_process(outcome):
    markers = [p for p in outcome.markers.iterdir() if not p.name.endswith(".json")]
    argvs = {p.name: p.read_text().split("\x00") for p in markers}
    # The markers work: the aggregator's own processes ran the copy it shipped.
    assert any("flwr-serverapp" in " ".join(argv) for argv in argvs.values()), argvs
    for name, argv in argvs.items():
        line = " ".join(argv)
        assert " agent " not in f" {line} " and "fedciuic.cluster.worker" not in line, (name, line)


def test_the_relay_and_the_foreign_app_get_nothing_from_the_agent_and_each_refusal_is_audited(
    outcome,
):
    relayed = _relay_records(outcome.markers, "relay")
    assert relayed, "the altered ClientApp left no record"
    for record in relayed:
        assert "acts only on what the aggregator signs" in record["sign"], record
        assert "replayed" in record["replay"], record
    foreign = _relay_records(outcome.markers, "foreign")
    assert len(foreign) == len(REGIONS), foreign
    for record in foreign:
        assert "malformed instruction" in record["agent"], record
    for region in REGIONS:
        records = load_records(outcome.deployment.region_dir(region) / "state" / REGION_LOG)
        refused = [r["details"]["reason"] for r in records if r["event"] == Event.REQUEST_REFUSED]
        assert any("'sign'" in reason for reason in refused)
        assert any("replayed" in reason for reason in refused)
        assert any("malformed instruction" in reason for reason in refused)


def test_every_audit_log_verifies_and_the_honest_app_completes(outcome):
    assert outcome.runs["honest"]["run"]["status"] == "completed"
    d = outcome.deployment
    keys = d.aggregator / "keys"
    logs = [("aggregator", d.aggregator / "audit" / AGGREGATOR_LOG)]
    logs += [(r, d.region_dir(r) / "state" / REGION_LOG) for r in REGIONS]
    for party, log in logs:
        verdict = verify(log, load_bundle(keys / f"{party}.pub.json"))
        assert verdict.ok, verdict.explain()


@pytest.mark.skipif(not AS_ROOT, reason=NO_ROOT)
def test_the_relay_runs_as_its_own_user_and_reads_no_region_file(outcome):
    records = _relay_records(outcome.markers, "relay") + _relay_records(outcome.markers, "foreign")
    assert records
    for record in records:
        assert record["uid"] == outcome.relay_uid
        opened = {path: how for path, how in record["files"].items() if how == "read"}
        assert not opened, opened
    for region in REGIONS:
        started = [
            r["details"]
            for r in load_records(outcome.deployment.region_dir(region) / "state" / REGION_LOG)
            if r["event"] == Event.AGENT_STARTED
        ]
        assert started and all(s["relay_user"] == outcome.relay_user for s in started)


def test_a_deployment_without_root_says_the_relay_shares_the_regions_user(outcome):
    if AS_ROOT:
        assert outcome.relay_user == RELAY
        return
    text = (outcome.deployment.region_dir(REGIONS[0]) / "agent.toml").read_text()
    assert 'relay-user = ""' in text
