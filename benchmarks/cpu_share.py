"""DP-SGD step time when several regions train on one machine at once: each with
PyTorch's default threads (one per core, in every process) against each with its
share of the cores (``cpu-threads``, what ``fedciuic init`` writes for the regions it
makes on one machine).

The regions run as separate processes started together, as ``start.sh`` starts their
agents; each times its own steps after a warm-up step. Reported: median seconds per
step in each mode and their ratio (a ratio above 1 is the oversubscription's cost).

    PYTHONPATH=. .venv/bin/python benchmarks/cpu_share.py                # 2 regions, tiny
    PYTHONPATH=. .venv/bin/python benchmarks/cpu_share.py --regions 3 --preset small
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from pathlib import Path

from fedciuic.cluster.protocol import share_cores
from fedciuic.ops.layout import cpu_share

NOISE = 1.0


def _region_steps(root: str, name: str, threads: int, args: argparse.Namespace) -> float:
    """In its own process: build region ``name`` and return its seconds per DP-SGD step."""
    share_cores(threads)
    from fedciuic.config import NodeConfig, RunConfig
    from fedciuic.ops.runconfig import app_run_config
    from fedciuic.privacy.dpsgd import PrivateTrainer
    from fedciuic.region.trainer import Region

    run = RunConfig.from_user_config(
        {
            **app_run_config(Path(__file__).resolve().parents[1]),
            "regions": name,
            "num-server-rounds": 1,
            "model-preset": args.preset,
            "batch-size": args.batch_size,
            "seq-len": args.seq_len,
            "privacy-unit": "record",
            "max-examples-per-unit": 1,
            "secure-mode": False,
            "data-root": root,
        },
        source="benchmark",
    )
    node = NodeConfig(
        region=name, data_path=f"{root}/{name}", state_path=f"{root}/state-{name}-{threads}"
    )
    region = Region(run, node)
    trainer = PrivateTrainer.for_run(
        region.model, region.data.train, region.local, region.dp, noise_multiplier=NOISE, seed=0
    )
    try:
        trainer.run(1)  # warm-up
        began = time.perf_counter()
        trainer.run(args.steps)
        return (time.perf_counter() - began) / int(args.steps)
    finally:
        trainer.close()
        region.close()


def together(root: Path, names: list[str], threads: int, args: argparse.Namespace) -> float:
    """The regions' median seconds per step, all of them training at once."""
    with mp.get_context("spawn").Pool(len(names)) as pool:
        steps: list[float] = pool.starmap(
            _region_steps, [(str(root), n, threads, args) for n in names]
        )
    return statistics.median(steps)


def main() -> None:
    from fedciuic.data.demo import write_demo_corpora

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", choices=("tiny", "small", "realistic"))
    parser.add_argument("--regions", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    names = ["eu", "cn", "us", "uk", "jp", "br", "in", "sg"][: args.regions]
    share = cpu_share(len(names))
    with tempfile.TemporaryDirectory(prefix="fedciuic-bench-") as tmp:
        write_demo_corpora(Path(tmp), tuple(names))
        default, shared = [], []
        for _ in range(args.repeats):  # interleaved: a busy machine slows both alike
            default.append(together(Path(tmp), names, 0, args))
            shared.append(together(Path(tmp), names, share, args))
    per_default, per_shared = statistics.median(default), statistics.median(shared)
    print(
        json.dumps(
            {
                "preset": args.preset,
                "regions": len(names),
                "cores": os.cpu_count(),
                "cpu_threads_each": share,
                "steps": args.steps,
                "batch_size": args.batch_size,
                "seq_len": args.seq_len,
                "step_s_default_threads": round(per_default, 4),
                "step_s_shared_cores": round(per_shared, 4),
                "default_over_shared": round(per_default / per_shared, 2),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
