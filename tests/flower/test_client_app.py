"""The ClientApp's handlers called directly with a real Context and Message: what the
Context and Message give the round, and how its outcome is packed (the round's own
behaviour is tested without Flower in tests/rounds/test_region_round.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict

from clients import app as client_app
from fedciuic.audit.log import load_records, verify
from fedciuic.cluster import service
from fedciuic.compression import get_codec
from fedciuic.crypto.keys import load_bundle
from fedciuic.crypto.sealing import aggregator_keys, generate_federation_keys, sign_global
from fedciuic.flower import protocol
from fedciuic.model.adapter import AdapterModel, ModelSpec
from fedciuic.policy.rules import load_policy
from fedciuic.rounds.wire import KEY_ID, WITNESSED, RunEndNotice, Witness
from tests.conftest import app_config, lab_policies

pytestmark = pytest.mark.usefixtures("task_identity")


@pytest.fixture(scope="module")
def model() -> AdapterModel:
    return AdapterModel(ModelSpec())


POLICIES = Path()  # the lab copies of the shipped policies, one per region


@pytest.fixture(autouse=True, scope="module")
def _lab_policies(tmp_path_factory) -> None:
    global POLICIES
    POLICIES = lab_policies(tmp_path_factory.mktemp("policies"))


def call(
    handler,
    node_config,
    run_overrides,
    model,
    kind=MessageType.TRAIN,
    signer=None,
    witness=None,
    sent_witness=None,
    config=None,
):
    """Call a ClientApp handler as Flower would; unsealed unless the test seals, under
    the lab copy of its jurisdiction's policy unless the test names another."""
    run_config = {**app_config(), "local-steps": 2, "seal": False, **run_overrides}
    if "region" in node_config:
        node_config = {"policy": str(POLICIES / f"{node_config['region']}.yaml"), **node_config}
    context = Context(
        run_id=7, node_id=2, node_config=node_config, state=RecordDict(), run_config=run_config
    )
    adapter = model.adapter_state()
    signature, signer_id = b"", ""
    if signer is not None:
        signature = sign_global(signer, 7, 1, adapter, witness)
        signer_id = signer.bundle.key_id.hex()
    content = protocol.instruction(
        protocol.pack_arrays(adapter),
        server_round=1,
        base_fingerprint=model.base_fingerprint,
        config=ConfigRecord(),
        signature=signature,
        signer=signer_id,
        witness=sent_witness or witness,
    )
    content.config_records[protocol.CONFIG].update(config or {})
    reply = handler(Message(content, dst_node_id=2, message_type=kind), context)
    return protocol.read_reply(reply)


def test_region_trains_on_its_own_data_and_returns_a_delta(model, demo_root, tmp_path):
    node = {"region": "cn", "data-path": str(demo_root / "cn"), "state-path": str(tmp_path)}
    got = call(client_app.train, node, {}, model)
    assert got.status == "trained" and got.region == "cn"
    assert got.arrays is not None and set(got.arrays) == {"update"}
    n = sum(v.size for v in model.adapter_state().values())
    codec = get_codec(app_config()["codec"])
    delta = codec.decode(got.arrays["update"].tobytes(), n).dense(n)
    assert np.abs(delta).sum() > 0
    assert got.metrics["num-examples"] > 0
    assert 0 < got.metrics["epsilon"] <= got.metrics["epsilon-budget"]
    assert (tmp_path / "privacy-ledger.jsonl").exists()


def test_corrupted_ledger_declines_naming_the_file(model, demo_root, tmp_path):
    (tmp_path / "privacy-ledger.jsonl").write_text('{"kind": "header"}\n')
    node = {"region": "cn", "data-path": str(demo_root / "cn"), "state-path": str(tmp_path)}
    got = call(client_app.train, node, {}, model)
    assert got.status == "declined" and got.arrays is None
    assert "privacy-ledger.jsonl:1: corrupted ledger record" in got.reason
    # A decline, too, carries the head of the checkpoint that logged it.
    last = load_records(tmp_path / "audit.jsonl")[-1]
    assert got.witness == Witness(last["details"]["count"], last["details"]["head"])


def test_unknown_region_declines_with_a_reason_and_sends_nothing(model, demo_root):
    got = call(client_app.train, {"region": "sg", "data-path": str(demo_root)}, {}, model)
    assert got.status == "declined" and got.arrays is None
    assert got.region == "sg"
    assert "node config:region: 'sg' is not a region of this run" in got.reason


def test_without_its_trainer_service_a_region_declines_naming_the_socket(
    model, demo_root, tmp_path, monkeypatch
):
    monkeypatch.setattr(service, "CONNECT_TIMEOUT", 0.2)
    node = {
        "region": "cn",
        "data-path": str(demo_root / "cn"),
        "state-path": str(tmp_path),
        "trainer": "service",
    }
    got = call(client_app.train, node, {}, model)
    assert got.status == "declined" and got.arrays is None and got.region == "cn"
    assert f"no trainer answers at {tmp_path / 'trainer' / 'trainer.sock'}" in got.reason
    assert f"start `fedciuic trainer --state-path {tmp_path}`" in got.reason
    assert not (tmp_path / "audit.jsonl").exists()  # nothing trained here, nothing logged


@pytest.fixture(scope="module")
def keys_dir(tmp_path_factory) -> Path:
    return generate_federation_keys(tmp_path_factory.mktemp("keys"), ("eu", "cn", "us"))


def sealed_train(model, node, keys_dir):
    """A sealed round as the aggregator would start it; the reply and the aggregator's keys."""
    aggregator = aggregator_keys(str(keys_dir), 2**28)
    run = {"seal": True, "keys-dir": str(keys_dir)}
    return call(client_app.train, node, run, model, signer=aggregator.keypair), aggregator


