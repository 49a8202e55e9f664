"""The ClientApp's handlers called directly with a real Context and Message.

Simulated (Flower gave the node a ``partition-id``, lab mode), the app runs the region's
round in its own process: what the Context and the Message give the round, and how its
outcome is packed (the round's own behaviour is tested without Flower in
tests/region/test_round.py). Deployed, the app is only a relay to the region's
agent: it holds no data, state or keys, and says so (tests/agent has the agent's side).
"""

from __future__ import annotations

import secrets
import shutil
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import Context, Message, MessageType, RecordDict

from clients import app as client_app
from fedciuic import __version__
from fedciuic.agent import channel
from fedciuic.audit.log import load_records, verify
from fedciuic.compression import get_codec
from fedciuic.config import EVALUATION, ModelSpec, RunConfig
from fedciuic.crypto.keys import Keypair, load_bundle
from fedciuic.crypto.parties import (
    NONCE_BYTES,
    AggregatorKeys,
    TaskKind,
    aggregator_keys,
    generate_federation_keys,
    sign_global,
)
from fedciuic.digests import installed_code
from fedciuic.flower import protocol, relay
from fedciuic.model.adapter import AdapterModel
from fedciuic.policy.rules import load_policy
from fedciuic.privacy.ledger import LEDGER_FILE, PrivacyLedger
from fedciuic.region import region_name
from fedciuic.wire import (
    AGENT_CODE,
    AGENT_VERSION,
    CONFIG,
    FAILED,
    KEY_ID,
    TASK,
    WITNESSED,
    Instruction,
    Reply,
    RunEndNotice,
    Witness,
)
from tests.conftest import lab_policies, signed_run_end, unit_config

pytestmark = pytest.mark.usefixtures("task_identity")

RUN_ID = 7
HEAD = "cd" * 32
#: Simulated nodes as Flower's simulation engine configures them: regions[i] is partition i.
EU, CN = ({"partition-id": i, "num-partitions": 3} for i in (0, 1))


@pytest.fixture(scope="module")
def model() -> AdapterModel:
    return AdapterModel(ModelSpec())


POLICIES = Path()  # the lab copies of the shipped policies, one per region


@pytest.fixture(autouse=True, scope="module")
def _lab_policies(tmp_path_factory) -> None:
    global POLICIES
    POLICIES = lab_policies(tmp_path_factory.mktemp("policies"))


@pytest.fixture(scope="module")
def keys_dir(tmp_path_factory) -> Path:
    return generate_federation_keys(tmp_path_factory.mktemp("keys"), ("eu", "cn", "us"))


@pytest.fixture
def data_root(demo_root: Path, tmp_path: Path) -> Path:
    """A data-root of this test's own: simulated regions keep their state inside it
    (data-root/REGION/.fedciuic)."""
    root = tmp_path / "data"
    for region in ("eu", "cn"):
        shutil.copytree(demo_root / region, root / region)
    # their dictionaries of names, where a simulation looks (the policies require names)
    shutil.copytree(demo_root / "deid-dictionaries", root / "deid-dictionaries")
    return root


def state_of(data_root: Path, region: str) -> Path:
    return data_root / region / ".fedciuic"


def settings(data_root: Path | None, **overrides: Any) -> dict[str, Any]:
    """The run config, as Flower's Context gives it and the aggregator signs it:
    unsealed unless the test seals, under the lab copies of the policies."""
    values = {**unit_config(), "local-steps": 2, "seal": False, "policies-dir": str(POLICIES)}
    if data_root is not None:
        values["data-root"] = str(data_root)
    return {**values, **overrides}


def context(node_config: dict[str, Any], run_config: dict[str, Any]) -> Context:
    return Context(
        run_id=RUN_ID, node_id=2, node_config=node_config, state=RecordDict(), run_config=run_config
    )


Handler = Callable[[Message, Context], Message]


