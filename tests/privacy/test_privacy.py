"""Accounting, calibration and the privacy ledger (no training here)."""

from __future__ import annotations

import json
import math
import multiprocessing
import random
from functools import partial
from pathlib import Path
from typing import Any

import dp_accounting
import pytest

from fedciuic.config import COUNTS, TRAINING, Accountant, PrivacyUnit, Purpose
from fedciuic.privacy import ledger as ledger_module
from fedciuic.privacy.dpsgd import dp_count, dp_mean
from fedciuic.privacy.ledger import (
    EPSILON_TOLERANCE,
    PrivacyError,
    PrivacyLedger,
    Step,
    calibrate_noise,
    calibrate_noise_after,
    dp_mean_step,
    epsilon_of,
    locked,
    poisson_sample_rate,
    remembered_noise,
    smallest_noise,
)

DATASET = "a" * 64
OTHER = "b" * 64

SETTINGS = [
    # (history of (noise multiplier, sample rate, steps), delta)
    ([(1.0, 0.01, 90)], 1e-5),
    ([(0.46, 1 / 146, 90)], 1e-5),
    ([(2.0, 0.05, 300)], 1e-6),
    ([(0.6, 0.01, 30), (1.2, 0.02, 60)], 1e-5),
]


def google(history, delta, kind):
    if kind == "prv":  # PRV and PLD are both numerical, near-exact accountants
        acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    else:
        acc = dp_accounting.rdp.RdpAccountant()
    for sigma, rate, steps in history:
        event = dp_accounting.PoissonSampledDpEvent(rate, dp_accounting.GaussianDpEvent(sigma))
        acc.compose(event, steps)
    return acc.get_epsilon(delta)


@pytest.mark.parametrize("kind", ["prv", "rdp"])
@pytest.mark.parametrize(("history", "delta"), SETTINGS)
def test_epsilon_matches_googles_dp_accounting_within_5_percent(history, delta, kind):
    ours = epsilon_of(history, delta, kind)
    theirs = google(history, delta, kind)
    assert ours == pytest.approx(theirs, rel=0.05)


@pytest.mark.parametrize("kind", ["prv", "rdp"])
def test_calibrated_noise_ends_at_or_under_the_target(kind):
    rate, steps = poisson_sample_rate(2322, 16), 90
    sigma = calibrate_noise(8.0, 1e-5, rate, steps, kind)
    eps = epsilon_of([(sigma, rate, steps)], 1e-5, kind)
    assert 7.8 <= eps <= 8.0
    assert google([(sigma, rate, steps)], 1e-5, kind) <= 8.0 * 1.05


@pytest.mark.parametrize("kind", ["prv", "rdp"])
def test_a_history_split_into_rounds_accounts_exactly_as_the_whole(kind):
    """Rounds of one noise and rate compose as one entry of all their steps (PRV's cost
    grows with the entries): the same epsilon to the last bit, in any order."""
    rounds = [(0.6, 0.01, 30), (14.0, 1.0, 1)] * 6
    whole = [(0.6, 0.01, 180), (14.0, 1.0, 6)]
    assert epsilon_of(rounds, 1e-5, kind) == epsilon_of(whole, 1e-5, kind)
    assert epsilon_of(rounds, 1e-5, kind) == pytest.approx(google(rounds, 1e-5, kind), rel=0.05)


def rdp_of(sigma: float, rate: float, steps: int) -> float:
    return epsilon_of([(sigma, rate, steps)], 1e-5, "rdp")


def test_calibration_ends_within_the_tolerance_under_any_target_in_a_few_accountings():
    """The search returns noise it accounted under target, within EPSILON_TOLERANCE of
    it (or the smallest to 0.2 %), over targets, rates and step counts that span what a
    run configures; a PRV calibration takes at most 7 accountings (bisection took 12)."""
    rng = random.Random(0)
    for _ in range(16):  # RDP at a high rate takes about 1 s a calibration
        target = math.exp(rng.uniform(math.log(0.2), math.log(60.0)))
        rate = math.exp(rng.uniform(math.log(1e-4), 0.0))
        steps = int(math.exp(rng.uniform(0.0, math.log(5000))))
        sigma = smallest_noise(partial(rdp_of, rate=rate, steps=steps), target)
        eps = epsilon_of([(sigma, rate, steps)], 1e-5, "rdp")
        less = epsilon_of([(sigma * (1 - 2e-3), rate, steps)], 1e-5, "rdp")
        assert eps <= target and (target - eps <= EPSILON_TOLERANCE or less > target)
    accounted: list[float] = []

    def prv(sigma: float) -> float:
        accounted.append(sigma)
        return epsilon_of([COUNT, (sigma, poisson_sample_rate(2322, 16), 90)], 1e-5, "prv")

    sigma = smallest_noise(prv, 8.0)
    assert len(accounted) <= 7
    assert 8.0 - EPSILON_TOLERANCE <= prv(sigma) <= 8.0


