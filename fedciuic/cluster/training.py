"""A region's local training as a ``torch.distributed`` job of several processes.

Rank 0 is the region's own process: it holds the ledger, seals, writes the audit log and
alone talks to Flower. The other ranks (:mod:`fedciuic.cluster.worker`) load the model and
data once per run and train on commands sent through rank 0's ``TCPStore`` under the
cluster secret's MAC (:mod:`fedciuic.cluster.auth`), with no timeout between rounds; each
round's collectives are bounded by ``collective-timeout``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import fedciuic
from fedciuic.cluster.auth import (
    SECRET_ENV,
    SECRET_FILE_ENV,
    SealedStore,
    StoreAuthError,
    new_secret,
    secret_from_env,
)
from fedciuic.cluster.dist import (
    ClusterError,
    World,
    backend_for,
    check_placement,
    first_line,
    form_group,
    leave,
    open_store,
)
from fedciuic.cluster.protocol import (
    COMMAND_KEY,
    CONFIG_KEY,
    JOINED_KEY,
    PARENT_ENV,
    POLL_S,
    READY_KEY,
    START_S,
    TIMEOUT_ENV,
    TrainCommand,
    free_port,
    threads_per_rank,
)
from fedciuic.config import DPSettings, LocalTraining, NodeConfig, RunConfig
from fedciuic.data import ExampleSet, RegionData
from fedciuic.model import (
    AdapterModel,
    Shard,
    TrainStats,
    evaluate,
    shard_base,
    train_local,
    unit_losses,
)
from fedciuic.privacy import private_round, time_private_step

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClusterStats:
    """A round over all ranks: the stats rank 0 reports, and the step counts every
    rank took (all equal, or the round is not released)."""

    stats: TrainStats
    fewest_steps: int
    most_steps: int
    empty_steps: int


def processes_key(run: RunConfig, node: NodeConfig) -> str:
    """Where this region's train-processes count came from, for error messages."""
    if node.train_processes is None:
        return "run config:train-processes"
    if dict(run.cluster.region_train_processes).get(node.region) == node.train_processes:
        return "run config:region-train-processes"
    return "node config:train-processes"


def train_rank(
    model: AdapterModel,
    examples: ExampleSet,
    local: LocalTraining,
    dp: DPSettings,
    command: TrainCommand,
    shard: Shard,
) -> ClusterStats:
    """This rank's part of one round, from rank 0's adapters (broadcast, so that every rank
    ends each step with the same weights); returns the statistics summed over the ranks."""
    for param in model.trainable_parameters():
        dist.broadcast(param.data, src=0)
    if not command.dp:
        stats = train_local(
            model,
            examples,
            steps=command.steps,
            batch_size=local.batch_size,
            learning_rate=local.learning_rate,
            generator=torch.Generator().manual_seed(command.seed),
            optimizer=local.optimizer,
            shard=shard,
            time_budget=command.time_budget,
            slowdown=command.slowdown,
            proximal_mu=local.proximal_mu,
        )
        taken, empty, loss_sum, counted = stats.steps, 0, stats.loss * stats.steps, 1.0
    else:
        done = private_round(
            model,
            examples,
            local,
            dp,
            noise_multiplier=command.noise_multiplier,
            sample_rate=command.sample_rate,
            steps=command.steps,
            seed=command.seed,
            who=f"training process rank {shard.rank}",
            units=command.units or None,
            shard=shard,
            slowdown=command.slowdown,
        )
        stats, taken, empty = done.stats, done.steps_taken, done.empty_steps
        losses = taken - empty
        loss_sum, counted = (stats.loss * losses, float(losses)) if losses else (0.0, 0.0)
    bounds = torch.tensor([taken, -taken], dtype=torch.float64)
    dist.all_reduce(bounds, op=dist.ReduceOp.MAX)
    sums = torch.tensor([loss_sum, counted, empty], dtype=torch.float64)
    dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    # DP: the mean over the ranks' non-empty batches; else each rank has the global loss.
    loss = stats.loss if not command.dp else float(sums[0] / sums[1]) if sums[1] else float("nan")
    return ClusterStats(
        stats=TrainStats(loss=loss, steps=taken, num_examples=len(examples)),
        fewest_steps=int(-bounds[1]),
        most_steps=int(bounds[0]),
        empty_steps=int(sums[2]),
    )