def send(
    handler: Handler,
    node_config: dict[str, Any],
    run_config: dict[str, Any],
    model: AdapterModel,
    kind: str = MessageType.TRAIN,
    *,
    task_kind: TaskKind | None = None,
    signer: Keypair | None = None,
    witness: tuple[int, str] | None = None,
    sent_witness: tuple[int, str] | None = None,
    config: dict[str, Any] | None = None,
    recipient: str | None = None,
) -> Message:
    """Call a ClientApp handler as Flower would, with the instruction the aggregator
    sends: the kind of task Flower's message type names (unless ``task_kind``), the run
    config signed into it, signed by ``signer`` (with ``witness``; ``sent_witness``: the
    head sent instead, when not the one signed) for the node's region (or
    ``recipient``); ``config``: fields sent instead."""
    run = RunConfig.from_user_config(run_config, source="run config")
    adapter = model.adapter_state()
    task = Instruction(
        adapter=adapter,
        server_round=1,
        base_fingerprint=model.base_fingerprint,
        kind=task_kind or relay.MESSAGE_KINDS[kind],
        run_config=run.canonical_json(),
        nonce=secrets.token_bytes(NONCE_BYTES),
        witness=sent_witness or witness,
        recipient=recipient or region_name(run_config, node_config),
    )
    if signer is not None:
        signature = sign_global(signer, RUN_ID, 1, adapter, task.terms, witness)
        task = replace(task, signature=signature, signer=signer.bundle.key_id.hex())
    content = protocol.instruction(protocol.pack_arrays(adapter), task)
    content.config_records[CONFIG].update(config or {})
    message = Message(content, dst_node_id=2, message_type=kind)
    return handler(message, context(node_config, run_config))


def call(
    handler: Handler,
    node_config: dict[str, Any],
    run_config: dict[str, Any],
    model: AdapterModel,
    kind: str = MessageType.TRAIN,
    **kwargs: Any,
) -> Reply:
    """The region's reply as the aggregator reads it."""
    return protocol.read_reply(send(handler, node_config, run_config, model, kind, **kwargs))


# -- a simulated region: its round in the ClientApp's process ----------------------------


def test_region_trains_on_its_own_data_and_returns_a_delta(model, data_root):
    got = call(client_app.train, CN, settings(data_root), model)
    assert got.status == "trained" and got.region == "cn"
    assert got.arrays is not None and set(got.arrays) == {"update"}
    n = sum(v.size for v in model.adapter_state().values())
    codec = get_codec(unit_config()["codec"])
    delta = codec.decode(got.arrays["update"].tobytes(), n).dense(n)
    assert np.abs(delta).sum() > 0
    assert got.metrics["num-examples"] > 0 and got.metrics["steps"] == 2
    assert 0 < got.metrics["epsilon"] <= got.metrics["epsilon-budget"]
    assert (state_of(data_root, "cn") / LEDGER_FILE).exists()
    # Which code made the reply.
    assert got.info[AGENT_VERSION] == __version__ and got.info[AGENT_CODE] == installed_code()


def test_a_region_without_its_dictionary_declines_under_its_policy_and_the_others_train(
    model, data_root, tmp_path
):
    """The CN and EU policies require names: a simulated region without its REGION.txt in
    deid-dictionaries (and no NER model) declines before it trains, in one line naming the
    policy field and both agent keys; a region with its dictionary trains."""
    names = tmp_path / "names"
    names.mkdir()
    shutil.copy(data_root / "deid-dictionaries" / "eu.txt", names / "eu.txt")
    run = settings(data_root, **{"deid-dictionaries": str(names), "privacy-unit": "user"})
    cn = call(client_app.train, CN, run, model)
    assert cn.status == "declined" and cn.arrays is None
    assert cn.reason.endswith(
        ": names are required (deidentification.entities: names) but this region has "
        "neither a name dictionary nor a NER model: set deid-dictionary or deid-ner-model "
        "in its agent config"
    ), cn.reason
    assert not (state_of(data_root, "cn") / LEDGER_FILE).exists()  # nothing trained
    eu = call(client_app.train, EU, run, model)
    assert eu.status == "trained", eu.reason
    assert eu.info["deid-entities"].split(",")[-2:] == ["DICTIONARY", "CONTEXT_NAME"]


