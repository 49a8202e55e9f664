"""A region's DP rounds against its ledger: budget, restarts, bad settings."""

from __future__ import annotations

import dp_accounting
import numpy as np
import pytest

from fedciuic.audit.log import AuditLog
from fedciuic.config import NodeConfig, RunConfig
from fedciuic.errors import ConfigError
from fedciuic.policy.binding import run_terms
from fedciuic.policy.rules import check_run, load_policy
from fedciuic.privacy.ledger import (
    BudgetExhausted,
    LedgerRolledBack,
    PrivacyError,
    PrivacyLedger,
    RunBudgetExceeded,
    epsilon_of,
    rebuild_ledger,
)
from fedciuic.region.trainer import Region, RoundOutOfRange
from tests.conftest import EXACT_RELEASES, ROOT


@pytest.fixture
def run(run_config: RunConfig) -> RunConfig:
    # These tests state their figures for a run aiming at the whole default budget, of
    # training alone (its count and evaluations exact: tests/region/test_round.py has
    # the DP ones).
    changes = {"local_steps": 3, "num_server_rounds": 2, "target_epsilon": 8.0}
    return run_config.updated(**changes, **EXACT_RELEASES)


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
    r = region(run.updated(**{"target_delta": 0.01}), demo_root, tmp_path)
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
    values = run_config.flat()
    values[key] = value
    with pytest.raises(ConfigError, match=f"run config:{field}:"):
        RunConfig.from_user_config(values, source="run config")


def test_node_config_budget_must_be_positive(run_config):
    with pytest.raises(ConfigError, match="node config:epsilon-budget"):
        NodeConfig.resolve({"region": "eu", "data-path": "/d", "epsilon-budget": -1}, run_config)


def note_trained(r: Region, outcome, server_round: int) -> None:
    """What the ClientApp writes after each release: the audit log's ``trained`` event,
    which witnesses the ledger's head."""
    log = AuditLog(r.audit_path, r.name, None)
    try:
        p = outcome.privacy
        log.append(
            "trained",
            run_id=5,
            server_round=server_round,
            data_fingerprint=outcome.data_fingerprint,
            epsilon=p.epsilon,
            ledger=p.ledger,
        )
    finally:
        log.close()


@pytest.mark.parametrize("server_round", [0, -1, 2, 7])
def test_rounds_beyond_num_server_rounds_are_refused(run, demo_root, tmp_path, server_round):
    one = run.updated(**{"num_server_rounds": 1})
    r = region(one, demo_root, tmp_path)
    before = r.model.adapter_state()
    with pytest.raises(
        RoundOutOfRange, match=rf"round {server_round} is outside this run's rounds 1\.\.1"
    ):
        train(r, server_round)
    assert all(np.array_equal(before[k], v) for k, v in r.model.adapter_state().items())
    assert not r.ledger_path.exists()  # nothing was spent
    train(r, 1)  # the run's own round is fine


def google_epsilon(history, delta=1e-5):
    acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    for sigma, rate, steps in history:
        acc.compose(
            dp_accounting.PoissonSampledDpEvent(rate, dp_accounting.GaussianDpEvent(sigma)), steps
        )
    return acc.get_epsilon(delta)


def test_per_run_cap_uses_actual_spend(run, demo_root, tmp_path):
    # A lifetime budget far away: only the per-run cap (target-epsilon 8) can stop it.
    r = region(run, demo_root, tmp_path, epsilon_budget=1000.0)
    first, second = train(r, 1), train(r, 2)
    assert first.privacy and second.privacy
    assert second.privacy.run_epsilon == pytest.approx(second.privacy.epsilon)
    history = PrivacyLedger.load(r.ledger_path).history
    assert second.privacy.run_epsilon == pytest.approx(google_epsilon(history), rel=0.05)
    assert second.privacy.run_epsilon <= 8.0
    # The run's two rounds are spent; any further release of run 5, whatever its round
    # number says (a resent instruction, a resumed run), goes over what the run may spend.
    with pytest.raises(RunBudgetExceeded, match=r"run 5 has actually spent from epsilon 7\.9"):
        train(r, 1)
    assert len(PrivacyLedger.load(r.ledger_path).rounds) == 2
    # Another run of the same dataset has its own per-run cap (the lifetime budget allows).
    other = r.train_round(
        r.model.adapter_state(), server_round=1, base_fingerprint=r.model.base_fingerprint, run_id=6
    )
    assert other.privacy and other.privacy.run_epsilon == pytest.approx(first.privacy.run_epsilon)


