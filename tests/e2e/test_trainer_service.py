"""A deployment whose regions hand their rounds to a long-lived ``fedciuic trainer``
(node config trainer='service'): each region loads its model once per run, not once
per message, and every process, the trainers included, is gone afterwards."""

from __future__ import annotations

import pytest

from fedciuic.crypto.sealing import generate_federation_keys
from fedciuic.flower.launch import LocalFederation
from fedciuic.rounds.region_round import model_loads
from tests.conftest import ROOT
from tests.e2e.helpers import alive, deployed_node, lab_policies_dir, only_run, processes_under

pytestmark = pytest.mark.e2e
REGIONS = ("eu", "cn")


def test_two_regions_two_rounds_through_their_trainers_load_the_model_once(tmp_path, demo_root):
    out, state = tmp_path / "runs", tmp_path / "state"
    keys = generate_federation_keys(tmp_path / "keys", REGIONS)
    with LocalFederation(tmp_path / "work", ROOT) as federation:
        federation.start_superlink(simulation=False)
        for region in REGIONS:
            federation.start_trainer(region, state / region)
            node = {**deployed_node(region, demo_root, state, keys), "trainer": "service"}
            federation.start_supernode(region, node)
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
    assert not processes_under(tmp_path), "a trainer or Flower process survived"
    data = only_run(out)
    assert data["run"]["status"] == "completed"
    for region in REGIONS:
        assert set(REGIONS) <= set(data["rounds"]["2"]["eval"])
        # Two train and three evaluate messages (or so), one model load.
        assert model_loads(state / region) == model_loads(state / region, run_id) == 1
        log = (tmp_path / "work" / "logs" / f"trainer-{region}.log").read_text()
        assert f"fedciuic: region {region}: model loaded (1 in this process)" in log
        assert "fedciuic: trainer stopped" in log
        assert not (state / region / "trainer" / "trainer.sock").exists()
