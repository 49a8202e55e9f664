"""One region's DP-SGD round as a cluster on this machine's GPUs (NCCL), or on the CPU.

The code paths only a GPU machine runs (NCCL process groups, one process per GPU, the
noise generator on CUDA) have no CPU test; this runs them: one region with
``train-processes`` = every GPU here (at least 1), one DP-SGD round through
:class:`~fedciuic.region.trainer.Region`, then the same round in one process, and
prints both step times, the ledger's epsilon for each (they must be equal: the same
global batch), rank 0's peak GPU memory and that every worker is gone. ``--sharding
shard``: the base sharded over the processes (FSDP2, docs/cluster.md), each holding a
slice of it. Without CUDA it runs the same with gloo
on 2 CPU processes, which is what CI's tests cover.

    .venv/bin/python benchmarks/gpu_cluster.py --preset small [--sharding shard]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from fedciuic.config import NodeConfig, RunConfig, Sharding
from fedciuic.data.demo import write_demo_corpora
from fedciuic.model.adapter import ADAPTER_MARK, AdapterModel
from fedciuic.ops.runconfig import app_run_config
from fedciuic.region.trainer import Region


def base_held(model: AdapterModel) -> tuple[int, int]:
    """Bytes of the frozen base this process holds (its slices, where sharded), and the
    whole base's."""
    held = whole = 0
    for name, param in model.model.named_parameters():
        if ADAPTER_MARK in name:
            continue
        local = param.to_local() if isinstance(param, DTensor) else param
        held += local.numel() * local.element_size()
        whole += param.numel() * param.element_size()
    return held, whole


def one_round(
    run: RunConfig, data: Path, state: Path, processes: int, sharding: Sharding
) -> dict[str, object]:
    node = NodeConfig(
        region="eu",
        data_path=str(data),
        state_path=str(state),
        train_processes=processes,
        train_sharding=sharding,
    )
    region = Region(run, node)
    held = base_bytes = 0
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    try:
        started = time.perf_counter()
        outcome = region.train_round(
            region.model.adapter_state(),
            server_round=1,
            base_fingerprint=region.model.base_fingerprint,
        )
        seconds = time.perf_counter() - started
        held, base_bytes = base_held(region.model)
        workers = [] if region._cluster is None else list(region._cluster.workers.values())
    finally:
        region.close()
    assert outcome.privacy is not None
    left = [w.pid for w in workers if w.poll() is None]
    return {
        "processes": processes,
        "sharding": sharding if processes > 1 else "whole",
        "device": str(region.model.device),
        # Rank 0's: with a sharded base, its slice of the base and its own step.
        "rank0_peak_gpu_gb": torch.cuda.max_memory_allocated() / 1e9
        if torch.cuda.is_available()
        else None,
        "seconds_per_step": seconds / run.training.local_steps,
        "rank0_base_mb": held / 2**20,
        "base_mb": base_bytes / 2**20,
        "epsilon": outcome.privacy.epsilon,
        "workers_left": left,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument(
        "--sharding",
        choices=["replicate", "shard"],
        default="replicate",
        help="each process holds the whole base, or a slice of it (FSDP2)",
    )
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    gpus = torch.cuda.device_count()
    processes = gpus if gpus > 1 else 2 if gpus == 0 else 1
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_demo_corpora(root / "data", ("eu",))
        run = RunConfig.from_user_config(
            {
                **app_run_config(Path(__file__).resolve().parent.parent),
                "model-preset": args.preset,
                "local-steps": args.steps,
                "collective-timeout": 300.0,
                "data-root": str(root / "data"),
                # The exact count sets the rate: no count release to make before a round.
                "count-noise": 0.0,
            },
            source="gpu_cluster",
        )
        rows = [
            one_round(run, root / "data" / "eu", root / f"state-{n}", n, args.sharding)
            for n in sorted({1, processes})
        ]
    for row in rows:
        peak = row["rank0_peak_gpu_gb"]
        print(
            f"{row['processes']} process(es), base {row['sharding']}, on {row['device']}: "
            f"{row['seconds_per_step']:.3f} s/step, epsilon {row['epsilon']:.4f}, "
            f"rank 0 holds {row['rank0_base_mb']:.0f} of the base's {row['base_mb']:.0f} MiB, "
            + (f"rank 0 peak {peak:.2f} GB, " if peak is not None else "")
            + f"workers left {row['workers_left']}"
        )
    if len(rows) == 2:
        same = abs(float(rows[0]["epsilon"]) - float(rows[1]["epsilon"])) < 1e-9  # type: ignore[arg-type]
        print(f"same epsilon with {processes} processes as with 1: {same}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
