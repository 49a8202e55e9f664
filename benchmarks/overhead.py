"""End-to-end overhead: a round of fedciuic with every layer on, against plain Flower FedAvg.

Both run on one simulation SuperLink, one after the other, alternating (ABBA: the app
that ran second in one repeat runs first in the next), with the same model, the same
demo data, the same DP-SGD training (noise calibrated the same way, same local steps
and batch size) and the same 3 regions. fedciuic adds compression, sealing, policy
checks at both ends, the privacy ledger, the audit logs and the checkpoints; the plain
baseline (``benchmarks/plain_flower``) is Flower's own ``FedAvg`` sending full adapters
in the clear. A round is training plus evaluation; its wall time is read from each
app's own per-round timestamps, leaving out round 1 (start-up). Target: fedciuic's
layers add at most 10 %.

    .venv/bin/python benchmarks/overhead.py                  # realistic preset
    .venv/bin/python benchmarks/overhead.py --preset tiny    # the app's own defaults

On ``realistic`` (207M parameters) the run settings are cut so that a run fits the
benchmark suite on 2 cores: LoRA r=64 on ``auto+mlp`` (10.3M adapter entries), 2 local
DP-SGD steps of 2 users (up to 2 examples each) x 128 tokens, 8 eval examples per
region. On ``tiny`` the app's defaults apply (r=8 on attention, 30 steps of 8 users x
256 tokens). Every setting can be given on the command line; both apps get the same.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from report import Row, verdict

from fedciuic.crypto.parties import generate_federation_keys
from fedciuic.data.demo import write_demo_corpora
from fedciuic.flower.launch import LocalFederation
from fedciuic.record.metrics import load_metrics
from fedciuic.record.recorder import METRICS_FILE

ROOT = Path(__file__).resolve().parents[1]
REGIONS = ("eu", "cn", "us")
SIMULATION = {"num-supernodes": 3, "client-resources-num-cpus": 1}
#: Run-config keys both apps get, and each preset's values (tiny: the app's defaults).
SETTINGS = (
    "lora-rank",
    "lora-targets",
    "local-steps",
    "batch-size",
    "seq-len",
    "max-eval-examples",
)
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {},
    "realistic": {
        "lora-rank": 64,
        "lora-targets": "auto+mlp",
        "local-steps": 2,
        "batch-size": 2,
        "seq-len": 128,
        "max-eval-examples": 8,
    },
}


def round_times(ended: dict[str, float]) -> list[float]:
    """Seconds per round 2..N from the end times of rounds 0..N. Round 1 is left out:
    it includes each app's one-off start-up (models built, data loaded, workers warm)."""
    marks = [ended[str(r)] for r in sorted(int(k) for k in ended)]
    return [b - a for a, b in itertools.pairwise(marks)][1:]


def rows(result: dict[str, Any]) -> list[Row]:
    spread = sorted(result["plain_rounds"] + result["fedciuic_rounds"])
    preset = result.get("preset")
    where = f", {preset} preset" if preset else ""
    return [
        [
            "end-to-end round vs plain Flower FedAvg",
            f"{result['ratio']:.2f}x, medians {result['fedciuic_s']:.2f} s vs "
            f"{result['plain_s']:.2f} s over {len(result['plain_rounds'])} rounds each{where} "
            f"(single rounds {spread[0]:.1f}-{spread[-1]:.1f} s: a noisy machine)",
            "<= 1.10x",
            verdict(result["ratio"] <= 1.10),
        ]
    ]


def _stamp(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC).timestamp()


def phases(logs: dict[str, Path]) -> dict[str, dict[str, float]]:
    """Where a fedciuic round's time goes, from each party's audit log: for each pair of
    consecutive records of one round (``witness -> policy_decision``: the global
    adapter's signature checked, the policy and projected epsilon checked;
    ``policy_decision -> trained``: DP-SGD, compression and the ledger;
    ``trained -> update_sealed``: sealing), the median seconds between them over
    rounds 2.. and parties of each kind (``region`` or ``aggregator``)."""
    spans: dict[str, dict[str, list[float]]] = {}
    for who, path in logs.items():
        if not path.is_file():
            continue
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        kind = spans.setdefault(who, {})
        for a, b in itertools.pairwise(records):
            if a.get("round") is None or a.get("round") != b.get("round") or a["round"] < 2:
                continue
            label = f"{a['event']} -> {b['event']}"
            kind.setdefault(label, []).append(_stamp(b["time"]) - _stamp(a["time"]))
    return {
        who: {label: statistics.median(v) for label, v in named.items()}
        for who, named in spans.items()
    }


