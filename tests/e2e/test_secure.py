"""Secure aggregation with real Flower processes: a simulation (`fedciuic simulate`) of
three regions. The published delta is the mean of the updates the regions kept, within
the fixed point's rounding; the aggregator received no region's update (its trained
replies carry metrics only); every party's log records its part in the secure sum and
verifies. The deployed secure round (`fedciuic init`'s `start.sh`, a region killed
mid-sum) is tests/e2e/test_init_secure.py's, with :func:`check_secure_round`."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest

from fedciuic.aggregator.checkpoint import load_checkpoint
from fedciuic.audit.events import Event
from fedciuic.audit.log import REGION_LOG, cross_check, load_records
from fedciuic.config import RunConfig
from fedciuic.crypto import read_update_payload
from fedciuic.data.demo import write_demo_corpora
from fedciuic.model import AdapterLayout
from fedciuic.region.trainer import SentUpdates
from tests.aggregator.test_secure_round import assert_published, assert_worth_checking, flat
from tests.conftest import app_config
from tests.e2e.helpers import (
    only_run,
    processes_under,
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


def check_secure_round(
    run_dir: Path, states: dict[str, Path], revealed: tuple[str, ...] = REGIONS
) -> Path:
    """The round's delta is the mean of what the regions kept; the aggregator received
    metrics only; the secure sum is on every party's record (up to its consent for a
    region not among ``revealed``, which stopped before it could reveal); every party's
    log agrees with the aggregator's. Returns the aggregator's audit log."""
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
        phases = PHASES if region in revealed else PHASES[:-1]
        assert [events.count(e) for e in PHASES] == [int(e in phases) for e in PHASES], (
            region,
            events,
        )
    check = cross_check(
        load_records(audit), {r: load_records(s / REGION_LOG) for r, s in states.items()}
    )
    assert check.agree and len(check.matched) == len(states), check.problems
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
    assert app_config()["secure-aggregation"] is False  # off unless a run turns it on
