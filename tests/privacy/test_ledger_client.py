"""The ClientApp's side of the privacy ledger: the audit log witnesses each release,
a rolled-back ledger and rounds beyond the run are declined (read from the audit log)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict

from clients import app as client_app
from fedciuic.audit.log import REGION_LOG, load_records
from fedciuic.flower import protocol
from fedciuic.model.adapter import AdapterModel, ModelSpec
from fedciuic.privacy.ledger import LEDGER_FILE, PrivacyLedger, rebuild_ledger
from tests.conftest import app_config, lab_policies

pytestmark = pytest.mark.usefixtures("task_identity")


@pytest.fixture(scope="module")
def model() -> AdapterModel:
    return AdapterModel(ModelSpec())


@pytest.fixture(scope="module")
def policies(tmp_path_factory) -> Path:
    return lab_policies(tmp_path_factory.mktemp("policies"))


def train(model, node, policies: Path, server_round: int, **run) -> dict[str, Any]:
    """A train instruction for ``server_round``; the region's last audit record."""
    run_config = {**app_config(), "local-steps": 2, "seal": False, **run}
    node = {"policy": str(policies / f"{node['region']}.yaml"), **node}
    context = Context(
        run_id=7, node_id=2, node_config=node, state=RecordDict(), run_config=run_config
    )
    content = protocol.instruction(
        protocol.pack_arrays(model.adapter_state()),
        server_round=server_round,
        base_fingerprint=model.base_fingerprint,
        config=ConfigRecord(),
    )
    client_app.train(Message(content, dst_node_id=2, message_type=MessageType.TRAIN), context)
    records = load_records(Path(node["state-path"]) / REGION_LOG)
    return next(r for r in reversed(records) if r["event"] in ("trained", "declined"))


def test_the_audit_log_witnesses_each_release_and_a_rollback_is_declined(
    model, demo_root, tmp_path, policies
):
    node = {"region": "eu", "data-path": str(demo_root / "eu"), "state-path": str(tmp_path)}
    first = train(model, node, policies, 1)
    assert first["event"] == "trained"
    ledger = PrivacyLedger.load(tmp_path / LEDGER_FILE)
    assert first["details"]["ledger"]["releases"] == 1
    assert first["details"]["ledger"]["head"] == ledger.heads[-1]
    saved = (tmp_path / LEDGER_FILE).read_bytes()
    assert train(model, node, policies, 2)["event"] == "trained"
    (tmp_path / LEDGER_FILE).write_bytes(saved)  # an older copy
    declined = train(model, node, policies, 3)
    assert declined["event"] == "declined"
    assert "was rolled back" in declined["details"]["reason"]
    assert "fedciuic ledger rebuild" in declined["details"]["reason"]
    assert len(PrivacyLedger.load(tmp_path / LEDGER_FILE).rounds) == 1  # nothing spent
    assert rebuild_ledger(tmp_path).releases == 2
    assert train(model, node, policies, 3)["event"] == "trained"


def test_rounds_beyond_num_server_rounds_are_declined(model, demo_root, tmp_path, policies):
    # A lifetime budget that would allow six rounds: only the round check stops them.
    node = {
        "region": "us",
        "data-path": str(demo_root / "us"),
        "state-path": str(tmp_path),
        "epsilon-budget": 30.0,
    }
    assert train(model, node, policies, 1, **{"num-server-rounds": 1})["event"] == "trained"
    for server_round in (2, 6):
        got = train(model, node, policies, server_round, **{"num-server-rounds": 1})
        assert got["event"] == "declined"
        assert f"round {server_round} is outside this run's rounds 1..1" in got["details"]["reason"]
    assert len(PrivacyLedger.load(tmp_path / LEDGER_FILE).rounds) == 1
