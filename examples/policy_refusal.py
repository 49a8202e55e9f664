"""A refusal, explained: the aggregator moves to the US and China's policy says no.

Runs one simulated round of the demo federation (eu, cn, us, shipped policies) with
the aggregator (and so the relay) in the US. The EU and US policies allow that;
the CN policy (PIPL Art. 38-40) allows an aggregator only in China or the EU, and
no relay in a third country. So the CN region declines before it trains, with
every reason, and the aggregate is built from EU and US alone.

Run from the repository root, inside the project's venv:

    .venv/bin/python examples/policy_refusal.py
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from fedciuic.ops.cli import main as fedciuic
from fedciuic.policy.rules import explain, load_policy
from fedciuic.record.metrics import load_metrics
from fedciuic.record.recorder import METRICS_FILE

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--output-dir", type=Path, help="default: a temporary folder")
    args = parser.parse_args()

    print("What the CN policy allows:\n")
    print(explain(load_policy(ROOT / "policies" / "cn-pipl.yaml")))
    print("\nOne round with the aggregator in the US:\n")
    with tempfile.TemporaryDirectory(prefix="fedciuic-refusal-") as tmp:
        out = (args.output_dir or Path(tmp)).resolve()
        status = fedciuic(
            [
                "simulate",
                "--app",
                str(ROOT),
                "--rounds",
                "1",
                "--output-dir",
                str(out),
                "--run-config",
                "aggregator-jurisdiction='US'",
                # A refusal, not training, is what this shows: 2 DP steps a round.
                "--run-config",
                "local-steps=2",
                "--quiet",
            ]
        )
        (metrics,) = out.glob(f"run-*/{METRICS_FILE}")
        data = load_metrics(metrics)
    cn = data.rounds[1].train["cn"]
    print(f"\nThe CN region {cn.status} round 1. Its reasons, one per rule:")
    for reason in (cn.reason or "").partition("declines: ")[2].split("; "):
        print(f"  - {reason}")
    aggregate = data.rounds[1].aggregate
    assert aggregate is not None
    print(f"Aggregate published: {aggregate.published}, from {', '.join(aggregate.regions)}")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