def test_poisson_rate_is_one_over_the_number_of_batches():
    assert poisson_sample_rate(100, 16) == pytest.approx(1 / 7)


def open_ledger(
    path: Path, dataset: str = DATASET, delta: float = 1e-5, unit: PrivacyUnit = "record"
) -> PrivacyLedger:
    return PrivacyLedger.open(
        path, region="eu", dataset=dataset, delta=delta, accountant="prv", unit=unit
    )


def spend(
    ledger: PrivacyLedger,
    step=(1.0, 0.01, 30),
    server_round: int = 1,
    purpose: Purpose = TRAINING,
    count: int | None = None,
) -> None:
    ledger.append(
        ledger.new_record(
            run_id=1,
            server_round=server_round,
            step=step,
            max_grad_norm=1.0,
            secure_mode=False,
            epsilon=ledger.epsilon_after(step),
            purpose=purpose,
            count=count,
        )
    )


@pytest.mark.parametrize("kind", ["prv", "rdp"])
def test_a_user_level_ledger_accounts_at_the_user_rate_as_dp_accounting_does(tmp_path, kind):
    """User-level DP-SGD samples users at q = batch_size / num_users: the ledger's epsilon
    is dp-accounting's for that q (within the 5 % above), and larger than the
    record-level epsilon of the same data, whose records outnumber its users."""
    records, users, batch, steps, sigma, delta = 2322, 300, 16, 90, 1.0, 1e-5
    step = (sigma, batch / users, steps)
    path = tmp_path / "ledger.jsonl"
    ledger = PrivacyLedger.open(
        path, region="eu", dataset=DATASET, delta=delta, accountant=kind, unit="user"
    )
    spend(ledger, step)
    kept = PrivacyLedger.load(path)
    assert kept.header.unit == "user" and kept.history == [step]
    assert kept.epsilon == pytest.approx(google([step], delta, kind), rel=0.05)
    per_record = epsilon_of([(sigma, poisson_sample_rate(records, batch), steps)], delta, kind)
    assert kept.epsilon > per_record


def test_the_ledger_refuses_a_run_with_another_privacy_unit(tmp_path):
    path = tmp_path / "ledger.jsonl"
    spend(open_ledger(path))
    with pytest.raises(PrivacyError) as err:
        open_ledger(path, unit="user")
    message = str(err.value)
    assert message.startswith(f"{path}: the ledger accounts per record, the run asks for ")
    assert "privacy-unit 'user'" in message and "set privacy-unit to 'record'" in message
    assert "their own state-path" in message and "\n" not in message
    assert open_ledger(path).epsilon > 0  # the record-level run goes on


def test_ledger_survives_reopening_and_keeps_the_full_history(tmp_path):
    path = tmp_path / "ledger.jsonl"
    first = open_ledger(path)
    spend(first)
    spend(first, server_round=2)
    again = open_ledger(path)
    assert len(again.rounds) == 2
    assert again.history == [(1.0, 0.01, 30), (1.0, 0.01, 30)]
    assert again.epsilon == pytest.approx(epsilon_of(again.history, 1e-5, "prv"))
    assert again.epsilon > epsilon_of(again.history[:1], 1e-5, "prv")


def test_ledger_records_recompute_from_their_own_fields(tmp_path):
    path = tmp_path / "ledger.jsonl"
    ledger = open_ledger(path)
    spend(ledger, step=(0.8, 0.02, 40))
    spend(ledger, step=(1.1, 0.02, 40), server_round=2)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0]["kind"] == "header" and lines[0]["dataset"] == DATASET
    for record in lines[1:]:
        history = [tuple(h) for h in record["accountant_state"]["history"]]
        assert epsilon_of(history, record["delta"], "prv") == pytest.approx(record["epsilon"])


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda t: t[:-1], "last line is truncated"),
        (lambda t: t.replace('"steps":30', '"steps":"x"', 1), r"ledger\.jsonl:2: corrupted"),
        (lambda t: t.replace('"steps":30', '"steps":3', 1), r"ledger\.jsonl:2: accountant history"),
        (lambda t: t + "{not json}\n", r"ledger\.jsonl:4: corrupted"),
        (lambda t: "", "ledger is empty"),
        (
            lambda t: "\n".join([t.splitlines()[0], t.splitlines()[2], t.splitlines()[1]]) + "\n",
            "accountant history does not continue",
        ),
    ],
)
def test_damaged_ledger_is_refused_naming_the_file(tmp_path, damage, message):
    path = tmp_path / "ledger.jsonl"
    ledger = open_ledger(path)
    spend(ledger)
    spend(ledger, server_round=2)
    path.write_text(damage(path.read_text()))
    with pytest.raises(PrivacyError, match=message):
        open_ledger(path)


