"""Aggregation: weighted FedAvg, update validation (norm, counts, values), robust rules,
FedNova's step normalisation and FedBuff's staleness weight."""

from __future__ import annotations

import numpy as np
import pytest

from fedciuic.aggregator.aggregation import (
    Accumulator,
    Bounds,
    ImplausibleUpdate,
    check,
    check_staleness,
    make_aggregator,
    staleness_weight,
)
from fedciuic.compression import get_codec

DENSE = get_codec("dense")
RNG = np.random.default_rng(0)


def enc(values, codec=DENSE) -> bytes:
    return bytes(codec.encode(np.asarray(values, np.float32), RNG))


NO_BOUNDS = Bounds()


def add(agg, values, weight=1.0, bounds=NO_BOUNDS):
    agg.add(check(DENSE, enc(values), len(values), weight, bounds))


def test_accumulator_weights_by_examples():
    acc = Accumulator(4)
    add(acc, [1.0] * 4, 1.0)
    add(acc, [4.0] * 4, 3.0)
    np.testing.assert_allclose(acc.mean(), 0.25 * 1 + 0.75 * 4)
    assert acc.mean().dtype == np.float32 and acc.count == 2


@pytest.mark.parametrize(
    ("values", "weight", "message"),
    [
        ([1.0, 1.0, 1.0, np.nan], 5.0, "NaN"),
        ([1.0, 1.0, np.inf, 1.0], 5.0, "inf"),
        ([1.0, 1.0, 1.0, 1.0], 0.0, "positive whole number"),
        ([1.0, 1.0, 1.0, 1.0], 2.5, "positive whole number"),
        ([1.0, 1.0, 1.0, 1.0], float("nan"), "positive whole number"),
        ([1.0, 1.0, 1.0, 1.0], 1e12, "over max-examples"),
        ([100.0] * 4, 1.0, "update norm 200 is over max-update-norm 10"),
    ],
)
def test_a_bad_update_is_refused_and_leaves_the_sum_untouched(values, weight, message):
    acc = Accumulator(4)
    add(acc, [1.0] * 4, 2.0)
    with pytest.raises(ValueError, match=message):
        add(acc, values, weight, Bounds(max_norm=10.0))
    np.testing.assert_allclose(acc.mean(), 1.0)
    assert acc.weight == 2.0


def test_wrong_shapes_are_refused():
    with pytest.raises(ValueError, match="update has 3 entries, the adapter has 4"):
        check(DENSE, enc([1.0, 2.0, 3.0]), 4, 1.0, Bounds())


def test_an_update_over_the_norm_bound_can_be_clipped_instead():
    acc = Accumulator(2)
    checked = check(DENSE, enc([30.0, 40.0]), 2, 1.0, Bounds(max_norm=5.0, norm_action="clip"))
    assert checked.clipped and checked.norm == pytest.approx(50.0)
    acc.add(checked)
    np.testing.assert_allclose(acc.mean(), [3.0, 4.0], rtol=1e-6)


def test_sparse_updates_are_checked_on_their_kept_values():
    codec = get_codec("topk:0.5")
    values = np.array([0.0, 3.0, 0.0, 4.0], np.float32)
    checked = check(codec, codec.encode(values, RNG), 4, 1.0, Bounds(max_norm=10.0))
    assert checked.norm == pytest.approx(5.0)


def test_median_and_trimmed_mean_resist_one_scaled_update():
    honest = [[1.0, -1.0], [1.2, -0.8], [0.8, -1.2], [1.1, -0.9]]
    attacker = [100.0, 100.0]
    fedavg, median, trimmed = (
        make_aggregator(m, 2) for m in ("fedavg", "median", "trimmed-mean:0.2")
    )
    for agg in (fedavg, median, trimmed):
        for row in [*honest, attacker]:
            add(agg, row)
    assert fedavg.mean()[0] > 20  # one region drags the mean
    np.testing.assert_allclose(median.mean(), [1.1, -0.9], atol=1e-6)
    np.testing.assert_allclose(trimmed.mean(), [1.1, -0.9], atol=0.05)


def test_unknown_aggregation_is_an_error():
    for bad in ("mean", "trimmed-mean:0.5", "trimmed-mean:x", "median:1"):
        with pytest.raises(ValueError):
            make_aggregator(bad, 2)


def test_empty_accumulator_has_no_mean():
    with pytest.raises(ValueError, match="no update"):
        Accumulator(3).mean()
    with pytest.raises(ValueError, match="no update"):
        make_aggregator("median", 3).mean()


# -- FedNova: local steps, and FedBuff: staleness ----------------------------------------


