"""A region's store: it listens on loopback (all ranks local) or on the interface the
operator names, never on every interface, and no rank acts on a value in it that
lacks the cluster secret's MAC: a stray client on MASTER_PORT or a rank with another
secret is refused with one line naming the key, and nothing trains on it."""

# ruff: noqa: F811 - the fixtures imported from test_cluster are parameters here

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil
import pytest
from torch._C._distributed_c10d import TCPStore

from fedciuic.cluster import TrainCommand, TrainingCluster
from fedciuic.cluster.auth import (
    SECRET_ENV,
    SECRET_FILE_ENV,
    SealedStore,
    StoreAuthError,
    new_secret,
    secret_from_env,
)
from fedciuic.cluster.dist import LOOPBACK, ClusterError, World, form_group, open_store
from fedciuic.cluster.protocol import COMMAND_KEY, CONFIG_KEY, READY_KEY, TIMEOUT_ENV, free_port
from fedciuic.config import RunConfig
from fedciuic.region.trainer import Region
from tests.cluster.test_cluster import (  # noqa: F401 - fixtures
    alive,
    make_region,
    run,
    worker_pids,
)
from tests.conftest import ROOT

NO_MAC = "its value carries no MAC"
WRONG_MAC = "its MAC does not match this region's cluster secret"


def listening(port: int) -> set[str]:
    """The addresses this process listens on at ``port`` (what the kernel says)."""
    return {
        c.laddr.ip
        for c in psutil.Process().net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    }


def stray(port: int) -> TCPStore:
    """Anything that reaches the port and speaks the store's protocol."""
    return TCPStore(LOOPBACK, port, is_master=False, timeout=timedelta(seconds=5))


# Tests without a region's cluster come first: a process is in one world at a time.


def test_a_multi_host_store_listens_on_master_addr_only() -> None:
    # torch's own TCPStore listens on :: whatever host name it is given.
    port = free_port()
    world = World(
        rank=0, world_size=2, local_world_size=1, master_addr="127.0.0.2", master_port=port
    )
    store = open_store(world, timeout=5, what="region eu")
    try:
        assert listening(port) == {"127.0.0.2"}
    finally:
        del store
    assert listening(port) == set()


@pytest.mark.parametrize("wildcard", ["0.0.0.0", "::"])
def test_a_wildcard_master_addr_is_refused(wildcard: str) -> None:
    world = World(rank=0, world_size=2, local_world_size=1, master_addr=wildcard, master_port=1)
    with pytest.raises(ClusterError, match=rf"MASTER_ADDR '{wildcard}' names every interface"):
        open_store(world, timeout=5, what="region eu")


def test_sealed_values_need_the_secret_and_their_own_key() -> None:
    port, secret = free_port(), new_secret()
    master = open_store(World(rank=0, world_size=2, master_port=port), timeout=5, what="rank 0")
    ours = SealedStore(master, secret, what="rank 0")
    ours.set(f"{COMMAND_KEY}0", "stop")
    assert SealedStore(stray(port), secret, what="rank 1").get(f"{COMMAND_KEY}0") == "stop"
    with pytest.raises(
        StoreAuthError, match=f"rank 1: refused the store key 'fedciuic/command/0': {WRONG_MAC}"
    ):
        SealedStore(stray(port), new_secret(), what="rank 1").get(f"{COMMAND_KEY}0")
    # An authentic value moved to another key (a command replayed as the next one).
    master.set(f"{COMMAND_KEY}1", bytes(master.get(f"{COMMAND_KEY}0")).decode())
    with pytest.raises(StoreAuthError, match=f"'fedciuic/command/1': {WRONG_MAC}"):
        ours.get(f"{COMMAND_KEY}1")
    master.set(f"{COMMAND_KEY}2", "stop")
    with pytest.raises(StoreAuthError, match=f"'fedciuic/command/2': {NO_MAC}"):
        ours.get(f"{COMMAND_KEY}2")


def test_the_secret_comes_from_the_environment_or_a_private_file(tmp_path: Path) -> None:
    secret = new_secret()
    assert secret_from_env({SECRET_ENV: secret.hex()}) == secret
    kept = tmp_path / "cluster.secret"
    kept.write_text(secret.hex() + "\n")
    kept.chmod(0o600)
    assert secret_from_env({SECRET_FILE_ENV: str(kept)}) == secret
    kept.chmod(0o640)
    with pytest.raises(ClusterError, match=r"file is mode 0640.*chmod 600"):
        secret_from_env({SECRET_FILE_ENV: str(kept)})
    with pytest.raises(ClusterError, match=f"neither {SECRET_ENV} nor {SECRET_FILE_ENV} is set"):
        secret_from_env({})
    with pytest.raises(ClusterError, match="at least 16 random bytes in hex"):
        secret_from_env({SECRET_ENV: "abcd"})


@pytest.fixture(scope="module")
def region(
    run: RunConfig, data_root: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Region]:
    """A 2-process region; every process it started is gone afterwards."""
    region = make_region(run, data_root, tmp_path_factory.mktemp("store"), 2)
    started: set[int] = set()
    try:
        yield region
    finally:
        started.update(worker_pids(region))
        region.close()
    assert not [pid for pid in started if alive(pid)]


