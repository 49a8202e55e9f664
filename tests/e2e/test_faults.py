"""Faults with real Flower processes: the aggregator killed mid-round and resumed, a
region killed mid-round."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from fedciuic.aggregator.checkpoint import load_checkpoint
from fedciuic.audit.log import AGGREGATOR_LOG, REGION_LOG, load_records, verify
from fedciuic.audit.report import build_report, open_logs
from fedciuic.config import TRAINING
from fedciuic.crypto.keys import load_bundle
from fedciuic.crypto.parties import generate_federation_keys
from fedciuic.crypto.tls import generate_server_tls
from fedciuic.data.demo import write_demo_corpora
from fedciuic.errors import FederationError
from fedciuic.flower.launch import LocalFederation
from fedciuic.privacy.ledger import LEDGER_FILE, PrivacyLedger
from tests.conftest import ROOT, SHIPPED_POLICIES, write_policy
from tests.e2e.helpers import alive, lab_policies_dir, start_region
from tests.e2e.pace import patient

pytestmark = [pytest.mark.e2e, pytest.mark.scenario]
REGIONS = ("eu", "cn", "us")
#: The aggregator's kill and resume need no third region: two train at once on 2 cores.
RESUMED = ("eu", "cn")
SIMULATION = {"num-supernodes": len(RESUMED), "client-resources-num-cpus": 1}


def when(condition: Callable[[], bool], then: Callable[[], None], timeout: float = 600) -> None:
    """In the background: once ``condition`` holds, do ``then``."""

    def watch() -> None:
        deadline = time.monotonic() + patient(timeout)
        while time.monotonic() < deadline:
            if condition():
                then()
                return
            time.sleep(0.2)

    threading.Thread(target=watch, daemon=True).start()


def released(state: Path, server_round: int) -> bool:
    """Whether this region's audit log shows an update it sent in ``server_round``."""
    try:
        records = load_records(state / REGION_LOG)
    except Exception:  # not written yet, or mid-write
        return False
    return any(r["event"] == "update_sealed" and r["round"] == server_round for r in records)


def final_adapter(out: Path) -> dict[str, np.ndarray]:
    (path,) = out.glob("run-*/adapter/adapter_model.safetensors")
    return load_file(path)


