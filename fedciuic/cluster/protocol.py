"""What a region's rank 0 and its other training processes say to each other.

Free of the model and data libraries, so that a worker reaches the store (or says it
cannot) before it spends time importing them.
"""

from __future__ import annotations

import os
import socket
from typing import Literal

from pydantic import BaseModel, ConfigDict

#: Store keys: the configs for the workers, each worker's readiness, the numbered commands.
CONFIG_KEY = "fedciuic/config"
READY_KEY = "fedciuic/ready/"
JOINED_KEY = "fedciuic/joined/"
COMMAND_KEY = "fedciuic/command/"
#: Variables a region sets for the workers it starts (not set under torchrun).
PARENT_ENV = "FEDCIUIC_PARENT_PID"
TIMEOUT_ENV = "FEDCIUIC_COLLECTIVE_TIMEOUT"
#: How often the watcher looks at the workers, and a worker at its parent.
POLL_S = 0.2
#: The least time workers this region started may take to load the model and data (they
#: are watched meanwhile, so one that dies fails the start at once).
START_S = 120.0


#: Rank 0's forward-only work that every rank of a sharded base takes part in.
ForwardOp = Literal["evaluate", "losses", "time"]


class TrainCommand(BaseModel):
    """One round's work for every rank (``stop`` ends the workers). On a sharded base every
    pass is collective, so rank 0's forward-only work (:data:`ForwardOp`) runs on every rank."""

    model_config = ConfigDict(frozen=True)

    op: Literal["train", "stop"] | ForwardOp = "train"
    server_round: int = 0
    seed: int = 0
    dp: bool = False
    #: DP: exactly this many steps (rank 0 planned them); otherwise the most.
    steps: int = 0
    noise_multiplier: float = 0.0
    sample_rate: float = 0.0
    #: DP with count-noise: the run's DP count of units (0: the exact count).
    units: int = 0
    #: Without DP: seconds of training, on rank 0's clock (0: all ``steps``).
    time_budget: float = 0.0
    #: test-region-slowdown's factor for this region, applied on every rank.
    slowdown: float = 1.0


#: The CPU cores this region may use (its agent's ``cpu-threads``, inherited by the ranks
#: it starts); unset: all of the machine's.
CORES_ENV = "FEDCIUIC_CPU_CORES"


def share_cores(threads: int) -> None:
    """Use ``threads`` CPU threads in this process and every rank it starts (0: the
    machine's cores): PyTorch's default of one thread per core in every process
    oversubscribes a machine that regions share."""
    if threads <= 0:
        return
    import torch

    os.environ[CORES_ENV] = str(threads)
    torch.set_num_threads(threads)


def threads_per_rank(local_world_size: int) -> int:
    """PyTorch threads per rank: the region's cores shared among its ranks on this machine."""
    given = os.environ.get(CORES_ENV, "")
    cores = int(given) if given.isdigit() and int(given) > 0 else os.cpu_count() or 1
    return max(1, cores // local_world_size)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (a region's own world, the
    SuperLink and SuperNodes that ``fedciuic.flower.launch`` starts)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
