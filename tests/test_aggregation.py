"""Aggregation: weighted FedAvg, update validation (norm, counts, values), robust rules."""

from __future__ import annotations

import numpy as np
import pytest

from fedciuic.aggregation import Accumulator, Bounds, apply_delta, check, make_aggregator
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


def test_apply_delta_scales_by_server_learning_rate():
    out = apply_delta({"a": np.ones(3, np.float32)}, {"a": np.full(3, 2.0, np.float32)}, 0.5)
    np.testing.assert_allclose(out["a"], 2.0)
