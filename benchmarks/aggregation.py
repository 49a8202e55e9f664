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
