"""The region's side of the privacy ledger: the audit log witnesses each release,
a rolled-back ledger and rounds beyond the run are declined (read from the audit log).
The region's round is called as its agent calls it, with the run config the
aggregator signs into each instruction."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fedciuic.audit.log import REGION_LOG, load_records
from fedciuic.config import ModelSpec, NodeConfig, RunConfig
from fedciuic.crypto.parties import TaskKind
from fedciuic.model.adapter import AdapterModel
from fedciuic.privacy.ledger import LEDGER_FILE, PrivacyLedger, rebuild_ledger
from fedciuic.region.round import handle_instruction
from tests.conftest import EXACT_RELEASES, lab_policies, train_instruction, unit_config


@pytest.fixture(scope="module")
def model() -> AdapterModel:
    return AdapterModel(ModelSpec())


@pytest.fixture(scope="module")
def policies(tmp_path_factory) -> Path:
    return lab_policies(tmp_path_factory.mktemp("policies"))


def train(model, node, policies: Path, server_round: int, **run) -> dict[str, Any]:
    """A train instruction for ``server_round``; the region's last audit record."""
    settings = {**unit_config(), **EXACT_RELEASES, "local-steps": 2, "seal": False, **run}
    run_config = RunConfig.from_user_config(settings, source="run config")
    # the region's dictionary of names (the demo's, beside its data): the policies require names
    names = Path(node["data-path"]).parent / "deid-dictionaries" / f"{node['region']}.txt"
    node = {
        "policy": str(policies / f"{node['region']}.yaml"),
        "deid-dictionary": str(names),
        **node,
    }
    task = train_instruction(model, run_config, server_round)
    handle_instruction(
        run_config,
        NodeConfig.resolve(node, run_config),
        task,
        asked=TaskKind.TRAIN,
        flower_run=7,
        simulated=False,
    )
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
