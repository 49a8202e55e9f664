"""Time-budgeted local work and FedProx: DP plans its step count from a synthetic step
(never a clock stop) and the ledger records the steps taken; the worst case is still
checked before training; the proximal term is added after clipping and noise."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from fedciuic.config import NodeConfig, RunConfig
from fedciuic.model.train import paced, train_local
from fedciuic.privacy.dpsgd import PrivateTrainer
from fedciuic.privacy.ledger import BudgetExhausted, PrivacyLedger, epsilon_of
from fedciuic.region.trainer import Region, train_metrics
from tests.conftest import EXACT_RELEASES

#: Small steps (2 units of one short example each), so that a round takes a moment.
SMALL = {
    "seq_len": 32,
    "batch_size": 2,
    "max_examples_per_unit": 1,
    "local_steps": 8,
    "num_server_rounds": 1,
    "dp_accountant": "rdp",  # calibrates its noise quicker than PRV
}
#: Seconds every DP-SGD step (real or calibration) is made to last at least, so that
#: the step counts do not hang on how loaded the test machine is.
FLOOR_S = 0.1


@pytest.fixture
def run(run_config: RunConfig) -> RunConfig:
    return run_config.updated(**SMALL, **EXACT_RELEASES)  # the plan on the exact count


def region(run: RunConfig, demo_root, tmp_path, name: str = "eu", **node) -> Region:
    state = tmp_path / name
    return Region(
        run, NodeConfig(region=name, data_path=str(demo_root / name), state_path=str(state), **node)
    )


def rerun(r: Region, run: RunConfig) -> None:
    """The region's next round under ``run`` (a region is otherwise built for one run)."""
    r.run, r.local = run, r.node.training(run)


def train(r: Region, run_id: int = 5):
    return r.train_round(
        r.model.adapter_state(),
        server_round=1,
        base_fingerprint=r.model.base_fingerprint,
        run_id=run_id,
    )


def diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    return float(np.sqrt(sum(float(((a[k] - b[k]) ** 2).sum()) for k in a)))


def norm(delta: dict[str, np.ndarray]) -> float:
    return diff(delta, {k: np.zeros_like(v) for k, v in delta.items()})


def test_paced_steps_sleep_their_slowdown_and_report_it() -> None:
    def step() -> str:
        time.sleep(0.05)
        return "done"

    began = time.perf_counter()
    result, seconds = paced(step, slowdown=4.0)
    wall = time.perf_counter() - began
    assert result == "done"
    assert 0.2 <= seconds <= wall < 2.0  # a loaded machine may oversleep, never undersleep


def test_a_slowed_region_plans_fewer_steps_and_its_ledger_records_them(
    run, demo_root, tmp_path, monkeypatch
):
    original = PrivateTrainer._step_batch

    def floored(self, *args):
        time.sleep(FLOOR_S)
        return original(self, *args)

    monkeypatch.setattr(PrivateTrainer, "_step_batch", floored)
    # The fast region's steps take FLOOR_S and a little: 2 FLOOR_S each fit local-steps
    # of them; the slowed one's take at least 4 FLOOR_S: at most half as many fit.
    cap = run.training.local_steps
    budgeted = run.updated(
        **{"local_time_budget": 2 * FLOOR_S * cap, "test_region_slowdown": (("us", 4.0),)}
    )
    steps = {}
    for name in ("eu", "us"):
        r = region(budgeted, demo_root, tmp_path, name)
        outcome = train(r)
        (record,) = PrivacyLedger.load(r.ledger_path).rounds
        noise, rate, worst = r.privacy_step()
        assert worst == cap and (record.noise_multiplier, record.sample_rate) == (noise, rate)
        # Reply, audit metrics and ledger say the one count that was taken and accounted.
        assert outcome.stats.steps == record.steps == train_metrics(outcome)["steps"]
        assert outcome.privacy is not None
        accounted = epsilon_of(
            [(noise, rate, record.steps)], run.privacy.target_delta, run.privacy.dp_accountant
        )
        assert record.epsilon == pytest.approx(accounted)
        assert outcome.privacy.epsilon == pytest.approx(accounted)
        assert outcome.privacy.run_epsilon == pytest.approx(accounted)
        steps[name] = record.steps
    # us's steps take at least 4 FLOOR_S (a bound that holds under any load): at most half
    # of local-steps fit, and at least 1 (a budget never plans none). No bound compares
    # it with eu's count: the two are timed one after the other, and a busy moment during
    # eu's timing alone can leave eu with fewer.
    assert 1 <= steps["us"] <= cap // 2 and 1 <= steps["eu"] <= cap


def test_the_worst_case_is_checked_before_planning(run, demo_root, tmp_path, monkeypatch):
    """A round that fits the budget only because few steps fit the time is refused:
    the checks use local-steps, so no calibration or training happens at all."""
    hurried = run.updated(**{"local_time_budget": 1e-9, "local_steps": 6})
    r = region(hurried, demo_root, tmp_path)
    noise, rate, worst = r.privacy_step()
    one = epsilon_of([(noise, rate, 1)], run.privacy.target_delta, run.privacy.dp_accountant)
    most = epsilon_of([(noise, rate, worst)], run.privacy.target_delta, run.privacy.dp_accountant)
    assert one < most and r.projected_epsilon() == pytest.approx(most)  # the policy's view
    r.node = r.node.model_copy(update={"epsilon_budget": (one + most) / 2})
    planned: list[int] = []

    def plan(*args, **kwargs) -> int:
        planned.append(1)
        return 1

    monkeypatch.setattr("fedciuic.region.trainer.plan_private_steps", plan)
    before = r.model.adapter_state()
    with pytest.raises(BudgetExhausted, match="over the dataset's budget"):
        train(r)
    assert not planned and not r.ledger_path.exists()
    assert diff(r.model.adapter_state(), before) == 0.0


