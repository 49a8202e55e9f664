"""``fedciuic simulate``: the local simulation (lab mode), kept apart from the command's
parser because it alone starts processes, handles signals and stops what it started.
Its exit statuses are listed in its ``--help`` (``cli.SIMULATE_EXIT``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedciuic.config import RunConfig
from fedciuic.errors import EXIT_AUDIT, EXIT_NO_AGGREGATE, EXIT_OK, ConfigError, FederationError
from fedciuic.ops.runconfig import app_run_config, parse_overrides

if TYPE_CHECKING:
    from fedciuic.record import RunMetrics


def cpus_per_region(regions: int, cores: int | None = None) -> int:
    """The simulation's default CPUs per ClientApp. Where the cores cannot train every
    region at once, one region at a time with every core does the same work in about the
    same time, and memory holds one training step instead of one per core."""
    cores = cores or os.cpu_count() or 1
    return cores if cores < regions else 1


class Interrupted(KeyboardInterrupt):
    """SIGTERM, turned into an exception so that every process we started is stopped."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def simulate(args: argparse.Namespace) -> int:
    from fedciuic.crypto import aggregator_keys
    from fedciuic.data import DEMO_DICTIONARIES, write_demo_corpora
    from fedciuic.flower import LocalFederation
    from fedciuic.model import check_model_spec
    from fedciuic.ops.outputs import summarize
    from fedciuic.ops.preflight import check_simulation, region_folders
    from fedciuic.ops.progress import RunProgress
    from fedciuic.record import RunStatus

    app = args.app.resolve()
    overrides = parse_overrides(args.run_config)
    if args.regions:
        overrides["regions"] = args.regions
    if args.rounds is not None:
        overrides["num-server-rounds"] = args.rounds
    cores = os.cpu_count() or 1
    if args.cpus_per_region is not None and not 1 <= args.cpus_per_region <= cores:
        # Ray would never place a ClientApp that asks for more cores than there are.
        raise ConfigError(
            [f"--cpus-per-region: {args.cpus_per_region}: give 1 to {cores} (this machine's cores)"]
        )
    output_dir = args.output_dir.resolve()
    overrides["output-dir"] = str(output_dir)
    defaults = app_run_config(app)
    known = ", ".join(sorted(defaults))
    if unknown := sorted(set(overrides) - set(defaults)):
        raise ConfigError([f"--run-config:{k}: unknown key; known: {known}" for k in unknown])
    if not defaults.get("policies-dir") and "policies-dir" not in overrides:
        overrides["policies-dir"] = str(app / "policies")
    # Validate everything here, before any process starts.
    run = RunConfig.from_user_config({**defaults, **overrides}, source="run config")
    check_model_spec(run.model)
    if run.sealing.seal and run.sealing.keys_dir:
        aggregator_keys(run.sealing.keys_dir, run.compression.max_update_bytes)
    if run.policy.enforce_policies:
        _check_policies(run)
    data_root = folders = None
    if args.data_root is not None:
        data_root = args.data_root.resolve()
        _check_data_root(data_root, run.regions)
        folders = region_folders(data_root, run.regions)
        if run.privacy.dp:
            found = simulation_budgets(data_root, [f.region for f in folders], run)
            for line in budget_lines(found, run)[1]:
                print(f"budget: {line}")
    # The model, tokenizer, chat template and data, in seconds: exit 2 naming every problem.
    check_simulation(run, folders)
    output_dir.mkdir(parents=True, exist_ok=True)
    workdir = output_dir / ".flower" / time.strftime("%Y%m%d-%H%M%S")
    if data_root is None:
        # Fresh demo datasets each time, so each demo starts with fresh privacy ledgers.
        data_root = workdir / "demo-data"
        write_demo_corpora(data_root, run.regions)
    overrides["data-root"] = str(data_root)
    dictionaries = data_root / DEMO_DICTIONARIES
    if run.deid.deidentify and not run.deid.deid_dictionaries and dictionaries.is_dir():
        # Where `fedciuic demo-data` (and the demo above) writes each region's names.
        print(f"de-identification: each region's dictionary from {dictionaries}/REGION.txt")
        overrides["deid-dictionaries"] = str(dictionaries)
    if run.sealing.seal and not run.sealing.keys_dir:
        overrides["keys-dir"] = str(_simulation_keys(workdir / "keys", data_root, run))
        # A fresh aggregator key is a fresh aggregator: its audit log starts with it.
        if not run.output.audit_dir:
            overrides["audit-dir"] = str(workdir / "audit")
    variants = [overrides]
    if args.compare_no_dp and run.privacy.dp:
        variants.append({**overrides, "dp": False, "enforce-policies": False})

    run_ids: list[int] = []
    interrupt: KeyboardInterrupt | None = None
    noted: list[int] = []  # SIGINT, SIGTERM that came while stopping or reporting
    previous = signal.signal(signal.SIGTERM, _raise_interrupted)
    federation = LocalFederation(workdir, app)
    try:
        federation.start_superlink(simulation=True)
        for number, variant in enumerate(variants):
            progress: RunProgress | None = None
            if not (args.quiet or args.verbose):
                label = "baseline without DP" if number else ""
                progress = RunProgress(sys.stdout, output_dir, label=label)
            try:
                run_id, _ = federation.run_app(
                    variant,
                    federation_config={
                        "num-supernodes": len(run.regions),
                        "client-resources-num-cpus": args.cpus_per_region
                        or cpus_per_region(len(run.regions), cores),
                    },
                    timeout=args.timeout,
                    echo=sys.stdout if args.verbose else None,
                    on_poll=progress.poll if progress else None,
                )
            finally:
                if progress is not None:
                    progress.finish()
            run_ids.append(run_id)
    except KeyboardInterrupt as err:  # SIGINT, or SIGTERM (Interrupted)
        interrupt = err
    finally:
        signal.signal(signal.SIGTERM, previous)
        # Every process we started (Ray's workers too) is gone before we go on, whatever a
        # second Ctrl-C says; then a run whose ServerApp did not end it is marked interrupted.
        with _signals_noted(noted):
            left = federation.stop()
            for unfinished in _settle_runs(federation, output_dir):
                print(
                    f"fedciuic: run {unfinished} did not end; marked interrupted", file=sys.stderr
                )
        if left:
            print(
                "fedciuic: warning: these processes of the simulation would not stop: "
                + ", ".join(f"{p.pid}" for p in left),
                file=sys.stderr,
            )
    if interrupt is not None:
        # Interrupted after every run had ended (flwr run still streaming its end, the
        # processes stopping): the runs' outcome stands, with their report.
        run_ids = _ended_runs(federation, output_dir)
        if len(run_ids) < len(variants):
            raise interrupt
        noted.insert(0, getattr(interrupt, "signum", signal.SIGINT))
    with _signals_noted(noted):  # the report of runs that ended is written whole
        results = [_read_metrics(output_dir, run_id, workdir) for run_id in run_ids]
        print("\n" + summarize(results[0], baseline=results[1] if len(results) > 1 else None))
        for data in results:
            if data.run.status not in (RunStatus.COMPLETED, RunStatus.NO_AGGREGATE):
                raise FederationError(f"run {data.run.run_id} {data.run.status}: {data.run.error}")
        code = _audit_after_simulation(output_dir / f"run-{run_ids[0]}")
    if noted:
        print(
            f"fedciuic: interrupted ({signal.Signals(noted[0]).name}) during clean-up, after "
            f"run {run_ids[0]} had ended ({results[0].run.status}): its report is written and "
            "the exit status is the run's",
            file=sys.stderr,
        )
    if results[0].run.status == RunStatus.NO_AGGREGATE:
        print(
            f"fedciuic: run {run_ids[0]} published no aggregate: nothing was trained "
            f"(exit {EXIT_NO_AGGREGATE}; see the reasons above)",
            file=sys.stderr,
        )
        return code or EXIT_NO_AGGREGATE
    return code