def run_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The run-config overrides both apps get: the preset's, then the command line's."""
    values: dict[str, Any] = {"model-preset": args.preset, **PRESETS.get(args.preset, {})}
    for key in SETTINGS:
        given = getattr(args, key.replace("-", "_"))
        if given is not None:
            values[key] = given
    return values


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--preset", default="realistic", help="model-preset of both apps")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each, alternating")
    parser.add_argument("--lora-rank", type=int)
    parser.add_argument("--lora-targets")
    parser.add_argument("--local-steps", type=int)
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--max-eval-examples", type=int)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    settings = run_settings(args)

    began = time.perf_counter()
    fedciuic_rounds: list[float] = []
    plain_rounds: list[float] = []
    run_seconds: dict[str, list[float]] = {"fedciuic": [], "plain": []}
    breakdown: list[dict[str, dict[str, float]]] = []
    with tempfile.TemporaryDirectory(prefix="fedciuic-bench-overhead-") as name:
        tmp = Path(name)
        keys = generate_federation_keys(tmp / "keys", REGIONS)
        with LocalFederation(tmp / "work", ROOT) as federation:
            federation.start_superlink(simulation=True)

            def run_fedciuic(i: int, data: Path) -> None:
                out = tmp / f"runs-{i}"
                started = time.perf_counter()
                run_id, _ = federation.run_app(
                    {
                        **settings,
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
                run_seconds["fedciuic"].append(time.perf_counter() - started)
                metrics = load_metrics(out / f"run-{run_id}" / METRICS_FILE)
                fedciuic_rounds.extend(
                    round_times(
                        {str(r): v.ended_at for r, v in metrics.rounds.items() if v.ended_at}
                    )
                )
                logs = {"aggregator": out / "audit" / "aggregator.audit.jsonl"}
                logs.update({r: data / r / ".fedciuic" / "audit.jsonl" for r in REGIONS})
                breakdown.append(phases(logs))

            def run_plain(i: int, data: Path) -> None:
                timings = tmp / f"plain-{i}.json"
                started = time.perf_counter()
                federation.run_app(
                    {
                        **settings,
                        "num-server-rounds": args.rounds,
                        "data-root": str(data),
                        "timings-file": str(timings),
                        "fedciuic-root": str(ROOT),
                    },
                    federation_config=SIMULATION,
                    timeout=1800,
                    app=ROOT / "benchmarks" / "plain_flower",
                )
                run_seconds["plain"].append(time.perf_counter() - started)
                plain_rounds.extend(round_times(json.loads(timings.read_text())))

            for i in range(args.repeats):
                # Fresh data per repeat: a fresh privacy ledger (and residual) each time;
                # the plain app reads the same copy (its ledger is never written).
                data = tmp / f"data-{i}"
                write_demo_corpora(data, REGIONS)
                order = (run_fedciuic, run_plain) if i % 2 == 0 else (run_plain, run_fedciuic)
                for run in order:
                    run(i, data)
    ours, plain = statistics.median(fedciuic_rounds), statistics.median(plain_rounds)
    ratio = ours / plain
    verdict = "met" if ratio <= 1.10 else "NOT met"
    shown = ", ".join(f"{k} {v}" for k, v in settings.items())
    print(f"round wall time (training + evaluation, 3 regions, DP-SGD; {shown}), median")
    print(f"plain Flower FedAvg:       {plain:.2f} s  ({len(plain_rounds)} rounds)")
    print(f"fedciuic, every layer on:  {ours:.2f} s  ({len(fedciuic_rounds)} rounds)")
    print(f"fedciuic / plain: {ratio:.2f}x (target <= 1.10x: {verdict})")
    for who, named in (breakdown[-1] if breakdown else {}).items():
        print(f"  {who}: " + ", ".join(f"{k} {v:.2f} s" for k, v in named.items()))
    seconds = time.perf_counter() - began
    print(f"took {seconds:.0f} s")
    if args.json:
        result: dict[str, Any] = {
            "preset": args.preset,
            "settings": settings,
            "plain_s": plain,
            "fedciuic_s": ours,
            "ratio": ratio,
            "plain_rounds": plain_rounds,
            "fedciuic_rounds": fedciuic_rounds,
            "run_seconds": run_seconds,
            "fedciuic_phases": breakdown,
            "seconds": seconds,
        }
        Path(args.json).write_text(json.dumps(result, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
