"""A region's training processes as one ``torch.distributed`` world.

The environment is torchrun's (:data:`ENV_KEYS`), so the same code runs under processes
the region spawns and under ``torchrun --nnodes``. Every set-up waits at most
``collective-timeout`` seconds, so a rank that cannot reach rank 0 fails, not hangs.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
from collections.abc import Mapping
from datetime import timedelta

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from torch._C._distributed_c10d import TCPStore

from fedciuic.errors import FedciuicError

#: The torchrun variables a rank reads (``World.from_env``).
ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class ClusterError(FedciuicError):
    """A region's training processes cannot be set up, or one of them failed."""


class World(BaseModel):
    """Where this process sits among the region's training processes."""

    model_config = ConfigDict(frozen=True)

    rank: int = Field(ge=0)
    world_size: int = Field(ge=1)
    local_rank: int = Field(default=0, ge=0)
    local_world_size: int = Field(default=1, ge=1)
    master_addr: str = "127.0.0.1"
    master_port: int = Field(ge=1, le=65535)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> World | None:
        """The world torchrun (or a region) described in ``env``; None where ``RANK`` is unset."""
        env = os.environ if env is None else env
        if "RANK" not in env:
            return None
        missing = [k for k in ("WORLD_SIZE", "MASTER_PORT") if k not in env]
        if missing:
            raise ClusterError(
                f"environment: RANK is set but {', '.join(missing)} is not; start the "
                "training processes with torchrun, or set all of " + ", ".join(ENV_KEYS)
            )
        try:
            world = cls(
                rank=int(env["RANK"]),
                world_size=int(env["WORLD_SIZE"]),
                local_rank=int(env.get("LOCAL_RANK", "0")),
                local_world_size=int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])),
                master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
                master_port=int(env["MASTER_PORT"]),
            )
        except (ValueError, ValidationError) as err:
            first = str(err).splitlines()[0]
            raise ClusterError(
                f"environment: bad torchrun variables ({first}); set {', '.join(ENV_KEYS)} "
                "to integers (and MASTER_ADDR to a host name)"
            ) from None
        if world.rank >= world.world_size:
            raise ClusterError(
                f"environment: RANK {world.rank} is not below WORLD_SIZE {world.world_size}"
            )
        return world

    def env(self) -> dict[str, str]:
        """This world as torchrun's environment variables (its fields, upper-cased)."""
        return {key: str(getattr(self, key.lower())) for key in ENV_KEYS}


def backend_for(device: torch.device) -> str:
    """``nccl`` for CUDA training, ``gloo`` on the CPU."""
    if device.type != "cuda":
        return "gloo"
    if not dist.is_nccl_available():
        raise ClusterError(
            "train-processes: this PyTorch build has no NCCL, which training several "
            "processes on CUDA needs; install a CUDA build of PyTorch with NCCL, or set "
            "train-processes = 1"
        )
    return "nccl"


def check_placement(count: int, device: torch.device, *, key: str) -> None:
    """Refuse more local training processes than the machine can place: one per GPU, or
    per CPU core (a gloo rank without a core of its own stalls the others' collectives)."""
    if count < 1:
        raise ClusterError(f"{key}: {count}; a region runs at least 1 training process")
    room = torch.cuda.device_count() if device.type == "cuda" else os.cpu_count() or 1
    if count > room:
        what = f"{room} GPU(s)" if device.type == "cuda" else f"{room} CPU core(s)"
        raise ClusterError(
            f"{key}: {count} training processes, but this machine has {what} (one process "
            f"each); set {key.rpartition(':')[2]} to at most {room}, or start the other "
            "ranks on more nodes with torchrun"
        )


#: Where a store listens when every rank is on this machine.
LOOPBACK = "127.0.0.1"
#: MASTER_ADDR values that mean every interface: refused for a multi-host store.
WILDCARDS = frozenset({"", "*", "0.0.0.0", "::", "[::]"})


def store_host(world: World) -> str:
    """The address rank 0's store listens on: loopback when every rank is on this machine
    (nothing off the host needs it), else MASTER_ADDR."""
    if world.local_world_size < world.world_size:
        return world.master_addr
    with contextlib.suppress(ValueError):
        if ipaddress.ip_address(world.master_addr).is_loopback:
            return world.master_addr
    return LOOPBACK


