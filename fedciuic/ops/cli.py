"""The ``fedciuic`` command.

Bad input prints one line, ``fedciuic: error: <where>: <what>; <fix>``, and exits 2 (no
traceback). ``fedciuic simulate`` and its exit statuses: :mod:`fedciuic.ops.simulate`.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedciuic import __version__
from fedciuic.config import DeidSettings, Fields, LocalTraining
from fedciuic.deid import REPLACEMENTS
from fedciuic.errors import FedciuicError
from fedciuic.ops import commands
from fedciuic.ops.preflight import preflight_command
from fedciuic.ops.simulate import Interrupted, simulate

#: `data check`'s --seq-len default: the run config's.
_SEQ_LEN = LocalTraining.model_fields["seq_len"].default

#: `data check` options naming record fields (run config keys), with their defaults.
DATA_FIELD_OPTIONS: dict[str, str] = Fields().model_dump(by_alias=True)

#: `data check` options of de-identification: the run config's two, the agent config's two.
DEID_OPTIONS: tuple[tuple[str, str, str], ...] = (
    ("deid-entities", ",".join(DeidSettings().deid_entities), "entity types"),
    ("deid-replacement", DeidSettings().deid_replacement, "placeholder or pseudonym"),
    ("deid-dictionary", "", "the region's dictionary of names, one per line"),
    ("deid-ner-model", "", "a spaCy pipeline the region installed (PERSON, LOCATION)"),
)

EXAMPLES = """\
examples:
  fedciuic simulate                          # 3 regions (eu, cn, us), demo data, CPU
  fedciuic simulate --rounds 5 --run-config local-steps=50
  fedciuic simulate --data-root ./my-data    # my-data/<region>/ (docs/data.md)
  fedciuic budget --data-root ./my-data      # epsilon spent and left, per region
  fedciuic demo-data ./demo-data --regions eu,cn,us
  fedciuic save-checkpoint ./tiny-ckpt --preset tiny
  fedciuic policy check policies/*.yaml      # validate, file:line: field: message
  fedciuic policy explain policies/cn-pipl.yaml
  fedciuic report runs/run-<id>              # HTML report with plots of one run
  fedciuic init ./federation --regions eu,cn,us --demo-data && bash ./federation/start.sh
"""

SIMULATE_EXIT = """\
exit status:
  0  the run completed and every party's audit log verified
  1  an audit log failed verification
  2  bad input (found in seconds, before anything starts: the run config, the model,
     its tokenizer or chat template, a region's data; every problem named), or the run
     failed
  3  every round ran but no aggregate was ever published (no region trained, or every
     aggregate was withheld): nothing was trained and no adapter was saved; the summary
     says why, per region
  130, 143  interrupted (SIGINT, SIGTERM) before the run ended; the run is marked
     "interrupted". Interrupted once it had ended (still stopping, or writing its
     report): the report is written and the status is the run's, as above
"""

REPORT_EXIT = """\
exit status:
  0  the run completed and every audit log verified
  1  an audit log failed verification, or could not be verified (no public keys:
     pass --keys DIR), or the logs disagree: whatever the run's outcome
  2  bad input: no run folder, a log or key that cannot be read
  3  the run ended but published no aggregate: nothing was trained
  4  the run did not end (interrupted, failed or still running): the report shows
     what it left
"""


class Arg:
    """One option or positional of a command, written as the ``add_argument`` call it is."""

    def __init__(self, *names: str, **options: Any) -> None:
        self.names, self.options = names, options


def app_arg(help: str) -> Arg:
    return Arg("--app", type=Path, default=Path("."), help=help)


def run_config_arg(help: str = "override a run-config value (TOML value), repeatable") -> Arg:
    return Arg("--run-config", action="append", default=[], metavar="KEY=VALUE", help=help)


@dataclass(frozen=True)
class Command:
    """A row of :data:`COMMANDS`: ``path`` under ``fedciuic`` (``("keys", "generate")``).
    One without a handler is a command with actions, whose rows follow it. A tuple among
    ``arguments`` is a mutually exclusive group."""

    path: tuple[str, ...]
    help: str
    example: str
    handler: Callable[[argparse.Namespace], int] | None = None
    description: str | None = None
    arguments: tuple[Arg | tuple[Arg, ...], ...] = ()
    exits: str = ""


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return int(args.handler(args))
    except FedciuicError as err:
        print(f"fedciuic: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:
        signum = err.signum if isinstance(err, Interrupted) else signal.SIGINT
        print("fedciuic: interrupted", file=sys.stderr)
        return 128 + int(signum)


def _parser() -> argparse.ArgumentParser:
    """The ``fedciuic`` parser, made from :data:`COMMANDS` in their order."""
    parser = argparse.ArgumentParser(
        prog="fedciuic",
        description="Federated fine-tuning of DeepSeek models across jurisdictions.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"fedciuic {__version__}")
    where: dict[tuple[str, ...], Any] = {
        (): parser.add_subparsers(required=True, metavar="COMMAND")
    }
    for entry in COMMANDS:
        *parent, name = entry.path
        description = entry.description
        if entry.handler is None:
            description = (
                f"{entry.help[0].upper()}{entry.help[1:]}. `fedciuic {name} ACTION --help` "
                "explains each action's options."
            )
        command: argparse.ArgumentParser = where[tuple(parent)].add_parser(
            name,
            help=entry.help,
            description=description,
            epilog=f"example:\n  {entry.example}" + (f"\n\n{entry.exits}" if entry.exits else ""),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        if entry.handler is None:
            where[entry.path] = command.add_subparsers(required=True, metavar="ACTION")
            continue
        command.set_defaults(handler=entry.handler)
        for argument in entry.arguments:
            if isinstance(argument, Arg):
                command.add_argument(*argument.names, **argument.options)
            else:
                exclusive = command.add_mutually_exclusive_group()
                for one in argument:
                    exclusive.add_argument(*one.names, **one.options)
    return parser


#: Every command of ``fedciuic``, in the order ``--help`` lists them.
COMMANDS: tuple[Command, ...] = (
    Command(
        ("simulate",),
        "run the local simulation (one simulated SuperNode per region; lab mode)",
        "fedciuic simulate --rounds 3 --output-dir runs",
        simulate,
        exits=SIMULATE_EXIT,
        description="Start a simulation SuperLink on a free port, `flwr run` the app with one "
        "SuperNode per region, print the summary and stop every process it started.\n\n"
        "Lab mode: every party runs in one process tree that you own, and each region's "
        "round runs in its ClientApp; its guarantees assume that one operator. A "
        "deployment (fedciuic init) runs each region's round in the region's own agent "
        "and the ClientApp only relays (docs/cluster.md).",
        arguments=(
            app_arg("the Flower app folder (with pyproject.toml); default: ."),
            Arg("--regions", help="comma-separated regions, e.g. eu,cn,us"),
            Arg("--rounds", type=int, help="number of server rounds"),
            Arg(
                "--data-root",
                type=Path,
                help="folder with one sub-folder of data per region (their privacy ledgers, audit "
                "logs and keys live in DATA_ROOT/<region>/.fedciuic/ and carry on from run to "
                "run); default: fresh demo corpora for this invocation, under OUTPUT_DIR/.flower/",
            ),
            Arg(
                "--compare-no-dp",
                action="store_true",
                help="also run the same federation without DP (a lab baseline, so without "
                "policies, which require DP) and show the gap",
            ),
            Arg(
                "--output-dir",
                type=Path,
                default=Path("runs"),
                help="where each run writes run-<id>/ (default: runs)",
            ),
            run_config_arg(),
            Arg(
                "--cpus-per-region",
                type=int,
                help="CPUs each region's ClientApp holds (Ray's client-resources-num-cpus; "
                "its torch threads follow). Default: every core where there are fewer cores "
                "than regions, so one region trains at a time and memory holds one step; "
                "else 1, and every region trains at once",
            ),
            Arg(
                "--timeout",
                type=float,
                default=1800.0,
                help="seconds before the whole run is stopped (default: 1800)",
            ),
            (
                Arg("--quiet", action="store_true", help="print only the summary"),
                Arg(
                    "--verbose",
                    action="store_true",
                    help="stream Flower's own log instead of the per-round progress",
                ),
            ),
        ),
    ),
    Command(
        ("init",),
        "write a deployment folder: keys, certificates, policies and start scripts per party",
        "fedciuic init ./federation --regions eu,cn,us --demo-data && bash ./federation/start.sh",
        commands.init,
        description="Write DIR with one folder per party (DIR/aggregator, DIR/regions/REGION),\n"
        "each holding only what that party needs (its private keys stay in it), and the\n"
        "scripts that start the SuperLink, each SuperNode and the run.\n\n"
        "`bash DIR/start.sh` runs the whole federation on this machine and stops every\n"
        "process it started when it ends; DIR/README.md has the commands for one machine\n"
        "per party. Nothing is written unless every check passes.",
        arguments=(
            Arg(
                "directory",
                type=Path,
                metavar="DIR",
                help="the deployment folder to create; must not exist or be empty",
            ),
            Arg(
                "--regions",
                default="eu,cn,us",
                help="comma-separated regions; a region's jurisdiction is its name upper-cased "
                "(eu is EU) unless given as NAME=JUR, e.g. paris=EU (default: eu,cn,us)",
            ),
            Arg(
                "--aggregator-jurisdiction",
                default="EU",
                metavar="JUR",
                help="where the aggregator (and its SuperLink) sits; written into its key and the "
                "run config, and every region's policy must allow it (default: EU)",
            ),
            app_arg("the Flower app folder, with pyproject.toml and [tool.flwr.app] (default: .)"),
            Arg(
                "--policies",
                type=Path,
                metavar="DIR",
                help="folder with one policy YAML per jurisdiction; each region gets a copy of its "
                "own (default: APP/policies)",
            ),
            Arg(
                "--host",
                default="127.0.0.1",
                help="the name or address SuperNodes reach the SuperLink at; the SuperLink listens "
                "there and its TLS certificate names it (default: 127.0.0.1)",
            ),
            Arg(
                "--port",
                type=int,
                default=9092,
                help="the SuperLink's port (Fleet, Control and runtime APIs) (default: 9092)",
            ),
            Arg(
                "--supernode-port-base",
                type=int,
                metavar="PORT",
                help="each SuperNode's local runtime API port is PORT + i, for the i-th region "
                "(default: --port + 1)",
            ),
            Arg(
                "--insecure",
                action="store_true",
                help="no TLS and no SuperNode authentication: for loopback tests only",
            ),
            Arg(
                "--relay-user",
                metavar="USER",
                help="the OS user each region's relay (Flower's ClientApp, which the aggregator "
                "ships) runs as, created by start-supernode.sh if missing; it must not be able to "
                'read the region\'s files (default: fedciuic-relay when run as root; "" otherwise: '
                "the relay runs as the region's own user, with no OS separation)",
            ),
            Arg(
                "--demo-data",
                action="store_true",
                help="put the demo corpus in each region's data/ (regions eu, cn, us, sg, in); "
                "otherwise data/ is empty and says what to put there",
            ),
        ),
    ),
    Command(
        ("demo-data",),
        "write the deterministic demo corpora, one folder per region",
        "fedciuic demo-data ./demo-data --regions eu,cn,us",
        commands.demo_data,
        arguments=(
            Arg("directory", type=Path),
            Arg("--regions", default="eu,cn,us", help="comma-separated (default: eu,cn,us)"),
        ),
    ),
    Command(
        ("data",),
        "check a region's data as a region reads it",
        "fedciuic data check ./demo-data/eu",
    ),
    Command(
        ("data", "check"),
        "formats, record shapes, counts, one example with its masked part, and every bad "
        "row as FILE:LINE: field: message (exit 1 if any)",
        "fedciuic data check ./data/eu --model-path ./DeepSeek-R1-Distill-Qwen-7B",
        commands.data_check,
        arguments=(
            Arg("data_path", type=Path, metavar="DATA_PATH"),
            Arg(
                "--model-path",
                default="",
                help="the checkpoint whose tokenizer and chat template count and render the "
                "records (default: the tiny preset's tokenizer)",
            ),
            Arg(
                "--seq-len",
                type=int,
                default=_SEQ_LEN,
                help=f"the seq-len your run trains at (default: {_SEQ_LEN}, the run config's)",
            ),
            Arg(
                "--max-record-bytes",
                type=int,
                default=commands.RECORD_BYTES,
                help="the largest record the region reads, in bytes; larger ones are dropped "
                f"unread and counted (default: {commands.RECORD_BYTES}, the run config's; a "
                "deployed region's agent.toml has its own)",
            ),
            *(
                Arg(f"--{option}", default=default, help=f"default: {default}")
                for option, default in DATA_FIELD_OPTIONS.items()
            ),
            Arg(
                "--no-deidentify",
                action="store_true",
                help="check the data as a run with deidentify = false reads it (nothing scrubbed)",
            ),
            *(
                Arg(
                    f"--{option}",
                    default=default,
                    choices=REPLACEMENTS if option == "deid-replacement" else None,
                    help=f"{what} (default: {default!r})",
                )
                for option, default, what in DEID_OPTIONS
            ),
        ),
    ),
    Command(
        ("budget",),
        "what each region's dataset has spent of its lifetime epsilon budget, and whether "
        "a run's target still fits",
        "fedciuic budget regions/eu/agent.toml regions/cn/agent.toml",
        commands.budget,
        description="Read each dataset's privacy ledger (changing nothing) and print its "
        "cumulative epsilon against its lifetime budget. A deployed region: give its agent "
        "config (the budget is the agent's epsilon-budget). Simulation datasets: give "
        "--data-root (the budget is the run config's epsilon-budget). Exit 1 when the "
        "run (its target-epsilon, rounds and local steps; the sample rate of the dataset's "
        "last release) would take a region past its budget.",
        arguments=(
            Arg("agent_configs", type=Path, nargs="*", metavar="AGENT_TOML", help="agent configs"),
            Arg(
                "--data-root", type=Path, help="a simulation's --data-root (one folder per region)"
            ),
            Arg("--regions", help="with --data-root: comma-separated (default: app's)"),
            app_arg("the app whose run config to read; default: ."),
            run_config_arg(
                "the run's overrides (target-epsilon, num-server-rounds, local-steps, ...), "
                "as given to simulate or start.sh; repeatable"
            ),
        ),
    ),
    Command(
        ("ledger",),
        "repair a region's privacy ledger",
        "fedciuic ledger rebuild --state-path data/eu/.fedciuic",
    ),
    Command(
        ("ledger", "rebuild"),
        "rebuild a rolled-back privacy ledger from every witness of it, keeping every release",
        "fedciuic ledger rebuild --state-path data/eu/.fedciuic",
        commands.ledger_rebuild,
        description="Rebuild STATE/privacy-ledger.jsonl from the union of every witness of it: "
        "the current file, the copies earlier rebuilds kept aside "
        "(STATE/privacy-ledger.jsonl.rolled-back-*), the ledger lines the region's audit log "
        "(STATE/audit.jsonl) witnessed and, with --aggregator-log, the epsilon the aggregator "
        "recorded. Prints what each source shows and where each release came from. Refuses, "
        "changing nothing, when two sources hold different releases at one position (two "
        "ledgers for one dataset), a release is in none of them, or the result would show "
        "less epsilon than a source. The replaced file is kept next to it as evidence "
        "(docs/privacy.md).",
        arguments=(
            Arg("--state-path", type=Path, required=True, metavar="STATE"),
            Arg(
                "--aggregator-log",
                type=Path,
                metavar="FILE",
                help="the aggregator's aggregator.audit.jsonl: its accepted updates' epsilon for "
                "this region is a floor the rebuilt ledger must reach (it holds no ledger lines)",
            ),
        ),
    ),
    Command(
        ("preflight",),
        "check the model, tokenizer, chat template and data before a run starts (exit 2 "
        "naming every problem)",
        "fedciuic preflight --data-root ./my-data --run-config model-path='\"./ckpt\"'",
        preflight_command,
        description="Check, in seconds and before anything starts, what a run would otherwise "
        "find minutes in: the model-path checkpoint (weights present and not only pickle, "
        "its tokenizer present and matching the model), the chat template (maskable, when "
        "the data has chat records) and each region's data visible here (every row read "
        "and checked, a sample tokenised). Exit 0 when all is well, 2 naming every "
        "problem. `fedciuic simulate` runs the same checks; a deployment's start.sh runs "
        "this command.",
        arguments=(
            app_arg("the Flower app folder (default: .)"),
            Arg(
                "--run-config-file",
                type=Path,
                metavar="FILE",
                help="run-config values (TOML) over the app's, e.g. aggregator/run-config.toml",
            ),
            run_config_arg(),
            Arg(
                "--data-root",
                type=Path,
                help="simulation datasets: one folder per region (DATA_ROOT/REGION)",
            ),
            Arg(
                "--agent-config",
                type=Path,
                action="append",
                default=[],
                metavar="FILE",
                help="a deployed region's agent config (its data-path and allow-pickle-weights), "
                "repeatable",
            ),
            Arg(
                "flwr_args",
                nargs=argparse.REMAINDER,
                metavar="-- FLWR_RUN_ARGS",
                help="`flwr run` arguments the run will get (start.sh passes its own): their "
                "--run-config values apply",
            ),
        ),
    ),
    Command(
        ("save-checkpoint",),
        "save a preset's base model and tokenizer as a checkpoint (for model-path)",
        "fedciuic save-checkpoint ./tiny-ckpt --preset tiny\n"
        "  fedciuic simulate --run-config model-path='\"./tiny-ckpt\"'",
        commands.save_preset_checkpoint,
        arguments=(
            Arg("directory", type=Path),
            Arg("--preset", default="tiny"),
            Arg("--seed", type=int, default=0),
        ),
    ),
    Command(
        ("keys",),
        "generate and show party keys (X-Wing + signatures)",
        "fedciuic keys generate --party eu --jurisdiction EU --out keys/",
    ),
    Command(
        ("keys", "generate"),
        "write PARTY.key.json (mode 0600) and PARTY.pub.json",
        "fedciuic keys generate --party eu --jurisdiction EU --out keys/",
        commands.keys_generate,
        description="Generate a party's X-Wing decapsulation key and signing key. The private "
        "file is created with mode 0600 and never overwritten; give the public bundle "
        "(PARTY.pub.json) to the other parties.",
        arguments=(
            Arg("--party", required=True, help="aggregator, or the region's name (eu, cn...)"),
            Arg("--jurisdiction", required=True, help="where the party sits, e.g. EU, CN"),
            Arg("--out", type=Path, required=True, help="folder for the two files"),
            Arg(
                "--signature",
                choices=["ed25519", "ed25519+mldsa65"],
                default="ed25519",
                help="Ed25519, or a hybrid Ed25519 + ML-DSA-65 signature (default: ed25519)",
            ),
        ),
    ),
    Command(
        ("keys", "show"),
        "print a public bundle (or the bundle of a private key file)",
        "fedciuic keys show keys/eu.pub.json",
        commands.keys_show,
        arguments=(Arg("file", type=Path),),
    ),
    Command(
        ("policy",),
        "check, explain and compare jurisdiction policies",
        "fedciuic policy check policies/*.yaml",
    ),
    Command(
        ("policy", "check"),
        "validate policy files (exit 1 if any is invalid)",
        "fedciuic policy check policies/*.yaml",
        commands.policy_check,
        arguments=(Arg("files", type=Path, nargs="+", metavar="FILE"),),
    ),
    Command(
        ("policy", "explain"),
        "what a policy allows, in plain language",
        "fedciuic policy explain policies/cn-pipl.yaml",
        commands.policy_explain,
        arguments=(Arg("file", type=Path, metavar="FILE"),),
    ),
    Command(
        ("policy", "diff"),
        "every rule that differs between two policies (exit 1 if any)",
        "fedciuic policy diff policies/eu-gdpr.yaml policies/cn-pipl.yaml",
        commands.policy_diff,
        arguments=(Arg("a", type=Path, metavar="A"), Arg("b", type=Path, metavar="B")),
    ),
    Command(
        ("tls",),
        "certificates for a TLS SuperLink, SuperNode auth keys",
        "fedciuic tls generate --out certs/ --host 127.0.0.1",
    ),
    Command(
        ("tls", "generate"),
        "write a CA (ca.pem, ca.key) and the SuperLink's certificate and key",
        "fedciuic tls generate --out certs/ --host superlink.example.org --host 10.0.0.5",
        commands.tls_generate,
        arguments=(
            Arg("--out", type=Path, required=True, help="folder for the files"),
            Arg(
                "--host",
                action="append",
                required=True,
                help="a name or address the SuperLink is reached at (repeatable)",
            ),
            Arg("--days", type=int, default=365, help="validity (default: 365)"),
        ),
    ),
    Command(
        ("tls", "supernode-key"),
        "write a SuperNode's authentication key pair (register the .pub with flwr)",
        "fedciuic tls supernode-key --name eu --out auth/\n"
        "  flwr supernode register auth/eu.auth.pub",
        commands.tls_supernode_key,
        arguments=(
            Arg("--name", required=True, help="the SuperNode's region, e.g. eu"),
            Arg("--out", type=Path, required=True, help="folder for the two files"),
        ),
    ),
    Command(
        ("audit",),
        "verify, read and report on tamper-evident audit logs",
        "fedciuic audit verify runs/audit/aggregator.audit.jsonl --pubkey keys/aggregator.pub.json",
    ),
    Command(
        ("audit", "verify"),
        "check a log's hash chain and signed checkpoints (exit 1 unless OK)",
        "fedciuic audit verify runs/audit/aggregator.audit.jsonl --pubkey keys/aggregator.pub.json",
        commands.audit_verify,
        description="Check every record's hash and chain and every checkpoint's signature; print "
        "OK or the first bad record. Exit status: 0 OK; 1 the log fails (a bad record, a torn "
        "tail, or records after the last checkpoint); 2 an error (the log or the key "
        "cannot be read).",
        arguments=(
            Arg("log", type=Path, metavar="LOG"),
            Arg("--pubkey", type=Path, required=True, help="the party's PARTY.pub.json"),
        ),
    ),
    Command(
        ("audit", "show"),
        "print a log's records, filtered",
        "fedciuic audit show runs/audit/aggregator.audit.jsonl --region cn --round 2",
        commands.audit_show,
        arguments=(
            Arg("log", type=Path, metavar="LOG"),
            Arg("--region", help="records by or about this region"),
            Arg("--round", type=int, help="records of this round"),
            Arg("--event", help="records of this event type, e.g. update_rejected"),
            Arg("--run", type=int, help="records of this run id"),
        ),
    ),
    Command(
        ("audit", "report"),
        "write a run's compliance report (Markdown and HTML) from the logs",
        "fedciuic audit report runs/audit/aggregator.audit.jsonl data/*/.fedciuic/audit.jsonl "
        "--keys keys/ --out reports/",
        commands.audit_report,
        description="Verify each log (with --keys), cross-check them (transfers, run config, "
        "witnessed checkpoints, and every prune against the policy its party declared) and write "
        "the run's compliance report. Exit status: 0 the logs agree and every log verified (or, "
        "without --keys, none was checked); 1 a log fails verification; 2 an error (a log or "
        "key unreadable, no such run); 3 the logs disagree (records inside a party's "
        "declared retention gone among them).",
        arguments=(
            Arg("logs", type=Path, nargs="+", metavar="LOG"),
            Arg("--keys", type=Path, help="folder of PARTY.pub.json to verify each log"),
            Arg("--run", type=int, help="run id (default: the aggregator's last run)"),
            Arg("--out", type=Path, default=Path("."), help="folder for the report"),
        ),
    ),
    Command(
        ("audit", "prune"),
        "remove a log's records past its policy's retention (signed: the log still verifies)",
        "fedciuic audit prune eu/state/audit.jsonl --key eu/keys/eu.key.json "
        "--policy eu/eu-gdpr.yaml",
        commands.audit_prune,
        description="Remove the records older than the policy's audit.retention_days from the "
        "log's start (a run with a later record is kept whole), after an audit_pruned record and "
        "a checkpoint signed with the party's key: `fedciuic audit verify` still accepts the "
        "log, and refuses one cut without them. The policy must be the party's own "
        "jurisdiction's and the one its log declared to the other parties (an edited copy "
        "is refused); records another declared policy still keeps are kept. A region's "
        "agent and the aggregator do this when they start.",
        arguments=(
            Arg("log", type=Path, metavar="LOG"),
            Arg("--key", type=Path, required=True, help="the party's PARTY.key.json"),
            Arg(
                "--policy",
                type=Path,
                required=True,
                help="the party's own policy, as it declared it",
            ),
            Arg("--dry-run", action="store_true", help="say what would be removed, change nothing"),
        ),
    ),
    Command(
        ("report",),
        "write a run's HTML report with plots (loss, epsilon, bytes, decisions)",
        "fedciuic report runs/run-1234567890\n"
        "  fedciuic report runs/run-1234567890 --keys keys/ "
        "--audit-log audit/aggregator.audit.jsonl",
        commands.html_report,
        exits=REPORT_EXIT,
        description="Write RUN_DIR/report.html: one self-contained page (plots embedded) "
        "with each region's eval loss per round, epsilon against its budget, bytes "
        "uploaded per round and every decision of the run (accepted, declined, rejected, "
        "withheld, with reasons) from the audit logs, then the compliance record. The "
        "plots are also written to RUN_DIR/report/*.png with their numbers in series.json. "
        "A run that did not end (running, interrupted, failed) is reported from what its "
        "logs hold, with records no signature covers yet listed as unverified.",
        arguments=(
            Arg("run_dir", type=Path, metavar="RUN_DIR", help="a run folder (run-<id>/)"),
            Arg(
                "--audit-log",
                type=Path,
                action="append",
                default=[],
                metavar="LOG",
                help="an audit log to read (repeatable); default: the aggregator's log named in "
                "metrics.json and, for a simulation, each region's log under data-root",
            ),
            Arg(
                "--keys",
                type=Path,
                help="folder of PARTY.pub.json to verify the logs; default: the run's keys-dir",
            ),
            Arg("--out", type=Path, help="the HTML file (default: RUN_DIR/report.html)"),
        ),
    ),
    Command(
        ("agent",),
        "a region's agent: the one process that holds its data, keys, ledger and policy, "
        "trains, seals and signs; Flower's ClientApp only relays to it",
        "fedciuic agent --config regions/eu/agent.toml",
        commands.agent,
        description="Serve the region described by --config (a TOML file: region, data-path, "
        "state-path, key-file, aggregator-bundle, policy, socket, relay-user, ...) on its "
        "Unix socket until SIGTERM or SIGINT, or until the process that started it exits. "
        "It acts only on instructions the aggregator signed, each once, under the region's "
        "own policy and ledger; it refuses to start while the relay's OS user can read the "
        "region's files (docs/cluster.md).",
        arguments=(
            Arg("--config", type=Path, required=True, metavar="FILE"),
            Arg(
                "--ping",
                action="store_true",
                help="do not serve: exit 0 once the agent answers on its socket (up to --timeout)",
            ),
            Arg("--timeout", type=float, default=60.0, help="seconds --ping waits (default: 60)"),
            Arg(
                "--pid",
                type=int,
                default=0,
                help="with --ping: exit 0 only if the agent that answers is this process "
                "(a start script checks that its own agent started)",
            ),
            Arg(
                "--keep-running",
                action="store_true",
                help="keep serving after the process that started it exits (under a service "
                "manager); by default the agent stops with its launcher",
            ),
        ),
    ),
)


if __name__ == "__main__":
    raise SystemExit(main())