def test_ledger_of_another_dataset_is_refused(tmp_path):
    path = tmp_path / "ledger.jsonl"
    spend(open_ledger(path))
    with pytest.raises(PrivacyError, match="belongs to region 'eu', dataset aaaaaaaaaaaa"):
        open_ledger(path, dataset=OTHER)


def test_ledger_refuses_a_different_delta(tmp_path):
    path = tmp_path / "ledger.jsonl"
    spend(open_ledger(path))
    with pytest.raises(PrivacyError, match="keep target-delta at 1e-05"):
        open_ledger(path, delta=1e-6)


def _append_many(path: str, count: int) -> None:
    for _ in range(count):
        with locked(Path(path)):
            ledger = open_ledger(Path(path))
            spend(ledger, step=(2.0, 0.01, 1), server_round=len(ledger.rounds) + 1)


def test_two_processes_of_one_region_do_not_corrupt_the_ledger(tmp_path):
    path = tmp_path / "ledger.jsonl"
    ctx = multiprocessing.get_context("spawn")
    workers = [ctx.Process(target=_append_many, args=(str(path), 6)) for _ in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=120)
        assert w.exitcode == 0
    ledger = open_ledger(path)  # validates the whole chain
    assert len(ledger.rounds) == 12
    assert [r.round for r in ledger.rounds] == list(range(1, 13))


def _hold_lock(path: str, ready, release) -> None:
    with locked(Path(path)):
        ready.set()
        release.wait(30)


def test_a_held_lock_times_out_with_a_clear_message(tmp_path):
    path = tmp_path / "ledger.jsonl"
    ctx = multiprocessing.get_context("spawn")
    ready, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold_lock, args=(str(path), ready, release))
    holder.start()
    try:
        assert ready.wait(30)
        with (
            pytest.raises(PrivacyError, match=r"ledger\.jsonl\.lock: held by another process"),
            locked(path, timeout=0.5),
        ):
            pass
    finally:
        release.set()
        holder.join(30)


# -- the run's DP count of units (count-noise) ----------------------------------------------

COUNT = (3.0, 1.0, 1)  # the Gaussian mechanism of sensitivity 1, std 3


@pytest.mark.parametrize("kind", ["prv", "rdp"])
def test_a_run_of_a_count_evaluations_and_rounds_reports_what_dp_accounting_does(kind):
    """A DP count, 5 DP held-out losses (each a sum and a count: noise / sqrt 2 at rate
    1) and the rounds: the epsilon the ledger reports for the whole history is Google's
    dp_accounting's within 5 %, and the calibration keeps it at or under the target."""
    prefix = (COUNT, *[dp_mean_step(20.0)] * 5)
    rate, steps = poisson_sample_rate(2322, 16), 90
    sigma = calibrate_noise_after(prefix, 8.0, 1e-5, rate, steps, kind)
    history = [*prefix, (sigma, rate, steps)]
    eps = epsilon_of(history, 1e-5, kind)
    assert 7.8 <= eps <= 8.0
    assert google(history, 1e-5, kind) == pytest.approx(eps, rel=0.05)


@pytest.mark.parametrize("kind", ["prv", "rdp"])
def test_calibration_after_a_count_keeps_the_whole_run_under_target(kind):
    """The run reports the composition of its count and its training steps: the noise is
    calibrated for both, so what it reports bounds all it released, and an independent
    accountant agrees within 5 %."""
    rate, steps = poisson_sample_rate(2322, 16), 90
    alone = calibrate_noise(8.0, 1e-5, rate, steps, kind)
    sigma = calibrate_noise_after((COUNT,), 8.0, 1e-5, rate, steps, kind)
    history = [COUNT, (sigma, rate, steps)]
    eps = epsilon_of(history, 1e-5, kind)
    assert 7.8 <= eps <= 8.0 and sigma > alone  # the count's cost leaves less for training
    assert google(history, 1e-5, kind) == pytest.approx(eps, rel=0.05)
    assert calibrate_noise_after((), 8.0, 1e-5, rate, steps, kind) == alone


