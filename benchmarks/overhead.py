"""End-to-end overhead: a round of fedciuic with every layer on, against plain Flower FedAvg.

Both run on one simulation SuperLink, one after the other, alternating, with the
same model (tiny preset), the same demo data, the same DP-SGD training (noise
calibrated the same way, same local steps and batch size) and the same 3 regions.
fedciuic adds compression, sealing, policy checks at both ends, the privacy
ledger, the audit logs and the checkpoints; the plain baseline
(``benchmarks/plain_flower``) is Flower's own ``FedAvg`` sending full adapters in
the clear. A round is training plus evaluation; its wall time is read from each
app's own per-round timestamps, leaving out round 1 (start-up). Target:
fedciuic's layers add at most 10 %.

    .venv/bin/python benchmarks/overhead.py
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from report import Row, verdict

from fedciuic.crypto.sealing import generate_federation_keys
from fedciuic.data.demo import write_demo_corpora
from fedciuic.flower.launch import LocalFederation
from fedciuic.rounds.metrics import load_metrics
from fedciuic.rounds.record import METRICS_FILE

ROOT = Path(__file__).resolve().parents[1]
REGIONS = ("eu", "cn", "us")
SIMULATION = {"num-supernodes": 3, "client-resources-num-cpus": 1}


def round_times(ended: dict[str, float]) -> list[float]:
    """Seconds per round 2..N from the end times of rounds 0..N. Round 1 is left out:
    it includes each app's one-off start-up (models built, data loaded, workers warm)."""
    marks = [ended[str(r)] for r in sorted(int(k) for k in ended)]
    return [b - a for a, b in itertools.pairwise(marks)][1:]


def rows(result: dict[str, Any]) -> list[Row]:
    spread = sorted(result["plain_rounds"] + result["fedciuic_rounds"])
    return [
        [
            "end-to-end round vs plain Flower FedAvg",
            f"{result['ratio']:.2f}x, medians {result['fedciuic_s']:.2f} s vs "
            f"{result['plain_s']:.2f} s over {len(result['plain_rounds'])} rounds each "
            f"(single rounds {spread[0]:.1f}-{spread[-1]:.1f} s: a noisy machine)",
            "<= 1.10x",
            verdict(result["ratio"] <= 1.10),
        ]
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each, alternating")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()

    fedciuic_rounds: list[float] = []
    plain_rounds: list[float] = []
    with tempfile.TemporaryDirectory(prefix="fedciuic-bench-overhead-") as name:
        tmp = Path(name)
        keys = generate_federation_keys(tmp / "keys", REGIONS)
        with LocalFederation(tmp / "work", ROOT) as federation:
            federation.start_superlink(simulation=True)
            for i in range(args.repeats):
                data = tmp / f"data-{i}"  # fresh data: a fresh privacy ledger each time
                write_demo_corpora(data, REGIONS)
                out = tmp / f"runs-{i}"
                run_id, _ = federation.run_app(
                    {
                        "num-server-rounds": args.rounds,
                        "data-root": str(data),
                        "output-dir": str(out),
                        "keys-dir": str(keys),
                        "policies-dir": str(ROOT / "policies"),
                        "audit-dir": str(out / "audit"),
                    },
                    federation_config=SIMULATION,
                    timeout=1800,
                )
                metrics = load_metrics(out / f"run-{run_id}" / METRICS_FILE)
                fedciuic_rounds += round_times(
                    {str(r): v.ended_at for r, v in metrics.rounds.items() if v.ended_at}
                )
                timings = tmp / f"plain-{i}.json"
                federation.run_app(
                    {
                        "num-server-rounds": args.rounds,
                        "data-root": str(data),
                        "timings-file": str(timings),
                        "fedciuic-root": str(ROOT),
                    },
                    federation_config=SIMULATION,
                    timeout=1800,
                    app=ROOT / "benchmarks" / "plain_flower",
                )
                plain_rounds += round_times(json.loads(timings.read_text()))
    ours, plain = statistics.median(fedciuic_rounds), statistics.median(plain_rounds)
    ratio = ours / plain
    verdict = "met" if ratio <= 1.10 else "NOT met"
    print("round wall time (training + evaluation, 3 regions, tiny preset, DP-SGD), median")
    print(f"plain Flower FedAvg:       {plain:.2f} s  ({len(plain_rounds)} rounds)")
    print(f"fedciuic, every layer on:  {ours:.2f} s  ({len(fedciuic_rounds)} rounds)")
    print(f"fedciuic / plain: {ratio:.2f}x (target <= 1.10x: {verdict})")
    if args.json:
        result: dict[str, Any] = {
            "plain_s": plain,
            "fedciuic_s": ours,
            "ratio": ratio,
            "plain_rounds": plain_rounds,
            "fedciuic_rounds": fedciuic_rounds,
        }
        Path(args.json).write_text(json.dumps(result, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
