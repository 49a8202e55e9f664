"""A region compresses its delta with error feedback kept on its own disk."""

from __future__ import annotations

import numpy as np
import pytest

from fedciuic.compression import ErrorFeedback, flatten, get_codec, layout_id, layout_of
from fedciuic.compression.errors import ResidualError
from fedciuic.config import NodeConfig
from fedciuic.region.trainer import Region, rounding_rng


@pytest.fixture
def region(run_config, demo_root, tmp_path) -> Region:
    run = run_config.updated(
        **{"local_steps": 2, "codec": get_codec("topk-int8:0.05"), "dp": False}
    )
    return Region(
        run, NodeConfig(region="eu", data_path=str(demo_root / "eu"), state_path=str(tmp_path))
    )


def train(r: Region, server_round: int):
    return r.train_round(
        r.model.adapter_state(),
        server_round=server_round,
        base_fingerprint=r.model.base_fingerprint,
    )


def test_what_is_not_sent_is_kept_for_the_next_round(region, tmp_path):
    codec = get_codec("topk-int8:0.05")
    first = train(region, 1)
    n = flatten(first.delta).size
    residual_file = tmp_path / "residual-topk-int8_0.05.bin"
    assert residual_file.exists()
    sent = codec.decode(first.update, n).dense(n)
    feedback = ErrorFeedback(residual_file, codec, layout_id(layout_of(first.delta)), n)
    np.testing.assert_allclose(sent + feedback.load(), flatten(first.delta), atol=1e-6)
    assert len(first.update) < 4 * n / 10  # really compressed


def test_a_corrupted_residual_stops_the_region(region, tmp_path):
    train(region, 1)
    path = tmp_path / "residual-topk-int8_0.05.bin"
    path.write_bytes(path.read_bytes()[:-8])
    with pytest.raises(ResidualError, match=r"residual-topk-int8_0\.05\.bin: corrupted residual"):
        train(region, 2)


def test_rounding_is_replayable_only_where_the_round_is(run_config):
    """A codec's stochastic rounding comes from os entropy under secure DP noise (not a
    stream the aggregator, who picks the seed, can replay), else from the round's seed
    on a stream of its own."""

    def draws(**update) -> list[np.ndarray]:
        run = run_config.updated(**update)
        return [rounding_rng(run.privacy, 1234).random(4) for _ in range(2)]

    first, second = draws(dp=True, secure_mode=True, insecure_reproducible_noise=False)
    assert not np.array_equal(first, second)
    lab = {"dp": True, "secure_mode": False, "insecure_reproducible_noise": True}
    for update in ({"dp": False}, lab):
        first, second = draws(**update)
        np.testing.assert_array_equal(first, second)
        assert not np.array_equal(first, np.random.default_rng(1234).random(4))
