"""Run every benchmark, then write results.json, results.md (the table) and PNG plots.

    bash scripts/bench.sh                       # the one command: installs, then runs this
    .venv/bin/python benchmarks/run_all.py --out benchmarks/results
    .venv/bin/python benchmarks/run_all.py --quick   # fewer repeats and sizes, for a try

Each figure comes from its own script (run here as a subprocess with ``--json``), measured
side by side in one run and reported as a ratio where the machine's speed would
otherwise drift. Every target is reported as met, or as not met with the figure.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the benchmark scripts, for their helpers
DEFAULT_CODEC = "topk-int8:0.015"  # pyproject.toml's run config

#: name -> (script, arguments, arguments with --quick)
BENCHMARKS: dict[str, tuple[str, list[str], list[str]]] = {
    "dp": ("dp_overhead.py", [], ["--rounds", "2"]),
    "sealing": ("sealing.py", [], ["--repeats", "2"]),
    "aggregation": (
        "aggregation.py",
        [],
        ["--counts", "10,100", "--sizes", "1000000", "--repeats", "1"],
    ),
    "audit": ("audit.py", [], ["--rounds", "2"]),
    "communication": ("compression.py", [], ["--rounds", "2", "--codecs", "dense,topk-int8:0.015"]),
    "overhead": ("overhead.py", [], ["--rounds", "2", "--repeats", "1"]),
    "scale": ("scale.py", [], ["--regions", "10"]),
}


def run(name: str, out: Path, quick: bool) -> dict[str, Any]:
    script, args, quick_args = BENCHMARKS[name]
    target = out / f"{name}.json"
    started = time.monotonic()
    done = subprocess.run(
        [
            sys.executable,
            str(HERE / script),
            *(quick_args if quick else args),
            "--json",
            str(target),
        ],
        capture_output=True,
        text=True,
        cwd=HERE.parent,
    )
    (out / f"{name}.log").write_text(done.stdout + done.stderr, encoding="utf-8")
    if done.returncode != 0 or not target.exists():
        print(f"{name}: FAILED (see {out / (name + '.log')})", file=sys.stderr)
        return {"error": done.stderr[-2000:]}
    print(f"{name}: done in {time.monotonic() - started:.0f}s")
    data: dict[str, Any] = json.loads(target.read_text(encoding="utf-8"))
    return data


def verdict(met: bool) -> str:
    return "met" if met else "**not met**"


def table(results: dict[str, Any]) -> list[list[str]]:
    """Rows of (figure, measured, target, verdict)."""
    rows: list[list[str]] = []
    comm = results.get("communication", {}).get("codecs", {})
    if "dense" in comm:
        dense = comm["dense"]
        for codec in [c for c in comm if c != "dense"]:
            r = comm[codec]
            fewer = dense["update_bytes"] / r["update_bytes"]
            wire = dense["wire_bytes"] / r["wire_bytes"]
            loss = 100 * (r["final_eval_loss"] / dense["final_eval_loss"] - 1)
            ok = fewer >= 100 and loss <= 2
            default = codec == DEFAULT_CODEC
            rows.append(
                [
                    f"communication, {codec}" + (" (the default)" if default else ""),
                    f"{fewer:.0f}x fewer update bytes ({wire:.1f}x on the wire), "
                    f"eval loss {loss:+.2f}% vs dense",
                    ">= 100x fewer, loss within 2%",
                    verdict(ok) if default else ("also meets it" if ok else "-"),
                ]
            )
            if default:
                rows.append(
                    [
                        f"upload on the wire, {codec}",
                        f"{wire:.1f}x fewer bytes than dense, sealed "
                        f"({r['wire_bytes']:.0f} vs {dense['wire_bytes']:.0f} B per round)",
                        ">= 100x fewer",
                        verdict(wire >= 100),
                    ]
                )
    dp = results.get("dp", {}).get("modes", {})
    for mode in ("hooks", "ghost"):
        if mode in dp:
            r = dp[mode]
            rows.append(
                [
                    f"DP-SGD cost, {mode}",
                    f"{r['time_ratio']:.2f}x time, {r['memory_ratio']:.2f}x memory of non-DP",
                    "<= 1.5x time",
                    verdict(r["time_ratio"] <= 1.5)
                    if mode == "hooks"
                    else "- (the default is hooks)",
                ]
            )
    sealing = results.get("sealing", {}).get("sizes", {})
    for size in ("1 MiB", "64 MiB"):
        if size in sealing:
            r = sealing[size]
            rows.append(
                [
                    f"sealing at {size}",
                    f"{r['envelope_ratio']:.2f} of raw AES-256-GCM "
                    f"({r['envelope_mb_s']:.0f} vs {r['raw_mb_s']:.0f} MB/s); "
                    f"X-Wing {results['sealing']['xwing_ms']:.2f} ms per update",
                    ">= 0.80 of raw AES-GCM",
                    verdict(r["envelope_ratio"] >= 0.8),
                ]
            )
    agg = results.get("aggregation", {})
    if "rows" in agg:
        from aggregation import scaling

        top = max(agg["rows"], key=lambda r: (r["regions"], r["entries"]))
        spread = scaling(agg["rows"])
        rows.append(
            [
                "aggregation scaling",
                f"10x the regions takes <= {spread:.2f} x 10 the time at every delta size; "
                f"{top['regions']} x {top['entries']:,} entries: {top['seconds']:.1f} s, "
                f"peak +{top['peak_mib']:.0f} MiB (flat in regions)",
                "linear in total update size",
                verdict(spread <= 1.2),
            ]
        )
    over = results.get("overhead", {})
    if "ratio" in over:
        spread = sorted(over["plain_rounds"] + over["fedciuic_rounds"])
        rows.append(
            [
                "end-to-end round vs plain Flower FedAvg",
                f"{over['ratio']:.2f}x, medians {over['fedciuic_s']:.2f} s vs "
                f"{over['plain_s']:.2f} s over {len(over['plain_rounds'])} rounds each "
                f"(single rounds {spread[0]:.1f}-{spread[-1]:.1f} s: a noisy machine)",
                "<= 1.10x",
                verdict(over["ratio"] <= 1.10),
            ]
        )
    audit = results.get("audit", {})
    if "ratio" in audit:
        rows.append(
            [
                "audit log cost",
                f"{100 * audit['ratio']:.2f}% of a demo round",
                "< 2%",
                verdict(audit["ratio"] < 0.02),
            ]
        )
    for r in results.get("scale", {}).get("rows", []):
        rows.append(
            [
                f"simulation, {r['regions']} regions",
                f"{r['round_s']:.1f} s/round, peak {r['peak_mib']:.0f} MiB, "
                f"{r['trained_updates']} updates, {r['status']}",
                "runs on 2 cores",
                verdict(r["status"] == "completed"),
            ]
        )
    return rows


def plots(results: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    comm = results.get("communication", {}).get("codecs", {})
    if comm:
        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
        names = list(comm)
        xs = range(len(names))
        left.bar(
            [x - 0.2 for x in xs],
            [comm[c]["update_bytes"] for c in names],
            0.4,
            label="compressed update",
        )
        left.bar(
            [x + 0.2 for x in xs],
            [comm[c]["wire_bytes"] for c in names],
            0.4,
            label="sealed, on the wire",
        )
        left.set_xticks(list(xs), names)
        left.set_yscale("log")
        left.set_ylabel("bytes per region per round")
        left.tick_params(axis="x", rotation=45)
        left.legend()
        for codec in names:
            curve = comm[codec]["eval_loss_per_round"]
            right.plot(range(len(curve)), curve, marker="o", label=codec)
        right.set_xlabel("round")
        right.set_xticks(range(len(comm[names[0]]["eval_loss_per_round"])))
        right.set_ylabel("eval loss (all regions)")
        right.legend(fontsize=7)
        fig.tight_layout()
        made.append(out / "communication.png")
        fig.savefig(made[-1], dpi=110)
        plt.close(fig)
    agg = results.get("aggregation", {}).get("rows", [])
    if agg:
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
        made.append(out / "aggregation.png")
        fig.savefig(made[-1], dpi=110)
        plt.close(fig)
    scale = results.get("scale", {}).get("rows", [])
    if scale:
        fig, left = plt.subplots(figsize=(6, 4))
        counts = [r["regions"] for r in scale]
        left.plot(counts, [r["round_s"] for r in scale], marker="o", color="tab:blue")
        left.set_xlabel("simulated regions")
        left.set_ylabel("seconds per round", color="tab:blue")
        right = left.twinx()
        right.plot(counts, [r["peak_mib"] for r in scale], marker="s", color="tab:red")
        right.set_ylabel("peak memory (MiB)", color="tab:red")
        fig.tight_layout()
        made.append(out / "scale.png")
        fig.savefig(made[-1], dpi=110)
        plt.close(fig)
    return made


def machine() -> str:
    cpus = os.cpu_count()
    mem = ""
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            kib = int(handle.readline().split()[1])
        mem = f", {kib / 2**20:.0f} GiB RAM"
    except (OSError, ValueError, IndexError):
        pass
    system = f"{platform.system()}, Python {platform.python_version()}"
    return f"{platform.machine()}, {cpus} CPUs{mem}, {system}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--only", help=f"comma-separated subset of {','.join(BENCHMARKS)}")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--report-only", action="store_true", help="rebuild the table and plots from results.json"
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    names = args.only.split(",") if args.only else list(BENCHMARKS)
    if args.report_only:
        names, args.only = [], "none"
    results: dict[str, Any] = {}
    previous = args.out / "results.json"
    if args.only and previous.exists():  # re-run some, keep the others' figures
        results = json.loads(previous.read_text(encoding="utf-8"))
    seconds: dict[str, float] = results.get("seconds", {})
    for name in names:
        started = time.monotonic()
        results[name] = run(name, args.out, args.quick)
        seconds[name] = time.monotonic() - started
    results["seconds"] = seconds
    results["machine"] = machine()
    results["minutes"] = sum(seconds.values()) / 60
    (args.out / "results.json").write_text(json.dumps(results, indent=2), encoding="utf-8")
    rows = table(results)
    took = f" in {results['minutes']:.0f} min" if set(BENCHMARKS) <= set(seconds) else ""
    lines = [
        f"Measured on {results['machine']}{took} "
        f"(`bash scripts/bench.sh`{' --quick' if args.quick else ''}).",
        "",
        "| figure | measured | target | verdict |",
        "| --- | --- | --- | --- |",
        *("| " + " | ".join(row) + " |" for row in rows),
    ]
    failed = [n for n in names if "error" in results[n]]
    if failed:
        lines += ["", f"Benchmarks that failed to run: {', '.join(failed)} (see their logs)."]
    made = plots(results, args.out)
    lines += ["", *(f"![{p.stem}]({p.name})" for p in made)]
    (args.out / "results.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