def test_the_region_evaluates_the_global_adapter(model, data_root):
    got = call(client_app.evaluate, CN, settings(data_root), model, MessageType.EVALUATE)
    assert got.status == "evaluated" and got.region == "cn" and got.arrays is None
    assert got.metrics["num-examples"] > 0 and got.metrics["eval-loss"] > 0
    assert got.metrics["perplexity"] == pytest.approx(np.exp(got.metrics["eval-loss"]))
    # a DP evaluation (eval-noise): one release of its own, charged to the ledger
    (line,) = PrivacyLedger.load(state_of(data_root, "cn") / LEDGER_FILE).rounds
    assert line.purpose == EVALUATION


def test_corrupted_ledger_declines_naming_the_file(model, data_root):
    state = state_of(data_root, "cn")
    state.mkdir(parents=True)
    (state / LEDGER_FILE).write_text('{"kind": "header"}\n')
    got = call(client_app.train, CN, settings(data_root), model)
    assert got.status == "declined" and got.arrays is None
    assert "privacy-ledger.jsonl:1: corrupted ledger record" in got.reason
    # A decline, too, carries the head of the checkpoint that logged it.
    last = load_records(state / "audit.jsonl")[-1]
    assert got.witness == Witness(last["details"]["count"], last["details"]["head"])


def test_a_partition_without_a_region_declines_with_a_reason_and_sends_nothing(model, data_root):
    node = {"partition-id": 5, "num-partitions": 6}
    got = call(client_app.train, node, settings(data_root), model)
    assert got.status == "declined" and got.arrays is None
    assert got.region == "partition-5"
    assert "node config:partition-id: 5 has no region" in got.reason


def test_a_training_message_carrying_an_evaluation_is_declined(model, data_root):
    got = call(client_app.train, CN, settings(data_root), model, task_kind=TaskKind.EVALUATE)
    assert got.status == "declined" and got.arrays is None
    assert "train message carries" in got.reason
    assert not (state_of(data_root, "cn") / LEDGER_FILE).exists()  # nothing trained


def test_a_simulated_region_takes_its_jurisdictions_policy_from_policies_dir(
    model, demo_root: Path, tmp_path: Path
):
    def root(name: str) -> Path:
        folder = tmp_path / name
        shutil.copytree(demo_root / "cn", folder / "cn")
        shutil.copytree(demo_root / "deid-dictionaries", folder / "deid-dictionaries")
        return folder

    run = settings(root("a"))
    got = call(client_app.train, CN, run, model)
    assert got.status == "trained" and got.region == "cn"
    assert got.info["jurisdiction"] == "CN"
    assert got.info["policy-hash"] == load_policy(POLICIES / "cn.yaml").hash
    missing = call(client_app.train, CN, {**run, "policies-dir": ""}, model)
    assert missing.status == "declined" and "run config:policies-dir: empty" in missing.reason
    lab = call(client_app.train, CN, settings(root("b"), **{"enforce-policies": False}), model)
    assert lab.status == "trained" and lab.info["policy-hash"] == ""


# -- sealing, witnessing and signed replies -----------------------------------------------


def sealed(data_root: Path, keys_dir: Path) -> tuple[dict[str, Any], AggregatorKeys]:
    """A sealed run's config and the aggregator's keys (simulated regions take theirs
    from the run's keys-dir)."""
    run = settings(data_root, seal=True, **{"keys-dir": str(keys_dir)})
    return run, aggregator_keys(str(keys_dir), 2**28)


