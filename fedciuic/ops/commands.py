"""What each ``fedciuic`` command does with its parsed arguments, one function per
command (``cli.py`` is the parser). Each returns the exit status; bad input raises a
:class:`~fedciuic.errors.FedciuicError`, which ``cli.main`` prints in one line."""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

from fedciuic.config import DataSettings, RunConfig
from fedciuic.errors import ConfigError
from fedciuic.ops.runconfig import app_run_config, parse_overrides
from fedciuic.ops.simulate import budget_lines, simulation_budgets

#: `data check`'s --max-record-bytes default: the run config's.
RECORD_BYTES = DataSettings.model_fields["max_record_bytes"].default


def init(args: argparse.Namespace) -> int:
    from fedciuic.ops.deploy import init_deployment
    from fedciuic.ops.layout import next_steps

    deployment = init_deployment(
        args.directory,
        args.regions,
        aggregator_jurisdiction=args.aggregator_jurisdiction,
        app_dir=args.app,
        policies_dir=args.policies,
        host=args.host,
        port=args.port,
        supernode_port_base=args.supernode_port_base,
        tls=not args.insecure,
        demo_data=args.demo_data,
        relay_user=args.relay_user,
    )
    print(next_steps(deployment))
    return 0


def demo_data(args: argparse.Namespace) -> int:
    from fedciuic.data import write_demo_corpora

    regions = tuple(r.strip() for r in args.regions.split(",") if r.strip())
    for region, folder in write_demo_corpora(args.directory, regions).items():
        print(f"{region}: {folder}")
    return 0


def data_check(args: argparse.Namespace) -> int:
    from fedciuic.config import MAX_RECORD_BYTES_LIMIT, DeidSettings, Fields, ModelSpec
    from fedciuic.data import check_data, region_scrubber
    from fedciuic.deid import listed_entities
    from fedciuic.model import spec_tokenizer

    if args.seq_len < 2:
        raise ConfigError([f"--seq-len: {args.seq_len} is too short; use at least 2"])
    if not 1 <= args.max_record_bytes <= MAX_RECORD_BYTES_LIMIT:
        raise ConfigError(
            [
                f"--max-record-bytes: {args.max_record_bytes} is not a size from 1 to "
                f"{MAX_RECORD_BYTES_LIMIT} bytes; the default is {RECORD_BYTES}"
            ]
        )
    spec = ModelSpec(model_path=args.model_path) if args.model_path else ModelSpec()
    fields = Fields(**{name: getattr(args, name) for name in Fields.model_fields})
    try:
        listed = listed_entities(args.deid_entities)
    except ValueError as err:
        raise ConfigError([f"--deid-entities: {err}"]) from None
    settings = DeidSettings(
        deidentify=not args.no_deidentify,
        deid_entities=listed,
        deid_replacement=args.deid_replacement,
    )
    with tempfile.TemporaryDirectory(prefix="fedciuic-data-check-key-") as scratch:
        scrubber = region_scrubber(
            settings,
            dictionary=args.deid_dictionary,
            secret=Path(scratch) / "key",  # a throwaway: pseudonyms here are examples
            ner_model=args.deid_ner_model,
            examples=True,
        )
        checked = check_data(
            args.data_path,
            spec_tokenizer(spec),
            seq_len=args.seq_len,
            fields=fields,
            tokenizer_name=f"tokenizer of {args.model_path}" if args.model_path else "tiny preset",
            scrubber=scrubber,
            max_record_bytes=args.max_record_bytes,
        )
    print("\n".join(checked.lines(fields.user_id_field)))
    return 0 if checked.ok else 1


def budget(args: argparse.Namespace) -> int:
    from fedciuic.agent import AgentConfig
    from fedciuic.privacy import budget_status

    if bool(args.agent_configs) == (args.data_root is not None):
        raise ConfigError(
            ["fedciuic budget: give either agent configs (a deployment) or --data-root"]
        )
    values = {**app_run_config(args.app.resolve()), **parse_overrides(args.run_config)}
    run = RunConfig.from_user_config(values, source="run config")
    if args.data_root is not None:
        regions = [r for r in (args.regions or ",".join(run.regions)).split(",") if r]
        found = simulation_budgets(args.data_root.resolve(), regions, run)
    else:
        agents = [AgentConfig.load(path) for path in args.agent_configs]
        found = [budget_status(a.region, a.state_dir, a.epsilon_budget) for a in agents]
    fits, lines = budget_lines(found, run)
    print("\n".join(lines))
    return 0 if fits else 1


def ledger_rebuild(args: argparse.Namespace) -> int:
    from fedciuic.privacy import rebuild_ledger_command

    return rebuild_ledger_command(args.state_path, args.aggregator_log)


def save_preset_checkpoint(args: argparse.Namespace) -> int:
    from fedciuic.config import ModelSpec
    from fedciuic.model import save_model_checkpoint

    path = save_model_checkpoint(
        ModelSpec(model_preset=args.preset, seed=args.seed), args.directory
    )
    print(f"saved preset {args.preset!r} (seed {args.seed}) to {path}")
    return 0


def keys_generate(args: argparse.Namespace) -> int:
    from fedciuic.crypto import NAME_PATTERN, Keypair, write_keys

    if not re.match(NAME_PATTERN, args.party):
        raise ConfigError([f"--party: {args.party!r} must be lower-case letters, digits, - or _"])
    keypair = Keypair.generate(args.party, args.jurisdiction, args.signature)
    private, public = write_keys(keypair, args.out)
    print(f"private key: {private} (mode 600; keep it on this party's machine)")
    print(f"public bundle: {public} (key id {keypair.bundle.key_id.hex()})")
    return 0


