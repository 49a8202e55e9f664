"""Peak memory of a 3-region simulation on the ``realistic`` preset: one shared,
memory-mapped base against a private base per region (``FEDCIUIC_SHARED_BASE=0``).

Each mode runs its own simulation (SuperLink, ServerApp, Ray with one CPU per
ClientApp, DP-SGD and sealing on, policies off), one after the other, with a fresh
base cache shared by both (the shared mode builds the base file, cold). Every ~0.2 s
the whole process tree is sampled: the federation's processes, their descendants and
every process carrying the federation's mark (Ray's workers, wherever they were
re-parented), read from ``/proc/PID/smaps_rollup``:

- **RSS** counts every resident page a process maps, so a page of the shared base
  file mapped by three processes is counted three times;
- **PSS** splits each page among the processes that map it, so their sum is the
  memory the tree really holds (each page once).

The 4 GiB target is judged on PSS: it is what the machine must provide, and the only
sum that does not grow with the number of processes that share the same pages. RSS is
reported beside it. The private mode keeps the cache as it was before sharing (up to
four regions per actor, no memory bound: ``FEDCIUIC_REGION_CACHE_MIB`` very high).

    .venv/bin/python benchmarks/simulation_memory.py
    .venv/bin/python benchmarks/simulation_memory.py --modes shared --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from report import Row, proc_bytes, process_tree, verdict

from fedciuic.crypto.parties import generate_federation_keys
from fedciuic.data.demo import write_demo_corpora
from fedciuic.flower.launch import LocalFederation
from fedciuic.model.shared_base import SHARE_ENV
from fedciuic.ops.runconfig import app_run_config
from fedciuic.ops.simulate import cpus_per_region
from fedciuic.record.metrics import load_metrics
from fedciuic.record.recorder import METRICS_FILE
from fedciuic.region.cache import BUDGET_ENV

ROOT = Path(__file__).resolve().parents[1]
REGIONS = ("eu", "cn", "us")
TARGET_GIB = 4.0
GIB = 2**30


def command(pid: int) -> str:
    """A short name for a process: its command, or the Ray actor it runs."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()[-40:]
    except OSError:
        return "?"


def run_mode(shared: bool, tmp: Path, cache: Path, args: argparse.Namespace) -> dict[str, Any]:
    mode = "shared" if shared else "private"
    saved = {k: os.environ.get(k) for k in (SHARE_ENV, BUDGET_ENV, "FEDCIUIC_CACHE")}
    os.environ[SHARE_ENV] = "1" if shared else "0"
    os.environ["FEDCIUIC_CACHE"] = str(cache)
    if not shared:
        os.environ[BUDGET_ENV] = str(2**20)  # no memory bound: the cache as it was
    out = tmp / f"runs-{mode}"
    peak: dict[str, Any] = {"rss": 0, "pss": 0, "processes": 0, "samples": 0, "top": []}
    try:
        with LocalFederation(tmp / f"work-{mode}", ROOT) as federation:
            federation.start_superlink(simulation=True)
            stop = threading.Event()
            pids: list[int] = []
            last_scan = 0.0

            def sample() -> None:
                nonlocal pids, last_scan
                while not stop.is_set():
                    if time.monotonic() - last_scan > 1.0:  # the tree changes slowly
                        pids, last_scan = sorted(process_tree(federation)), time.monotonic()
                    sizes = [proc_bytes(f"/proc/{pid}/smaps_rollup", "Rss", "Pss") for pid in pids]
                    peak["rss"] = max(peak["rss"], sum(r for r, _ in sizes))
                    if sum(p for _, p in sizes) > peak["pss"]:
                        peak["pss"] = sum(p for _, p in sizes)
                        peak["top"] = sorted(
                            ((p, r, command(pid)) for pid, (r, p) in zip(pids, sizes, strict=True)),
                            reverse=True,
                        )[:6]
                    peak["processes"] = max(peak["processes"], sum(1 for r, _ in sizes if r))
                    peak["samples"] += 1
                    time.sleep(0.2)

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            started = time.monotonic()
            try:
                run_id, _ = federation.run_app(
                    {
                        "regions": ",".join(REGIONS),
                        "model-preset": "realistic",
                        "dtype": args.dtype,
                        "num-server-rounds": args.rounds,
                        "local-steps": args.steps,
                        "batch-size": args.batch_size,
                        "max-physical-batch-size": args.physical_batch,
                        "seq-len": args.seq_len,
                        "gradient-checkpointing": args.gradient_checkpointing,
                        "max-eval-examples": 8,
                        "data-root": str(tmp / f"data-{mode}"),
                        "output-dir": str(out),
                        "keys-dir": str(tmp / "keys"),
                        "enforce-policies": False,
                        "audit-dir": str(out / "audit"),
                        "min-regions": len(REGIONS),
                    },
                    federation_config={
                        "num-supernodes": len(REGIONS),
                        "client-resources-num-cpus": args.cpus_per_region,
                    },
                    timeout=540,
                )
            finally:
                elapsed = time.monotonic() - started
                stop.set()
                sampler.join()
            left = federation.stop()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    metrics = load_metrics(out / f"run-{run_id}" / METRICS_FILE)
    return {
        "mode": mode,
        "status": str(metrics.run.status),
        "seconds": round(elapsed, 1),
        "peak_rss_gib": peak["rss"] / GIB,
        "peak_pss_gib": peak["pss"] / GIB,
        "processes": peak["processes"],
        "samples": peak["samples"],
        "left_running": len(left),
        "at_peak_pss": [
            {"pss_mib": p >> 20, "rss_mib": r >> 20, "command": c} for p, r, c in peak["top"]
        ],
    }