def started(region: Region) -> TrainingCluster:
    """The region's cluster, started by one round (its adapters then put back)."""
    if region._cluster is None or not region._cluster.started:
        before = region.model.adapter_state()
        region._train_cluster(TrainCommand(steps=1, seed=1))
        region.model.load_adapter_state(before)
    assert region._cluster is not None
    return region._cluster


def test_a_local_regions_store_listens_on_loopback_only(region: Region) -> None:
    cluster = started(region)
    assert cluster.world is not None
    assert listening(cluster.world.master_port) == {LOOPBACK}


def test_a_forged_command_is_refused_and_nothing_trains_on_it(region: Region) -> None:
    cluster = started(region)
    assert cluster.world is not None
    (worker,) = cluster.workers.values()
    key = f"{COMMAND_KEY}{cluster._seq}"
    try:
        stray(cluster.world.master_port).set(
            key, TrainCommand(server_round=77, steps=1).model_dump_json()
        )
        assert worker.wait(timeout=60) == 2
    finally:
        region.close()
    log = (cluster.logs / "rank-1.log").read_text()
    assert f"fedciuic: rank 1: refused the store key '{key}': {NO_MAC}" in log
    assert "round 77" not in log


@pytest.fixture
def cluster(region: Region, run: RunConfig) -> Iterator[TrainingCluster]:
    """A cluster of the region's model and data (the region's own closed: a process is
    in one world at a time); closed afterwards, whatever the test saw."""
    region.close()
    cluster = TrainingCluster(run, region.node, region.model, region.data)
    try:
        yield cluster
    finally:
        pids = [proc.pid for proc in cluster.workers.values()]
        cluster.close()
    assert not [pid for pid in pids if alive(pid)]


def forging(
    monkeypatch: pytest.MonkeyPatch, cluster: TrainingCluster, key: str, value: str, *, read: bool
) -> None:
    """Once the group forms, a stray client writes ``value`` at ``key`` (before rank 0
    writes the config); where the worker ``read``s that key, it gets a moment to act
    on it (a worker that does not refuse it lives on)."""

    def form_then_forge(world: World, store: TCPStore, **kwargs: Any) -> None:
        form_group(world, store, **kwargs)
        stray(world.master_port).set(key, value)
        deadline = time.monotonic() + (20 if read else 0)
        while time.monotonic() < deadline and all(
            p.poll() is None for p in cluster.workers.values()
        ):
            time.sleep(0.1)

    monkeypatch.setattr("fedciuic.cluster.training.form_group", form_then_forge)


def test_a_forged_config_is_refused_before_a_worker_uses_it(
    cluster: TrainingCluster, region: Region, run: RunConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    lr = run.updated(**{"learning_rate": 100.0})
    config = {
        "run": lr.model_dump(mode="json", by_alias=True),
        "node": region.node.model_dump(mode="json", by_alias=True),
    }
    forging(monkeypatch, cluster, CONFIG_KEY, json.dumps(config), read=True)
    with pytest.raises(
        ClusterError,
        match=r"region eu: training process rank 1 \(pid \d+\) died \(exit status 2\) during "
        r"start-up \(its log ends: fedciuic: rank 1: refused the store key 'fedciuic/config': "
        + NO_MAC,
    ):
        cluster.start()
    assert not cluster.started and not cluster.workers


def test_a_forged_check_in_is_refused_by_rank_0(
    cluster: TrainingCluster, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Rank 1 "loaded" exactly rank 0's model and data, says a stray client.
    forging(
        monkeypatch, cluster, f"{READY_KEY}1", json.dumps(list(cluster.fingerprints)), read=False
    )
    message = f"region eu: refused the store key 'fedciuic/ready/1': {NO_MAC}"
    with caplog.at_level(logging.ERROR), pytest.raises(StoreAuthError, match=message):
        cluster.start()
    assert any(message in r.getMessage() for r in caplog.records)
    assert not cluster.started and not cluster.workers


def test_a_rank_with_another_secret_is_refused(
    cluster: TrainingCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Rank 0 under torchrun's variables, rank 1 started by hand with another secret.
    world = World(rank=0, world_size=2, local_world_size=2, master_port=free_port())
    for name, value in {**world.env(), SECRET_ENV: new_secret().hex()}.items():
        monkeypatch.setenv(name, value)
    env = {
        **os.environ,
        **world.model_copy(update={"rank": 1, "local_rank": 1}).env(),
        SECRET_ENV: new_secret().hex(),
        TIMEOUT_ENV: "60",
        "PYTHONPATH": str(ROOT),
    }
    other = subprocess.Popen(
        [sys.executable, "-m", "fedciuic.cluster.worker"],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    # Rank 1 is not watched by rank 0 here: 60 s for its cold start on a busy machine.
    cluster.run = cluster.run.updated(**{"collective_timeout": 60.0})
    try:
        with pytest.raises(
            StoreAuthError,
            match=f"region eu: refused the store key 'fedciuic/joined/1': {WRONG_MAC}",
        ):
            cluster.start()
    finally:
        other.kill()
        other.wait()
    assert not cluster.started