def is_wildcard(host: str) -> bool:
    """Whether ``host`` names every interface (0.0.0.0, ::) rather than one."""
    if host.strip() in WILDCARDS:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return False


def listen_socket(host: str, port: int, *, what: str) -> socket.socket:
    """A socket listening on ``host``'s address only (``TCPStore`` as master listens on
    every interface, so rank 0 binds the socket itself and hands it over)."""
    if is_wildcard(host):
        raise ClusterError(
            f"environment: MASTER_ADDR {host!r} names every interface: rank 0's store "
            "would then take connections from any host, and anything that reaches it "
            "reads and writes the region's keys; set MASTER_ADDR to the address of the "
            "interface the region's other hosts reach this one on (docs/cluster.md)"
        )
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host.strip("[]"), port, type=socket.SOCK_STREAM
        )[0]
    except (OSError, UnicodeError) as err:
        raise ClusterError(
            f"{what}: MASTER_ADDR {host!r} does not resolve ({first_line(err)}); set it to "
            "an address of this host"
        ) from None
    if is_wildcard(str(address[0])):
        raise ClusterError(
            f"environment: MASTER_ADDR {host!r} resolves to {address[0]}, every interface; "
            "set it to the address of the interface the region's other hosts reach this "
            "one on (docs/cluster.md)"
        )
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock


def open_store(world: World, *, timeout: float, what: str) -> TCPStore:
    """Rank 0 hosts the world's store on :func:`store_host`'s address, the others connect
    to it within ``timeout`` seconds; ``what`` names the region or rank in errors."""
    if dist.is_initialized():
        raise ClusterError(
            f"{what}: this process already belongs to a torch.distributed world; one "
            "process trains one region's cluster at a time"
        )
    host, wait = store_host(world), timedelta(seconds=timeout)
    where = f"{host}:{world.master_port}"
    if world.rank != 0:
        try:
            return TCPStore(
                host, world.master_port, world.world_size, is_master=False, timeout=wait
            )
        except (RuntimeError, OSError):
            raise ClusterError(
                f"{what}: rank {world.rank} cannot reach rank 0 at {where} within "
                f"{timeout:g} s (collective-timeout); check MASTER_ADDR and MASTER_PORT "
                "(and LOCAL_WORLD_SIZE: ranks all on one host meet on loopback) and that "
                "rank 0 is running"
            ) from None
    try:
        sock = listen_socket(host, world.master_port, what=what)
    except OSError as err:
        raise ClusterError(
            f"{what}: rank 0 cannot listen on {where} ({first_line(err)}); choose a free "
            "MASTER_PORT"
        ) from None
    # The store owns (and closes) the descriptor it gets: give it a copy, closed here only
    # if the store failed without closing it (ours keeps the inode alive, so a reused
    # descriptor number is never closed).
    handed = os.dup(sock.fileno())
    try:
        return TCPStore(
            host,
            world.master_port,
            world.world_size,
            is_master=True,
            timeout=wait,
            wait_for_workers=False,
            master_listen_fd=handed,
        )
    except (RuntimeError, OSError) as err:
        with contextlib.suppress(OSError):
            if os.fstat(handed).st_ino == os.fstat(sock.fileno()).st_ino:
                os.close(handed)
        raise ClusterError(
            f"{what}: rank 0 cannot serve its store on {where} ({first_line(err)}); "
            "choose a free MASTER_PORT"
        ) from None
    finally:
        sock.close()


def form_group(world: World, store: TCPStore, *, backend: str, timeout: float, what: str) -> None:
    """Join the default process group over ``store``, its collectives bounded by ``timeout``."""
    try:
        dist.init_process_group(
            backend,
            store=store,
            rank=world.rank,
            world_size=world.world_size,
            timeout=timedelta(seconds=timeout),
        )
    except (RuntimeError, OSError) as err:
        raise ClusterError(
            f"{what}: rank {world.rank} could not form the {world.world_size}-process "
            f"group at {world.master_addr}:{world.master_port} within {timeout:g} s "
            f"(collective-timeout): {first_line(err)}; check that every rank started"
        ) from None


def leave() -> None:
    """Destroy this process's process group, if any (after a failure too)."""
    if dist.is_initialized():
        # A broken group (a rank died) may refuse: nothing more to tidy then.
        with contextlib.suppress(RuntimeError, ValueError):
            dist.destroy_process_group()


def first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0][:300] if text else type(err).__name__
