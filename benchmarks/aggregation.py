"""Aggregation scaling: time and peak memory against the number of regions and the delta size.

Each update is encoded just before it is aggregated (encoding is the regions' work,
not timed), then decoded, validated and added into the one accumulator, as the
aggregator does. Time should grow linearly in the total update size and memory
stay at the model size plus one update, whatever the number of regions.

    .venv/bin/python benchmarks/aggregation.py
    .venv/bin/python benchmarks/aggregation.py --counts 10,100 --sizes 1000000 --json out.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
from report import Row, verdict

from fedciuic.aggregation import Accumulator, Bounds, check
from fedciuic.compression import get_codec


def _rss(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def measure(codec_spec: str, n: int, count: int) -> dict[str, float]:
    """Seconds spent aggregating, bytes aggregated and the peak memory aggregation added."""
    codec = get_codec(codec_spec)
    rng = np.random.default_rng(0)
    base = rng.standard_normal(n).astype(np.float32)
    with open("/proc/self/clear_refs", "w", encoding="ascii") as handle:
        handle.write("5")  # reset the peak RSS
    before = _rss("VmRSS")
    acc = Accumulator(n)
    seconds, total = 0.0, 0
    for i in range(count):
        blob = codec.encode(base * np.float32(1 + 0.001 * i), rng)
        total += len(blob)
        start = time.perf_counter()
        acc.add(check(codec, blob, n, 10.0, Bounds()))
        seconds += time.perf_counter() - start
        del blob
    start = time.perf_counter()
    acc.mean()
    seconds += time.perf_counter() - start
    return {
        "seconds": seconds,
        "update_bytes_total": float(total),
        "peak_mib": (_rss("VmHWM") - before) / 2**20,
        "model_mib": n * 8 / 2**20,  # the float64 accumulator
    }


def scaling(rows: list[dict[str, Any]]) -> float:
    """For each delta size, time at the most regions over time at a tenth of them, times
    a tenth: 1.0 is exactly linear in the total update size (at a given delta size; a
    fixed cost per update, about half a millisecond, makes small deltas dearer per MB)."""
    worst = 0.0
    for n in {r["entries"] for r in rows}:
        mine = {r["regions"]: r["seconds"] for r in rows if r["entries"] == n}
        for count, seconds in mine.items():
            if count // 10 in mine and mine[count // 10] > 0:
                worst = max(worst, seconds / (10 * mine[count // 10]))
    return worst


def rows(result: dict[str, Any]) -> list[Row]:
    top = max(result["rows"], key=lambda r: (r["regions"], r["entries"]))
    spread = scaling(result["rows"])
    return [
        [
            "aggregation scaling",
            f"10x the regions takes <= {spread:.2f} x 10 the time at every delta size; "
            f"{top['regions']} x {top['entries']:,} entries: {top['seconds']:.1f} s, "
            f"peak +{top['peak_mib']:.0f} MiB (flat in regions)",
            "linear in total update size",
            verdict(spread <= 1.2),
        ]
    ]


def plot(result: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib.pyplot as plt

    agg = result["rows"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for n in sorted({r["entries"] for r in agg}):
        mine = [r for r in agg if r["entries"] == n]
        left.plot(
            [r["update_bytes_total"] / 1e6 for r in mine],
            [r["seconds"] for r in mine],
            marker="o",
            label=f"{n:,} entries",
        )
        right.plot(
            [r["regions"] for r in mine],
            [r["peak_mib"] for r in mine],
            marker="o",
            label=f"{n:,} entries",
        )
    left.set_xscale("log")
    left.set_yscale("log")
    left.set_xlabel("total update MB aggregated")
    left.set_ylabel("seconds")
    right.set_xscale("log")
    right.set_xlabel("regions")
    right.set_ylabel("peak memory added (MiB)")
    left.legend()
    right.legend()
    fig.tight_layout()
    path = out / "aggregation.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--codec", default="topk-int8:0.015")
    parser.add_argument("--counts", default="10,100,1000")
    parser.add_argument("--sizes", default="100000,1000000,5000000", help="delta entries")
    parser.add_argument("--repeats", type=int, default=3, help="keep the fastest")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    counts = [int(c) for c in args.counts.split(",")]
    sizes = [int(s) for s in args.sizes.split(",")]
    rows: list[dict[str, Any]] = []
    print(f"aggregation of {args.codec} updates (decode, validate, add), one accumulator")
    print(
        f"{'entries':>10} {'regions':>8} {'seconds':>8} {'MB in':>8} {'us/MB':>8} "
        f"{'peak MiB':>9} {'accumulator MiB':>16}"
    )
    for n in sizes:
        for count in counts:
            # The fastest of a few: this machine is shared, and noise only adds time.
            runs = [measure(args.codec, n, count) for _ in range(args.repeats)]
            r = {"entries": n, "regions": count, **min(runs, key=lambda m: m["seconds"])}
            per_mb = r["seconds"] / (r["update_bytes_total"] / 1e6) * 1e6
            r["us_per_mb"] = per_mb
            rows.append(r)
            print(
                f"{n:>10} {count:>8} {r['seconds']:>8.2f} {r['update_bytes_total'] / 1e6:>8.1f} "
                f"{per_mb:>8.0f} {r['peak_mib']:>9.1f} {r['model_mib']:>16.1f}"
            )
    spread = scaling(rows)
    print(
        f"10x the regions (so 10x the update bytes) takes at most {spread:.2f} x 10 the time, "
        "for every delta size (1.0 = exactly linear)"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"codec": args.codec, "rows": rows, "linearity_spread": spread}, indent=2),
            encoding="utf-8",
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