def test_sealed_update_opens_only_at_the_aggregator(model, demo_root, tmp_path, keys_dir):
    node = {"region": "cn", "data-path": str(demo_root / "cn"), "state-path": str(tmp_path)}
    got, aggregator = sealed_train(model, node, keys_dir)
    assert got.status == "sealed" and got.arrays is None and got.envelope
    opened = aggregator.open_update(got.envelope, run_id=7, server_round=1)
    assert opened.sender.party == "cn" and opened.info["region"] == "cn"
    assert set(opened.arrays) == {"update"} and opened.metrics["num-examples"] > 0
    # The header names the policy the region applied; the payload says so too.
    cn_policy = load_policy(POLICIES / "cn.yaml")
    assert opened.policy_hash == cn_policy.hash == opened.info["policy-hash"]
    assert opened.info["jurisdiction"] == "CN" and opened.suite == "xwing-aes256gcm"


# -- what the Context says: a simulated node ------------------------------------------


def simulated_root(demo_root: Path, folder: Path) -> Path:
    """A data-root of our own: simulated regions keep their state inside it."""
    shutil.copytree(demo_root / "cn", folder / "cn")
    return folder


def test_a_simulated_region_takes_its_jurisdictions_policy_from_policies_dir(
    model, demo_root, tmp_path
):
    root = simulated_root(demo_root, tmp_path / "a")
    run = {"data-root": str(root), "policies-dir": str(POLICIES)}
    got = call(client_app.train, {"partition-id": 1}, run, model)
    assert got.status == "trained" and got.region == "cn"
    assert got.info["jurisdiction"] == "CN"
    assert got.info["policy-hash"] == load_policy(POLICIES / "cn.yaml").hash
    missing = call(client_app.train, {"partition-id": 1}, {**run, "policies-dir": ""}, model)
    assert missing.status == "declined" and "run config:policies-dir: empty" in missing.reason
    lab_root = simulated_root(demo_root, tmp_path / "b")
    lab_run = {"data-root": str(lab_root), "enforce-policies": False}
    lab = call(client_app.train, {"partition-id": 1}, lab_run, model)
    assert lab.status == "trained" and lab.info["policy-hash"] == ""


# -- witnessing and signed replies --------------------------------------------------------

HEAD = "cd" * 32


def sealed_eval(model, node, keys_dir, **kwargs):
    aggregator = aggregator_keys(str(keys_dir), 2**28)
    run = {"seal": True, "keys-dir": str(keys_dir)}
    got = call(
        client_app.evaluate, node, run, model, MessageType.EVALUATE, aggregator.keypair, **kwargs
    )
    return got, aggregator


def test_the_region_records_the_aggregators_signed_head_and_signs_its_reply(
    model, demo_root, tmp_path, keys_dir
):
    node = {"region": "cn", "data-path": str(demo_root / "cn"), "state-path": str(tmp_path)}
    got, aggregator = sealed_eval(model, node, keys_dir, witness=(5, HEAD))
    assert got.status == "evaluated"
    sender = aggregator.reply_sender(
        got.info[KEY_ID], got.signature, run_id=7, server_round=1, fields=got.signed
    )
    assert sender.party == "cn"
    records = load_records(tmp_path / "audit.jsonl")
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
    ],
)
def test_a_malformed_instruction_is_declined_naming_the_field(
    model, demo_root, tmp_path, config, field
):
    node = {"region": "cn", "data-path": str(demo_root / "cn"), "state-path": str(tmp_path)}
    got = call(client_app.evaluate, node, {}, model, MessageType.EVALUATE, config=config)
    assert got.status == "declined" and "malformed instruction" in got.reason
    assert field in got.reason


def test_the_run_end_notice_is_witnessed_signed_and_answered(model, demo_root, tmp_path, keys_dir):
    from fedciuic.crypto.sealing import sign_run_end

    node: dict[str, bool | float | int | str] = {
        "region": "eu",
        "data-path": str(demo_root / "eu"),
        "state-path": str(tmp_path),
        "policy": str(POLICIES / "eu.yaml"),
    }
    aggregator = aggregator_keys(str(keys_dir), 2**28)
    notice = RunEndNotice(
        7,
        (9, HEAD),
        sign_run_end(aggregator.keypair, 7, (9, HEAD)),
        aggregator.keypair.bundle.key_id.hex(),
    )
    run_config = {**app_config(), "seal": True, "keys-dir": str(keys_dir)}
    context = Context(
        run_id=7, node_id=2, node_config=node, state=RecordDict(), run_config=run_config
    )
    message = Message(protocol.run_end_notice(notice), dst_node_id=2, message_type="query")
    got = protocol.read_reply(client_app.query(message, context))
    assert got.status == WITNESSED
    sender = aggregator.reply_sender(
        got.info[KEY_ID], got.signature, run_id=7, server_round=0, fields=got.signed
    )
    assert sender.party == "eu"
    records = load_records(tmp_path / "audit.jsonl")
    assert records[-2]["event"] == "witness" and records[-2]["details"]["count"] == 9
    assert records[-1]["event"] == "checkpoint"  # the witness is signed, not a dangling tail
    assert verify(tmp_path / "audit.jsonl", load_bundle(keys_dir / "eu.pub.json")).ok
    forged = RunEndNotice(7, (10, HEAD), notice.signature, notice.signer)
    message = Message(protocol.run_end_notice(forged), dst_node_id=2, message_type="query")
    refused = protocol.read_reply(client_app.query(message, context))
    assert refused.status == "declined" and "not signed by the aggregator" in refused.reason
