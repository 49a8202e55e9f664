"""The ClientApp's handlers called directly with a real Context and Message."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict

from clients import app as client_app
from fedciuic.compression import get_codec
from fedciuic.crypto.keys import Keypair
from fedciuic.flower import protocol
from fedciuic.model import AdapterModel, ModelSpec
from fedciuic.sealing import aggregator_keys, generate_federation_keys, sign_global
from tests.conftest import app_config

pytestmark = pytest.mark.usefixtures("task_identity")


@pytest.fixture(scope="module")
def model() -> AdapterModel:
    return AdapterModel(ModelSpec())


def call(handler, node_config, run_overrides, model, kind=MessageType.TRAIN, signer=None):
    """Call a ClientApp handler as Flower would; unsealed unless the test seals."""
    run_config = {**app_config(), "local-steps": 2, "seal": False, **run_overrides}
    context = Context(
        run_id=7, node_id=2, node_config=node_config, state=RecordDict(), run_config=run_config
    )
    adapter = model.adapter_state()
    signature, signer_id = b"", ""
    if signer is not None:
        signature = sign_global(signer, 7, 1, adapter)
        signer_id = signer.bundle.key_id.hex()
    content = protocol.instruction(
        protocol.pack_arrays(adapter),
        server_round=1,
        base_fingerprint=model.base_fingerprint,
        config=ConfigRecord(),
        signature=signature,
        signer=signer_id,
    )
    reply = handler(Message(content, dst_node_id=2, message_type=kind), context)
    return protocol.read_reply(reply, {})


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


def test_sealed_update_opens_only_at_the_aggregator(model, demo_root, tmp_path, keys_dir):
    node = {"region": "cn", "data-path": str(demo_root / "cn"), "state-path": str(tmp_path)}
    aggregator = aggregator_keys(str(keys_dir), 2**28)
    got = call(
        client_app.train,
        node,
        {"seal": True, "keys-dir": str(keys_dir)},
        model,
        signer=aggregator.keypair,
    )
    assert got.status == "sealed" and got.arrays is None and got.envelope
    arrays, metrics, info, sender = aggregator.open_update(got.envelope, run_id=7, server_round=1)
    assert sender.party == "cn" and info["region"] == "cn"
    assert set(arrays) == {"update"} and metrics["num-examples"] > 0


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