def _raise_interrupted(signum: int, _frame: object) -> None:
    raise Interrupted(signum)


@contextlib.contextmanager
def _signals_noted(noted: list[int]) -> Iterator[None]:
    """SIGINT and SIGTERM appended to ``noted`` instead of raised: for work that an
    interruption must not cut short (stopping every process, a finished run's report)."""
    kept = {
        signum: signal.signal(signum, lambda number, _frame: noted.append(number))
        for signum in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        yield
    finally:
        for signum, handler in kept.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)


def _started_runs(federation: Any) -> list[int]:
    """The runs this federation's ``flwr run``s started (they printed the id), in order."""
    from fedciuic.processes import STARTED_RUN

    started = []
    logs = federation.logs.glob("flwr-run-*.log")
    for log in sorted(logs, key=lambda path: int(path.stem.rsplit("-", 1)[1])):
        match = STARTED_RUN.search(log.read_text(encoding="utf-8", errors="replace"))
        if match is None:
            break
        started.append(int(match.group(1)))
    return started


def _ended_runs(federation: Any, output_dir: Path) -> list[int]:
    """The runs this federation started, up to the first that did not end."""
    from fedciuic.record import METRICS_FILE, MetricsError, RunStatus, load_metrics

    ended = []
    for run_id in _started_runs(federation):
        try:
            data = load_metrics(output_dir / f"run-{run_id}" / METRICS_FILE)
        except MetricsError:
            break
        if data.run.status not in (RunStatus.COMPLETED, RunStatus.NO_AGGREGATE):
            break
        ended.append(run_id)
    return ended


def _settle_runs(federation: Any, output_dir: Path) -> list[int]:
    """Mark interrupted the runs it started that still say running, their processes gone."""
    from fedciuic.ops.outputs import mark_unfinished

    why = (
        "its ServerApp ended without finishing the run (stopped or killed); "
        "fedciuic simulate stopped the simulation"
    )
    return [r for r in _started_runs(federation) if mark_unfinished(output_dir / f"run-{r}", why)]


