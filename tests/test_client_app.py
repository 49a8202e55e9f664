"""The ClientApp's handlers called directly with a real Context and Message."""

from __future__ import annotations

import base64
import hashlib
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict

from clients import app as client_app
from fedciuic.audit.log import load_records, verify
from fedciuic.compression import get_codec
from fedciuic.crypto.keys import Keypair, load_bundle
from fedciuic.crypto.sealing import aggregator_keys, generate_federation_keys, sign_global
from fedciuic.flower import protocol
from fedciuic.model.adapter import AdapterModel, ModelSpec
from fedciuic.policy.rules import load_policy
from tests.conftest import ROOT, app_config, lab_policies, write_policy

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


def test_unknown_region_declines_with_a_reason_and_sends_nothing(model, demo_root):
    got = call(client_app.train, {"region": "sg", "data-path": str(demo_root)}, {}, model)
    assert got.status == "declined" and got.arrays is None
    assert got.region == "sg"
    assert "node config:region: 'sg' is not a region of this run" in got.reason


def test_missing_data_path_declines_naming_the_region_and_path(model, tmp_path):
    node = {"region": "eu", "data-path": str(tmp_path / "missing")}
    got = call(client_app.evaluate, node, {}, model, MessageType.EVALUATE)
    assert got.status == "declined" and got.region == "eu"
    assert f"data-path {tmp_path / 'missing'} does not exist" in got.reason


def test_empty_dataset_declines(model, tmp_path):
    (tmp_path / "eu").mkdir()
    got = call(client_app.train, {"region": "eu", "data-path": str(tmp_path / "eu")}, {}, model)
    assert got.status == "declined" and "holds no .jsonl or .txt files" in got.reason


def test_mismatched_base_model_declines(model, demo_root, tmp_path):
    node = {"region": "eu", "data-path": str(demo_root / "eu"), "state-path": str(tmp_path)}
    got = call(client_app.train, node, {"seed": 5}, model)
    assert got.status == "declined" and "base model fingerprint" in got.reason


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


def test_unsigned_global_adapter_is_refused(model, demo_root, tmp_path, keys_dir):
    node = {"region": "cn", "data-path": str(demo_root / "cn"), "state-path": str(tmp_path)}
    impostor = Keypair.generate("aggregator", "EU")
    got = call(
        client_app.train, node, {"seal": True, "keys-dir": str(keys_dir)}, model, signer=impostor
    )
    assert got.status == "declined" and got.arrays is None and got.envelope is None
    assert "is not signed by the aggregator key" in got.reason
    assert not (tmp_path / "privacy-ledger.jsonl").exists()  # nothing trained


def test_missing_keys_decline_and_nothing_is_sent_unsealed(model, demo_root, tmp_path):
    node = {"region": "cn", "data-path": str(demo_root / "cn"), "state-path": str(tmp_path)}
    got = call(client_app.train, node, {"seal": True, "keys-dir": str(tmp_path / "none")}, model)
    assert got.status == "declined" and got.arrays is None and got.envelope is None
    assert "cn.key.json: no private key here" in got.reason


# -- jurisdiction policies ------------------------------------------------------------


def cn_node(demo_root: Path, state: Path, policy: Path | None = None) -> dict[str, str]:
    node = {"region": "cn", "data-path": str(demo_root / "cn"), "state-path": str(state)}
    if policy is not None:
        node["policy"] = str(policy)
    return node


def test_cn_declines_a_us_aggregator_with_every_reason_and_trains_nothing(
    model, demo_root, tmp_path
):
    node = cn_node(demo_root, tmp_path, ROOT / "policies" / "cn-pipl.yaml")
    run = {"aggregator-jurisdiction": "US", "relay-jurisdiction": "SG"}
    got = call(client_app.train, node, run, model)
    assert got.status == "declined" and got.arrays is None and got.envelope is None
    assert "cn-pipl.yaml" in got.reason
    for rule in (
        "aggregator in US, CN's policy allows CN, EU (transfers.aggregator_jurisdictions)",
        "relay in SG, a third country for CN (transfers.relay_in_third_country)",
        "updates would leave unsealed (sealing.required)",
    ):
        assert rule in got.reason
    assert not (tmp_path / "privacy-ledger.jsonl").exists()  # nothing trained


def test_policy_refusal_also_stops_evaluation(model, demo_root, tmp_path):
    node = cn_node(demo_root, tmp_path, ROOT / "policies" / "cn-pipl.yaml")
    run = {"aggregator-jurisdiction": "US"}
    got = call(client_app.evaluate, node, run, model, MessageType.EVALUATE)
    assert got.status == "declined" and "transfers.aggregator_jurisdictions" in got.reason
    assert "eval-loss" not in got.metrics


