"""Upload bytes and final eval loss per codec, and aggregation cost at scale.

Part 1 runs the demo federation (tiny preset, 3 regions, same seed, rounds and DP
settings, sealing on) once per codec, side by side on one simulation SuperLink, and
prints per codec the bytes each region uploaded per round (the sealed envelope,
as measured by the aggregator, and the compressed update inside it), the ratio to
``dense`` and the final eval loss.

Part 2 aggregates 10 and 100 updates of a 10-million-entry delta with the best
codec and prints time and the peak memory the aggregation added.

    .venv/bin/python benchmarks/compression.py
    .venv/bin/python benchmarks/compression.py --skip-federation   # part 2 only
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from fedciuic.aggregation import Accumulator, Bounds, check
from fedciuic.compression import get_codec
from fedciuic.demo_data import write_demo_corpora
from fedciuic.flower.launch import LocalFederation
from fedciuic.outputs import METRICS_FILE, final_eval, upload_bytes
from fedciuic.sealing import generate_federation_keys

ROOT = Path(__file__).resolve().parents[1]
CODECS = [
    "dense",
    "int8",
    "sign",
    "topk:0.01",
    "topk-int8:0.01",
    "topk-int8:0.015",
    "topk-int8:0.05",
]
REGIONS = ("eu", "cn", "us")


def run_federation(codecs: list[str], rounds: int) -> dict[str, dict[str, Any]]:
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="fedciuic-bench-") as tmp:
        keys = generate_federation_keys(Path(tmp) / "keys", REGIONS)
        with LocalFederation(Path(tmp) / "work", ROOT) as federation:
            federation.start_superlink(simulation=True)
            for codec in codecs:
                # Same data for every codec, each with its own fresh privacy ledger.
                data = Path(tmp) / f"data-{codec.replace(':', '_')}"
                write_demo_corpora(data, REGIONS)
                out = Path(tmp) / "runs"
                run_id, _ = federation.run_app(
                    {
                        "codec": codec,
                        "num-server-rounds": rounds,
                        "data-root": str(data),
                        "output-dir": str(out),
                        "keys-dir": str(keys),
                        "policies-dir": str(ROOT / "policies"),
                        "audit-dir": str(Path(tmp) / "audit"),
                    },
                    federation_config={"num-supernodes": 3, "client-resources-num-cpus": 1},
                    timeout=1800,
                )
                metrics = json.loads((out / f"run-{run_id}" / METRICS_FILE).read_text())
                wire = [b for r in REGIONS for b in upload_bytes(metrics, r)]
                payload = [
                    int(e.get("update_bytes", 0))
                    for rnd in metrics["rounds"].values()
                    for e in rnd.get("train", {}).values()
                    if "update_bytes" in e
                ]
                results[codec] = {
                    "wire_bytes": statistics.mean(wire),
                    "update_bytes": statistics.mean(payload) if payload else float("nan"),
                    "final_eval_loss": final_eval(metrics)[1]["overall"]["loss"],
                    "status": metrics["run"]["status"],
                }
                print(f"  ran {codec}: {results[codec]}", file=sys.stderr)
    return results


def aggregation_cost(codec_spec: str, n: int, count: int) -> tuple[float, float]:
    """Seconds and peak bytes to aggregate ``count`` encoded updates of ``n`` entries."""
    codec = get_codec(codec_spec)
    rng = np.random.default_rng(0)
    base = rng.standard_normal(n).astype(np.float32)
    updates = [codec.encode(base * (1 + 0.01 * i), rng) for i in range(count)]
    with open("/proc/self/clear_refs", "w", encoding="ascii") as handle:
        handle.write("5")  # reset the peak RSS: measure the aggregation alone
    before = _rss("VmRSS")
    start = time.perf_counter()
    acc = Accumulator(n)
    for blob in updates:
        acc.add(check(codec, blob, n, 10.0, Bounds()))
    acc.mean()
    seconds = time.perf_counter() - start
    return seconds, float(_rss("VmHWM") - before)


def _rss(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--codecs", default=",".join(CODECS))
    parser.add_argument("--skip-federation", action="store_true")
    parser.add_argument("--best", default="topk-int8:0.015", help="codec for part 2")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    out: dict[str, Any] = {}

    if not args.skip_federation:
        results = run_federation(args.codecs.split(","), args.rounds)
        dense = results["dense"]
        print(f"Upload per region per round, tiny preset, {args.rounds} rounds, DP on, sealed")
        print(
            f"{'codec':<16} {'on the wire':>12} {'ratio':>7} {'update':>9} {'ratio':>7} "
            f"{'eval loss':>10} {'vs dense':>9}"
        )
        for codec, r in results.items():
            print(
                f"{codec:<16} {r['wire_bytes']:>12.0f} "
                f"{dense['wire_bytes'] / r['wire_bytes']:>6.1f}x {r['update_bytes']:>9.0f} "
                f"{dense['update_bytes'] / r['update_bytes']:>6.1f}x "
                f"{r['final_eval_loss']:>10.4f} "
                f"{100 * (r['final_eval_loss'] / dense['final_eval_loss'] - 1):>+8.2f}%"
            )
        out["federation"] = results

    print(f"\nAggregation of 10-million-entry updates with {args.best}")
    print(f"{'updates':>8} {'seconds':>8} {'peak MiB':>9} {'dense copies would need':>24}")
    out["aggregation"] = {}
    for count in (10, 100):
        seconds, peak = aggregation_cost(args.best, 10_000_000, count)
        naive = count * 10_000_000 * 4 / 2**20
        print(f"{count:>8} {seconds:>8.2f} {peak / 2**20:>9.1f} {naive:>20.0f} MiB")
        out["aggregation"][count] = {"seconds": seconds, "peak_bytes": peak}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
