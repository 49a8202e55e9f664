"""Aggregation scaling: time and peak memory against the number of regions and the delta
size; and 32 realistic-size compressed updates against the memory-bandwidth bound.

**Scaling.** Updates are encoded before the clock starts (encoding is the regions' work,
not timed: a pool of up to 8 distinct random deltas per size, each with its own top-k
indices, used in turn), then each is decoded, validated and added into the one
accumulator, as the aggregator does. Time should grow linearly in the total update size
and memory stay at the model size plus one update, whatever the number of regions.

**Against the bandwidth bound.** 32 updates of ``--realistic-entries`` entries (13.8M:
the ``realistic`` preset's LoRA r=128 attention adapter) with the run's codec (the
``codec`` of pyproject.toml's run config, read at run time), aggregated as the
aggregator does (a fresh float64 accumulator, then decode + validate + add for each,
then the mean), fastest of ``--repeats``. In the same run this machine's memory
bandwidth is measured with numpy on one core (copy and add of 256 MiB arrays, fastest
of 5), and the least the aggregation must move is computed: the compressed inputs,
zeroing the accumulator, each update's accumulator entries read and written, and the
mean (read the accumulator, write float32). The figure is achieved time / bound time;
the bound is given both at 16 bytes per sparse entry (8 read + 8 written) and at the
64-byte cache lines that a scatter really moves.

Every time here is the process's CPU time (user + system, so page faults count): the
aggregation is single-threaded, so on an idle core it is its wall time, and on this
shared machine it leaves out the time spent waiting for a core.

    .venv/bin/python benchmarks/aggregation.py
    .venv/bin/python benchmarks/aggregation.py --counts 10,100 --sizes 1000000 --json out.json
"""

from __future__ import annotations

import argparse
import json
import time
import tomllib
from pathlib import Path
from typing import Any

import numpy as np
from report import Row, proc_bytes, save_figure, verdict

from fedciuic.aggregator.aggregation import Accumulator, Bounds, check
from fedciuic.compression import Codec, get_codec

ROOT = Path(__file__).resolve().parents[1]
#: Entries of the realistic preset's adapter (LoRA r=128 on its attention).
REALISTIC_ENTRIES = 13_811_712
#: Updates aggregated against the bandwidth bound.
REALISTIC_REGIONS = 32
#: Distinct deltas (top-k index sets) encoded per size; updates use them in turn.
POOL = 8


def clock() -> float:
    """This process's CPU seconds (user + system, page faults included): on a shared
    machine time spent waiting for a core is not aggregation; on an idle core the
    single-threaded aggregation's CPU time is its wall time."""
    return time.process_time()


def default_codec() -> str:
    """The run config's ``codec``, as pyproject.toml says today."""
    with open(ROOT / "pyproject.toml", "rb") as handle:
        config = tomllib.load(handle)
    return str(config["tool"]["flwr"]["app"]["config"]["codec"])


def encoded_pool(codec: Codec, n: int, count: int) -> list[bytes]:
    """Up to ``POOL`` encodings of distinct random deltas (distinct top-k indices)."""
    rng = np.random.default_rng(0)
    return [
        codec.encode(rng.standard_normal(n).astype(np.float32), rng)
        for _ in range(min(count, POOL))
    ]


def measure(codec: Codec, pool: list[bytes], n: int, count: int) -> dict[str, float]:
    """Seconds spent aggregating, bytes aggregated and the peak memory aggregation added."""
    with open("/proc/self/clear_refs", "w", encoding="ascii") as handle:
        handle.write("5")  # reset the peak RSS
    before = proc_bytes("/proc/self/status", "VmRSS")[0]
    start = clock()
    acc = Accumulator(n)
    total = 0
    for i in range(count):
        blob = pool[i % len(pool)]
        total += len(blob)
        acc.add(check(codec, blob, n, 10.0, Bounds()))
    acc.mean()
    seconds = clock() - start
    return {
        "seconds": seconds,
        "update_bytes_total": float(total),
        "peak_mib": (proc_bytes("/proc/self/status", "VmHWM")[0] - before) / 2**20,
        "model_mib": n * 8 / 2**20,  # the float64 accumulator
    }


def bandwidth(mib: int = 256, repeats: int = 5) -> dict[str, float]:
    """This machine's memory bandwidth on one core, in bytes per second, fastest of
    ``repeats``: numpy copy (read + write: 2 arrays' bytes) and add (a + b -> c: 3)."""
    n = mib * 2**20 // 8
    a = np.ones(n)
    b = np.ones(n)
    c = np.ones(n)  # every page touched before timing
    best = {"copy": 0.0, "add": 0.0}
    for _ in range(repeats):
        start = clock()
        np.copyto(c, a)
        best["copy"] = max(best["copy"], 2 * a.nbytes / (clock() - start))
        start = clock()
        np.add(a, b, out=c)
        best["add"] = max(best["add"], 3 * a.nbytes / (clock() - start))
    return {**best, "best": max(best.values())}