def test_per_run_cap_takes_the_policys_lower_cap(run, demo_root, tmp_path):
    r = region(run, demo_root, tmp_path, epsilon_budget=1000.0)
    first = r.train_round(
        r.model.adapter_state(),
        server_round=1,
        base_fingerprint=r.model.base_fingerprint,
        run_id=5,
        max_run_epsilon=7.5,
    )
    assert first.privacy and first.privacy.run_epsilon_cap == 7.5
    with pytest.raises(
        RunBudgetExceeded, match=r"over the per-run cap of 7.5 \(privacy\.max_epsilon_per_run\)"
    ):
        r.train_round(
            r.model.adapter_state(),
            server_round=2,
            base_fingerprint=r.model.base_fingerprint,
            run_id=5,
            max_run_epsilon=7.5,
        )


def test_rolled_back_ledger_stops_the_region(run, demo_root, tmp_path):
    r = region(run, demo_root, tmp_path)
    note_trained(r, train(r, 1), 1)
    saved = r.ledger_path.read_bytes()
    note_trained(r, train(r, 2), 2)
    r.ledger_path.write_bytes(saved)  # "restore the backup"
    with pytest.raises(LedgerRolledBack, match="records 2 release"):
        r.projected_epsilon()
    before = r.model.adapter_state()
    with pytest.raises(LedgerRolledBack, match="fedciuic ledger rebuild"):
        train(r, 2)
    assert all(np.array_equal(before[k], v) for k, v in r.model.adapter_state().items())
    assert rebuild_ledger(tmp_path).releases == 2
    with pytest.raises(BudgetExhausted):  # the rebuilt ledger holds both releases again
        train(r, 2)


def test_noise_never_comes_from_the_run_configs_seed(run, demo_root, tmp_path):
    # The aggregator chooses the seed: by default it must not determine the noise.
    deltas = [train(region(run, demo_root, tmp_path / str(i))).delta for i in range(2)]
    assert any(not np.array_equal(deltas[0][k], deltas[1][k]) for k in deltas[0])
    # Reproducible noise only behind the explicit setting meant for tests.
    lab = run.updated(**{"secure_mode": False, "insecure_reproducible_noise": True})
    deltas = [train(region(lab, demo_root, tmp_path / f"lab{i}")).delta for i in range(2)]
    assert all(np.array_equal(deltas[0][k], deltas[1][k]) for k in deltas[0])
    ledger = PrivacyLedger.load(tmp_path / "lab0" / "privacy-ledger.jsonl")
    assert ledger.rounds[0].reproducible_noise and not ledger.rounds[0].secure_mode


def test_reproducible_noise_needs_secure_mode_off_and_is_refused_by_shipped_policies(run_config):
    values = run_config.flat()
    assert values["secure-mode"] is True and values["insecure-reproducible-noise"] is False
    with pytest.raises(ConfigError, match=r"run config:insecure-reproducible-noise: .*secure-mode"):
        RunConfig.from_user_config(
            {**values, "insecure-reproducible-noise": True}, source="run config"
        )
    lab = RunConfig.from_user_config(
        {**values, "secure-mode": False, "insecure-reproducible-noise": True}, source="run config"
    )
    assert (
        lab.privacy.noise_warning is not None
        and "NO differential privacy" in lab.privacy.noise_warning
    )
    for path in sorted((ROOT / "policies").glob("*.yaml")):
        loaded = load_policy(path)
        terms = run_terms(lab, aggregator_jurisdiction=loaded.policy.jurisdiction)
        decision = check_run("r", loaded, terms)
        assert not decision.accepted, path
        assert any("secure_rng_required" in reason for reason in decision.reasons), path