#: What rank 0's forward-only work is, in its error messages.
_DOING = {"evaluate": "evaluation", "losses": "evaluation", "time": "a timed step"}


def forward_work(
    model: AdapterModel,
    data: RegionData,
    local: LocalTraining,
    dp: DPSettings,
    command: TrainCommand,
    *,
    every_rank: bool = False,
) -> Any:
    """Forward-only work (``command.op``): the held-out loss (:class:`EvalStats`), each
    eval unit's loss (a list) or one DP-SGD step's seconds. ``every_rank``: this rank's
    part on a sharded base, from rank 0's adapters (broadcast first)."""
    if every_rank:
        for param in model.trainable_parameters():
            dist.broadcast(param.data, src=0)
    if command.op == "evaluate":
        return evaluate(model, data.eval, batch_size=local.batch_size)
    if command.op == "losses":
        return unit_losses(model, data.eval, batch_size=local.batch_size)
    return time_private_step(
        model, data.train, local, dp, command.noise_multiplier, command.slowdown
    )


def check_sharding(run: RunConfig, node: NodeConfig) -> None:
    """Refuse, before anything loads, what a sharded base cannot do yet."""
    if node.sharded(run) and run.model.quantization != "none":
        raise ClusterError(
            'train-sharding: "shard" needs a bf16 or fp32 base; set quantization = "none" (each '
            'process then holds 1/N of the base) or train-sharding = "replicate"'
        )


def describe_exit(code: int) -> str:
    """``signal 9`` or ``exit status 1``, as a worker's Popen return code says."""
    if code < 0:
        try:
            return f"signal {-code}: {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit status {code}"