def test_the_aggregator_killed_mid_round_resumes_to_the_same_model(tmp_path):
    keys = generate_federation_keys(tmp_path / "keys", RESUMED)
    # "The same model" needs the same noise: reproducible noise, a test-only setting
    # that every shipped policy refuses, so these lab copies allow it.
    policies = tmp_path / "policies"
    for jurisdiction in SHIPPED_POLICIES:
        write_policy(
            policies / f"{jurisdiction.lower()}.yaml",
            jurisdiction,
            privacy__secure_rng_required=False,
        )
    common = {
        "regions": ",".join(RESUMED),
        "num-server-rounds": 2,
        # A test of what survives the kill, not of what is learnt: a few steps a round.
        "local-steps": 4,
        "keys-dir": str(keys),
        "policies-dir": str(policies),
        "secure-mode": False,
        "insecure-reproducible-noise": True,
        # Server state that must survive the kill: FedAdam's moments (checkpointed).
        "server-optimizer": "fedadam",
        "server-learning-rate": 0.01,
    }

    def config(name: str, **extra: object) -> dict[str, object]:
        out = tmp_path / name / "runs"
        return {
            **common,
            "data-root": str(tmp_path / name / "data"),
            "output-dir": str(out),
            "audit-dir": str(out / "audit"),
            **extra,
        }

    for name in ("whole", "cut"):
        write_demo_corpora(tmp_path / name / "data", RESUMED)
    with LocalFederation(tmp_path / "work-whole", ROOT) as federation:
        federation.start_superlink(simulation=True)
        federation.run_app(config("whole"), federation_config=SIMULATION, timeout=patient(600))

    cut = config("cut")
    states = [tmp_path / "cut" / "data" / r / ".fedciuic" for r in RESUMED]
    with LocalFederation(tmp_path / "work-cut", ROOT) as federation:
        federation.start_superlink(simulation=True)
        pids = federation.pids()
        # Kill everything (SIGKILL) once round 1 is checkpointed and a region has
        # released its round-2 update.
        when(
            lambda: (
                any((tmp_path / "cut" / "runs").glob("run-*/checkpoint/LATEST"))
                and any(released(s, 2) for s in states)
            ),
            federation.crash,
        )
        with pytest.raises(FederationError):
            federation.run_app(cut, federation_config=SIMULATION, timeout=patient(600))
    assert not alive(pids)
    (killed,) = (tmp_path / "cut" / "runs").glob("run-*")
    assert not (killed / "adapter").exists()  # it never finished
    at_kill = load_checkpoint(killed)
    assert at_kill.round == 1 and at_kill.optimizer is not None
    assert at_kill.optimizer.name == "fedadam" and at_kill.optimizer.steps == 1

    with LocalFederation(tmp_path / "work-resume", ROOT) as federation:
        federation.start_superlink(simulation=True)
        federation.run_app(
            {**config("cut", **{"resume-from": str(killed)})},
            federation_config=SIMULATION,
            timeout=patient(600),
        )

    whole, resumed = (
        final_adapter(tmp_path / "whole" / "runs"),
        final_adapter(tmp_path / "cut" / "runs"),
    )
    assert sorted(whole) == sorted(resumed)
    for name in whole:
        np.testing.assert_allclose(resumed[name], whole[name], rtol=1e-6, atol=1e-7)
    # The resumed run continued the killed run's FedAdam moments: step 2 of 2, and the
    # same moments as the uninterrupted run's.
    (resumed_run,) = set((tmp_path / "cut" / "runs").glob("run-*")) - {killed}
    whole_state = load_checkpoint(next((tmp_path / "whole" / "runs").glob("run-*"))).optimizer
    resumed_state = load_checkpoint(resumed_run).optimizer
    assert whole_state is not None and resumed_state is not None
    assert resumed_state.steps == whole_state.steps == 2
    for moment in ("m", "v"):
        np.testing.assert_allclose(
            resumed_state.arrays[moment], whole_state.arrays[moment], rtol=1e-5, atol=1e-9
        )

    for region in RESUMED:
        ledger = PrivacyLedger.load(tmp_path / "cut" / "data" / region / ".fedciuic" / LEDGER_FILE)
        rounds = [(r.run_id, r.round) for r in ledger.rounds if r.purpose == TRAINING]
        assert len(rounds) == len(set(rounds)) == 2, rounds  # no epsilon counted twice
        reference = PrivacyLedger.load(
            tmp_path / "whole" / "data" / region / ".fedciuic" / LEDGER_FILE
        )
        assert ledger.epsilon == pytest.approx(reference.epsilon)
        verdict = verify(
            tmp_path / "cut" / "data" / region / ".fedciuic" / REGION_LOG,
            load_bundle(keys / f"{region}.pub.json"),
        )
        assert verdict.ok, verdict.explain()
    # The aggregator's log continues without a gap and verifies.
    aggregator_log = tmp_path / "cut" / "runs" / "audit" / "aggregator.audit.jsonl"
    verdict = verify(aggregator_log, load_bundle(keys / "aggregator.pub.json"))
    assert verdict.ok, verdict.explain()
    starts = [r for r in load_records(aggregator_log) if r["event"] == "run_start"]
    assert len(starts) == 2 and starts[1]["details"]["resumed_after_round"] == 1
    assert starts[0]["run_id"] == starts[1]["run_id"]  # one federation run
    # Which checkpoint it continued from, signed by the aggregator's key: on its record
    # and, through the instructions it signed, on every region's.
    signed = load_checkpoint(killed, load_bundle(keys / "aggregator.pub.json"))
    assert starts[1]["details"]["checkpoint"]["identity"] == signed.identity
    for region in RESUMED:
        records = load_records(tmp_path / "cut" / "data" / region / ".fedciuic" / REGION_LOG)
        joined = [
            r["details"]["resumed_from_checkpoint"] for r in records if r["event"] == "run_joined"
        ]
        assert joined[-1] == signed.identity, (region, joined)


