"""A region's DP rounds against its ledger: budget, restarts, bad settings."""

from __future__ import annotations

import numpy as np
import pytest

from fedciuic.config import NodeConfig, RunConfig
from fedciuic.errors import ConfigError
from fedciuic.privacy import BudgetExhausted, PrivacyError, PrivacyLedger, epsilon_of
from fedciuic.region import Region


@pytest.fixture
def run(run_config: RunConfig) -> RunConfig:
    return run_config.model_copy(update={"local_steps": 3, "num_server_rounds": 2})


def region(run: RunConfig, demo_root, tmp_path, **node) -> Region:
    return Region(
        run,
        NodeConfig(region="eu", data_path=str(demo_root / "eu"), state_path=str(tmp_path), **node),
    )


def train(r: Region, server_round: int = 1):
    return r.train_round(
        r.model.adapter_state(),
        server_round=server_round,
        base_fingerprint=r.model.base_fingerprint,
        run_id=5,
    )


def test_a_dp_round_is_recorded_before_the_update_is_returned(run, demo_root, tmp_path):
    r = region(run, demo_root, tmp_path)
    outcome = train(r)
    ledger = PrivacyLedger.load(r.ledger_path)
    assert len(ledger.rounds) == 1
    rec = ledger.rounds[0]
    assert (rec.run_id, rec.round, rec.steps) == (5, 1, 3)
    assert outcome.privacy is not None
    assert outcome.privacy.epsilon == pytest.approx(rec.epsilon)
    assert rec.epsilon == pytest.approx(epsilon_of(ledger.history, 1e-5, "prv"))
    # Calibrated for 2 rounds x 3 steps: one round is well under the 8.0 target.
    assert 0 < rec.epsilon < 8.0


def test_restarting_a_region_continues_its_ledger(run, demo_root, tmp_path):
    first = train(region(run, demo_root, tmp_path), 1)
    restarted = region(run, demo_root, tmp_path)  # a new process would do the same
    second = train(restarted, 2)
    ledger = PrivacyLedger.load(restarted.ledger_path)
    assert [r.round for r in ledger.rounds] == [1, 2]
    assert first.privacy and second.privacy
    assert second.privacy.epsilon > first.privacy.epsilon
    assert len(ledger.rounds[1].accountant_state["history"]) == 2


def test_a_spent_budget_declines_without_training(run, demo_root, tmp_path):
    # Noise is calibrated for 2 rounds to reach 8.0; a budget of 7.5 admits one round.
    r = region(run, demo_root, tmp_path, epsilon_budget=7.5)
    first = train(r, 1)
    assert first.privacy is not None and first.privacy.epsilon <= 7.5
    before = r.model.adapter_state()
    with pytest.raises(BudgetExhausted, match=r"region eu: this round would raise epsilon"):
        train(r, 2)
    # The declined round neither trained nor wrote to the ledger.
    assert all(np.array_equal(before[k], v) for k, v in r.model.adapter_state().items())
    assert len(PrivacyLedger.load(r.ledger_path).rounds) == 1


def test_delta_not_below_one_over_the_dataset_size_is_refused(run, demo_root, tmp_path):
    r = region(run.model_copy(update={"target_delta": 0.01}), demo_root, tmp_path)
    with pytest.raises(PrivacyError, match=r"run config:target-delta: 0.01 is not below 1/n"):
        train(r)
    assert not r.ledger_path.exists()


def test_a_corrupted_ledger_stops_the_region(run, demo_root, tmp_path):
    r = region(run, demo_root, tmp_path)
    train(r)
    r.ledger_path.write_text(r.ledger_path.read_text()[:-10])
    before = r.model.adapter_state()
    with pytest.raises(PrivacyError, match=r"privacy-ledger\.jsonl"):
        train(r, 2)
    assert all(np.array_equal(before[k], v) for k, v in r.model.adapter_state().items())


def test_a_ledger_of_other_data_stops_the_region(run, demo_root, tmp_path):
    train(region(run, demo_root, tmp_path))
    other = Region(
        run, NodeConfig(region="eu", data_path=str(demo_root / "cn"), state_path=str(tmp_path))
    )
    with pytest.raises(PrivacyError, match="belongs to region 'eu', dataset"):
        train(other)


@pytest.mark.parametrize(
    ("key", "value", "field"),
    [
        ("target-epsilon", 0.0, "target-epsilon"),
        ("target-epsilon", -1.0, "target-epsilon"),
        ("target-delta", 1.0, "target-delta"),
        ("max-grad-norm", 0.0, "max-grad-norm"),
        ("epsilon-budget", 0.0, "epsilon-budget"),
        ("dp-accountant", "gdp", "dp-accountant"),
    ],
)
def test_bad_dp_settings_are_config_errors(run_config, key, value, field):
    values = run_config.model_dump(by_alias=True)
    values[key] = value
    with pytest.raises(ConfigError, match=f"run config:{field}:"):
        RunConfig.from_user_config(values, source="run config")


def test_node_config_budget_must_be_positive(run_config):
    with pytest.raises(ConfigError, match="node config:epsilon-budget"):
        NodeConfig.resolve({"region": "eu", "data-path": "/d", "epsilon-budget": -1}, run_config)
