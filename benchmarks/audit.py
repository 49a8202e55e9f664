"""Audit-log cost: the records a demo round writes, against the round itself.

One region's round as the demo runs it (tiny preset, demo data, DP-SGD, 30 local
steps, compression, evaluation) is timed next to the audit records that round
makes, written to real files with signed, fsync'ed checkpoints: that region's
records (policy decisions, trained, update_sealed, evaluated, two checkpoints)
plus everything the aggregator logs for a round of three regions. Rounds and
audit writes alternate, so a noisy machine slows both alike; the figure is the
ratio of the medians (target: under 2 %).

    .venv/bin/python benchmarks/audit.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from report import Row, verdict

from fedciuic.audit.log import AuditLog
from fedciuic.config import NodeConfig, RunConfig
from fedciuic.crypto.keys import Keypair
from fedciuic.data.demo import write_demo_corpora
from fedciuic.ops.runconfig import app_run_config
from fedciuic.region.trainer import Region

DIGEST = "ab" * 32
ROOT = Path(__file__).resolve().parents[1]


def region_records(log: AuditLog, run_id: int, r: int) -> None:
    """What a region writes in one round: train, then evaluate, each with a checkpoint."""
    decision = {
        "actor": "eu",
        "subject": "run terms",
        "outcome": "accept",
        "reasons": [],
        "policy_hash": DIGEST,
    }
    log.append("policy_decision", run_id=run_id, server_round=r, **decision)
    log.append(
        "trained",
        run_id=run_id,
        server_round=r,
        examples=1200,
        steps=30,
        data_fingerprint=DIGEST,
        epsilon=5.2,
        epsilon_budget=8.0,
        delta=1e-5,
        noise_multiplier=0.9,
    )
    log.append(
        "update_sealed",
        run_id=run_id,
        server_round=r,
        region="eu",
        digest=DIGEST,
        bytes=2280,
        suite="xwing-aes256gcm",
        destination="aggregator",
        destination_jurisdiction="EU",
        aggregator_key_id=DIGEST[:32],
        policy_hash=DIGEST,
    )
    log.checkpoint(run_id=run_id, server_round=r)
    log.append("policy_decision", run_id=run_id, server_round=r, **decision)
    log.append("evaluated", run_id=run_id, server_round=r, examples=128, loss=4.5)
    log.checkpoint(run_id=run_id, server_round=r)


def aggregator_records(log: AuditLog, run_id: int, r: int) -> None:
    """What the aggregator writes in one round of three regions."""
    for region in ("eu", "cn", "us"):
        log.append(
            "update_received",
            run_id=run_id,
            server_round=r,
            region=region,
            digest=DIGEST,
            bytes=2280,
            suite="sealed",
            sender_key_id=DIGEST[:32],
        )
        log.append(
            "policy_decision",
            run_id=run_id,
            server_round=r,
            actor="aggregator",
            subject=f"update from {region}",
            outcome="accept",
            reasons=[],
            policy_hash=DIGEST,
        )
        log.append(
            "update_accepted",
            run_id=run_id,
            server_round=r,
            region=region,
            examples=1200,
            epsilon=5.2,
            suite="xwing-aes256gcm",
            policy_hash=DIGEST,
        )
    log.append(
        "policy_decision",
        run_id=run_id,
        server_round=r,
        actor="aggregator",
        subject="aggregate",
        outcome="accept",
        reasons=[],
        policy_hash="",
    )
    log.append(
        "aggregate_published",
        run_id=run_id,
        server_round=r,
        regions=["eu", "cn", "us"],
        examples=3600,
        model_digest=DIGEST,
    )
    log.checkpoint(run_id=run_id, server_round=r)


def rows(result: dict[str, Any]) -> list[Row]:
    return [
        [
            "audit log cost",
            f"{100 * result['ratio']:.2f}% of a demo round",
            "< 2%",
            verdict(result["ratio"] < 0.02),
        ]
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="fedciuic-bench-audit-") as tmp:
        root = Path(tmp)
        write_demo_corpora(root / "data", ("eu",))
        run = RunConfig.from_user_config(
            {
                **app_run_config(ROOT),
                "num-server-rounds": args.rounds,
                "epsilon-budget": 1000.0,
                # The exact count sets the rate: no count release to make before a round.
                "count-noise": 0.0,
            },
            source="benchmark",
        )
        region = Region(run, NodeConfig(region="eu", data_path=str(root / "data" / "eu")))
        adapter = region.model.adapter_state()
        fingerprint = region.model.base_fingerprint
        region_log = AuditLog(root / "eu.jsonl", "eu", Keypair.generate("eu", "EU"))
        aggregator_log = AuditLog(
            root / "aggregator.jsonl", "aggregator", Keypair.generate("aggregator", "EU")
        )
        rounds, audits = [], []
        for r in range(1, args.rounds + 1):
            start = time.perf_counter()
            region.train_round(adapter, server_round=r, base_fingerprint=fingerprint, run_id=1)
            region.evaluate(adapter, base_fingerprint=fingerprint)
            rounds.append(time.perf_counter() - start)
            start = time.perf_counter()
            region_records(region_log, 1, r)
            aggregator_records(aggregator_log, 1, r)
            audits.append(time.perf_counter() - start)
        records = sum(
            (root / name).read_text().count("\n") for name in ("eu.jsonl", "aggregator.jsonl")
        )
    round_s, audit_s = statistics.median(rounds), statistics.median(audits)
    print(
        f"demo round (one region: DP train 30 steps + evaluate), median of {args.rounds}: "
        f"{round_s * 1000:.1f} ms"
    )
    print(
        f"audit records of that round ({records // args.rounds} records, "
        f"3 signed fsync'ed checkpoints), median: {audit_s * 1000:.2f} ms"
    )
    ratio = audit_s / round_s
    verdict = "met" if ratio < 0.02 else "NOT met"
    print(f"audit cost / round time: {ratio:.2%} (target < 2%: {verdict})")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"round_s": round_s, "audit_s": audit_s, "ratio": ratio}), encoding="utf-8"
        )


if __name__ == "__main__":
    main()
