"""A secure round against a plain one: fedciuic's simulation with secure-aggregation on
and off, side by side.

Both run on one simulation SuperLink (3 regions, one CPU per ClientApp), one after the
other, alternating (ABBA), on the same data and settings: the app's run config on the
``tiny`` preset, ``secure-aggregation`` the only difference. A secure round is the
plain round's training and evaluation plus five exchanges through the SuperLink
(adverts, shares, masked vectors, consents, reveals: docs/secure-aggregation.md). A
round's wall time comes from the run's own per-round end times (``metrics.json``),
leaving out round 1 (start-up); every secure round must have been unmasked. Target
(issue 48): a secure round at most 1.3x a plain one.

    .venv/bin/python benchmarks/secure_rounds.py                # 4 rounds, 2 repeats
    .venv/bin/python benchmarks/secure_rounds.py --rounds 3 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from overhead import REGIONS, ROOT, SIMULATION, round_times
from report import Row, verdict

from fedciuic.audit import Event, load_records
from fedciuic.crypto.parties import generate_federation_keys
from fedciuic.data.demo import write_demo_corpora
from fedciuic.flower.launch import LocalFederation
from fedciuic.record.metrics import load_metrics
from fedciuic.record.recorder import METRICS_FILE

TARGET = 1.3
KINDS = ("secure", "plain")


def rows(result: dict[str, Any]) -> list[Row]:
    rounds = result["rounds"]
    measured = (
        f"{result['ratio']:.2f}x, medians {result['secure_s']:.2f} s vs "
        f"{result['plain_s']:.2f} s over {len(rounds['plain'])} rounds each, "
        f"{result['preset']} preset, 3 regions"
    )
    figure = "secure round / plain round (simulation)"
    return [[figure, measured, f"<= {TARGET:g}x", verdict(result["ratio"] <= TARGET)]]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--preset", default="tiny", help="model-preset of the base")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each, alternating")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    began = time.perf_counter()
    rounds: dict[str, list[float]] = {kind: [] for kind in KINDS}
    with tempfile.TemporaryDirectory(prefix="fedciuic-bench-secure-") as name:
        tmp = Path(name)
        keys = generate_federation_keys(tmp / "keys", REGIONS)
        with LocalFederation(tmp / "work", ROOT) as federation:
            federation.start_superlink(simulation=True)

            def run(kind: str, i: int) -> None:
                data, out = tmp / f"data-{kind}-{i}", tmp / f"runs-{kind}-{i}"
                write_demo_corpora(data, REGIONS)  # a fresh ledger per run
                config = {
                    "model-preset": args.preset,
                    "num-server-rounds": args.rounds,
                    "secure-aggregation": kind == "secure",
                    "data-root": str(data),
                    "output-dir": str(out),
                    "keys-dir": str(keys),
                    "policies-dir": str(ROOT / "policies"),
                    "audit-dir": str(out / "audit"),
                }
                run_id, _ = federation.run_app(config, federation_config=SIMULATION, timeout=1800)
                metrics = load_metrics(out / f"run-{run_id}" / METRICS_FILE)
                ended = {str(r): v.ended_at for r, v in metrics.rounds.items() if v.ended_at}
                if len(ended) != args.rounds + 1:
                    raise SystemExit(f"{kind} run {run_id} ended {len(ended) - 1} round(s)")
                if kind == "secure":
                    log = out / "audit" / "aggregator.audit.jsonl"
                    outcomes = [
                        r["details"]["outcome"]
                        for r in load_records(log)
                        if r["event"] == Event.SECURE_SUM
                    ]
                    if outcomes != ["unmasked"] * args.rounds:
                        raise SystemExit(f"secure run {run_id}: sums {outcomes}")
                rounds[kind].extend(round_times(ended))

            for i in range(args.repeats):
                order = KINDS if i % 2 == 0 else KINDS[::-1]
                for kind in order:
                    run(kind, i)
    medians = {kind: statistics.median(v) for kind, v in rounds.items()}
    ratio = medians["secure"] / medians["plain"]
    print(
        f"round wall time, {args.preset} preset, 3 regions, {args.rounds} rounds x "
        f"{args.repeats} repeats, median of rounds 2..{args.rounds}"
    )
    for kind in KINDS:
        shown = ", ".join(f"{s:.1f}" for s in rounds[kind])
        print(f"{kind:6s}: {medians[kind]:.2f} s  ({shown})")
    print(f"secure / plain: {ratio:.2f}x (target <= {TARGET:g}x)")
    seconds = time.perf_counter() - began
    print(f"took {seconds:.0f} s")
    if args.json:
        result = {
            "preset": args.preset,
            "secure_s": medians["secure"],
            "plain_s": medians["plain"],
            "ratio": ratio,
            "rounds": rounds,
            "seconds": seconds,
        }
        Path(args.json).write_text(json.dumps(result, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