def test_a_region_killed_mid_round_does_not_stall_the_run(tmp_path, demo_root):
    keys = generate_federation_keys(tmp_path / "keys", REGIONS)
    out = tmp_path / "runs"
    tls = generate_server_tls(tmp_path / "tls", ["127.0.0.1"])
    with LocalFederation(tmp_path / "work", ROOT) as federation:
        federation.start_superlink(simulation=False, tls=tls, supernode_auth=True)
        nodes = {}
        for region in REGIONS:
            _, nodes[region] = start_region(
                federation,
                region,
                demo_root,
                tmp_path / "state",
                keys,
                auth_folder=tmp_path / "auth",
            )
        us_log = tmp_path / "state" / "us" / REGION_LOG
        # Kill the US SuperNode (and its relay) as soon as its agent starts round 1.
        when(
            lambda: (
                us_log.exists()
                and any(
                    r["event"] == "policy_decision" and r["round"] == 1
                    for r in load_records(us_log)
                )
            ),
            lambda: federation.kill(nodes["us"]),
        )
        started = time.monotonic()
        federation.run_app(
            {
                "num-server-rounds": 1,
                "output-dir": str(out),
                "data-root": "",
                "keys-dir": str(keys),
                "policies-dir": str(lab_policies_dir(tmp_path / "state")),
                # The dead region is given up at this timeout or once Flower misses its
                # heartbeats (about 60 s), whichever comes first.
                "round-timeout": patient(45.0),
                # Little training: this test is about a dropout, and the honest
                # regions must finish well inside the timeout even on a slow machine.
                "local-steps": 5,
            },
            timeout=patient(600),
        )
        took = time.monotonic() - started
        # US's agent outlived its relay: it finishes the round it began and seals its
        # update, which can no longer reach the aggregator.
        deadline = time.monotonic() + patient(180)
        while not released(tmp_path / "state" / "us", 1) and time.monotonic() < deadline:
            time.sleep(0.5)
    assert nodes["us"].process.poll() is not None
    (metrics,) = out.glob("run-*/metrics.json")
    data = json.loads(metrics.read_text())
    assert data["run"]["status"] == "completed"
    train = data["rounds"]["1"]["train"]
    assert train["eu"]["status"] == train["cn"]["status"] == "trained"
    # Failed under its region's name: Flower's own error once the node's heartbeats stop
    # (usually well before round-timeout), or no reply within round-timeout.
    assert train["us"]["status"] == "failed", train["us"]
    reason = train["us"]["reason"]
    assert reason.startswith("no reply within round-timeout (") or reason.startswith(
        "Error: Node Unavailable"
    ), train
    assert sorted(train) == ["cn", "eu", "us"]
    aggregate = data["rounds"]["1"]["aggregate"]
    assert aggregate["published"] and sorted(aggregate["regions"]) == ["cn", "eu"]
    assert took < patient(400), f"the run took {took:.0f}s"
    # Its release is spent and was never delivered: the compliance report says so, with
    # the aggregator's reason, rather than that the logs simply agree.
    assert released(tmp_path / "state" / "us", 1), "us's agent sealed no update"
    logs = [out / "audit" / AGGREGATOR_LOG, *(tmp_path / "state" / r / REGION_LOG for r in REGIONS)]
    report = build_report(open_logs(logs, {}), data["run"]["run_id"])
    (spent,) = [s for s in report.sections if s.title == "Spent, not delivered"]
    assert [row[1] for row in spent.rows] == ["us"], spent.rows
    assert spent.rows[0][4] == reason
    assert not report.disagreements, report.disagreements
