"""DP-SGD step time of one region with 1 vs 2 training processes (gloo, CPU).

Same model preset, demo data, global batch and noise in both; the 2-process region
trains through its :class:`~fedciuic.cluster.TrainingCluster` (DP-DDP: each rank
clips its own units, the sums are all-reduced, rank 0 adds the noise). Start-up is
not timed (a warm-up round starts the workers). The ratio is reported, not a
target: on a CPU the two processes share the machine's cores (each rank gets
cores / ranks PyTorch threads), so the one-process step is also timed with one
thread: on a busy machine, fewer threads per process can matter more than the split.

    PYTHONPATH=. .venv/bin/python benchmarks/train_processes.py       # small preset
    PYTHONPATH=. .venv/bin/python benchmarks/train_processes.py --preset tiny --steps 20
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from fedciuic.cluster import TrainCommand
from fedciuic.config import NodeConfig, RunConfig
from fedciuic.data.demo import write_demo_corpora
from fedciuic.privacy.dpsgd import PrivateTrainer
from fedciuic.privacy.ledger import poisson_sample_rate
from fedciuic.region.trainer import Region

NOISE = 1.0


def region(preset: str, processes: int, root: Path, args: argparse.Namespace) -> Region:
    run = RunConfig.from_user_config(
        {
            "regions": "eu",
            "num-server-rounds": 1,
            "seed": 0,
            "model-preset": preset,
            "local-steps": args.steps,
            "batch-size": args.batch_size,
            "learning-rate": 1e-3,
            "seq-len": args.seq_len,
            "max-eval-examples": 8,
            "eval-fraction": 0.1,
            "node-wait-timeout": 60,
            "round-timeout": 600,
            "privacy-unit": "record",
            "max-examples-per-unit": 1,
            "secure-mode": False,
            "data-root": str(root),
        },
        source="benchmark",
    )
    node = NodeConfig(
        region="eu",
        data_path=str(root / "eu"),
        state_path=str(root / f"state-{processes}"),
        train_processes=processes,
    )
    return Region(run, node)


def one_process(r: Region, steps: int) -> float:
    """Seconds per DP-SGD step of ``steps`` steps in this process alone."""
    rate = poisson_sample_rate(r.data.train.num_units, r.run.training.batch_size)
    trainer = PrivateTrainer.for_run(
        r.model, r.data.train, r.local, r.dp, noise_multiplier=NOISE, seed=0
    )
    assert trainer.sample_rate == rate
    try:
        began = time.perf_counter()
        trainer.run(steps)
        return (time.perf_counter() - began) / steps
    finally:
        trainer.close()


def two_processes(r: Region, steps: int) -> float:
    """Seconds per DP-SGD step of ``steps`` steps over the region's 2 processes."""
    rate = poisson_sample_rate(r.data.train.num_units, r.run.training.batch_size)
    command = TrainCommand(dp=True, noise_multiplier=NOISE, sample_rate=rate, seed=1, steps=steps)
    began = time.perf_counter()
    r._train_cluster(command)
    return (time.perf_counter() - began) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small", choices=("tiny", "small", "realistic"))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fedciuic-bench-") as tmp:
        root = Path(tmp)
        write_demo_corpora(root, ("eu",))
        single = region(args.preset, 1, root, args)
        pair = region(args.preset, 2, root, args)
        try:
            one_process(single, 1)  # warm-up
            two_processes(pair, 1)  # starts the workers
            # Interleaved, so that a busy machine slows both alike; medians reported.
            ones, single_thread, twos = [], [], []
            cores = torch.get_num_threads()
            for _ in range(args.repeats):
                ones.append(one_process(single, args.steps))
                torch.set_num_threads(1)  # what each of the 2 ranks gets on 2 cores
                single_thread.append(one_process(single, args.steps))
                torch.set_num_threads(cores)
                twos.append(two_processes(pair, args.steps))
        finally:
            pair.close()
        per_step_1, per_step_2 = statistics.median(ones), statistics.median(twos)
    result = {
        "preset": args.preset,
        "device": "cpu",
        "cores": torch.get_num_threads(),
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "steps": args.steps,
        "repeats": args.repeats,
        "step_s_1_process": round(per_step_1, 4),
        "step_s_1_process_1_thread": round(statistics.median(single_thread), 4),
        "step_s_2_processes": round(per_step_2, 4),
        "speed_up_2_over_1": round(per_step_1 / per_step_2, 3),
        "speed_up_2_over_1_thread": round(statistics.median(single_thread) / per_step_2, 3),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
