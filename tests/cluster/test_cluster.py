"""A region trained by several processes (gloo on the CPU): DP-DDP equals one process
with the same global batch, the ledger accounts the same, and a dead rank fails the
round with one clear line, never a hang, leaving no process behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from fedciuic.cluster import TrainCommand, TrainingCluster, training
from fedciuic.cluster.auth import SECRET_ENV, new_secret
from fedciuic.cluster.dist import ClusterError, World, check_placement
from fedciuic.cluster.protocol import TIMEOUT_ENV, free_port
from fedciuic.cluster.training import processes_key
from fedciuic.config import NodeConfig, RunConfig, Sharding
from fedciuic.model.train import train_local
from fedciuic.privacy.dpsgd import PrivateTrainer
from fedciuic.privacy.ledger import PrivacyLedger, poisson_sample_rate
from fedciuic.region.trainer import Region
from tests.conftest import EXACT_RELEASES, ROOT, unit_config

#: Every unit in every batch (q = 1), all of a unit's examples: sampling is then the
#: same in one process and in two, so their updates must match.
SETTINGS = {
    **EXACT_RELEASES,  # the trainer's rounds alone (the agent's rounds count first)
    "local-steps": 2,
    "num-server-rounds": 3,
    "batch-size": 100_000,
    "privacy-unit": "record",
    "max-examples-per-unit": 1024,
    "optimizer": "sgd",
    "learning-rate": 0.5,
    "secure-mode": False,
    "epsilon-budget": 1000.0,
    "collective-timeout": 5.0,
    "seq-len": 64,
}


def alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def worker_pids(region: Region) -> list[int]:
    cluster = region._cluster
    return [] if cluster is None else [p.pid for p in cluster.workers.values()]


@pytest.fixture(scope="module")
def run(data_root: Path) -> RunConfig:
    return RunConfig.from_user_config(
        {**unit_config(), "data-root": str(data_root), **SETTINGS}, source="test"
    )


def make_region(
    run: RunConfig, data_root: Path, state: Path, processes: int, sharding: Sharding = "replicate"
) -> Region:
    node = NodeConfig(
        region="eu",
        data_path=str(data_root / "eu"),
        state_path=str(state),
        train_processes=processes,
        train_sharding=sharding,
    )
    return Region(run, node)


@pytest.fixture(scope="module")
def pair(
    run: RunConfig, data_root: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Region]:
    """A 2-process region, its cluster kept across the module's tests; every process
    it started is gone afterwards."""
    region = make_region(run, data_root, tmp_path_factory.mktemp("pair"), 2)
    started: set[int] = set()
    try:
        yield region
        started.update(worker_pids(region))
    finally:
        started.update(worker_pids(region))
        region.close()
    assert not [pid for pid in started if alive(pid)]


def dp_command(region: Region, **changes: Any) -> TrainCommand:
    rate = poisson_sample_rate(region.data.train.num_units, region.run.training.batch_size)
    values: dict[str, Any] = {"dp": True, "steps": 2, "sample_rate": rate, "seed": 3}
    return TrainCommand(**{**values, **changes})


def assert_one_process_update(cluster: Region, whole: Region, atol: float) -> None:
    """Two noise-free DP steps of ``cluster`` over its processes move the adapters as
    ``whole``'s two in one process do, from the same start (then restored)."""
    start = whole.model.adapter_state()
    cluster.model.load_adapter_state(start)
    cluster._train_cluster(dp_command(cluster, noise_multiplier=0.0))
    two = cluster.model.adapter_state()
    whole.model.load_adapter_state(start)
    trainer = PrivateTrainer.for_run(
        whole.model, whole.data.train, whole.local, whole.dp, noise_multiplier=0.0, seed=3
    )
    try:
        trainer.run(2)
    finally:
        trainer.close()
    one = whole.model.adapter_state()
    whole.model.load_adapter_state(start)
    assert any(np.abs(one[k] - start[k]).max() > 1e-4 for k in start)  # it trained
    for name in start:
        np.testing.assert_allclose(two[name] - start[name], one[name] - start[name], atol=atol)


def test_two_processes_give_the_one_process_update(pair: Region) -> None:
    assert_one_process_update(pair, pair, atol=2e-6)


