"""A deployment whose regions run their own agents: each region loads its model once
per run, not once per message, the ClientApp only relays, and every process, the
agents included, is gone afterwards."""

from __future__ import annotations

import pytest

from fedciuic.audit.events import Event
from fedciuic.audit.log import REGION_LOG, load_records
from fedciuic.crypto.sealing import generate_federation_keys
from fedciuic.digests import installed_code
from fedciuic.flower.launch import LocalFederation
from fedciuic.rounds.region_round import model_loads
from tests.conftest import ROOT
from tests.e2e.helpers import alive, lab_policies_dir, only_run, processes_under, start_region

pytestmark = pytest.mark.e2e
REGIONS = ("eu", "cn")


def test_two_regions_two_rounds_through_their_agents_load_the_model_once(tmp_path, demo_root):
    out, state = tmp_path / "runs", tmp_path / "state"
    keys = generate_federation_keys(tmp_path / "keys", REGIONS)
    with LocalFederation(tmp_path / "work", ROOT) as federation:
        federation.start_superlink(simulation=False)
        for region in REGIONS:
            start_region(federation, region, demo_root, state, keys)
        pids = federation.pids()
        run_id, _ = federation.run_app(
            {
                "num-server-rounds": 2,
                "local-steps": 2,
                "regions": ",".join(REGIONS),
                "output-dir": str(out),
                "data-root": "",
                "keys-dir": str(keys),
                "policies-dir": str(lab_policies_dir(state)),
            },
            timeout=600,
        )
    assert not alive(pids), "processes survived the federation"
    assert not processes_under(tmp_path), "an agent or Flower process survived"
    data = only_run(out)
    assert data["run"]["status"] == "completed"
    for region in REGIONS:
        assert set(REGIONS) <= set(data["rounds"]["2"]["eval"])
        # Two train and three evaluate messages (or so), one model load.
        assert model_loads(state / region) == model_loads(state / region, run_id) == 1
        log = (tmp_path / "work" / "logs" / f"agent-{region}.log").read_text()
        assert f"fedciuic: region {region}: model loaded (1 in this process)" in log
        assert "fedciuic: agent stopped" in log
        assert not (tmp_path / "agents" / region / "agent.sock").exists()
        # Which code made each update: the agent's, on the record at both ends.
        for server_round in ("1", "2"):
            entry = data["rounds"][server_round]["train"][region]
            assert entry["agent_code"] == installed_code() and entry["agent_version"]
        records = load_records(state / region / REGION_LOG)
        (started,) = [r for r in records if r["event"] == Event.AGENT_STARTED]
        assert started["details"]["code"] == installed_code()