def add_with(agg, values, weight, *, steps=1, staleness=0, bounds=NO_BOUNDS):
    checked = check(
        DENSE, enc(values), len(values), weight, bounds, steps=steps, staleness=staleness
    )
    agg.add(checked)


def test_equal_steps_are_fedavg_bit_for_bit():
    rng = np.random.default_rng(3)
    rows = [rng.normal(size=64).astype(np.float32) for _ in range(5)]
    weights = [3.0, 17.0, 1.0, 250.0, 9.0]
    for method in ("fedavg", "median", "trimmed-mean:0.2"):
        plain, nova = make_aggregator(method, 64), make_aggregator(method, 64)
        for row, w in zip(rows, weights, strict=True):
            add(plain, row, w)
            add_with(nova, row, w, steps=30)
        assert nova.mean().tobytes() == plain.mean().tobytes(), method
    plain = make_aggregator("fedavg", 64)
    for row, w in zip(rows, weights, strict=True):
        add(plain, row, w)
    expected = sum(w * r.astype(np.float64) for r, w in zip(rows, weights, strict=True))
    np.testing.assert_allclose(plain.mean(), expected / sum(weights), rtol=1e-6, atol=1e-7)


def test_unequal_steps_are_normalised_and_rescaled_by_the_mean_step_count():
    acc = Accumulator(2)
    add_with(acc, [2.0, 4.0], 1.0, steps=2)  # p = 1/4, 1 per step
    add_with(acc, [9.0, 3.0], 3.0, steps=6)  # p = 3/4, 1.5 and 0.5 per step
    tau_eff = 0.25 * 2 + 0.75 * 6  # 5
    expected = tau_eff * (0.25 * np.array([2.0, 4.0]) / 2 + 0.75 * np.array([9.0, 3.0]) / 6)
    np.testing.assert_allclose(acc.mean(), expected, rtol=1e-6)  # [6.875, 4.375]
    np.testing.assert_allclose(acc.mean(), [6.875, 4.375], rtol=1e-6)
    # FedAvg would give 0.25 * [2, 4] + 0.75 * [9, 3] = [7.25, 3.25]: the region that
    # stepped three times as often pulls the mean towards its own objective.
    assert acc.weight == 4.0


def test_robust_rules_normalise_each_row_by_steps_times_the_mean_steps():
    median = make_aggregator("median", 1)
    for value, steps in ((2.0, 1), (30.0, 10), (4.0, 4)):  # per step: 2, 3, 1
        add_with(median, [value], 1.0, steps=steps)
    tau_bar = (1 + 10 + 4) / 3
    np.testing.assert_allclose(median.mean(), [2.0 * tau_bar], rtol=1e-6)


def test_staleness_weight_is_one_over_root_one_plus_s():
    assert staleness_weight(0) == 1.0
    assert staleness_weight(3) == pytest.approx(0.5)
    assert staleness_weight(8) == pytest.approx(1 / 3)


def test_stale_updates_count_less_without_renormalising():
    bounds = Bounds(max_staleness=4)
    acc = Accumulator(2)
    add_with(acc, [4.0, 4.0], 1.0, staleness=3, bounds=bounds)  # w = 1/2
    add_with(acc, [2.0, 2.0], 1.0, staleness=0, bounds=bounds)
    np.testing.assert_allclose(acc.mean(), (0.5 * 4 + 2) / 2)  # 2, not (2 + 2) / 1.5
    only_stale = Accumulator(2)
    add_with(only_stale, [4.0, 4.0], 5.0, staleness=3, bounds=bounds)
    np.testing.assert_allclose(only_stale.mean(), 2.0)  # moves the model half as far
    assert only_stale.weight == 5.0


@pytest.mark.parametrize(
    ("steps", "staleness", "message"),
    [
        (0, 0, "steps must be a whole number >= 1, got 0"),
        (31, 0, "claims 31 local steps, over local-steps 30"),
        (30, 3, "update is 3 global versions old, over max-staleness 2"),
        (30, -1, "staleness must be a whole number >= 0"),
    ],
)
def test_implausible_steps_and_staleness_are_refused(steps, staleness, message):
    acc = Accumulator(2)
    bounds = Bounds(max_steps=30, max_staleness=2)
    add_with(acc, [1.0, 1.0], 1.0, steps=30, staleness=2, bounds=bounds)  # the limits: fine
    with pytest.raises(ImplausibleUpdate, match=message):
        add_with(acc, [9.0, 9.0], 1.0, steps=steps, staleness=staleness, bounds=bounds)
    assert acc.count == 1
    with pytest.raises(ImplausibleUpdate, match="over max-staleness 4"):
        check_staleness(5, 4)
    check_staleness(4, 4)
