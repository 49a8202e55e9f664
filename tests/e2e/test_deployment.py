"""A real deployment on 127.0.0.1: flower-superlink, and per region its agent and a
flower-supernode whose ClientApp relays to it; flwr run."""

from __future__ import annotations

import re

import pytest

from fedciuic.audit.events import Event
from fedciuic.audit.log import AGGREGATOR_LOG, REGION_LOG, cross_check, load_records, verify
from fedciuic.config import COUNTS, EVALUATION, TRAINING, NodeConfig, RunConfig
from fedciuic.crypto.keys import load_bundle
from fedciuic.crypto.parties import generate_federation_keys
from fedciuic.crypto.tls import generate_server_tls, generate_supernode_key
from fedciuic.data.corpus import load_region_data
from fedciuic.deid.secret import SECRET_FILE, data_commitment, region_secret
from fedciuic.digests import installed_code
from fedciuic.flower.launch import LocalFederation
from fedciuic.model.presets import byte_tokenizer
from fedciuic.policy.rules import load_policy
from fedciuic.privacy.ledger import LEDGER_FILE, PrivacyLedger
from fedciuic.region.round import model_loads
from tests.conftest import ROOT, SHIPPED_POLICIES, app_config
from tests.e2e.helpers import (
    RecordingProxy,
    alive,
    eval_loss,
    lab_policies_dir,
    only_run,
    processes_under,
    start_region,
)
from tests.e2e.pace import patient

pytestmark = pytest.mark.e2e
REGIONS = ("eu", "cn", "us")