def test_a_round_past_the_policys_lifetime_epsilon_is_declined_before_training(
    model, demo_root, tmp_path
):
    policy = write_policy(
        tmp_path / "cn.yaml", "CN", sealing__required=False, privacy__max_lifetime_epsilon=0.5
    )
    got = call(client_app.train, cn_node(demo_root, tmp_path / "state", policy), {}, model)
    assert got.status == "declined"
    assert "would raise the dataset's epsilon to" in got.reason
    assert "over 0.5 (privacy.max_lifetime_epsilon)" in got.reason
    assert "epsilon budget 8 > 0.5 (privacy.max_lifetime_epsilon)" in got.reason
    assert not (tmp_path / "state" / "privacy-ledger.jsonl").exists()


EU_TEXT = (ROOT / "policies" / "eu-gdpr.yaml").read_text()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (EU_TEXT.replace("dp_required: true", "dp_required: [true"), r"YAML syntax error"),
        (
            EU_TEXT.replace("min_regions: 2", "min_regions: two"),
            r"aggregation\.min_regions: Input should be a valid integer",
        ),
        (EU_TEXT.replace("audit:", "audit:\n  shred: true"), r"audit\.shred: Extra inputs"),
        (EU_TEXT.replace("  max_delta: 1.0e-5\n", ""), r"privacy\.max_delta: Field required"),
        (EU_TEXT.replace("jurisdiction: EU", "jurisdiction: XX"), r"jurisdiction: .*unknown"),
        ("", r"the policy file is empty"),
    ],
    ids=["syntax", "type", "unknown-field", "missing-field", "unknown-jurisdiction", "empty"],
)
def test_a_malformed_policy_names_file_line_field_and_the_region_does_not_train(
    model, demo_root, tmp_path, content, message
):
    policy = tmp_path / "eu.yaml"
    policy.write_text(content)
    node = {
        "region": "eu",
        "data-path": str(demo_root / "eu"),
        "state-path": str(tmp_path / "state"),
        "policy": str(policy),
    }
    got = call(client_app.train, node, {}, model)
    assert got.status == "declined" and got.arrays is None
    assert re.search(rf"{re.escape(str(policy))}:\d+: {message}", got.reason), got.reason
    assert not (tmp_path / "state" / "privacy-ledger.jsonl").exists()


def test_a_deployed_region_without_a_policy_sends_nothing_whatever_the_run_config_says(
    model, demo_root, tmp_path
):
    node = {"region": "eu", "data-path": str(demo_root / "eu"), "policy": ""}
    got = call(client_app.train, node, {"enforce-policies": False}, model)
    assert got.status == "declined" and got.arrays is None
    assert "node config:policy: not set" in got.reason


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


def test_a_released_round_is_resent_as_it_was_never_trained_twice(model, demo_root, tmp_path):
    """A restarted aggregator asks again: the same update, no second ledger charge."""
    node = cn_node(demo_root, tmp_path)
    first = call(client_app.train, node, {}, model)
    ledger = (tmp_path / "privacy-ledger.jsonl").read_text()
    again = call(client_app.train, node, {}, model)
    assert again.status == "trained"
    assert again.arrays is not None and first.arrays is not None
    np.testing.assert_array_equal(again.arrays["update"], first.arrays["update"])
    assert again.metrics == first.metrics
    assert (tmp_path / "privacy-ledger.jsonl").read_text() == ledger
    assert "update_resent" in [r["event"] for r in load_records(tmp_path / "audit.jsonl")]
    # Without the kept update, the region sits out rather than release the round again.
    for kept in (tmp_path / "sent").iterdir():
        kept.unlink()
    lost = call(client_app.train, node, {}, model)
    assert lost.status == "declined" and "was already released" in lost.reason
    assert (tmp_path / "privacy-ledger.jsonl").read_text() == ledger


# -- the region's audit log -----------------------------------------------------------


def test_the_region_logs_what_it_sealed_before_it_leaves_and_signs_it(
    model, demo_root, tmp_path, keys_dir
):
    got, aggregator = sealed_train(model, cn_node(demo_root, tmp_path), keys_dir)
    assert got.status == "sealed" and got.envelope is not None
    log = tmp_path / "audit.jsonl"
    assert verify(log, load_bundle(keys_dir / "cn.pub.json")).ok
    records = load_records(log)
    events = [r["event"] for r in records]
    assert events[-4:] == ["policy_decision", "trained", "update_sealed", "checkpoint"]
    sealed = records[-2]["details"]
    assert sealed["digest"] == hashlib.sha256(got.envelope).hexdigest()
    assert sealed["bytes"] == len(got.envelope) and sealed["destination_jurisdiction"] == "EU"
    assert sealed["policy_hash"] == load_policy(POLICIES / "cn.yaml").hash
    assert records[-3]["details"]["epsilon"] == pytest.approx(got_epsilon(aggregator, got))