def assert_one_process_training(cluster: Region, whole: Region) -> None:
    """Two steps without DP over ``cluster``'s processes (each rank its share of the same
    global batch, the gradients summed) move the adapters as ``whole``'s two in one
    process do, from the same start (then restored)."""
    start = whole.model.adapter_state()
    cluster.model.load_adapter_state(start)
    two = cluster._train_cluster(TrainCommand(steps=2, seed=5)).stats
    after_two = cluster.model.adapter_state()
    whole.model.load_adapter_state(start)
    local = whole.local
    one = train_local(
        whole.model,
        whole.data.train,
        steps=2,
        batch_size=local.batch_size,
        learning_rate=local.learning_rate,
        generator=torch.Generator().manual_seed(5),
        optimizer=local.optimizer,
    )
    after_one = whole.model.adapter_state()
    whole.model.load_adapter_state(start)
    assert two.loss == pytest.approx(one.loss, rel=1e-5)
    assert any(np.abs(after_one[k] - start[k]).max() > 1e-4 for k in start)  # it trained
    for name in start:
        np.testing.assert_allclose(after_two[name], after_one[name], atol=2e-6)


def test_two_processes_train_without_dp_as_one(pair: Region) -> None:
    assert_one_process_training(pair, pair)


def test_noise_is_added_once(pair: Region, run: RunConfig) -> None:
    # Noise that swamps every clipped gradient: one SGD step moves each coordinate by
    # lr * N(0, (sigma C)^2) / B; noise from both ranks would be sqrt(2) times that.
    sigma, units = 1000.0, pair.data.train.num_units
    start = pair.model.adapter_state()
    pair._train_cluster(dp_command(pair, noise_multiplier=sigma, steps=1))
    moved = np.concatenate([(v - start[k]).ravel() for k, v in pair.model.adapter_state().items()])
    pair.model.load_adapter_state(start)
    scale = run.training.learning_rate * sigma * run.privacy.max_grad_norm / units
    assert 0.93 < moved.std() / scale < 1.07


def test_the_ledger_accounts_the_global_batch(
    pair: Region, run: RunConfig, data_root: Path, tmp_path: Path
) -> None:
    alone = make_region(run, data_root, tmp_path, 1)
    adapter = alone.model.adapter_state()
    fingerprint = alone.model.base_fingerprint
    one = alone.train_round(adapter, server_round=1, base_fingerprint=fingerprint, run_id=1)
    assert alone._cluster is None  # one process: no process group, no subprocess
    two = pair.train_round(adapter, server_round=1, base_fingerprint=fingerprint, run_id=1)
    assert one.privacy is not None and two.privacy is not None
    assert two.privacy.epsilon == pytest.approx(one.privacy.epsilon, rel=1e-9)
    (a,) = PrivacyLedger.load(alone.ledger_path).rounds
    (b,) = PrivacyLedger.load(pair.ledger_path).rounds
    assert (a.noise_multiplier, a.sample_rate, a.steps) == (
        b.noise_multiplier,
        b.sample_rate,
        b.steps,
    )
    assert a.epsilon == pytest.approx(b.epsilon, rel=1e-9)