def versus_bound(codec: Codec, n: int, count: int, repeats: int) -> dict[str, Any]:
    """``count`` updates of ``n`` entries aggregated as the aggregator does, fastest of
    ``repeats``, with where the time goes, against the least memory traffic it needs."""
    pool = encoded_pool(codec, n, count)
    blobs = [pool[i % len(pool)] for i in range(count)]
    decoded = [codec.decode(b, n) for b in pool]
    sparse = decoded[0].indices is not None
    entries = [d.values.size for d in decoded]
    lines = [
        int(np.unique(d.indices // 8).size) if d.indices is not None else -(-n // 8)
        for d in decoded
    ]
    del decoded
    runs = []
    for _ in range(repeats):
        timing = {"zero": 0.0, "decode": 0.0, "validate": 0.0, "add": 0.0, "mean": 0.0}
        start = clock()
        t = clock()
        acc = Accumulator(n)
        acc.total.fill(0.0)  # np.zeros maps lazily: the page faults land here, not in add
        timing["zero"] += clock() - t
        for blob in blobs:
            t = clock()
            codec.decode(blob, n)  # the decode alone, to split check's time
            timing["decode"] += clock() - t
            t = clock()
            checked = check(codec, blob, n, 10.0, Bounds())
            timing["validate"] += clock() - t
            t = clock()
            acc.add(checked)
            timing["add"] += clock() - t
        t = clock()
        acc.mean()
        timing["mean"] += clock() - t
        # The extra decode (to split check's time) is not the aggregator's work.
        total = clock() - start - timing["decode"]
        timing["validate"] -= timing["decode"]  # check = decode + norm + bounds
        runs.append({"seconds": total, **timing})
        del acc
    best = min(runs, key=lambda r: r["seconds"])
    inputs = sum(len(b) for b in blobs)
    touched = sum(entries[i % len(pool)] for i in range(count))
    touched_lines = sum(lines[i % len(pool)] for i in range(count))
    fixed = 8 * n + 12 * n  # zero the float64 accumulator; mean: read it, write float32
    bw = bandwidth()
    bound_entries = inputs + 16 * touched + fixed
    bound_lines = inputs + 128 * touched_lines + fixed
    dense = count * (4 * n + 16 * n) + fixed  # dense float32 updates, for comparison
    return {
        "codec": codec.name,
        "entries": n,
        "regions": count,
        "sparse": sparse,
        "input_bytes": inputs,
        "entries_added": touched,
        "cache_lines_added": touched_lines,
        "bandwidth": bw,
        "bound_bytes_entries": bound_entries,
        "bound_bytes_lines": bound_lines,
        "dense_bound_bytes": dense,
        "bound_s_entries": bound_entries / bw["best"],
        "bound_s_lines": bound_lines / bw["best"],
        "dense_bound_s": dense / bw["best"],
        "add_bound_s_lines": 128 * touched_lines / bw["best"],
        **best,
        "ratio_entries": best["seconds"] / (bound_entries / bw["best"]),
        "ratio_lines": best["seconds"] / (bound_lines / bw["best"]),
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
    out: list[Row] = []
    b = result.get("bound")
    if b:
        out.append(
            [
                f"aggregation of {b['regions']} x {b['entries'] / 1e6:.1f}M-entry "
                f"{result['codec']} updates vs memory bandwidth",
                f"{b['seconds']:.2f} s (decode {b['decode']:.2f}, validate {b['validate']:.2f}, "
                f"add {b['add']:.2f}, zero+mean {b['zero'] + b['mean']:.2f}); bound at "
                f"{b['bandwidth']['best'] / 1e9:.1f} GB/s: {b['bound_s_entries'] * 1e3:.0f} ms "
                f"(16 B/entry), {b['bound_s_lines'] * 1e3:.0f} ms (64 B lines): "
                f"{b['ratio_entries']:.1f}x / {b['ratio_lines']:.1f}x the bound",
                "reported (bound = 1x)",
                "reported",
            ]
        )
    return [
        *out,
        [
            "aggregation scaling",
            f"10x the regions takes <= {spread:.2f} x 10 the time at every delta size; "
            f"{top['regions']} x {top['entries']:,} entries: {top['seconds']:.1f} s, "
            f"peak +{top['peak_mib']:.0f} MiB (flat in regions)",
            "linear in total update size",
            verdict(spread <= 1.2),
        ],
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
    path = save_figure(fig, out / "aggregation.png")
    paths = [path]
    b = result.get("bound")
    if b:
        fig, ax = plt.subplots(figsize=(8, 3.6))
        parts = ["zero", "decode", "validate", "add", "mean"]
        left = 0.0
        for part in parts:
            ax.barh("achieved", b[part] * 1e3, left=left, label=part)
            left += b[part] * 1e3
        ax.barh("bound, 64 B lines", b["bound_s_lines"] * 1e3, color="grey")
        ax.barh("bound, 16 B/entry", b["bound_s_entries"] * 1e3, color="lightgrey")
        ax.barh("bound, dense fp32", b["dense_bound_s"] * 1e3, color="white", edgecolor="k")
        ax.set_xlabel("milliseconds")
        ax.set_title(
            f"{b['regions']} x {b['entries'] / 1e6:.1f}M-entry {result['codec']} updates; "
            f"bandwidth {b['bandwidth']['best'] / 1e9:.1f} GB/s (one core)"
        )
        ax.legend(loc="lower right", fontsize=8)
        path = save_figure(fig, out / "aggregation_bound.png")
        paths.append(path)
    return paths


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--codec", default=None, help="default: pyproject.toml's run config")
    parser.add_argument("--counts", default="10,100,1000")
    parser.add_argument("--sizes", default="100000,1000000,5000000", help="delta entries")
    parser.add_argument("--repeats", type=int, default=2, help="keep the fastest")
    parser.add_argument(
        "--realistic-entries",
        type=int,
        default=REALISTIC_ENTRIES,
        help="entries of each update aggregated against the bandwidth bound (0: skip it)",
    )
    parser.add_argument("--realistic-regions", type=int, default=REALISTIC_REGIONS)
    parser.add_argument(
        "--bound-repeats",
        type=int,
        default=7,
        help="repeats of the bandwidth comparison (about 0.3 s each), keep the fastest",
    )
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    spec = args.codec or default_codec()
    codec = get_codec(spec)
    counts = [int(c) for c in args.counts.split(",")]
    sizes = [int(s) for s in args.sizes.split(",")]
    rows: list[dict[str, Any]] = []
    print(f"aggregation of {spec} updates (decode, validate, add), one accumulator", flush=True)
    print(
        f"{'entries':>10} {'regions':>8} {'seconds':>8} {'MB in':>8} {'us/MB':>8} "
        f"{'peak MiB':>9} {'accumulator MiB':>16}"
    )
    for n in sizes:
        pool = encoded_pool(codec, n, max(counts))
        for count in counts:
            # The fastest of a few: this machine is shared, and noise only adds time.
            runs = [measure(codec, pool, n, count) for _ in range(args.repeats)]
            r = {"entries": n, "regions": count, **min(runs, key=lambda m: m["seconds"])}
            per_mb = r["seconds"] / (r["update_bytes_total"] / 1e6) * 1e6
            r["us_per_mb"] = per_mb
            rows.append(r)
            print(
                f"{n:>10} {count:>8} {r['seconds']:>8.2f} {r['update_bytes_total'] / 1e6:>8.1f} "
                f"{per_mb:>8.0f} {r['peak_mib']:>9.1f} {r['model_mib']:>16.1f}",
                flush=True,
            )
        del pool
    spread = scaling(rows)
    print(
        f"10x the regions (so 10x the update bytes) takes at most {spread:.2f} x 10 the time, "
        "for every delta size (1.0 = exactly linear)"
    )
    result: dict[str, Any] = {"codec": spec, "rows": rows, "linearity_spread": spread}
    if args.realistic_entries:
        b = versus_bound(codec, args.realistic_entries, args.realistic_regions, args.bound_repeats)
        result["bound"] = b
        bw = b["bandwidth"]
        print(
            f"\n{b['regions']} updates of {b['entries']:,} entries ({spec}, "
            f"{b['input_bytes'] / b['regions'] / 1e3:.0f} kB each, "
            f"{b['entries_added'] // b['regions']:,} entries each in "
            f"{b['cache_lines_added'] // b['regions']:,} cache lines)"
        )
        print(
            f"memory bandwidth, one core: copy {bw['copy'] / 1e9:.1f} GB/s, "
            f"add {bw['add'] / 1e9:.1f} GB/s; bound uses {bw['best'] / 1e9:.1f} GB/s"
        )
        print(
            f"aggregation: {b['seconds'] * 1e3:.0f} ms = zero {b['zero'] * 1e3:.0f} + decode "
            f"{b['decode'] * 1e3:.0f} + validate (norm) {b['validate'] * 1e3:.0f} + add "
            f"{b['add'] * 1e3:.0f} + mean {b['mean'] * 1e3:.0f} ms"
        )
        print(
            f"least traffic: {b['bound_bytes_entries'] / 1e6:.0f} MB at 16 B per added entry "
            f"-> {b['bound_s_entries'] * 1e3:.0f} ms ({b['ratio_entries']:.1f}x); "
            f"{b['bound_bytes_lines'] / 1e6:.0f} MB in whole 64 B lines -> "
            f"{b['bound_s_lines'] * 1e3:.0f} ms ({b['ratio_lines']:.1f}x)"
        )
        print(
            f"scatter-add alone: {b['add'] * 1e3:.0f} ms against {b['add_bound_s_lines'] * 1e3:.0f}"
            f" ms for its cache lines at full bandwidth; dense fp32 updates would need at "
            f"least {b['dense_bound_s'] * 1e3:.0f} ms"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
