"""Peak memory of one region's training round in one process, per setting.

What a simulated region's Ray actor holds while it trains, without Flower or Ray
around it: each variant builds the region (base memory-mapped, docs/cluster.md), trains
one round and reports the process's peak RSS (the mapped base's pages included, once).
Each variant runs in its own process, so one's heap cannot hide another's.

    .venv/bin/python benchmarks/step_memory.py --preset realistic
    .venv/bin/python benchmarks/step_memory.py --batch-size 8 --only "dp;dp, whole batch per pass"
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

#: name -> (run config overrides, environment)
VARIANTS: dict[str, tuple[dict[str, Any], dict[str, str]]] = {
    "dp": ({}, {}),  # the default: steps in parts of max-physical-batch-size examples
    "dp, whole batch per pass": ({"max-physical-batch-size": 0}, {}),
    "dp, parts of 4": ({"max-physical-batch-size": 4}, {}),
    "no-dp": ({"dp": False}, {}),
    "dp, gradient checkpointing": ({"gradient-checkpointing": True}, {}),
    "dp, bf16 base": ({"dtype": "bf16"}, {}),
    "dp, bf16 base, gradient checkpointing": (
        {"dtype": "bf16", "gradient-checkpointing": True},
        {},
    ),
    "dp, MALLOC_ARENA_MAX=1": ({}, {"MALLOC_ARENA_MAX": "1"}),
}


def one(preset: str, steps: int, batch: int, seq_len: int, overrides: dict[str, Any]) -> None:
    """Build and train one region in this process; print its figures as JSON."""
    from fedciuic.config import NodeConfig, RunConfig
    from fedciuic.data.demo import write_demo_corpora
    from fedciuic.ops.runconfig import app_run_config
    from fedciuic.region.trainer import Region

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_demo_corpora(root / "data", ("eu",))
        settings = {
            "model-preset": preset,
            "local-steps": steps,
            "batch-size": batch,
            "seq-len": seq_len,
            "data-root": str(root / "data"),
            # The exact count sets the rate: no count release to make before a round.
            "count-noise": 0.0,
        }
        run = RunConfig.from_user_config(
            {**app_run_config(ROOT), **settings, **overrides}, source="step_memory"
        )
        node = NodeConfig(region="eu", data_path=str(root / "data" / "eu"), state_path=tmp)
        region = Region(run, node)
        started = time.perf_counter()
        region.train_round(
            region.model.adapter_state(),
            server_round=1,
            base_fingerprint=region.model.base_fingerprint,
        )
        seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    print(json.dumps({"peak_rss_gib": peak / 2**30, "seconds_per_step": seconds / steps}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="realistic")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--only", help="these variants alone, in this order (names split by ;)")
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # one variant, in a child
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    if args.variant:
        one(args.preset, args.steps, args.batch_size, args.seq_len, json.loads(args.variant))
        return
    rows = []
    print(
        f"one region's round on {args.preset}: {args.steps} step(s) of {args.batch_size} "
        f"units x {args.seq_len} tokens, one process each"
    )
    chosen = args.only.split(";") if args.only else list(VARIANTS)
    for name in chosen:
        overrides, env = VARIANTS[name]
        done = subprocess.run(
            [sys.executable, __file__, *sys.argv[1:], "--variant", json.dumps(overrides)],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT), **env},
            cwd=ROOT,
        )
        if done.returncode != 0:
            print(f"{name:42} failed: {done.stderr.strip().splitlines()[-1:]}")
            continue
        row = {"variant": name, **json.loads(done.stdout.strip().splitlines()[-1])}
        rows.append(row)
        print(
            f"{name:42} peak RSS {row['peak_rss_gib']:.2f} GiB, "
            f"{row['seconds_per_step']:.1f} s/step"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