def rows(result: dict[str, Any]) -> list[Row]:
    """The results table's row: the shared base's peak PSS against the 4 GiB target."""
    by_mode = {row["mode"]: row for row in result["rows"]}
    if "shared" not in by_mode or "settings" not in result:
        return []
    s, shared = result["settings"], by_mode["shared"]
    parts = f" in parts of {s['physical_batch']}" if s["physical_batch"] else ""
    measured = (
        f"peak PSS {shared['peak_pss_gib']:.2f} GiB (RSS {shared['peak_rss_gib']:.2f}), "
        f"{s['steps']} DP-SGD steps of {s['batch_size']} x {s['seq_len']} tokens{parts}, "
        f"{s['cpus_per_region']} CPU(s) per ClientApp"
    )
    if "private" in by_mode:
        measured += f"; a private base per region: {by_mode['private']['peak_pss_gib']:.2f} GiB"
    figure = "memory, 3 simulated regions on the realistic preset, default settings"
    met = verdict(shared["peak_pss_gib"] <= TARGET_GIB)
    return [[figure, measured, f"<= {TARGET_GIB:g} GiB", met]]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--modes", default="shared,private")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--dtype", default="auto", help="run config dtype (auto = fp32 on CPU)")
    parser.add_argument("--batch-size", type=int, help="default: the app's run config's")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument(
        "--physical-batch",
        type=int,
        help="max-physical-batch-size (0: the whole batch at once); default: the app's",
    )
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument(
        "--cpus-per-region",
        type=int,
        help="Ray's client-resources-num-cpus; default: fedciuic simulate's (every core where "
        "there are fewer cores than regions: one region trains at a time)",
    )
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    args.cpus_per_region = args.cpus_per_region or cpus_per_region(len(REGIONS))
    defaults = app_run_config(ROOT)
    if args.batch_size is None:
        args.batch_size = defaults["batch-size"]
    if args.physical_batch is None:
        args.physical_batch = defaults["max-physical-batch-size"]
    rows = []
    print(
        f"3-region simulation, realistic preset (dtype {args.dtype}), {args.rounds} round(s) x "
        f"{args.steps} DP-SGD step(s) of batch {args.batch_size} x {args.seq_len} tokens"
        f"{f' in parts of {args.physical_batch}' if args.physical_batch else ''}"
        f"{', gradient checkpointing' if args.gradient_checkpointing else ''}, "
        f"{args.cpus_per_region} CPU(s) per ClientApp, sampled every 0.2 s"
    )
    print(
        f"{'mode':>8} {'status':>10} {'s':>6} {'procs':>5} "
        f"{'peak RSS GiB':>12} {'peak PSS GiB':>12}"
    )
    with tempfile.TemporaryDirectory(prefix="fedciuic-bench-simmem-") as name:
        tmp = Path(name)
        for mode in ("shared", "private"):  # fresh datasets (and privacy ledgers) for each
            write_demo_corpora(tmp / f"data-{mode}", REGIONS)
        generate_federation_keys(tmp / "keys", REGIONS)
        for mode in args.modes.split(","):
            row = run_mode(mode == "shared", tmp, tmp / "cache", args)
            rows.append(row)
            print(
                f"{row['mode']:>8} {row['status']:>10} {row['seconds']:>6.0f} "
                f"{row['processes']:>5} {row['peak_rss_gib']:>12.2f} {row['peak_pss_gib']:>12.2f}",
                flush=True,
            )
            print(f"{'':>8} processes left running after the stop: {row['left_running']}")
            for top in row["at_peak_pss"]:
                print(
                    f"{'':>8} at the peak: PSS {top['pss_mib']:>6} MiB, RSS {top['rss_mib']:>6} MiB"
                    f"  {top['command']}"
                )
    by_mode = {row["mode"]: row for row in rows}
    if {"shared", "private"} <= set(by_mode):
        s, p = by_mode["shared"], by_mode["private"]
        print(
            f"private / shared: RSS {p['peak_rss_gib'] / s['peak_rss_gib']:.2f}x, "
            f"PSS {p['peak_pss_gib'] / s['peak_pss_gib']:.2f}x"
        )
    if "shared" in by_mode:
        pss = by_mode["shared"]["peak_pss_gib"]
        outcome = "met" if pss <= TARGET_GIB else "NOT met"
        print(f"target: shared peak PSS {pss:.2f} GiB <= {TARGET_GIB:g} GiB: {outcome}")
    if args.json:
        settings = {
            "batch_size": args.batch_size,
            "physical_batch": args.physical_batch,
            "seq_len": args.seq_len,
            "steps": args.steps,
            "gradient_checkpointing": args.gradient_checkpointing,
            "dtype": args.dtype,
            "cpus_per_region": args.cpus_per_region,
        }
        result = {"settings": settings, "rows": rows}
        Path(args.json).write_text(json.dumps(result, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
