from __future__ import annotations

import numpy as np
import pytest

from fedciuic.aggregation import Accumulator, apply_delta
from fedciuic.compression import get_codec


def test_accumulator_weights_by_examples():
    codec = get_codec("dense")
    acc = Accumulator(codec, 4)
    rng = np.random.default_rng(0)
    acc.add(codec.encode(np.ones(4, np.float32), rng), 1.0)
    acc.add(codec.encode(np.full(4, 4.0, np.float32), rng), 3.0)
    np.testing.assert_allclose(acc.mean(), 0.25 * 1 + 0.75 * 4)
    assert acc.mean().dtype == np.float32 and acc.count == 2


def test_a_bad_update_leaves_the_sum_untouched():
    codec = get_codec("dense")
    acc = Accumulator(codec, 4)
    rng = np.random.default_rng(0)
    acc.add(codec.encode(np.ones(4, np.float32), rng), 2.0)
    bad = bytearray(codec.encode(np.ones(4, np.float32), rng))
    bad[-4:] = np.float32(np.nan).tobytes()
    with pytest.raises(ValueError, match="NaN"):
        acc.add(bytes(bad), 5.0)
    with pytest.raises(ValueError, match="positive"):
        acc.add(codec.encode(np.ones(4, np.float32), rng), 0.0)
    np.testing.assert_allclose(acc.mean(), 1.0)
    assert acc.weight == 2.0


def test_empty_accumulator_has_no_mean():
    with pytest.raises(ValueError, match="no update"):
        Accumulator(get_codec("dense"), 3).mean()


def test_apply_delta_scales_by_server_learning_rate():
    out = apply_delta({"a": np.ones(3, np.float32)}, {"a": np.full(3, 2.0, np.float32)}, 0.5)
    np.testing.assert_allclose(out["a"], 2.0)