def keys_show(args: argparse.Namespace) -> int:
    from fedciuic.crypto import load_bundle, load_keypair

    private = args.file.name.endswith(".key.json")
    bundle = load_keypair(args.file).bundle if private else load_bundle(args.file)
    print(bundle.to_file().model_dump_json(indent=2))
    return 0


def policy_check(args: argparse.Namespace) -> int:
    from fedciuic.policy import PolicyError, load_policy

    failed = 0
    for path in args.files:
        try:
            loaded = load_policy(path)
        except PolicyError as err:
            failed += 1
            for problem in err.problems:
                print(problem, file=sys.stderr)
        else:
            print(f"{path}: ok ({loaded.policy.jurisdiction}, policy {loaded.hash[:12]})")
    return 1 if failed else 0


def policy_explain(args: argparse.Namespace) -> int:
    from fedciuic.policy import explain, load_policy

    print(explain(load_policy(args.file)))
    return 0


def policy_diff(args: argparse.Namespace) -> int:
    from fedciuic.policy import diff, load_policy

    a, b = load_policy(args.a), load_policy(args.b)
    lines = diff(a, b)
    print(f"--- {args.a} ({a.hash[:12]})\n+++ {args.b} ({b.hash[:12]})")
    print("\n".join(lines) if lines else "no differences")
    return 1 if lines else 0


def tls_generate(args: argparse.Namespace) -> int:
    from fedciuic.crypto import generate_server_tls

    files = generate_server_tls(args.out, args.host, args.days)
    print(f"CA certificate (give it to every SuperNode and flwr user): {files.ca_cert}")
    print(f"SuperLink certificate and key: {files.server_cert}, {files.server_key}")
    print(f"CA key (keep offline): {args.out / 'ca.key'}")
    return 0


def tls_supernode_key(args: argparse.Namespace) -> int:
    from fedciuic.crypto import generate_supernode_key

    private, public = generate_supernode_key(args.out, args.name)
    print(f"private key (--auth-supernode-private-key, stays with the SuperNode): {private}")
    print(f"public key (flwr supernode register {public}): {public}")
    return 0


def audit_verify(args: argparse.Namespace) -> int:
    from fedciuic.audit import verify
    from fedciuic.crypto import load_bundle

    verdict = verify(args.log, load_bundle(args.pubkey))
    print(verdict.explain())
    return 0 if verdict.ok else 1


def audit_show(args: argparse.Namespace) -> int:
    from fedciuic.audit import load_records

    for record in load_records(args.log):
        details = record.get("details") or {}
        if (
            (args.region and args.region not in (record.get("actor"), details.get("region")))
            or (args.round is not None and record.get("round") != args.round)
            or (args.event and record.get("event") != args.event)
            or (args.run is not None and record.get("run_id") != args.run)
        ):
            continue
        print(
            f"{record.get('seq'):>5} {record.get('time')} run {record.get('run_id')} "
            f"round {record.get('round')} {record.get('actor')} {record.get('event')} "
            + json.dumps(details, sort_keys=True)
        )
    return 0


def audit_report(args: argparse.Namespace) -> int:
    from fedciuic.audit import check_and_report

    outcome = check_and_report(args.logs, args.keys, args.out, args.run)
    print("\n".join(outcome.lines))
    return outcome.exit_code


def audit_prune(args: argparse.Namespace) -> int:
    from fedciuic.audit import prune_log

    print(prune_log(args.log, args.key, args.policy, dry_run=args.dry_run))
    return 0


def agent(args: argparse.Namespace) -> int:
    from fedciuic.agent import AgentConfig, hello, serve

    if not args.ping:
        return serve(args.config, exit_with_parent=not args.keep_running)
    config = AgentConfig.load(args.config)
    status = hello(Path(config.socket), args.timeout, pid=args.pid)
    print(
        f"fedciuic: the agent of region {status.get('region')} (pid {status.get('pid')}, "
        f"fedciuic {status.get('fedciuic')}) answers on {Path(config.socket)}"
    )
    return 0


def html_report(args: argparse.Namespace) -> int:
    from fedciuic.ops.run_report import write_run_report

    report = write_run_report(
        args.run_dir.resolve(), audit_logs=args.audit_log, keys_dir=args.keys, out=args.out
    )
    print(f"report: {report.html}")
    if report.compliance is not None:  # as `fedciuic simulate` writes it
        print(f"compliance report: {report.compliance} (and .html)")
    print(f"plots: {', '.join(str(p) for p in report.plots.values())}")
    for note in report.notes:
        print(f"note: {note}")
    if report.verified is None:
        print("audit logs: not verified (no public keys; pass --keys DIR)")
    # The same verdict lines as `fedciuic simulate` (start.sh ends with them).
    for log in report.logs:
        if log.verdict is None:
            continue
        verdict = log.verdict.explain()
        if log.verdict.ok:
            print(f"audit: {verdict}")
        elif verdict in report.problems:
            print(f"audit: {verdict}", file=sys.stderr)
        else:  # the run did not end: its writer stopped before signing its last records
            print(f"audit: (the run did not end; its tail is unverified) {verdict}")
    for disagreement in report.disagreements:
        print(f"audit: the logs DISAGREE: {disagreement}", file=sys.stderr)
    return report.exit_code
