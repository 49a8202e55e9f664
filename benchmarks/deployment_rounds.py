"""Deployment round time against simulation, and model loads per region per run.

Each deployed region runs its own agent (``fedciuic agent``), which holds the model,
data and keys for the whole run; Flower's ClientApp, started anew for every message,
only relays to it. This runs the same 2 regions x N rounds (same preset, demo data,
DP-SGD, sealing, shipped policies) on 127.0.0.1, one mode after the other:

* ``deployment-agent``: flower-superlink, an agent and a flower-supernode per region,
  the relay as the region's own user (Flower's default subprocess isolation);
* ``deployment-relay-user`` (root only): the same with ``--isolation process`` and the
  relay's ``flower-superexec`` as an OS user of its own (``--relay-user``, which
  must exist and be able to run this Python), as ``fedciuic init`` deploys it;
* ``simulation`` (one simulation SuperLink, 2 virtual SuperNodes).

A round's wall time is read from the aggregator's per-round end times (round 0, the
initial evaluation, is the start mark: it holds each mode's start-up); the run's
wall time is ``flwr run``'s. Model loads are counted in each region's state dir
(``model-loads.jsonl``). Target: deployment / simulation <= 1.2x, and one model load
per region per run.

    .venv/bin/python benchmarks/deployment_rounds.py --preset tiny
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from fedciuic.agent.config import AgentConfig
from fedciuic.crypto.parties import generate_federation_keys
from fedciuic.data.demo import write_demo_corpora
from fedciuic.flower.launch import LocalFederation
from fedciuic.flower.relay import AGENT
from fedciuic.ops.layout import cpu_share
from fedciuic.record.metrics import load_metrics
from fedciuic.record.recorder import METRICS_FILE
from fedciuic.region.round import model_loads

ROOT = Path(__file__).resolve().parents[1]
REGIONS = ("eu", "cn")
POLICIES = ROOT / "policies"
SHIPPED = {"eu": "eu-gdpr.yaml", "cn": "cn-pipl.yaml", "us": "us-ccpa.yaml"}
MODES = ("deployment-agent", "deployment-relay-user", "simulation")
DEPLOYED = MODES[:2]


def round_times(ended: dict[str, float]) -> list[float]:
    """Seconds per round 1..N from the end times of rounds 0..N."""
    marks = [ended[str(r)] for r in sorted(int(k) for k in ended)]
    return [b - a for a, b in itertools.pairwise(marks)]


def _agent_config(
    tmp: Path, mode: str, region: str, data: Path, keys: Path, relay_user: str
) -> Path:
    config = AgentConfig(
        region=region,
        data_path=str(data / region),
        state_path=str(tmp / mode / "state" / region),
        key_file=str(keys / f"{region}.key.json"),
        aggregator_bundle=str(keys / "aggregator.pub.json"),
        policy=str(POLICIES / SHIPPED[region]),
        socket=str(tmp / mode / "agents" / region / "agent.sock"),
        relay_user=relay_user,
        cpu_threads=cpu_share(len(REGIONS)),
    )
    path = tmp / mode / f"{region}.agent.toml"
    path.write_text(config.toml())
    return path


def _run_one(
    mode: str, tmp: Path, keys: Path, run_config: dict[str, Any], relay_user: str
) -> dict[str, Any]:
    data = tmp / mode / "data"  # fresh data: a fresh privacy ledger each time
    write_demo_corpora(data, REGIONS)
    out = tmp / mode / "runs"
    config = {**run_config, "output-dir": str(out), "keys-dir": str(keys)}
    simulated = mode == "simulation"
    states = {
        r: (data / r / ".fedciuic") if simulated else (tmp / mode / "state" / r) for r in REGIONS
    }
    with LocalFederation(tmp / mode / "work", ROOT) as federation:
        # One CPU per region, as the simulation's client-resources-num-cpus gives its
        # actors (Ray sets their torch threads so): regions share this machine's cores.
        federation.env["OMP_NUM_THREADS"] = "1"
        federation.start_superlink(simulation=simulated)
        if not simulated:
            for region in REGIONS:
                own_user = mode == "deployment-relay-user"
                agent = _agent_config(tmp, mode, region, data, keys, relay_user if own_user else "")
                if own_user:
                    for private in (data, tmp / mode / "state"):
                        private.mkdir(parents=True, exist_ok=True)
                        private.chmod(0o700)
                federation.start_agent(region, agent)
                node = {AGENT: str(tmp / mode / "agents" / region / "agent.sock")}
                federation.start_supernode(
                    region,
                    node,
                    relay_user=relay_user if mode == "deployment-relay-user" else None,
                    relay_home=tmp / mode / "relay" / region,
                )
        started = time.monotonic()
        run_id, _ = federation.run_app(
            {**config, "data-root": str(data) if simulated else ""},
            federation_config={"num-supernodes": len(REGIONS), "client-resources-num-cpus": 1}
            if simulated
            else None,
            timeout=3600,
        )
        run_s = time.monotonic() - started
    metrics = load_metrics(out / f"run-{run_id}" / METRICS_FILE)
    rounds = round_times({str(r): v.ended_at for r, v in metrics.rounds.items() if v.ended_at})
    return {
        "status": metrics.run.status,
        "run_s": run_s,
        "round_s": rounds,
        "mean_round_s": statistics.mean(rounds) if rounds else float("nan"),
        "model_loads": {r: model_loads(states[r], run_id) for r in REGIONS},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--preset", default="tiny", help="model-preset (default: tiny)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--local-steps", type=int, default=5)
    parser.add_argument("--modes", default=",".join(MODES), help=f"of {', '.join(MODES)}")
    parser.add_argument(
        "--relay-user",
        default="fedciuic-relay",
        help="deployment-relay-user: the relay's OS user (default: fedciuic-relay)",
    )
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    run_config = {
        "num-server-rounds": args.rounds,
        "local-steps": args.local_steps,
        "model-preset": args.preset,
        "regions": ",".join(REGIONS),
        "policies-dir": str(POLICIES),
    }
    results: dict[str, Any] = {}
    modes = args.modes.split(",")
    if "deployment-relay-user" in modes and os.geteuid() != 0:
        print("deployment-relay-user: skipped (needs root to run the relay as another user)")
        modes.remove("deployment-relay-user")
    with tempfile.TemporaryDirectory(prefix="fedciuic-bench-deploy-", dir="/tmp") as name:
        tmp = Path(name)
        tmp.chmod(0o711)  # the relay's user passes through to its home and the agents' sockets
        keys = generate_federation_keys(tmp / "keys", REGIONS)
        for mode in modes:
            results[mode] = _run_one(mode, tmp, keys, run_config, args.relay_user)
            r = results[mode]
            print(
                f"{mode:<22} {r['status']:<10} run {r['run_s']:7.1f} s, rounds "
                f"{', '.join(f'{s:.1f}' for s in r['round_s'])} s (mean {r['mean_round_s']:.1f} s),"
                f" model loads per region {r['model_loads']}",
                flush=True,
            )
    print(
        f"\n2 regions x {args.rounds} rounds, preset {args.preset}, {args.local_steps} local steps"
    )
    sim = results.get("simulation")
    for mode in DEPLOYED:
        if sim and mode in results:
            ratio = results[mode]["mean_round_s"] / sim["mean_round_s"]
            run_ratio = results[mode]["run_s"] / sim["run_s"]
            results[mode]["ratio"], results[mode]["run_ratio"] = ratio, run_ratio
            verdict = "met" if ratio <= 1.2 else "NOT met"
            print(
                f"{mode} / simulation: round {ratio:.2f}x (target <= 1.2x: {verdict}), "
                f"whole run {run_ratio:.2f}x"
            )
    for mode, r in results.items():
        loads = max(r["model_loads"].values())
        print(f"{mode}: model loads per region per run: {loads} (target 1)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
