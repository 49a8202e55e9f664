"""A region's training process of rank > 0: ``python -m fedciuic.cluster.worker``.

Started by the region itself, or on its other hosts by torchrun with the cluster secret
(every value it acts on must carry its MAC, :mod:`fedciuic.cluster.auth`; docs/cluster.md).
It loads the model and data once, then trains on rank 0's commands until told to stop or
rank 0 is gone.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import json
import os
import signal
import sys
import threading
import time
from datetime import timedelta

import torch

from fedciuic.cluster.auth import SECRET_ENV, SealedStore, secret_from_env
from fedciuic.cluster.dist import ClusterError, World, backend_for, form_group, leave, open_store
from fedciuic.cluster.protocol import (
    COMMAND_KEY,
    CONFIG_KEY,
    JOINED_KEY,
    PARENT_ENV,
    POLL_S,
    READY_KEY,
    TIMEOUT_ENV,
    TrainCommand,
    threads_per_rank,
)
from fedciuic.errors import FedciuicError

PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> None:
    """Never outlive the region's process: the kernel kills us when it dies (Linux),
    and a thread checks it too (other systems, and a parent gone before we asked)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)

    def watch() -> None:
        while True:
            if os.getppid() != parent:
                os._exit(1)
            time.sleep(POLL_S)

    if os.getppid() != parent:
        os._exit(1)
    threading.Thread(target=watch, daemon=True, name="fedciuic-parent").start()


def next_command(store: SealedStore, seq: int) -> TrainCommand:
    """Wait for rank 0's command ``seq``, without a deadline: rounds may be far apart."""
    key = f"{COMMAND_KEY}{seq}"
    try:
        while not store.raw.check([key]):  # polled: a timed-out wait would log each time
            time.sleep(POLL_S)
        text = store.get(key)
    except (RuntimeError, OSError):
        raise ClusterError("rank 0 is gone (its store closed)") from None
    return TrainCommand.model_validate_json(text)


def device_for(world: World) -> torch.device:
    """This rank's GPU (its local rank), or the CPU."""
    if torch.cuda.is_available():
        torch.cuda.set_device(world.local_rank)
        return torch.device("cuda", world.local_rank)
    return torch.device("cpu")


def serve(world: World) -> None:
    parent = os.environ.get(PARENT_ENV)
    if parent:
        die_with_parent(int(parent))
    # Nothing this rank starts needs the secret: out of the environment it goes.
    secret = secret_from_env()
    os.environ.pop(SECRET_ENV, None)
    timeout = float(os.environ.get(TIMEOUT_ENV, "600"))
    device = device_for(world)
    torch.set_num_threads(threads_per_rank(world.local_world_size))
    what = f"rank {world.rank}"
    store = SealedStore(open_store(world, timeout=timeout, what=what), secret, what=what)
    store.set(f"{JOINED_KEY}{world.rank}", "1")
    form_group(world, store.raw, backend=backend_for(device), timeout=timeout, what=what)
    # Model and data libraries load once the rank has joined: one that cannot join says so first.
    from fedciuic.cluster.training import forward_work, train_rank
    from fedciuic.config import NodeConfig, RunConfig
    from fedciuic.data import load_region_data
    from fedciuic.model import AdapterModel, Shard, shard_base

    try:
        store.raw.wait([CONFIG_KEY], timedelta(seconds=timeout))
        config = json.loads(store.get(CONFIG_KEY))
        run = RunConfig.from_user_config(config["run"], source="run config")
        node = NodeConfig.from_user_config(config["node"], source="node config")
        model = AdapterModel(node.model_spec(run), device=device, skeleton=node.sharded(run))
        data = load_region_data(run, node, model.tokenizer)
        store.set(
            f"{READY_KEY}{world.rank}", json.dumps([model.base_fingerprint, data.fingerprint])
        )
        if node.sharded(run):  # with rank 0, once it has seen every rank ready
            shard_base(model, world.world_size)
        shard = Shard(rank=world.rank, size=world.world_size)
        for seq in itertools.count():
            command = next_command(store, seq)
            if command.op == "stop":
                return
            # In the rank's log (STATE/cluster/rank-N.log): what it was doing if it dies.
            doing = "training" if command.op == "train" else command.op
            print(f"fedciuic: {what}: round {command.server_round}: {doing}", file=sys.stderr)
            if command.op == "train":
                train_rank(model, data.train, node.training(run), run.privacy, command, shard)
            else:  # rank 0's forward-only work, on a sharded base
                forward_work(model, data, node.training(run), run.privacy, command, every_rank=True)
    finally:
        leave()


def main() -> int:
    try:
        world = World.from_env()
        if world is None:
            raise ClusterError(
                "environment: RANK is not set; fedciuic.cluster.worker runs under torchrun "
                "or is started by a region with train-processes > 1"
            )
        serve(world)
    except FedciuicError as err:
        print(f"fedciuic: {err}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