def got_epsilon(aggregator, got) -> float:
    return float(aggregator.open_update(got.envelope, run_id=7, server_round=1).metrics["epsilon"])


def test_a_decline_is_logged_with_every_reason_and_paths_redacted(model, demo_root, tmp_path):
    node = cn_node(demo_root, tmp_path, ROOT / "policies" / "cn-pipl.yaml")
    (tmp_path / "privacy-ledger.jsonl").write_text('{"kind": "header"}\n')
    got = call(client_app.train, node, {}, model)
    assert got.status == "declined"
    records = load_records(tmp_path / "audit.jsonl")
    declined = [r for r in records if r["event"] == "declined"][-1]
    assert "corrupted ledger record" in declined["details"]["reason"]
    assert str(tmp_path) not in (tmp_path / "audit.jsonl").read_text()
    assert "<state-path>/privacy-ledger.jsonl" in declined["details"]["reason"]
    assert records[-1]["event"] == "checkpoint"


def test_a_policy_refusal_is_logged_as_a_decision(model, demo_root, tmp_path):
    node = cn_node(demo_root, tmp_path, ROOT / "policies" / "cn-pipl.yaml")
    call(client_app.train, node, {"aggregator-jurisdiction": "US"}, model)
    decision = [
        r for r in load_records(tmp_path / "audit.jsonl") if r["event"] == "policy_decision"
    ]
    assert decision[-1]["details"]["outcome"] == "decline"
    assert len(decision[-1]["details"]["reasons"]) == 3  # aggregator, relay, unsealed


def test_a_corrupted_key_file_declines_sends_nothing_and_is_audited(
    model, demo_root, tmp_path, keys_dir
):
    keys = tmp_path / "keys"
    shutil.copytree(keys_dir, keys)
    private = keys / "cn.key.json"
    data = json.loads(private.read_text())
    data["xwing_seed"] = base64.b64encode(b"\x01" * 32).decode()  # no longer its key id
    private.write_text(json.dumps(data))
    private.chmod(0o600)
    state = tmp_path / "state"
    got, _ = sealed_train(model, cn_node(demo_root, state), keys)
    assert got.status == "declined" and got.envelope is None and got.arrays is None
    assert f"{private}:key_id: does not match the keys in the file" in got.reason
    declined = [r for r in load_records(state / "audit.jsonl") if r["event"] == "declined"]
    assert "key_id: does not match" in declined[-1]["details"]["reason"]
    assert not (state / "privacy-ledger.jsonl").exists()


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
        got.info[protocol.KEY_ID], got.signature, run_id=7, server_round=1, fields=got.signed
    )
    assert sender.party == "cn"
    records = load_records(tmp_path / "audit.jsonl")
    witnessed = [r["details"] for r in records if r["event"] == "witness"]
    assert witnessed == [{"party": "aggregator", "count": 5, "head": HEAD}]
    last = records[-1]
    assert last["event"] == "checkpoint"
    assert got.witness == protocol.Witness(last["details"]["count"], last["details"]["head"])


def test_an_audit_head_the_aggregator_did_not_sign_is_refused(model, demo_root, tmp_path, keys_dir):
    node = {"region": "cn", "data-path": str(demo_root / "cn"), "state-path": str(tmp_path)}
    got, _ = sealed_eval(model, node, keys_dir, witness=(5, HEAD), sent_witness=(4, HEAD))
    assert got.status == "declined" and "is not signed by the aggregator key" in got.reason
    records = load_records(tmp_path / "audit.jsonl")
    assert not [r for r in records if r["event"] == "witness"]


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
    notice = protocol.RunEndNotice(
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
    assert got.status == protocol.WITNESSED
    sender = aggregator.reply_sender(
        got.info[protocol.KEY_ID], got.signature, run_id=7, server_round=0, fields=got.signed
    )
    assert sender.party == "eu"
    records = load_records(tmp_path / "audit.jsonl")
    assert records[-2]["event"] == "witness" and records[-2]["details"]["count"] == 9
    assert records[-1]["event"] == "checkpoint"  # the witness is signed, not a dangling tail
    assert verify(tmp_path / "audit.jsonl", load_bundle(keys_dir / "eu.pub.json")).ok
    forged = protocol.RunEndNotice(7, (10, HEAD), notice.signature, notice.signer)
    message = Message(protocol.run_end_notice(forged), dst_node_id=2, message_type="query")
    refused = protocol.read_reply(client_app.query(message, context))
    assert refused.status == "declined" and "not signed by the aggregator" in refused.reason