def test_calibration_leaves_no_trace(run, demo_root, tmp_path, monkeypatch):
    """With a budget that fits every step, a round is the round without a budget
    (reproducible noise): the synthetic steps left the adapters as they were."""
    lab = run.updated(
        **{"local_steps": 3, "secure_mode": False, "insecure_reproducible_noise": True}
    )
    r = region(lab, demo_root, tmp_path, epsilon_budget=1000.0)
    start = r.model.adapter_state()
    plain = train(r)
    seen: list[dict[str, np.ndarray]] = []
    run_steps = PrivateTrainer.run

    def spy(self, steps, slowdown=1.0):
        seen.append(self.model.adapter_state())
        return run_steps(self, steps, slowdown)

    monkeypatch.setattr(PrivateTrainer, "run", spy)
    r.model.load_adapter_state(start)
    rerun(r, lab.updated(**{"local_time_budget": 1000.0}))
    budgeted = train(r, run_id=6)
    assert len(seen) == 1 and diff(seen[0], start) == 0.0  # calibrated before, untouched
    assert budgeted.stats.steps == plain.stats.steps == 3
    for name in plain.delta:
        np.testing.assert_array_equal(budgeted.delta[name], plain.delta[name])


def test_no_budget_takes_exactly_local_steps(run, demo_root, tmp_path):
    r = region(run, demo_root, tmp_path)
    outcome = train(r)
    assert outcome.stats.steps == PrivacyLedger.load(r.ledger_path).rounds[0].steps == 8
    rerun(r, run.updated(**{"dp": False}))
    assert train(r).stats.steps == 8


def test_without_dp_the_clock_stops_training(run, demo_root, tmp_path):
    r = region(run, demo_root, tmp_path)

    def local(budget: float):
        return train_local(
            r.model,
            r.data.train,
            steps=run.training.local_steps,
            batch_size=run.training.batch_size,
            learning_rate=run.training.learning_rate,
            generator=torch.Generator().manual_seed(1),
            time_budget=budget,
        )

    assert local(1e-9).steps == 1  # at least one step
    assert local(0.0).steps == run.training.local_steps
    assert local(1000.0).steps == run.training.local_steps  # local-steps is the cap


# -- FedProx ----------------------------------------------------------------------------


def test_fedprox_pulls_the_update_towards_the_global_adapter(run, demo_root, tmp_path):
    sgd = run.updated(**{"dp": False, "optimizer": "sgd", "learning_rate": 0.5})
    r = region(sgd, demo_root, tmp_path)
    start = r.model.adapter_state()
    free = train(r)
    r.model.load_adapter_state(start)
    rerun(r, sgd.updated(**{"proximal_mu": 1.0}))
    held = train(r)
    assert 0 < norm(held.delta) < 0.8 * norm(free.delta)


def test_fedprox_is_added_after_clipping_and_noise(run, demo_root, tmp_path, monkeypatch):
    """Clipping to almost nothing and no noise leave the DP gradient near zero; the
    proximal term still pulls the adapters back by lr * mu per step, in full: it was
    never clipped."""
    lr, mu, moved, steps = 0.1, 1.0, 0.1, 3
    lab = run.updated(
        **{
            "optimizer": "sgd",
            "learning_rate": lr,
            "proximal_mu": mu,
            "max_grad_norm": 1e-9,
            "secure_mode": False,
        }
    )
    r = region(lab, demo_root, tmp_path)
    start = r.model.adapter_state()
    trainer = PrivateTrainer.for_run(
        r.model, r.data.train, r.local, r.dp, noise_multiplier=0.0, seed=1
    )
    try:
        with torch.no_grad():
            for p in r.model.trainable_parameters():
                p.add_(moved)  # away from the round's start, where the term anchors
        trainer.run(steps)
    finally:
        trainer.close()
    after = r.model.adapter_state()
    expected = moved * (1 - lr * mu) ** steps
    for name in start:
        np.testing.assert_allclose(after[name] - start[name], expected, atol=1e-5)


def test_calibration_warms_up_on_one_example_then_times_the_worst_shape(run, demo_root, tmp_path):
    r = region(run, demo_root, tmp_path)
    trainer = PrivateTrainer.for_run(
        r.model, r.data.train, r.local, r.dp, noise_multiplier=1.0, seed=0
    )
    calls: list[int] = []
    original = trainer._step_batch

    def counted(batch, owners):
        calls.append(len(batch))
        return original(batch, owners)

    trainer._step_batch = counted  # type: ignore[method-assign]
    try:
        start = r.model.adapter_state()
        seconds = trainer.time_step(run.training.seq_len, slowdown=1.0)
        worst = trainer.worst_batch(run.training.seq_len)[0]
        assert seconds > 0 and calls == [1, len(worst)]  # a warm-up, then the worst shape
        assert diff(r.model.adapter_state(), start) == 0.0
        assert not trainer.optimizer.original_optimizer.state
    finally:
        trainer.close()
