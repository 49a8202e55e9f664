"""Communication: upload bytes per region per round and eval loss per round, per codec.

Runs the demo federation (tiny preset, 3 regions, same seed, rounds and DP
settings, sealing and policies on) once per codec, side by side on one simulation
SuperLink, and prints per codec the bytes each region uploaded per round (the
sealed envelope, as measured by the aggregator, and the compressed update inside
it), the ratio to ``dense``, and the eval loss per round (the convergence curve).
Aggregation at scale: ``benchmarks/aggregation.py``.

    .venv/bin/python benchmarks/compression.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from report import Row, verdict

from fedciuic.crypto.sealing import generate_federation_keys
from fedciuic.data.demo import write_demo_corpora
from fedciuic.flower.launch import LocalFederation
from fedciuic.ops.outputs import upload_bytes
from fedciuic.rounds.metrics import OVERALL, load_metrics
from fedciuic.rounds.record import METRICS_FILE

ROOT = Path(__file__).resolve().parents[1]
CODECS = ["dense", "int8", "sign", "topk-int8:0.01", "topk-int8:0.015", "topk-int8:0.05"]
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
                metrics = load_metrics(out / f"run-{run_id}" / METRICS_FILE)
                wire = [b for r in REGIONS for b in upload_bytes(metrics, r)]
                payload = [
                    e.update_bytes
                    for rnd in metrics.rounds.values()
                    for e in rnd.train.values()
                    if e.update_bytes is not None
                ]
                results[codec] = {
                    "wire_bytes": statistics.mean(wire),
                    "update_bytes": statistics.mean(payload) if payload else float("nan"),
                    "final_eval_loss": metrics.final_eval()[1][OVERALL].loss,
                    "eval_loss_per_round": [
                        metrics.rounds[r].eval[OVERALL].loss for r in range(rounds + 1)
                    ],
                    "status": str(metrics.run.status),
                }
                print(f"  ran {codec}: {results[codec]}", file=sys.stderr)
    return results


DEFAULT_CODEC = "topk-int8:0.015"  # pyproject.toml's run config


def rows(result: dict[str, Any]) -> list[Row]:
    comm = result["codecs"]
    dense = comm["dense"]
    out: list[Row] = []
    for codec in [c for c in comm if c != "dense"]:
        r = comm[codec]
        fewer = dense["update_bytes"] / r["update_bytes"]
        wire = dense["wire_bytes"] / r["wire_bytes"]
        loss = 100 * (r["final_eval_loss"] / dense["final_eval_loss"] - 1)
        ok = fewer >= 100 and loss <= 2
        default = codec == DEFAULT_CODEC
        out.append(
            [
                f"communication, {codec}" + (" (the default)" if default else ""),
                f"{fewer:.0f}x fewer update bytes ({wire:.1f}x on the wire), "
                f"eval loss {loss:+.2f}% vs dense",
                ">= 100x fewer, loss within 2%",
                verdict(ok) if default else ("also meets it" if ok else "-"),
            ]
        )
        if default:
            out.append(
                [
                    f"upload on the wire, {codec}",
                    f"{wire:.1f}x fewer bytes than dense, sealed "
                    f"({r['wire_bytes']:.0f} vs {dense['wire_bytes']:.0f} B per round)",
                    ">= 100x fewer",
                    verdict(wire >= 100),
                ]
            )
    return out


def plot(result: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib.pyplot as plt

    comm = result["codecs"]
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
    path = out / "communication.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--codecs", default=",".join(CODECS))
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
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
    if args.json:
        Path(args.json).write_text(json.dumps({"codecs": results}, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