def test_a_time_budget_is_planned_on_rank_0_for_every_rank(
    pair: Region, run: RunConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    # DP: rank 0 plans one step (nothing fits the budget) and sends the count; both
    # ranks take it, and the ledger records it. The noise stays calibrated for 2.
    monkeypatch.setattr(pair, "run", run.updated(**{"local_time_budget": 1e-9}))
    monkeypatch.setattr(pair, "local", pair.node.training(pair.run))
    adapter = pair.model.adapter_state()
    fingerprint = pair.model.base_fingerprint
    out = pair.train_round(adapter, server_round=1, base_fingerprint=fingerprint, run_id=9)
    pair.model.load_adapter_state(adapter)
    record = PrivacyLedger.load(pair.ledger_path).rounds[-1]
    assert (record.run_id, record.steps) == (9, 1) and out.stats.steps == 1
    assert record.noise_multiplier == pair.privacy_step()[0]


def test_without_dp_rank_0s_clock_stops_every_rank(pair: Region) -> None:
    start = pair.model.adapter_state()
    done = pair._train_cluster(TrainCommand(steps=5, seed=5, time_budget=1e-9))
    pair.model.load_adapter_state(start)
    assert done.stats.steps == done.fewest_steps == done.most_steps == 1


def kill_at_next_step(region: Region, monkeypatch: pytest.MonkeyPatch) -> int:
    """SIGKILL ``region``'s one worker as rank 0 takes its next DP-SGD step; its pid."""
    (victim,) = worker_pids(region)
    step = PrivateTrainer.step

    def kill_then_step(self: PrivateTrainer, units: Any) -> float:
        if alive(victim):
            os.kill(victim, signal.SIGKILL)
        return step(self, units)

    monkeypatch.setattr(PrivateTrainer, "step", kill_then_step)
    return victim


def test_a_killed_worker_fails_the_round_and_the_next_round_rebuilds(
    pair: Region, monkeypatch: pytest.MonkeyPatch
) -> None:
    adapter = pair.model.adapter_state()
    fingerprint = pair.model.base_fingerprint
    pair.train_round(adapter, server_round=1, base_fingerprint=fingerprint, run_id=2)
    victim = kill_at_next_step(pair, monkeypatch)
    began = time.monotonic()
    with pytest.raises(
        ClusterError,
        match=rf"region eu: training process rank 1 \(pid {victim}\) died \(signal 9: SIGKILL\) "
        "during round 2",
    ):
        pair.train_round(adapter, server_round=2, base_fingerprint=fingerprint, run_id=2)
    assert time.monotonic() - began < pair.run.cluster.collective_timeout + 5
    assert pair._cluster is None and not alive(victim)
    ledger = PrivacyLedger.load(pair.ledger_path)
    assert [(r.run_id, r.round) for r in ledger.rounds if r.run_id == 2] == [(2, 1)]
    monkeypatch.undo()
    third = pair.train_round(adapter, server_round=3, base_fingerprint=fingerprint, run_id=2)
    assert third.stats.steps == 2
    (fresh,) = worker_pids(pair)
    assert fresh != victim and alive(fresh)


def test_a_failure_on_rank_0_with_every_worker_alive_is_one_clear_error(
    pair: Region, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 fails (here before its first collective) while its worker lives: one
    ClusterError naming the round and the cause, and the next round starts afresh."""
    pair._train_cluster(TrainCommand(steps=1, seed=1))  # the cluster is up
    workers = worker_pids(pair)

    def fail(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("Connection reset by peer\nstack trace ...")

    monkeypatch.setattr(training, "train_rank", fail)
    with pytest.raises(
        ClusterError,
        match=r"region eu: training across 2 processes failed during round 7 "
        r"\(Connection reset by peer\); collective-timeout is",
    ):
        pair._train_cluster(TrainCommand(steps=1, seed=1, server_round=7))
    assert pair._cluster is None and workers and not [p for p in workers if alive(p)]
    monkeypatch.undo()
    assert pair._train_cluster(TrainCommand(steps=1, seed=1)).stats.steps == 1


def test_more_processes_than_cores_is_one_clear_line(pair: Region, run: RunConfig) -> None:
    cores = os.cpu_count() or 1
    node = pair.node.model_copy(update={"train_processes": cores + 1})
    cluster = TrainingCluster(run, node, pair.model, pair.data)
    with pytest.raises(
        ClusterError,
        match=rf"^node config:train-processes: {cores + 1} training processes, but this "
        rf"machine has {cores} CPU core\(s\).*set train-processes to at most {cores}",
    ):
        cluster.start()
    assert not cluster.workers
    with pytest.raises(ClusterError, match="run config:train-processes: 0; a region runs"):
        check_placement(0, pair.model.device, key="run config:train-processes")


def test_a_rank_that_cannot_reach_rank_0_fails_within_the_timeout() -> None:
    world = World(rank=1, world_size=2, master_port=free_port())  # nobody listens there
    env = {
        **os.environ,
        **world.env(),
        SECRET_ENV: new_secret().hex(),
        TIMEOUT_ENV: "1",
        "PYTHONPATH": str(ROOT),
    }
    began = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "fedciuic.cluster.worker"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert re.search(
        r"^fedciuic: rank 1: rank 1 cannot reach rank 0 at 127\.0\.0\.1:\d+ within 1 s "
        r"\(collective-timeout\); check MASTER_ADDR and MASTER_PORT",
        done.stderr,
        re.MULTILINE,
    ), done.stderr
    assert time.monotonic() - began < 30  # python and torch start-up, then about 1 s


@pytest.mark.parametrize(
    ("env", "problem"),
    [
        ({"RANK": "1"}, "RANK is set but WORLD_SIZE, MASTER_PORT is not"),
        ({"RANK": "x", "WORLD_SIZE": "2", "MASTER_PORT": "1"}, "bad torchrun variables"),
        ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_PORT": "1"}, "RANK 2 is not below"),
    ],
)
def test_bad_torchrun_environments_are_one_line(env: dict[str, str], problem: str) -> None:
    with pytest.raises(ClusterError, match=problem):
        World.from_env(env)


def test_the_torchrun_environment_is_read() -> None:
    env = World(rank=3, world_size=16, local_rank=3, local_world_size=8, master_port=29500)
    assert World.from_env(env.env()) == env
    assert World.from_env({}) is None


def test_errors_name_where_the_count_was_set(run: RunConfig, data_root: Path) -> None:
    node = NodeConfig(region="eu", data_path=str(data_root / "eu"))
    simulated = run.updated(**{"region_train_processes": (("eu", 2),)})
    assert processes_key(run, node) == "run config:train-processes"
    counted = node.model_copy(update={"train_processes": 2})
    assert processes_key(simulated, counted) == "run config:region-train-processes"
    assert processes_key(run, counted) == "node config:train-processes"


def test_fedprox_over_two_processes_is_fedprox_in_one(
    pair: Region, run: RunConfig, data_root: Path, tmp_path: Path
) -> None:
    # The term joins after the all-reduce, once per step on each rank: counted twice
    # (or summed over the ranks) the second step would differ from one process's.
    pair.close()  # a process is in one world at a time (the pair starts again if used)
    prox = run.updated(**{"proximal_mu": 3.0})
    region = make_region(prox, data_root, tmp_path, 2)
    try:
        start = region.model.adapter_state()
        region._train_cluster(dp_command(region, noise_multiplier=0.0))
        two = region.model.adapter_state()
    finally:
        pids = worker_pids(region)
        region.close()
    assert not [pid for pid in pids if alive(pid)]
    after = {}
    for mu in (3.0, 0.0):
        region.model.load_adapter_state(start)
        trainer = PrivateTrainer.for_run(
            region.model,
            region.data.train,
            run.updated(**{"proximal_mu": mu}).training,
            run.privacy,
            noise_multiplier=0.0,
            seed=3,
        )
        try:
            trainer.run(2)
        finally:
            trainer.close()
        after[mu] = region.model.adapter_state()
    for name in start:
        np.testing.assert_allclose(two[name], after[3.0][name], atol=2e-6)
    assert any(np.abs(after[3.0][k] - after[0.0][k]).max() > 1e-4 for k in start)


def test_two_processes_train_lora_sb_as_one(
    pair: Region, run: RunConfig, data_root: Path, tmp_path: Path
) -> None:
    """Each worker derives the fixed factors itself: the R they train is rank 0's alone."""
    pair.close()  # one cluster per process at a time (a later round would rebuild it)
    sb = run.updated(**{"adapter_mode": "lora-sb"})
    region = make_region(sb, data_root, tmp_path, 2)
    try:
        start = region.model.adapter_state()
        region._train_cluster(dp_command(region, noise_multiplier=0.0))
        two = region.model.adapter_state()
    finally:
        region.close()
    region.model.load_adapter_state(start)
    model, examples = region.model, region.data.train
    trainer = PrivateTrainer.for_run(
        model, examples, sb.training, sb.privacy, noise_multiplier=0.0, seed=3
    )
    try:
        trainer.run(2)
    finally:
        trainer.close()
    one = region.model.adapter_state()
    assert all(name.endswith(".lora_R.weight") for name in start)
    assert any(np.abs(one[k] - start[k]).max() > 1e-4 for k in start)  # it trained
    for name in start:
        np.testing.assert_allclose(two[name], one[name], atol=2e-6)
