from __future__ import annotations

import numpy as np
import pytest

from fedciuic.aggregation import apply_delta, check_update, weighted_mean

REF = {"a": np.zeros((2, 3), np.float32), "b": np.zeros(4, np.float32)}


def test_weighted_mean_weights_by_examples():
    d1 = {"a": np.ones((2, 3), np.float32), "b": np.full(4, 2.0, np.float32)}
    d2 = {"a": np.full((2, 3), 4.0, np.float32), "b": np.zeros(4, np.float32)}
    mean = weighted_mean([d1, d2], [1.0, 3.0])
    np.testing.assert_allclose(mean["a"], 0.25 * 1 + 0.75 * 4)
    np.testing.assert_allclose(mean["b"], 0.5)
    assert mean["a"].dtype == np.float32


def test_weighted_mean_refuses_zero_weights_and_empty_input():
    with pytest.raises(ValueError, match="positive"):
        weighted_mean([REF], [0.0])
    with pytest.raises(ValueError, match="at least one"):
        weighted_mean([], [])


def test_apply_delta_scales_by_server_learning_rate():
    current = {"a": np.ones(3, np.float32)}
    out = apply_delta(current, {"a": np.full(3, 2.0, np.float32)}, 0.5)
    np.testing.assert_allclose(out["a"], 2.0)


@pytest.mark.parametrize(
    ("update", "message"),
    [
        ({"a": np.zeros((2, 3), np.float32)}, "missing"),
        ({**REF, "c": np.zeros(1, np.float32)}, "unexpected"),
        ({**REF, "b": np.zeros(5, np.float32)}, "shape"),
        ({**REF, "b": np.array([0, np.nan, 0, 0], np.float32)}, "NaN or infinite"),
        ({**REF, "b": np.array([0, np.inf, 0, 0], np.float32)}, "NaN or infinite"),
    ],
)
def test_bad_updates_are_rejected(update, message):
    with pytest.raises(ValueError, match=message):
        check_update(update, REF)


def test_good_update_passes():
    check_update({k: v + 1 for k, v in REF.items()}, REF)