def test_sealed_update_opens_only_at_the_aggregator(model, data_root, keys_dir):
    run, aggregator = sealed(data_root, keys_dir)
    got = call(client_app.train, CN, run, model, signer=aggregator.keypair)
    assert got.status == "sealed" and got.arrays is None and got.envelope
    assert got.info[KEY_ID] == load_bundle(keys_dir / "cn.pub.json").key_id.hex()
    opened = aggregator.open_update(got.envelope, run_id=RUN_ID, server_round=1)
    info, metrics = opened.info, opened.metrics  # untrusted until parsed: plain dicts here
    assert isinstance(info, dict) and isinstance(metrics, dict)
    assert opened.sender.party == "cn" and info["region"] == "cn"
    assert set(opened.arrays) == {"update"} and metrics["num-examples"] > 0
    # The header names the policy the region applied; the payload says so too.
    cn_policy = load_policy(POLICIES / "cn.yaml")
    assert opened.policy_hash == cn_policy.hash == info["policy-hash"]
    assert info["jurisdiction"] == "CN" and opened.suite == "xwing-aes256gcm"


def test_an_instruction_the_aggregator_did_not_sign_is_declined(model, data_root, keys_dir):
    run, _ = sealed(data_root, keys_dir)
    impostor = Keypair.generate("aggregator", "EU")
    got = call(client_app.train, CN, run, model, signer=impostor)
    assert got.status == "declined" and "is not signed by the aggregator key" in got.reason
    assert not (state_of(data_root, "cn") / LEDGER_FILE).exists()  # nothing trained


def test_the_region_records_the_aggregators_signed_head_and_signs_its_reply(
    model, data_root, keys_dir
):
    run, aggregator = sealed(data_root, keys_dir)
    got = call(
        client_app.evaluate,
        CN,
        run,
        model,
        MessageType.EVALUATE,
        signer=aggregator.keypair,
        witness=(5, HEAD),
    )
    assert got.status == "evaluated"
    sender = aggregator.reply_sender(
        got.info[KEY_ID], got.signature, run_id=RUN_ID, server_round=1, fields=got.signed
    )
    assert sender.party == "cn"
    signed_info = got.signed["info"]
    assert isinstance(signed_info, dict)
    assert signed_info[AGENT_VERSION] == __version__  # the code is signed for too
    records = load_records(state_of(data_root, "cn") / "audit.jsonl")
    witnessed = [r["details"] for r in records if r["event"] == "witness"]
    assert witnessed == [{"party": "aggregator", "count": 5, "head": HEAD}]
    last = records[-1]
    assert last["event"] == "checkpoint"
    assert got.witness == Witness(last["details"]["count"], last["details"]["head"])


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"server-round": "1"}, "server-round"),
        ({"server-round": True}, "server-round"),
        ({"federation-run": 1.5}, "federation-run"),
        ({"audit-count": 3}, "audit-head"),
        ({"model-signature": "abc"}, "model-signature"),
        ({"task": "teach"}, "task"),
        ({"task": "run-end"}, "task"),
        ({"nonce": b"\x01" * 3}, "nonce"),
        ({"run-config": "[1]"}, "run-config"),
        ({"resumed-from-checkpoint": "ab"}, "resumed-from-checkpoint"),
        ({"resumed-from-checkpoint": 7}, "resumed-from-checkpoint"),
    ],
)
def test_a_malformed_instruction_is_declined_naming_the_field(model, data_root, config, field):
    got = call(
        client_app.evaluate, CN, settings(data_root), model, MessageType.EVALUATE, config=config
    )
    assert got.status == "declined" and got.region == "cn"
    assert "malformed instruction" in got.reason and field in got.reason


def run_end(keypair: Keypair, run_config: dict[str, Any], witness: tuple[int, str]) -> RunEndNotice:
    """The aggregator's run-end notice, signed."""
    notice: RunEndNotice = signed_run_end(keypair, RUN_ID, run_config, witness, recipient="eu")
    return notice