def test_a_calibration_is_remembered_across_processes_and_checked_before_use(
    tmp_path, monkeypatch, caplog
):
    """A region's calibration is kept in its state folder, so another process serving the
    region does not calibrate again; a remembered value that would not keep the run
    under target (edited, damaged) is calibrated over, and an unreadable file too."""
    inputs: tuple[tuple[Step, ...], float, float, float, int, Accountant] = (
        (COUNT,),
        4.0,
        1e-5,
        poisson_sample_rate(500, 8),
        60,
        "rdp",
    )

    def in_a_new_process(*args: Any) -> float:
        remembered_noise.cache_clear()  # what a process remembers in memory
        return remembered_noise(*args)

    sigma = in_a_new_process(tmp_path, *inputs)
    assert sigma == calibrate_noise_after(*inputs)
    path = tmp_path / ledger_module.CALIBRATIONS_FILE
    (key,) = json.loads(path.read_text())
    calls: list[object] = []

    def calibrate(*args: object) -> float:
        calls.append(args)
        return 9.0

    monkeypatch.setattr(ledger_module, "calibrate_noise_after", calibrate)
    assert in_a_new_process(tmp_path, *inputs) == sigma and calls == []
    path.write_text(json.dumps({key: sigma / 4}))  # too little noise for the target
    assert in_a_new_process(tmp_path, *inputs) == 9.0 and len(calls) == 1
    assert json.loads(path.read_text()) == {key: 9.0}
    path.write_text("{not json")
    assert in_a_new_process(tmp_path, *inputs) == 9.0 and len(calls) == 2
    assert "unreadable" in caplog.text and str(path) in caplog.text
    other = (*inputs[:4], 90, inputs[5])  # other inputs: their own entry
    assert in_a_new_process(tmp_path, *other) == 9.0 and len(calls) == 3
    assert len(json.loads(path.read_text())) == 2


def test_a_count_that_costs_the_whole_target_is_refused_naming_the_keys():
    with pytest.raises(PrivacyError, match=r"target-epsilon: 0\.5 leaves nothing .* eval-noise"):
        calibrate_noise_after(((0.5, 1.0, 1),), 0.5, 1e-5, 0.01, 90, "prv")


def test_a_count_line_is_its_own_release_and_training_lines_keep_their_old_form(tmp_path):
    path = tmp_path / "ledger.jsonl"
    ledger = open_ledger(path)
    assert ledger.run_count(1) is None
    spend(ledger, COUNT, purpose=COUNTS, count=1234)
    spend(ledger, server_round=1)
    kept = PrivacyLedger.load(path)
    assert kept.history == [COUNT, (1.0, 0.01, 30)]  # the count composes with the rounds
    assert kept.run_count(1) == 1234 and kept.run_count(2) is None
    assert kept.released(1, 1) and not kept.released(1, 2)
    assert kept.epsilon == pytest.approx(epsilon_of(kept.history, 1e-5, "prv"))
    lines = path.read_bytes().splitlines()
    assert b'"purpose":"counts"' in lines[1] and b'"count":1234' in lines[1]
    assert b"purpose" not in lines[2] and b'"count"' not in lines[2]  # as before counts


def test_a_dp_count_is_the_count_plus_gaussian_noise_rounded():
    draws = [dp_count(1000, 20.0, secure_mode=False, seed=s) for s in range(400)]
    assert all(isinstance(d, int) for d in draws)
    mean = sum(draws) / len(draws)
    std = (sum((d - mean) ** 2 for d in draws) / (len(draws) - 1)) ** 0.5
    assert abs(mean - 1000) < 4 and 17 < std < 23
    assert dp_count(1000, 20.0, secure_mode=False, seed=7) == dp_count(
        1000, 20.0, secure_mode=False, seed=7
    )
    assert dp_count(0, 50.0, secure_mode=True) >= 0  # post-processing keeps a count a count


def test_a_dp_mean_clips_each_unit_and_keeps_its_figures_in_range():
    values = [0.5, 2.0, 50.0, -1.0]  # one above the clip, one below 0
    mean, count = dp_mean(values, 10.0, 1e-9, secure_mode=False, seed=1)
    assert mean == pytest.approx((0.5 + 2.0 + 10.0 + 0.0) / 4) and count == 4
    noisy = [dp_mean([1.0] * 40, 10.0, 50.0, secure_mode=True) for _ in range(20)]
    assert all(0.0 <= m <= 10.0 and c >= 1 for m, c in noisy)
