"""Secure aggregation with real Flower processes: a simulation (`fedciuic simulate`) and
a deployment (flower-superlink, and per region its agent and a flower-supernode), three
regions each. The published delta is the mean of the updates the regions kept, within
the fixed point's rounding; the aggregator received no region's update (its trained
replies carry metrics only); every party's log records its part in the secure sum and
verifies; the regions' and the aggregator's logs agree."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedciuic.aggregator.checkpoint import load_checkpoint
from fedciuic.audit.events import Event
from fedciuic.audit.log import REGION_LOG, cross_check, load_records, verify
from fedciuic.config import RunConfig
from fedciuic.crypto import load_bundle, read_update_payload
from fedciuic.crypto.parties import generate_federation_keys
from fedciuic.data.demo import write_demo_corpora
from fedciuic.flower.launch import LocalFederation
from fedciuic.model import AdapterLayout
from fedciuic.region.trainer import SentUpdates
from tests.aggregator.test_secure_round import assert_published, assert_worth_checking, flat
from tests.conftest import ROOT, app_config
from tests.e2e.helpers import (
    alive,
    lab_policies_dir,
    only_run,
    processes_under,
    start_region,
)
from tests.e2e.pace import patient
from tests.e2e.test_simulation import _command

pytestmark = pytest.mark.e2e
REGIONS = ("eu", "cn", "us")
SECURE = {"secure-aggregation": True, "num-server-rounds": 1, "local-steps": 4}
#: What the aggregator receives of a region's round at most: its metrics, sealed.
METRICS_ONLY = 4096
PHASES = (
    Event.SECURE_JOINED,
    Event.SECURE_SHARED,
    Event.SECURE_MASKED,
    Event.SECURE_CONSENTED,
    Event.SECURE_REVEALED,
)


def check_secure_round(run_dir: Path, states: dict[str, Path]) -> Path:
    """The round's delta is the mean of what the regions kept; the aggregator received
    metrics only; the secure sum is on every party's record. Returns the aggregator's
    audit log."""
    data = only_run(run_dir.parent)
    audit = Path(data["run"]["audit_log"])
    assert data["run"]["status"] == "completed"
    run = RunConfig.from_user_config({**app_config(), **SECURE}, source="run config")
    run_id = data["run"]["run_id"]
    (summed,) = [r["details"] for r in load_records(audit) if r["event"] == Event.SECURE_SUM]
    assert summed["outcome"] == "unmasked" and summed["survivors"] == sorted(REGIONS)
    initial = AdapterLayout.of(run.model).initial
    final = load_checkpoint(run_dir).adapter
    delta = flat(final) - flat(initial)
    kept = []
    for region, state in states.items():
        found = SentUpdates(state).load(run_id, 1)
        assert found is not None, region
        arrays, _, _ = read_update_payload(found.payload)
        kept.append(run.compression.codec.decode(arrays["update"].tobytes(), delta.size))
    mean = np.mean([k.dense(delta.size) for k in kept], axis=0)
    assert_published(delta, mean, summed["scale"], final, initial)
    assert_worth_checking(delta, mean)
    for region, state in states.items():
        entry = data["rounds"]["1"]["train"][region]
        assert entry["status"] == "trained" and "norm" not in entry  # no update to measure
        assert entry["upload_bytes"] < METRICS_ONLY
        events = [r["event"] for r in load_records(state / REGION_LOG)]
        assert all(events.count(e) == 1 for e in PHASES), (region, events)
    return audit


def test_a_secure_simulation_publishes_the_mean_of_the_regions_updates(tmp_path):
    data_root = tmp_path / "data"
    write_demo_corpora(data_root, REGIONS)
    overrides = [f"{k}={str(v).lower()}" for k, v in SECURE.items()]
    command = _command(tmp_path, "--data-root", str(data_root))
    for value in overrides:
        command += ["--run-config", value]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=patient(900), cwd=tmp_path
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("audit: OK: ") == 4, done.stdout
    assert not processes_under(tmp_path)
    (run_dir,) = (tmp_path / "runs").glob("run-*")
    states = {r: data_root / r / ".fedciuic" for r in REGIONS}
    check_secure_round(run_dir, states)


def test_a_secure_deployment_publishes_the_mean_and_every_log_agrees(tmp_path, demo_root):
    out = tmp_path / "runs"
    keys = generate_federation_keys(tmp_path / "keys", REGIONS)
    state = tmp_path / "state"
    settings: dict[str, Any] = {
        **SECURE,
        "output-dir": str(out),
        "data-root": "",
        "keys-dir": str(keys),
        "policies-dir": str(lab_policies_dir(state)),
    }
    with LocalFederation(tmp_path / "work", ROOT) as federation:
        federation.start_superlink(simulation=False)
        for region in REGIONS:
            start_region(federation, region, demo_root, state, keys)
        pids = federation.pids()
        federation.run_app(settings, timeout=patient(900))
    assert not alive(pids) and not processes_under(tmp_path)
    (run_dir,) = out.glob("run-*")
    states = {r: state / r for r in REGIONS}
    aggregator = check_secure_round(run_dir, states)
    for party, path in [
        ("aggregator", aggregator),
        *((r, s / REGION_LOG) for r, s in states.items()),
    ]:
        verdict = verify(path, load_bundle(keys / f"{party}.pub.json"))
        assert verdict.ok, verdict.explain()
    check = cross_check(
        load_records(aggregator), {r: load_records(s / REGION_LOG) for r, s in states.items()}
    )
    assert check.agree and len(check.matched) == 3, check.problems
    assert app_config()["secure-aggregation"] is False  # off unless a run turns it on
