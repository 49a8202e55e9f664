"""Deployment on 127.0.0.1: a real flower-superlink, one agent and one flower-supernode per
region, flwr run. Each region's agent (``fedciuic agent``) holds its data, state, keys and
policy; the ClientApp only relays to it.

By default the SuperLink serves TLS only (a CA and certificate made here with
``fedciuic tls generate``) and admits only registered SuperNodes (one EC P-384
key per region, registered with ``flwr supernode register``). ``--insecure`` runs
the plain loopback variant instead. Run from the repository root, in the venv:

    .venv/bin/python examples/deploy_local.py --rounds 2
    .venv/bin/python examples/deploy_local.py --rounds 2 --insecure

Every process it starts is stopped when it ends, also on errors or Ctrl-C. The
same commands by hand are in the README ("Deployment").
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from fedciuic.agent.config import AgentConfig
from fedciuic.audit.log import AGGREGATOR_LOG, REGION_LOG
from fedciuic.audit.report import check_and_report
from fedciuic.crypto.parties import generate_federation_keys
from fedciuic.crypto.tls import generate_server_tls, generate_supernode_key
from fedciuic.data.demo import write_demo_corpora
from fedciuic.data.demo_pii import DEMO_DICTIONARIES
from fedciuic.errors import EXIT_OK
from fedciuic.flower.launch import LocalFederation
from fedciuic.flower.relay import AGENT
from fedciuic.ops.outputs import summarize
from fedciuic.policy.rules import load_policies
from fedciuic.record.metrics import RunStatus, load_metrics
from fedciuic.record.recorder import METRICS_FILE

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--regions", default="eu,cn,us")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--data-root", type=Path, help="one folder per region (default: demo data)")
    parser.add_argument(
        "--deid-dictionaries",
        type=Path,
        help="one <region>.txt of names per region, which the CN and EU policies require "
        "(default: the demo data's)",
    )
    parser.add_argument("--output-dir", type=Path, default=ROOT / "runs")
    parser.add_argument(
        "--insecure", action="store_true", help="no TLS, no SuperNode authentication"
    )
    args = parser.parse_args()

    regions = tuple(r.strip() for r in args.regions.split(","))
    output_dir = args.output_dir.resolve()
    with tempfile.TemporaryDirectory(prefix="fedciuic-deploy-") as tmp:
        data_root = args.data_root or Path(tmp) / "data"
        if args.data_root is None:
            write_demo_corpora(data_root, regions)
        dictionaries = args.deid_dictionaries or (
            data_root / DEMO_DICTIONARIES if args.data_root is None else None
        )
        # One folder of keys for the demo; in a real deployment each party makes its own.
        keys = generate_federation_keys(Path(tmp) / "keys", regions)
        # Each region enforces its own jurisdiction's policy; the shipped ones here.
        policies = load_policies(ROOT / "policies")
        tls = None if args.insecure else generate_server_tls(Path(tmp) / "tls", ["127.0.0.1"])
        with LocalFederation(Path(tmp) / "work", ROOT) as federation:
            address = federation.start_superlink(
                simulation=False, tls=tls, supernode_auth=not args.insecure
            )
            print(
                f"flower-superlink on {address} (pid {federation.pids()[0]}), "
                + ("insecure" if args.insecure else "TLS, SuperNode authentication")
            )
            for region in regions:
                # The region's agent holds its data, state, keys and policy; the ClientApp
                # (code the aggregator ships) learns only where the agent listens.
                agent = AgentConfig(
                    region=region,
                    data_path=str((data_root / region).resolve()),
                    state_path=str(Path(tmp) / "state" / region),
                    key_file=str(keys / f"{region}.key.json"),
                    aggregator_bundle=str(keys / "aggregator.pub.json"),
                    policy=str(policies.require(region.upper()).path),
                    socket=str(Path(tmp) / "agents" / region / "agent.sock"),
                    deid_dictionary=str(dictionaries / f"{region}.txt") if dictionaries else "",
                )
                config = Path(tmp) / f"{region}.agent.toml"
                config.write_text(agent.toml())
                started = federation.start_agent(region, config)
                print(f"fedciuic agent {region} (pid {started.process.pid})")
                node = {AGENT: agent.socket}
                auth_key = None
                if not args.insecure:
                    auth_key, public = generate_supernode_key(Path(tmp) / "auth", region)
                    federation.register_supernode(public, region)
                managed = federation.start_supernode(region, node, auth_key=auth_key)
                print(f"flower-supernode {region} (pid {managed.process.pid})")
            run_id, _ = federation.run_app(
                {
                    "regions": ",".join(regions),
                    "num-server-rounds": args.rounds,
                    "output-dir": str(output_dir),
                    "data-root": "",
                    "keys-dir": str(keys),
                    "policies-dir": str(ROOT / "policies"),
                    # Fresh keys each time: the aggregator's log starts with them.
                    "audit-dir": str(Path(tmp) / "audit"),
                },
                timeout=1800,
                echo=sys.stdout,
            )
        print("all Flower processes stopped")
        data = load_metrics(output_dir / f"run-{run_id}" / METRICS_FILE)
        print(summarize(data))
        # Each party's audit log, verified with its public key, and the run's report.
        report = check_and_report(
            [
                Path(tmp) / "audit" / AGGREGATOR_LOG,
                *(Path(tmp) / "state" / region / REGION_LOG for region in regions),
            ],
            keys,
            output_dir / f"run-{run_id}",
            run_id,
        )
        print("\n".join(report.lines))
    return 0 if data.run.status == RunStatus.COMPLETED and report.exit_code == EXIT_OK else 1


if __name__ == "__main__":
    raise SystemExit(main())