def test_superlink_and_three_supernodes_run_two_rounds_sealed_on_their_own_data(
    tmp_path, demo_root
):
    """TLS and SuperNode authentication on: an unregistered SuperNode is refused."""
    out = tmp_path / "runs"
    keys = generate_federation_keys(tmp_path / "keys", REGIONS)
    tls = generate_server_tls(tmp_path / "tls", ["127.0.0.1"])
    with LocalFederation(tmp_path / "work", ROOT) as federation:
        address = federation.start_superlink(simulation=False, tls=tls, supernode_auth=True)
        # Every byte between the SuperNodes and the SuperLink goes through this relay.
        proxy = RecordingProxy(int(address.rsplit(":", 1)[1]))
        intruder_key, _ = generate_supernode_key(tmp_path / "auth", "intruder")
        intruder = federation.start_supernode(
            "intruder",
            {"agent": str(tmp_path / "agent.sock")},
            superlink=f"127.0.0.1:{proxy.port}",
            auth_key=intruder_key,
        )
        for region in REGIONS:  # while the intruder is being turned away
            start_region(
                federation,
                region,
                demo_root,
                tmp_path / "state",
                keys,
                superlink=f"127.0.0.1:{proxy.port}",
                auth_folder=tmp_path / "auth",
            )
        assert federation.expect_exit(intruder, timeout=patient(120)) != 0
        assert "Failed to activate SuperNode" in intruder.log_path.read_text()
        pids = federation.pids()
        assert len(pids) == 7  # the SuperLink, and each region's agent and SuperNode
        run_id, streamed = federation.run_app(
            {
                "num-server-rounds": 2,
                "local-steps": 4,  # three regions share 2 cores
                "output-dir": str(out),
                "data-root": "",
                "keys-dir": str(keys),
                "policies-dir": str(lab_policies_dir(tmp_path / "state")),
            },
            timeout=patient(900),
        )
    proxy.stop()
    assert not alive(pids), "processes survived the federation"
    assert not processes_under(tmp_path), "an agent or Flower process survived"

    data = only_run(out)
    assert data["run"]["status"] == "completed"
    state = tmp_path / "state"
    for region in REGIONS:
        # Each region's agent held its model for the whole run: two train and about
        # three evaluate messages, one model load; and it stopped with the federation.
        assert model_loads(state / region) == model_loads(state / region, run_id) == 1
        log = (tmp_path / "work" / "logs" / f"agent-{region}.log").read_text()
        assert f"fedciuic: region {region}: model loaded (1 in this process)" in log
        assert "fedciuic: agent stopped" in log
        assert not (tmp_path / "agents" / region / "agent.sock").exists()
        # Which code made each update: the agent's own, on the record at both ends.
        for server_round in ("1", "2"):
            entry = data["rounds"][server_round]["train"][region]
            assert entry["agent_code"] == installed_code() and entry["agent_version"]
        (started,) = [
            r
            for r in load_records(state / region / REGION_LOG)
            if r["event"] == Event.AGENT_STARTED
        ]
        assert started["details"]["code"] == installed_code()
    config = app_config()
    captured = bytes(proxy.captured)
    for region in REGIONS:
        own = load_region_data(
            RunConfig.from_user_config(config, source="app config"),
            NodeConfig(
                region=region, data_path=str(demo_root / region), state_path=str(tmp_path / "own")
            ),
            byte_tokenizer(),
        )
        ledger = PrivacyLedger.load(tmp_path / "state" / region / LEDGER_FILE)
        (counted,) = [r for r in ledger.rounds if r.purpose == COUNTS]
        for server_round in ("1", "2"):
            entry = data["rounds"][server_round]["train"][region]
            assert entry["status"] == "trained"
            # its own data, nobody else's: committed to under the region's own key
            key = region_secret(tmp_path / "state" / region / SECRET_FILE)
            assert entry["data_fingerprint"] == data_commitment(key, own.fingerprint, run_id)
            # its weight: the run's DP count of its units, never the exact count
            assert entry["num_examples"] == counted.count and entry.get("loss") is None
            assert 0 < entry["epsilon"] <= entry["epsilon_budget"]
        # What its ledger holds of the run: the count, its DP evaluations, its rounds.
        assert [r.purpose for r in ledger.rounds if r.purpose != EVALUATION] == [
            COUNTS,
            TRAINING,
            TRAINING,
        ]
        assert len([r for r in ledger.rounds if r.purpose == EVALUATION]) == 3
        for evaluated in (0, 1, 2):  # a DP held-out loss: clipped, post-processed
            assert 0.0 <= eval_loss(data, evaluated, region) <= 10.0
        # Over TLS the relay sees neither the sealed plaintext (the data fingerprint)
        # nor what the envelope header carries in the clear (key id, policy hash).
        key_id = (keys / f"{region}.pub.json").read_text().split('"key_id": "')[1][:32]
        assert key_id.encode() not in captured
        assert own.fingerprint.encode() not in captured
        # Each update was checked against its sender's shipped policy.
        policy = load_policy(
            lab_policies_dir(tmp_path / "state") / SHIPPED_POLICIES[region.upper()]
        )
        assert bytes.fromhex(policy.hash) not in captured
        for server_round in ("1", "2"):
            (decision,) = [
                d
                for d in data["rounds"][server_round]["decisions"]
                if d["subject"] == f"update from {region}"
            ]
            assert decision["outcome"] == "accept" and decision["policy_hash"] == policy.hash
    assert len(captured) > 100_000
    superlink_log = (tmp_path / "work" / "logs" / "superlink.log").read_text()
    assert "No SuperNode found with the given public key" in superlink_log  # the intruder
    # The ServerApp's lines, as `flwr run --stream` shows them, once each in Flower's
    # format: no second copy through Opacus' root handler ("%m/%d/%Y %H:%M:%S:INFO:").
    assert streamed.count("fedciuic: writing this run to") == 1
    assert not re.search(r"^\d\d/\d\d/\d{4} \d\d:\d\d:\d\d:[A-Z]+:", streamed, re.M)

    # The audit logs: each verifies with its party's key, and what every region logged
    # as sent is what the aggregator logged as received (6 updates, by digest).
    aggregator_log = out / "audit" / AGGREGATOR_LOG
    region_logs = {r: tmp_path / "state" / r / REGION_LOG for r in REGIONS}
    for party, path in [("aggregator", aggregator_log), *region_logs.items()]:
        verdict = verify(path, load_bundle(keys / f"{party}.pub.json"))
        assert verdict.ok, verdict.explain()
    check = cross_check(
        load_records(aggregator_log), {r: load_records(p) for r, p in region_logs.items()}
    )
    assert check.agree and len(check.matched) == 6, check.problems
    for path in region_logs.values():
        assert str(demo_root) not in path.read_text()  # paths redacted, as the policies say


def test_every_process_is_stopped_when_the_body_fails(tmp_path, demo_root):
    pids: list[int] = []
    with (
        pytest.raises(RuntimeError, match="test failure"),
        LocalFederation(tmp_path / "work", ROOT) as federation,
    ):
        federation.start_superlink(simulation=False)
        federation.start_supernode("eu", {"agent": str(tmp_path / "agent.sock")})
        pids = federation.pids()
        raise RuntimeError("test failure")
    assert len(pids) == 2
    assert not alive(pids)
