"""Simulation scale: wall time per round and peak memory with 10, 50 and 100 regions.

Each region gets a shard of the demo corpora (the five stdlib families split into
as many regions as asked), its own keys, DP-SGD and sealing on; the regions are
synthetic, so they have no jurisdiction and policies are off. The simulation runs
with one CPU per simulated ClientApp on this machine. Peak memory is the largest
sum of the resident sizes of every process of the federation (SuperLink, Ray,
ServerApp, ClientApps), sampled every 0.5 s.

    .venv/bin/python benchmarks/scale.py
    .venv/bin/python benchmarks/scale.py --regions 10 --json out.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil
from report import Row, verdict

from fedciuic.crypto.sealing import generate_federation_keys
from fedciuic.data.demo import write_demo_corpora
from fedciuic.flower.launch import LocalFederation
from fedciuic.rounds.metrics import load_metrics
from fedciuic.rounds.record import METRICS_FILE
from fedciuic.rounds.wire import TRAINED

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ("eu", "cn", "us", "sg", "in")


def shard_corpora(folder: Path, count: int) -> tuple[str, ...]:
    """``count`` regions r000, r001, ... each with a slice of one demo family's records
    (whole records, their users kept: the demo's own JSON Lines)."""
    source = folder / "source"
    write_demo_corpora(source, FAMILIES)
    lines = {f: sorted((source / f).glob("*")) for f in FAMILIES}
    texts = {
        f: [ln for p in paths for ln in p.read_text(encoding="utf-8").splitlines() if ln]
        for f, paths in lines.items()
    }
    regions = tuple(f"r{i:03d}" for i in range(count))
    per_family = {
        f: [r for i, r in enumerate(regions) if i % len(FAMILIES) == k]
        for k, f in enumerate(FAMILIES)
    }
    for family, members in per_family.items():
        for j, region in enumerate(members):
            mine = texts[family][j :: len(members)]
            (folder / region).mkdir(parents=True)
            (folder / region / "records.jsonl").write_text(
                "".join(t + "\n" for t in mine), encoding="utf-8"
            )
    return regions


def tree_rss(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            root = psutil.Process(pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            continue
        for proc in procs:
            try:
                total += proc.memory_info().rss
            except psutil.Error:
                continue
    return total


def run_scale(count: int, rounds: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="fedciuic-bench-scale-") as name:
        tmp = Path(name)
        regions = shard_corpora(tmp / "data", count)
        keys = generate_federation_keys(tmp / "keys", regions)
        out = tmp / "runs"
        peak = [0]
        with LocalFederation(tmp / "work", ROOT) as federation:
            federation.start_superlink(simulation=True)
            stop = threading.Event()

            def sample() -> None:
                while not stop.is_set():
                    peak[0] = max(peak[0], tree_rss(federation.pids()))
                    time.sleep(0.5)

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            started = time.monotonic()
            run_id, _ = federation.run_app(
                {
                    "regions": ",".join(regions),
                    "num-server-rounds": rounds,
                    "data-root": str(tmp / "data"),
                    "output-dir": str(out),
                    "keys-dir": str(keys),
                    "enforce-policies": False,
                    "audit-dir": str(out / "audit"),
                    "min-regions": count,
                },
                federation_config={"num-supernodes": count, "client-resources-num-cpus": 1},
                timeout=3600,
            )
            total = time.monotonic() - started
            stop.set()
            sampler.join()
        metrics = load_metrics(out / f"run-{run_id}" / METRICS_FILE)
    ended = [metrics.rounds[r].ended_at or 0.0 for r in range(rounds + 1)]
    per_round = [b - a for a, b in itertools.pairwise(ended)]
    trained = sum(
        e.status == TRAINED for r in range(1, rounds + 1) for e in metrics.rounds[r].train.values()
    )
    return {
        "regions": count,
        "round_s": sum(per_round) / len(per_round),
        "total_s": total,
        "peak_mib": peak[0] / 2**20,
        "trained_updates": trained,
        "status": str(metrics.run.status),
    }


def rows(result: dict[str, Any]) -> list[Row]:
    return [
        [
            f"simulation, {r['regions']} regions",
            f"{r['round_s']:.1f} s/round, peak {r['peak_mib']:.0f} MiB, "
            f"{r['trained_updates']} updates, {r['status']}",
            "runs on 2 cores",
            verdict(r["status"] == "completed"),
        ]
        for r in result["rows"]
    ]


def plot(result: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib.pyplot as plt

    scale = result["rows"]
    fig, left = plt.subplots(figsize=(6, 4))
    counts = [r["regions"] for r in scale]
    left.plot(counts, [r["round_s"] for r in scale], marker="o", color="tab:blue")
    left.set_xlabel("simulated regions")
    left.set_ylabel("seconds per round", color="tab:blue")
    right = left.twinx()
    right.plot(counts, [r["peak_mib"] for r in scale], marker="s", color="tab:red")
    right.set_ylabel("peak memory (MiB)", color="tab:red")
    fig.tight_layout()
    path = out / "scale.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--regions", default="10,50,100")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    rows = []
    print("simulation scale: tiny preset, DP-SGD, sealed, 2 cores, 1 CPU per ClientApp")
    print(f"{'regions':>8} {'s/round':>8} {'peak MiB':>9} {'updates':>8} {'status':>10}")
    for count in (int(c) for c in args.regions.split(",")):
        row = run_scale(count, args.rounds)
        rows.append(row)
        print(
            f"{count:>8} {row['round_s']:>8.1f} {row['peak_mib']:>9.0f} "
            f"{row['trained_updates']:>8} {row['status']:>10}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows}, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