class TrainingCluster:
    """Rank 0's handle on a region's training processes: it starts ``count - 1`` workers
    on this machine, or under torchrun (``RANK=0``) waits for the other ranks to join. A
    dead worker fails the round (a :class:`ClusterError` naming it) and the cluster is torn
    down; the region builds a new one for its next round."""

    def __init__(
        self,
        run: RunConfig,
        node: NodeConfig,
        model: AdapterModel,
        data: RegionData,
    ) -> None:
        self.run, self.node, self.model, self.data = run, node, model, data
        self.name = f"region {node.region}"
        self.fingerprints = (model.base_fingerprint, data.fingerprint)
        self.workers: dict[int, subprocess.Popen[bytes]] = {}
        self.logs = node.state_dir / "cluster"
        self.world: World | None = None
        self.store: SealedStore | None = None
        self._seq = 0
        self._dead: tuple[int, int, int] | None = None  # rank, pid, return code
        self._closing = threading.Event()
        self._watcher: threading.Thread | None = None

    @property
    def started(self) -> bool:
        return self.store is not None

    def start(self) -> None:
        """Start (or join) the ranks, hand them the configs, and wait until all loaded."""
        if self.model.sharded:  # its shards died with the last process group
            self.model.unshard()
        timeout = self.run.cluster.collective_timeout
        world = World.from_env()
        count = self.node.processes(self.run)
        if world is None:
            check_placement(count, self.model.device, key=processes_key(self.run, self.node))
            world = World(rank=0, world_size=count, local_world_size=count, master_port=free_port())
            secret = new_secret()  # this start's own: the workers get it from us
            self._spawn(world, secret)
        elif world.rank != 0:
            raise ClusterError(
                f"{self.name}: this process has RANK={world.rank}; the region's own process "
                "must be rank 0 (start the others with python -m fedciuic.cluster.worker)"
            )
        else:  # launched under torchrun: the environment, not train-processes, says how many
            check_placement(
                world.local_world_size, self.model.device, key="environment:LOCAL_WORLD_SIZE"
            )
            secret = secret_from_env()
        self.world = world
        self._closing.clear()
        self._watcher = threading.Thread(target=self._watch, daemon=True, name="fedciuic-ranks")
        self._watcher.start()
        try:
            self.store = SealedStore(
                open_store(world, timeout=timeout, what=self.name), secret, what=self.name
            )
            # Workers we started are watched meanwhile, so they may take longer to load.
            starting = max(timeout, START_S) if self.workers else timeout
            self._await(JOINED_KEY, world, starting, "start and reach rank 0's store")
            for rank in range(1, world.world_size):
                self.store.get(f"{JOINED_KEY}{rank}")  # a rank that holds the secret
            backend = backend_for(self.model.device)
            form_group(world, self.store.raw, backend=backend, timeout=timeout, what=self.name)
            node = self.node.model_dump(mode="json", by_alias=True)
            self.store.set(CONFIG_KEY, json.dumps({"run": self.run.flat(), "node": node}))
            self._await(READY_KEY, world, starting, "load the model and data")
            for rank in range(1, world.world_size):
                if tuple(json.loads(self.store.get(f"{READY_KEY}{rank}"))) != self.fingerprints:
                    raise ClusterError(
                        f"{self.name}: training process rank {rank} loaded another base model "
                        "or dataset (fingerprints differ from rank 0's); every rank must read "
                        "the same model and the same data-path"
                    )
            if self.node.sharded(self.run):  # each rank keeps its slice from now on
                shard_base(self.model, world.world_size)
                logging.getLogger("flwr").info(
                    "fedciuic: %s: base sharded over %d training processes (FSDP2)",
                    self.name,
                    world.world_size,
                )
        except BaseException as err:
            if isinstance(err, StoreAuthError):
                log.error("fedciuic: %s", err)
            died = self._died()
            self.close()
            if died is not None:
                raise self._death_error(died, "start-up") from err
            raise

    def _spawn(self, world: World, secret: bytes) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        package_root = str(Path(fedciuic.__file__).resolve().parents[1])
        path = os.environ.get("PYTHONPATH", "")
        inherited = {k: v for k, v in os.environ.items() if k != SECRET_FILE_ENV}
        for rank in range(1, world.world_size):
            env = {
                **inherited,
                **world.model_copy(update={"rank": rank, "local_rank": rank}).env(),
                SECRET_ENV: secret.hex(),  # an environment only its user (and root) reads
                PARENT_ENV: str(os.getpid()),
                TIMEOUT_ENV: repr(self.run.cluster.collective_timeout),
                "PYTHONPATH": os.pathsep.join(filter(None, [package_root, path])),
                "TORCH_CPP_LOG_LEVEL": os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR"),
            }
            with open(self.logs / f"rank-{rank}.log", "wb") as out:
                self.workers[rank] = subprocess.Popen(
                    [sys.executable, "-m", "fedciuic.cluster.worker"],
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )

    def _await(self, prefix: str, world: World, timeout: float, what: str) -> None:
        """Wait until every other rank has set ``prefix<rank>`` (at most ``timeout``
        seconds), failing at once if a worker we started dies meanwhile."""
        assert self.store is not None
        deadline = time.monotonic() + timeout
        for rank in range(1, world.world_size):
            while not self.store.raw.check([f"{prefix}{rank}"]):  # polled: no wait to log
                if self._died() is not None:
                    raise ClusterError(f"{self.name}: a training process died while starting")
                if time.monotonic() > deadline:
                    raise ClusterError(
                        f"{self.name}: training process rank {rank} did not {what} "
                        f"within {timeout:g} s (run config collective-timeout, at least "
                        f"{START_S:g} s for processes the region starts); see "
                        f"{self.logs / f'rank-{rank}.log'}"
                    )
                time.sleep(POLL_S)

    def _watch(self) -> None:
        """Notice a dead worker at once and stop the others, so that rank 0's pending
        collective fails at once (their sockets close) instead of at the timeout."""
        while not self._closing.wait(POLL_S):
            if self._dead is None and self._died() is not None:
                self._kill_all()

    def _died(self) -> tuple[int, int, int] | None:
        if self._dead is None:
            for rank, proc in self.workers.items():
                code = proc.poll()
                if code is not None:
                    self._dead = (rank, proc.pid, code)
                    break
        return self._dead

    def _death_error(self, died: tuple[int, int, int], during: str) -> ClusterError:
        rank, pid, code = died
        tail = ""
        with suppress(OSError):
            lines = (self.logs / f"rank-{rank}.log").read_text(errors="replace").splitlines()
            last = [line for line in lines if line.strip()][-1:]
            tail = f" (its log ends: {last[0][:200]})" if last and code > 0 else ""
        return ClusterError(
            f"{self.name}: training process rank {rank} (pid {pid}) died "
            f"({describe_exit(code)}) during {during}{tail}; the round fails for this region "
            "and its training processes are started again for the next round"
        )

    def train(self, command: TrainCommand) -> ClusterStats:
        """Run ``command`` on every rank; any failure tears the cluster down."""
        with self._on_every_rank(command) as size:
            local, dp = self.node.training(self.run), self.run.privacy
            return train_rank(self.model, self.data.train, local, dp, command, Shard(0, size))

    def forward(self, command: TrainCommand) -> Any:
        """Rank 0's forward-only work on a sharded base, which every rank takes part in."""
        with self._on_every_rank(command):
            local, dp = self.node.training(self.run), self.run.privacy
            return forward_work(self.model, self.data, local, dp, command, every_rank=True)

    @contextmanager
    def _on_every_rank(self, command: TrainCommand) -> Iterator[int]:
        """Send ``command`` to the other ranks, then do rank 0's part (the ``with`` block,
        given the world's size)."""
        died = self._died() if self.started else None
        if died is not None:
            log.warning(
                "fedciuic: %s: training process rank %d (pid %d) died between rounds (%s); "
                "starting the training processes again",
                self.name,
                died[0],
                died[1],
                describe_exit(died[2]),
            )
            self.close()
        if not self.started:
            self.start()
        assert self.world is not None and self.store is not None
        world, during = self.world, _DOING.get(command.op, f"round {command.server_round}")
        threads = torch.get_num_threads()
        try:
            self._send(command)
            # The machine's cores, shared among its ranks for the round.
            torch.set_num_threads(threads_per_rank(world.local_world_size))
            yield world.world_size
        except BaseException as err:
            died = self._wait_for_death() if self.workers else None
            self.close()
            if died is not None:
                raise self._death_error(died, during) from err
            if isinstance(err, (RuntimeError, OSError)) and not isinstance(err, ClusterError):
                raise ClusterError(
                    f"{self.name}: training across {world.world_size} processes failed "
                    f"during {during} ({first_line(err)}); "
                    f"collective-timeout is {self.run.cluster.collective_timeout:g} s; the "
                    "training processes are started again for the next round"
                ) from err
            raise
        finally:
            torch.set_num_threads(threads)

    def _wait_for_death(self) -> tuple[int, int, int] | None:
        """A failed collective usually means a worker is dying: give it a moment."""
        deadline = time.monotonic() + 2.0
        while self._died() is None and time.monotonic() < deadline:
            time.sleep(POLL_S / 4)
        return self._died()

    def _send(self, command: TrainCommand) -> None:
        assert self.store is not None
        self.store.set(f"{COMMAND_KEY}{self._seq}", command.model_dump_json())
        self._seq += 1

    def close(self, timeout: float = 10.0) -> None:
        """Stop the workers (a stop command, then SIGKILL after ``timeout``)."""
        self._closing.set()
        if self.store is not None and self.workers and self._dead is None:
            with suppress(RuntimeError, OSError):
                self._send(TrainCommand(op="stop"))
        deadline = time.monotonic() + timeout
        for proc in self.workers.values():
            with suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.0, deadline - time.monotonic()))
        self._kill_all()
        for proc in self.workers.values():
            proc.wait()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join()
        self._watcher = None
        leave()
        self.workers.clear()
        self.store, self.world, self._dead, self._seq = None, None, None, 0

    def _kill_all(self) -> None:
        for proc in self.workers.values():
            if proc.poll() is None:
                with suppress(ProcessLookupError):
                    proc.kill()
