"""A sharded region's rank with nothing to train: its module of its own, so that no
other test's cluster is up in this process while it runs (one world per process)."""

from __future__ import annotations

from pathlib import Path

from fedciuic.config import RunConfig
from tests.cluster.test_cluster import alive, assert_one_process_training, make_region, worker_pids
from tests.cluster.test_sharding import SETTINGS
from tests.conftest import unit_config


def test_a_rank_with_nothing_to_train_meets_the_others_passes(
    tiny_checkpoints: dict[str, Path], data_root: Path, tmp_path: Path
) -> None:
    """Without DP, a global batch of one example leaves rank 1 nothing to train on at
    each step: its blank pass meets rank 0's gathers (or rank 0 would wait out the
    collective-timeout), and the round is one process's."""
    values = {
        **unit_config(),
        **SETTINGS,
        "dp": False,
        "batch-size": 1,
        "data-root": str(data_root),
        "model-path": str(tiny_checkpoints["deepseek_v3"]),
    }
    run = RunConfig.from_user_config(values, source="test")
    whole = make_region(run, data_root, tmp_path / "whole", 1)
    sharded = make_region(run, data_root, tmp_path / "sharded", 2, "shard")
    try:
        assert_one_process_training(sharded, whole)
        started = worker_pids(sharded)
    finally:
        sharded.close()
    assert started and not [pid for pid in started if alive(pid)]
