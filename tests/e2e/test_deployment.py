"""A real deployment on 127.0.0.1: flower-superlink, one flower-supernode per region, flwr run."""

from __future__ import annotations

import pytest

from fedciuic.data import load_region_data
from fedciuic.flower.launch import LocalFederation
from fedciuic.model import byte_tokenizer
from tests.conftest import ROOT, app_config
from tests.e2e.helpers import alive, eval_loss, only_run

pytestmark = pytest.mark.e2e
REGIONS = ("eu", "cn", "us")


def test_superlink_and_three_supernodes_run_two_rounds_on_their_own_data(tmp_path, demo_root):
    out = tmp_path / "runs"
    with LocalFederation(tmp_path / "work", ROOT) as federation:
        federation.start_superlink(simulation=False)
        for region in REGIONS:
            node = {
                "region": region,
                "data-path": str(demo_root / region),
                "state-path": str(tmp_path / "state" / region),
            }
            federation.start_supernode(region, node)
        pids = federation.pids()
        assert len(pids) == 4
        federation.run_app(
            {"num-server-rounds": 2, "output-dir": str(out), "data-root": ""}, timeout=900
        )
    assert not alive(pids), "processes survived the federation"

    data = only_run(out)
    assert data["run"]["status"] == "completed"
    config = app_config()
    for region in REGIONS:
        own = load_region_data(
            region,
            demo_root / region,
            byte_tokenizer(),
            seq_len=config["seq-len"],
            eval_fraction=config["eval-fraction"],
            max_eval_examples=config["max-eval-examples"],
        )
        for server_round in ("1", "2"):
            entry = data["rounds"][server_round]["train"][region]
            assert entry["status"] == "trained"
            assert entry["data_fingerprint"] == own.fingerprint  # its own data, nobody else's
            assert entry["num_examples"] == own.train.shape[0]
            assert 0 < entry["epsilon"] <= entry["epsilon_budget"]
        assert (tmp_path / "state" / region / "privacy-ledger.jsonl").exists()
        assert eval_loss(data, 2, region) < eval_loss(data, 0, region)


def test_every_process_is_stopped_when_the_body_fails(tmp_path, demo_root):
    pids: list[int] = []
    with (
        pytest.raises(RuntimeError, match="test failure"),
        LocalFederation(tmp_path / "work", ROOT) as federation,
    ):
        federation.start_superlink(simulation=False)
        federation.start_supernode("eu", {"region": "eu", "data-path": str(demo_root / "eu")})
        pids = federation.pids()
        raise RuntimeError("test failure")
    assert len(pids) == 2
    assert not alive(pids)