def _check_data_root(data_root: Path, regions: Sequence[str]) -> None:
    """--data-root must hold a folder for some region (one without declines; others train)."""
    fix = "each region reads --data-root/REGION (e.g. `fedciuic demo-data DIR` writes them)"
    if not data_root.is_dir():
        what = "is not a folder" if data_root.exists() else "no such folder"
        raise ConfigError([f"--data-root: {data_root}: {what}; {fix}"])
    if not any((data_root / r).is_dir() for r in regions):
        where = ", ".join(str(data_root / r) for r in regions)
        raise ConfigError(
            [f"--data-root: {data_root} has no folder for any region ({where}); {fix}"]
        )


def _simulation_keys(keys: Path, data_root: Path, run: RunConfig) -> Path:
    """A simulation's keys-dir: a fresh aggregator key, and each region's key kept with its
    state (DATA_ROOT/REGION/.fedciuic/keys/), so that its audit log, which outlives runs,
    stays signed by one key."""
    from fedciuic.crypto import AGGREGATOR, KeyFileError, Keypair, load_keypair, write_keys
    from fedciuic.jurisdictions import simulated_jurisdiction

    write_keys(Keypair.generate(AGGREGATOR, run.policy.aggregator_jurisdiction), keys)
    for region in run.regions:
        jurisdiction = simulated_jurisdiction(region)
        if not (data_root / region).is_dir():
            # It will decline; its state folder is not made for it (nor its data folder).
            write_keys(Keypair.generate(region, jurisdiction), keys)
            continue
        kept = data_root / region / ".fedciuic" / "keys"
        private = kept / f"{region}.key.json"
        if not private.exists():
            # (another simulation on this data root may make it just now: then use that)
            with contextlib.suppress(KeyFileError):
                write_keys(Keypair.generate(region, jurisdiction), kept)
        keypair = load_keypair(private)
        held = (keypair.bundle.party, keypair.bundle.jurisdiction)
        if held != (region, jurisdiction):
            raise KeyFileError(
                f"--data-root:{private}: the key of {held[0]} ({held[1]}), not of region "
                f"{region} ({jurisdiction}); move it away or use another --data-root"
            )
        write_keys(keypair, keys)  # the run's keys-dir, where a simulated region looks
    return keys


def _audit_after_simulation(run_dir: Path) -> int:
    """Verify every party's audit log once, then write the compliance and HTML reports."""
    from fedciuic.ops.run_report import PLOTS_DIR, write_run_report

    report = write_run_report(run_dir)
    lines = [f"audit: {log.verdict.explain()}" for log in report.logs if log.verdict]
    lines += [f"audit: the logs DISAGREE: {d}" for d in report.disagreements]
    if report.compliance is not None:
        lines.append(f"compliance report: {report.compliance} (and .html)")
    lines.append(f"run report: {report.html} (plots in {report.html.parent / PLOTS_DIR})")
    print("\n".join(lines))
    return EXIT_OK if report.ok else EXIT_AUDIT


def _check_policies(run: RunConfig) -> None:
    """Every simulated region's policy must load, or nothing starts."""
    from fedciuic.jurisdictions import simulated_jurisdiction
    from fedciuic.policy import PolicyError, load_policies

    policies = load_policies(Path(run.policy.policies_dir))
    missing = [
        f"region {r} (simulated regions are named after their jurisdiction): "
        + policies.missing(simulated_jurisdiction(r))
        for r in run.regions
        if policies.get(simulated_jurisdiction(r)) is None
    ]
    if missing:
        raise PolicyError(missing)


def _read_metrics(output_dir: Path, run_id: int, workdir: Path) -> RunMetrics:
    from fedciuic.record import METRICS_FILE, MetricsError, load_metrics

    try:
        return load_metrics(output_dir / f"run-{run_id}" / METRICS_FILE)
    except MetricsError as err:
        raise FederationError(
            f"run {run_id} wrote no usable metrics ({err}); see the logs in {workdir / 'logs'}"
        ) from None


def simulation_budgets(data_root: Path, regions: Sequence[str], run: RunConfig) -> list[Any]:
    """Each simulated region's spend against the run config's epsilon-budget (no agent config)."""
    from fedciuic.config import NodeConfig
    from fedciuic.privacy import budget_status

    return [
        budget_status(
            region,
            NodeConfig(region=region, data_path=str(data_root / region)).state_dir,
            run.privacy.epsilon_budget,
        )
        for region in regions
    ]


def budget_lines(found: Sequence[Any], run: RunConfig) -> tuple[bool, list[str]]:
    """Whether ``run`` fits every region's budget, and a line or two per region."""
    from fedciuic.privacy import run_prefix

    rounds = run.schedule.num_server_rounds
    steps, prefix = rounds * run.training.local_steps, run_prefix(run.privacy, rounds)
    lines, every = [], True
    for status in found:
        lines.append(status.line())
        fits, line = status.run_line(run.privacy.target_epsilon, steps, prefix)
        every = every and fits
        if line and (status.unit is not None or not fits):
            lines.append(line)
    return every, lines