def test_the_run_end_notice_is_witnessed_signed_and_answered(model, data_root, keys_dir):
    run, aggregator = sealed(data_root, keys_dir)
    notice = run_end(aggregator.keypair, run, (9, HEAD))
    ctx = context(EU, run)

    def query(sent: RunEndNotice) -> Reply:
        message = Message(protocol.run_end_notice(sent), dst_node_id=2, message_type="query")
        return protocol.read_reply(client_app.query(message, ctx))

    got = query(notice)
    assert got.status == WITNESSED and got.region == "eu"
    sender = aggregator.reply_sender(
        got.info[KEY_ID], got.signature, run_id=RUN_ID, server_round=0, fields=got.signed
    )
    assert sender.party == "eu"
    log = state_of(data_root, "eu") / "audit.jsonl"
    records = load_records(log)
    assert records[-2]["event"] == "witness" and records[-2]["details"]["count"] == 9
    assert records[-1]["event"] == "checkpoint"  # the witness is signed, not a dangling tail
    assert verify(log, load_bundle(keys_dir / "eu.pub.json")).ok
    forged = query(replace(notice, witness=(10, HEAD)))
    assert forged.status == "declined" and "not signed by the aggregator" in forged.reason
    content = protocol.run_end_notice(notice)
    content.config_records[CONFIG][TASK] = str(TaskKind.TRAIN)  # the task it is not
    message = Message(content, dst_node_id=2, message_type="query")
    other = protocol.read_reply(client_app.query(message, ctx))
    assert other.status == "declined" and "malformed run-end notice" in other.reason


# -- a deployed region: the ClientApp only relays ------------------------------------------


@pytest.mark.parametrize(
    ("handler", "kind"),
    [
        (client_app.train, MessageType.TRAIN),
        (client_app.evaluate, MessageType.EVALUATE),
    ],
)
@pytest.mark.parametrize(
    "node",
    [
        {"region": "cn", "data-path": "DATA", "key-file": "KEY"},
        {"partition-id": 1, "region": "cn", "data-path": "DATA", "key-file": "KEY"},
    ],
    ids=["deployed", "partition-and-region"],
)
def test_a_deployed_clientapp_holds_no_data_state_or_keys(model, tmp_path, handler, kind, node):
    """A node config that hands the ClientApp (code the aggregator ships) the region's
    data or keys is refused, with a Flower error the aggregator records as failed."""
    paths = {"DATA": str(tmp_path / "cn"), "KEY": str(tmp_path / "cn.key.json")}
    node = {k: paths.get(v, v) if isinstance(v, str) else v for k, v in node.items()}
    reply = send(handler, node, settings(None), model, kind)
    assert reply.has_error() and reply.error.code == relay.UNDELIVERED
    reason = reply.error.reason or ""
    assert reason.startswith("relay: node config: region, data-path, key-file: ")
    assert "a deployed region's ClientApp holds no data, state or keys" in reason
    assert f"{relay.AGENT}='/path/to/agent.sock'" in reason
    assert not (tmp_path / "cn").exists()  # nothing read or written for the region
    got = protocol.read_reply(reply, node_id=2)
    assert got.status == FAILED and got.reason == reason


def test_a_relay_without_its_agent_answers_with_an_error_naming_the_socket(
    model, tmp_path, monkeypatch, keys_dir
):
    monkeypatch.setattr(relay, "ask", partial(channel.ask, connect_timeout=0.2))
    socket_path = tmp_path / "agent" / "agent.sock"
    node = {relay.AGENT: str(socket_path)}
    reply = send(client_app.train, node, settings(None), model)
    assert reply.has_error() and reply.error.code == relay.UNDELIVERED
    reason = reply.error.reason or ""
    assert reason.startswith(f"relay: no agent answers on {socket_path}")
    assert "fedciuic agent --config agent.toml" in reason
    aggregator = aggregator_keys(str(keys_dir), 2**28)
    notice = run_end(aggregator.keypair, settings(None), (9, HEAD))
    message = Message(protocol.run_end_notice(notice), dst_node_id=2, message_type="query")
    answer = client_app.query(message, context(node, settings(None)))
    assert answer.has_error() and str(socket_path) in (answer.error.reason or "")
    assert not (tmp_path / "agent").exists()  # the relay makes nothing of its own
