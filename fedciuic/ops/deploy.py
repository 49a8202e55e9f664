"""``fedciuic init``: a deployment folder, laid out per party, with the scripts that run it.

A user should not need to know Flower's commands, certificates or node configs to
run a federation. :func:`init_deployment` writes one folder per party (the
aggregator, each region) holding only what that party needs, so each can be
copied to its own machine: private keys never leave their party's folder, only
public bundles are copied across. ``start.sh`` at the top runs every party on
this machine in one command and stops every process it started when it ends.

Everything is checked before anything is written: a refused deployment leaves
nothing behind. The scripts call ``python -m fedciuic.ops.deploy ACTION`` for the
parts that are easier to get right in Python (health check, stopping process
trees, reading a run's outcome).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import sys
import tempfile
import time
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from fedciuic.audit.log import AGGREGATOR_LOG, REGION_LOG
from fedciuic.config import RunConfig
from fedciuic.crypto.keys import NAME_PATTERN, Keypair, bundle_path, write_keys
from fedciuic.crypto.sealing import AGGREGATOR
from fedciuic.errors import ConfigError
from fedciuic.flower.launch import (
    CONNECTION,
    FLOWER_ENV,
    OWNER_ENV,
    STARTED_RUN,
    connection_toml,
    healthy,
    owner_tag,
    running,
    stop_process_trees,
    tail,
    toml_pairs,
    toml_value,
)
from fedciuic.jurisdictions import JURISDICTIONS, simulated_jurisdiction
from fedciuic.ops.outputs import mark_unfinished
from fedciuic.policy.rules import LoadedPolicy, PolicyError, PolicySet, load_policies
from fedciuic.rounds.record import (
    COMPLETED,
    METRICS_FILE,
    NO_AGGREGATE,
    RUNNING,
    no_aggregate_reasons,
)

DEFAULT_PORT = 9092

#: run.sh's (and start.sh's) exit status when every round ran but no aggregate was
#: ever published: nothing was trained (the same as `fedciuic simulate`).
EXIT_NO_AGGREGATE = 3

#: A bash function that drops ANSI colour codes (Flower colours its log lines), so that
#: logs and a redirected output read as plain text.
PLAIN = (
    "plain() {  # drop ANSI colour codes: Flower colours its log lines\n"
    '  "$BIN/python" -u -c \'import re, sys\n'
    'for line in iter(sys.stdin.readline, ""):\n'
    '    sys.stdout.write(re.sub(r"\\x1b\\[[0-9;?]*[A-Za-z]", "", line))\n'
    "    sys.stdout.flush()'\n"
    "}\n"
)


def start_owner(directory: Path) -> str:
    """The ``FEDCIUIC_LAUNCH`` value start.sh gives every process it starts."""
    return owner_tag("start.sh", directory)


@dataclass(frozen=True)
class Region:
    """One region of the deployment: its jurisdiction, policy and SuperNode port."""

    name: str
    jurisdiction: str
    policy: LoadedPolicy
    port: int  # its SuperNode's local runtime API (ClientAppIo)


@dataclass(frozen=True)
class Deployment:
    """What ``fedciuic init`` wrote, and where."""

    directory: Path
    app: Path
    regions: tuple[Region, ...]
    aggregator_jurisdiction: str
    host: str
    port: int
    tls: bool
    demo_data: bool
    bin_dir: Path  # the venv whose Flower executables the scripts run

    @property
    def aggregator(self) -> Path:
        return self.directory / "aggregator"

    def region_dir(self, name: str) -> Path:
        return self.directory / "regions" / name

    @property
    def superlink(self) -> str:
        return f"{self.host}:{self.port}"


# -- checks ---------------------------------------------------------------------------


def parse_regions(regions: str | Sequence[str]) -> tuple[list[tuple[str, str]], list[str]]:
    """``eu,cn,paris=EU`` as (name, jurisdiction) pairs, and every problem found."""
    specs = regions.split(",") if isinstance(regions, str) else list(regions)
    parsed: list[tuple[str, str]] = []
    problems: list[str] = []
    for spec in (s.strip() for s in specs):
        if not spec:
            continue
        name, sep, jurisdiction = spec.partition("=")
        name = name.strip()
        jurisdiction = jurisdiction.strip().upper() if sep else simulated_jurisdiction(name)
        if not re.match(NAME_PATTERN, name):
            problems.append(
                f"--regions:{name}: not a region name; use a lower-case letter, then up to 31 "
                "lower-case letters, digits, - or _ (e.g. eu, paris)"
            )
        elif name == AGGREGATOR:
            problems.append(f"--regions:{name}: the aggregator's name; call the region otherwise")
        elif any(name == other for other, _ in parsed):
            problems.append(f"--regions:{name}: listed twice; list each region once")
        else:
            parsed.append((name, jurisdiction))
    if not parsed and not problems:
        problems.append("--regions: empty; list the regions, e.g. --regions eu,cn,us")
    return parsed, problems


def _app_defaults(app: Path) -> tuple[dict[str, Any], list[str]]:
    """The app's run-config defaults, or why ``app`` is not a Flower app folder."""
    from fedciuic.ops.runconfig import app_run_config

    try:
        return app_run_config(app), []
    except ConfigError as err:
        return {}, list(err.problems)


def _check_directory(directory: Path) -> list[str]:
    if directory.exists() and not directory.is_dir():
        return [f"{directory}: exists and is not a folder; choose another DIR"]
    if directory.is_dir() and any(directory.iterdir()):
        return [
            f"{directory}: exists and is not empty; choose another DIR or remove it "
            "(init never writes over a deployment's keys)"
        ]
    if any(c in str(directory) for c in "\"'\n"):
        # Flower parses --run-config "k='v'" with a regular expression that quotes break.
        return [f"{directory}: a quote or line break in the path; choose a plainer DIR"]
    return []


def _region_policy(
    name: str, jurisdiction: str, policies_dir: Path, policies: PolicySet | None, aggregator: str
) -> tuple[LoadedPolicy | None, list[str]]:
    if policies is None:
        return None, []
    loaded = policies.get(jurisdiction)
    if loaded is None:
        have = ", ".join(sorted(policies.by_jurisdiction)) or "none"
        unreadable = "".join(f"; unreadable: {p}" for p in policies.problems)
        if jurisdiction in JURISDICTIONS:
            fix = "add one or pass --policies DIR"
        else:
            fix = (
                f"{jurisdiction} is not a jurisdiction fedciuic knows: name the region's as "
                f"{name}=JUR (an ISO 3166-1 code, EU or EEA), e.g. paris=EU"
            )
        return None, [
            f"--regions:{name}: no policy for jurisdiction {jurisdiction} in {policies_dir} "
            f"(have {have}){unreadable}; {fix}"
        ]
    allowed = loaded.policy.transfers.aggregator_jurisdictions
    if aggregator in JURISDICTIONS and aggregator not in allowed:
        return loaded, [
            f"--aggregator-jurisdiction: {aggregator}, but region {name}'s policy "
            f"({loaded.path.name}) lets its updates go only to {', '.join(allowed)} "
            "(transfers.aggregator_jurisdictions); choose one of those or leave the region out"
        ]
    return loaded, []


# -- init -----------------------------------------------------------------------------


def init_deployment(
    directory: Path,
    regions: str | Sequence[str],
    aggregator_jurisdiction: str = "EU",
    app_dir: Path = Path("."),
    policies_dir: Path | None = None,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    tls: bool = True,
    demo_data: bool = False,
    supernode_port_base: int | None = None,
) -> Deployment:
    """Check everything, then write the deployment folder; raise ConfigError with every problem.

    Regions are ``name`` (jurisdiction: the name upper-cased) or ``name=JUR``.
    SuperNode ports are ``supernode_port_base + i`` (default: ``port + 1 + i``).
    """
    from fedciuic.data.demo import FAMILIES

    directory = Path(os.path.abspath(directory.expanduser()))
    app = app_dir.expanduser().resolve()
    policies_path = (policies_dir.expanduser() if policies_dir else app / "policies").resolve()
    aggregator = aggregator_jurisdiction.strip().upper()
    problems = _check_directory(directory)
    parsed, region_problems = parse_regions(regions)
    problems += region_problems
    defaults, app_problems = _app_defaults(app)
    problems += app_problems
    if aggregator not in JURISDICTIONS:
        problems.append(
            f"--aggregator-jurisdiction: {aggregator or '(empty)'} is not a jurisdiction "
            "fedciuic knows; use an ISO 3166-1 code, EU or EEA"
        )
    if not host or any(c.isspace() or c in "\"'/" for c in host):
        problems.append(
            f"--host: {host!r} is not a name or address; give the one SuperNodes reach the "
            "SuperLink at, e.g. 127.0.0.1 or superlink.example.org"
        )
    base = port + 1 if supernode_port_base is None else supernode_port_base
    ports = [base + i for i in range(len(parsed))]
    for option, value, top in (
        ("--port", port, 65535),
        ("--supernode-port-base", base, 65536 - max(len(parsed), 1)),
    ):
        if not 0 < value <= top:
            problems.append(f"{option}: {value} is not a usable TCP port; pick one in 1-{top}")
    if port in ports:
        problems.append(
            f"--supernode-port-base: {base} gives a SuperNode the SuperLink's --port {port}; "
            f"pick a base above {port} or below {port - len(parsed)}"
        )
    if demo_data:
        problems += [
            f"--demo-data: no demo corpus for region {name} (have {', '.join(FAMILIES)}); "
            f"leave out --demo-data and put {name}'s data in its data/ folder"
            for name, _ in parsed
            if name not in FAMILIES
        ]
    try:
        policies = load_policies(policies_path)
    except PolicyError:
        policies = None
        problems.append(
            f"--policies:{policies_path}: no such folder; pass --policies DIR with one policy "
            "YAML per jurisdiction (the shipped ones are in the app's policies/)"
        )
    loaded: list[Region] = []
    for (name, jurisdiction), node_port in zip(parsed, ports, strict=True):
        policy, policy_problems = _region_policy(
            name, jurisdiction, policies_path, policies, aggregator
        )
        problems += policy_problems
        if policy is not None:
            loaded.append(Region(name, jurisdiction, policy, node_port))
    deployment = Deployment(
        directory=directory,
        app=app,
        regions=tuple(loaded),
        aggregator_jurisdiction=aggregator,
        host=host,
        port=port,
        tls=tls,
        demo_data=demo_data,
        bin_dir=Path(sys.executable).parent,
    )
    if not problems:
        # The run config the aggregator will submit must be one the ServerApp accepts.
        try:
            RunConfig.from_user_config(
                {**defaults, **_run_overrides(deployment)}, source="run config"
            )
        except ConfigError as err:
            problems += err.problems
    if problems:
        raise ConfigError(problems)

    existed = directory.is_dir()
    directory.mkdir(parents=True, exist_ok=True)
    try:
        _write(deployment, policies)
    except BaseException:
        # No half-written deployment: remove what this call wrote, and only that.
        if existed:  # it was empty: everything in it is ours
            for child in directory.iterdir():
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child)
                else:
                    child.unlink()
        else:
            shutil.rmtree(directory, ignore_errors=True)
        raise
    return deployment


def _run_overrides(d: Deployment) -> dict[str, Any]:
    agg = d.aggregator
    return {
        "regions": ",".join(r.name for r in d.regions),
        "aggregator-jurisdiction": d.aggregator_jurisdiction,
        "keys-dir": str(agg / "keys"),
        "policies-dir": str(agg / "policies"),
        "output-dir": str(agg / "runs"),
        "audit-dir": str(agg / "audit"),
        # Deployed regions read their node config's data-path, never a data-root.
        "data-root": "",
    }


def _node_config(d: Deployment, region: Region) -> dict[str, str]:
    here = d.region_dir(region.name)
    return {
        "region": region.name,
        "data-path": str(here / "data"),
        "state-path": str(here / "state"),
        "key-file": str(here / "keys" / f"{region.name}.key.json"),
        "aggregator-bundle": str(here / "keys" / f"{AGGREGATOR}.pub.json"),
        "policy": str(here / region.policy.path.name),
    }


def _toml(values: dict[str, Any], comment: str) -> str:
    lines = [f"# {line}".rstrip() for line in comment.splitlines()]
    return "\n".join([*lines, *(f"{k} = {toml_value(v)}" for k, v in values.items())]) + "\n"


def _private_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o700)
    return path


def _write(d: Deployment, policies: PolicySet | None) -> None:
    from fedciuic.crypto.tls import generate_server_tls, generate_supernode_key
    from fedciuic.data.demo import write_demo_corpora

    agg = d.aggregator
    agg_keys = _private_dir(agg / "keys")
    write_keys(Keypair.generate(AGGREGATOR, d.aggregator_jurisdiction), agg_keys)
    (agg / "policies").mkdir()
    own = policies.get(d.aggregator_jurisdiction) if policies is not None else None
    if own is not None:  # the aggregator's own policy, when there is one, redacts its log
        shutil.copyfile(own.path, agg / "policies" / own.path.name)
    if d.tls:
        server = generate_server_tls(
            _private_dir(agg / "certs"), list(dict.fromkeys([d.host, "127.0.0.1", "localhost"]))
        )
        _private_dir(agg / "auth")
    for region in d.regions:
        here = d.region_dir(region.name)
        keys = _private_dir(here / "keys")
        write_keys(Keypair.generate(region.name, region.jurisdiction), keys)
        shutil.copyfile(bundle_path(keys, region.name), bundle_path(agg_keys, region.name))
        shutil.copyfile(bundle_path(agg_keys, AGGREGATOR), bundle_path(keys, AGGREGATOR))
        shutil.copyfile(region.policy.path, here / region.policy.path.name)
        shutil.copyfile(region.policy.path, agg / "policies" / region.policy.path.name)
        (here / "state").mkdir()
        data = here / "data"
        data.mkdir()
        (data / "README.md").write_text(_DATA_README.format(region=region.name), encoding="utf-8")
        if d.demo_data:
            with tempfile.TemporaryDirectory(dir=here) as tmp:
                corpus = write_demo_corpora(Path(tmp), (region.name,))[region.name]
                for file in corpus.iterdir():
                    shutil.move(file, data / file.name)
        if d.tls:
            auth = _private_dir(here / "auth")
            _, public = generate_supernode_key(auth, region.name)
            shutil.copyfile(public, agg / "auth" / public.name)
            shutil.copyfile(server.ca_cert, auth / "ca.pem")
        (here / "node-config.toml").write_text(
            _toml(
                _node_config(d, region),
                f"Node config of region {region.name} ({region.jurisdiction}): "
                "flower-supernode --node-config FILE.\nGenerated by fedciuic init.",
            ),
            encoding="utf-8",
        )
        _script(here / "start-supernode.sh", _supernode_script(d, region))
    (agg / "run-config.toml").write_text(
        _toml(
            _run_overrides(d),
            "Run-config overrides for `flwr run` (aggregator/run.sh); any other key of the "
            "app's\n[tool.flwr.app.config] may be added. Generated by fedciuic init.",
        ),
        encoding="utf-8",
    )
    home = agg / "flwr-home"
    home.mkdir()
    (home / "config.toml").write_text(connection_config(d), encoding="utf-8")
    _script(agg / "start-superlink.sh", _superlink_script(d))
    if d.tls:
        _script(agg / "register-supernodes.sh", _register_script(d))
    _script(agg / "run.sh", _run_script(d))
    _script(d.directory / "start.sh", _start_script(d))
    _script(d.directory / "stop.sh", _stop_script(d))
    (d.directory / "README.md").write_text(_readme(d), encoding="utf-8")


def connection_config(d: Deployment) -> str:
    """``$FLWR_HOME/config.toml``: the ``fedciuic`` connection that ``flwr`` commands use."""
    return connection_toml(d.superlink, d.aggregator / "certs" / "ca.pem" if d.tls else None)


# -- scripts --------------------------------------------------------------------------


def _q(path: Path | str) -> str:
    return shlex.quote(str(path))


def _script(path: Path, body: str) -> None:
    path.write_text(body, encoding="utf-8")
    path.chmod(0o755)


def _header(d: Deployment, what: str, party: Path, flwr_home: Path | None = None) -> str:
    """Strict mode, Flower kept offline and quiet, this party's FLWR_HOME and folder."""
    env = " ".join(f"{k}={_q(v)}" for k, v in FLOWER_ENV.items())
    return (
        "#!/usr/bin/env bash\n"
        f"# {what}\n"
        "# Generated by `fedciuic init`; the paths are absolute.\n"
        "set -euo pipefail\n"
        f"export {env}\n"
        f"export FLWR_HOME={_q(flwr_home or party / 'flwr-home')}\n"
        # Flower starts helpers (flower-superexec, flwr-serverapp...) by name.
        f'export PATH={_q(d.bin_dir)}:"$PATH"\n'
        f"BIN={_q(d.bin_dir)}\n"
        f"cd {_q(party)}\n"
    )


def _superlink_script(d: Deployment) -> str:
    certs = d.aggregator / "certs"
    security = (
        f"--ssl-ca-certfile {_q(certs / 'ca.pem')} --ssl-certfile {_q(certs / 'superlink.pem')} "
        f"--ssl-keyfile {_q(certs / 'superlink.key')} --enable-supernode-auth"
        if d.tls
        else "--insecure"
    )
    return _header(
        d,
        f"The SuperLink (relay) of this federation on {d.superlink}; runs until stopped.",
        d.aggregator,
    ) + (
        f'exec "$BIN/flower-superlink" {security} \\\n'
        f"  --host {_q(d.host)} --port {d.port} --disable-runtime-dependency-installation "
        '"$@"\n'
    )


def _register_script(d: Deployment) -> str:
    lines = [
        f'"$BIN/flwr" supernode register {_q(d.aggregator / "auth" / f"{r.name}.auth.pub")} '
        f"{CONNECTION} --name {r.name}\n"
        for r in d.regions
    ]
    return _header(
        d,
        "Admit each region's SuperNode (its auth/REGION.auth.pub) to the running SuperLink.",
        d.aggregator,
    ) + "".join(lines)


def _data_check(data: Path, region: str) -> str:
    # The same files fedciuic.data.corpus reads: *.jsonl and *.txt, hidden entries skipped.
    message = f"{region}: {data} holds no .jsonl or .txt files; put the region's data there"
    return (
        f"if [ -z \"$(find {_q(data)} -mindepth 1 -name '.*' -prune -o "
        "\\( -type f -o -type l \\) \\( -name '*.jsonl' -o -name '*.txt' \\) -print -quit)\" ]; "
        f"then\n  echo {_q(message + f' (see {data}/README.md)')} >&2\n  exit 1\nfi\n"
    )


def _supernode_script(d: Deployment, region: Region) -> str:
    here = d.region_dir(region.name)
    security = (
        f"--root-certificates {_q(here / 'auth' / 'ca.pem')} "
        f"--auth-supernode-private-key {_q(here / 'auth' / f'{region.name}.auth.key')}"
        if d.tls
        else "--insecure"
    )
    return (
        _header(
            d,
            f"Region {region.name}'s SuperNode: trains on data/ under {region.policy.path.name}, "
            "runs until stopped.",
            here,
        )
        + _data_check(here / "data", region.name)
        + f'exec "$BIN/flower-supernode" {security} \\\n'
        f"  --superlink {_q(d.superlink)} --host 127.0.0.1 --port {region.port} \\\n"
        f'  --node-config {_q(here / "node-config.toml")} "$@"\n'
    )


def _run_script(d: Deployment) -> str:
    config = d.aggregator / "run-config.toml"
    return _header(
        d,
        "Submit the app to the SuperLink and stream its log; extra arguments go to `flwr run`,\n"
        '# e.g. --run-config "num-server-rounds=5 local-steps=50". Exit 0 only if the run '
        "completed;\n"
        f"# {EXIT_NO_AGGREGATE} if it published no aggregate (nothing trained), 1 otherwise.",
        d.aggregator,
    ) + (
        # Flower takes a TOML file or key=value pairs, not both: pass the file as pairs so
        # that the caller's --run-config can follow (later values win).
        f'PAIRS="$("$BIN/python" -m fedciuic.ops.deploy run-config {_q(config)})"\n'
        + PLAIN
        + 'LOG="$(mktemp)"\n'
        "trap 'rm -f \"$LOG\"' EXIT\n"
        "rc=0\n"
        f'"$BIN/flwr" run {_q(d.app)} {CONNECTION} --stream --run-config "$PAIRS" "$@" '
        '2>&1 | plain | tee "$LOG" || rc=$?\n'
        # 0 completed; 3 no aggregate published (nothing trained); 1 anything else.
        "outcome=0\n"
        f'"$BIN/python" -m fedciuic.ops.deploy check-run "$LOG" {_q(config)} || outcome=$?\n'
        '[ "$outcome" -eq 0 ] || rc=$outcome\n'
        'exit "$rc"\n'
    )


def _start_script(d: Deployment) -> str:
    agg = d.aggregator
    scheme = "https" if d.tls else "http"
    ca = _q(agg / "certs" / "ca.pem") if d.tls else "''"
    checks = "".join(_data_check(d.region_dir(r.name) / "data", r.name) for r in d.regions)
    register = f"bash {_q(agg / 'register-supernodes.sh')}\n" if d.tls else ""
    supernodes = "".join(
        f"launch supernode-{r.name} bash {_q(d.region_dir(r.name) / 'start-supernode.sh')}\n"
        for r in d.regions
    )
    logs = [agg / "audit" / AGGREGATOR_LOG]
    logs += [d.region_dir(r.name) / "state" / REGION_LOG for r in d.regions]
    report_logs = " ".join(f"--audit-log {_q(log)}" for log in logs)
    return (
        _header(
            d,
            "The whole federation on this machine: SuperLink, one SuperNode per region, one run.\n"
            "# Extra arguments go to aggregator/run.sh. Every process started here is stopped "
            "on exit.",
            d.directory,
            agg / "flwr-home",
        )
        + PLAIN
        + f"""set -m  # each process started below leads its own process group
DIR={_q(d.directory)}
# Every process started below, and all they start, carries this mark: stop.sh stops
# by it what outlived its parent.
export {OWNER_ENV}={_q(start_owner(d.directory))}
START=$(date +%s)
mkdir -p "$DIR/pids" "$DIR/logs"
if ! "$BIN/python" -m fedciuic.ops.deploy running "$DIR/pids"; then
  echo "start.sh: an earlier start.sh is still running; stop it with: bash $DIR/stop.sh" >&2
  exit 1
fi
rm -f "$DIR"/pids/*.pid
{checks}
stop_all() {{
  local rc=$?
  trap - EXIT INT TERM
  echo "start.sh: stopping every process it started"
  disown -a  # stopped by stop.sh, by PID: no job reports from this shell
  bash "$DIR/stop.sh" || true
  # A run whose ServerApp was stopped before it ended must not stay "running".
  "$BIN/python" -m fedciuic.ops.deploy settle "$DIR/aggregator/runs" "$START" || true
  exit "$rc"
}}
trap stop_all EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
launch() {{  # NAME COMMAND...: in the background, logging to logs/NAME.log (no colours)
  local name=$1
  shift
  "$@" > >(plain >"$DIR/logs/$name.log") 2>&1 &
  echo "$!" >"$DIR/pids/$name.pid"
  echo "start.sh: $name (pid $!), log $DIR/logs/$name.log"
}}

launch superlink bash {_q(agg / "start-superlink.sh")}
"$BIN/python" -m fedciuic.ops.deploy wait-healthy {_q(f"{scheme}://{d.superlink}/health")} {ca} \\
  "$DIR/pids/superlink.pid" "$DIR/logs/superlink.log"
{register}{supernodes}
# In the background, so that a signal to this script is handled at once.
bash {_q(agg / "run.sh")} "$@" &
echo "$!" >"$DIR/pids/flwr-run.pid"
run_rc=0
wait "$!" || run_rc=$?
echo "start.sh: results in $DIR/aggregator/runs"
# Every party's log is on this machine: the run report verifies and cross-checks them
# all, and prints each log's verdict (as `fedciuic simulate` does), whatever the outcome.
report_rc=0
run_dir=$(ls -td "$DIR"/aggregator/runs/run-*/ 2>/dev/null | head -1 || true)
if [ -n "$run_dir" ]; then
  "$BIN/fedciuic" report "$run_dir" --keys {_q(agg / "keys")} {report_logs} || report_rc=$?
fi
# The run's outcome first (3: no aggregate was published), then the audit's.
if [ "$run_rc" -ne 0 ]; then
  exit "$run_rc"
fi
exit "$report_rc"
"""
    )


def _stop_script(d: Deployment) -> str:
    return _header(
        d,
        "Stop every process start.sh started (pids/*.pid) and everything they started.",
        d.directory,
        d.aggregator / "flwr-home",
    ) + (f'"$BIN/python" -m fedciuic.ops.deploy stop {_q(d.directory / "pids")}\n')


_DATA_README = """\
Region {region}'s training data goes in this folder (sub-folders are fine):

* *.jsonl: one JSON object per line, {{"text": "..."}}
* *.txt: each file is one document

Other files (like this one) and hidden files are ignored. The data never leaves
this machine: only the region's DP-trained, sealed adapter update does.
"""


# -- next steps and README ------------------------------------------------------------


def next_steps(d: Deployment) -> str:
    """The commands to run, in order: all parties here, or one machine per party."""
    agg, top = d.aggregator, d.directory
    width = max(len("aggregator"), *(len(f"region {r.name}") for r in d.regions)) + 1
    mode = "TLS, SuperNode authentication" if d.tls else "INSECURE: no TLS, loopback only"
    regions = ", ".join(f"{r.name} ({r.jurisdiction}, {r.policy.path.name})" for r in d.regions)
    lines = [
        f"Deployment in {top}",
        f"  aggregator in {d.aggregator_jurisdiction}, SuperLink {d.superlink} ({mode})",
        f"  regions: {regions}",
        "",
    ]
    if not d.demo_data:
        lines += [
            'First put each region\'s data (*.jsonl with {"text": ...}, or *.txt) in '
            + ", ".join(str(d.region_dir(r.name) / "data") for r in d.regions),
            "",
        ]
    lines += [
        "Everything on this machine, one command (stops every process when the run ends):",
        f"  bash {_q(top / 'start.sh')}",
        f'  bash {_q(top / "start.sh")} --run-config "num-server-rounds=5 local-steps=50"',
        "Each run spends up to its target-epsilon (default 8) of each region's lifetime",
        "budget (epsilon-budget, default 8): after a run at the default, another run on the",
        "same data trains nothing (every region declines; start.sh exits 3). For two runs,",
        'give each --run-config "target-epsilon=4.0".',
        "",
        f"One machine per party: copy {agg} to the aggregator and each",
        f"{top / 'regions'}/REGION to its region, at the same paths, then:",
        f"  {'aggregator':<{width}} bash {_q(agg / 'start-superlink.sh')}",
    ]
    if d.tls:
        lines.append(f"  {'aggregator':<{width}} bash {_q(agg / 'register-supernodes.sh')}")
    lines += [
        f"  {f'region {r.name}':<{width}} bash {_q(d.region_dir(r.name) / 'start-supernode.sh')}"
        for r in d.regions
    ]
    lines += [
        f"  {'aggregator':<{width}} bash {_q(agg / 'run.sh')}",
        "",
        f"Results and report.html: {agg / 'runs'}/run-<id>/",
        f"Who keeps which file: {top / 'README.md'}",
    ]
    if d.host in ("127.0.0.1", "localhost", "::1"):
        lines.append(
            f"(--host {d.host}: SuperNodes on other machines cannot reach this SuperLink;\n"
            " for them, run fedciuic init with --host set to its address.)"
        )
    return "\n".join(lines)


def _readme(d: Deployment) -> str:
    region_rows = "\n".join(
        f"| `regions/{r.name}/` | region {r.name} ({r.jurisdiction}) | `keys/{r.name}.key.json`"
        + (f", `auth/{r.name}.auth.key`" if d.tls else "")
        + f" | `{r.policy.path.name}`, `node-config.toml`, SuperNode port {r.port} |"
        for r in d.regions
    )
    tls = (
        "TLS: `aggregator/certs/` holds the federation's CA (keep `ca.key` offline once the\n"
        "deployment works) and the SuperLink's certificate, which each region trusts as\n"
        "`regions/REGION/auth/ca.pem`. `aggregator/auth/*.auth.pub` are the SuperNode keys\n"
        "`register-supernodes.sh` admits; each SuperNode signs in with its `auth/*.auth.key`."
        if d.tls
        else "**Insecure**: no TLS and no SuperNode authentication (`--insecure`), "
        "for loopback tests only."
    )
    return f"""# fedciuic deployment

Written by `fedciuic init` for the app in `{d.app}`. Paths in the scripts and
config files are absolute; Flower and fedciuic come from `{d.bin_dir}`.

## Next steps

```text
{next_steps(d)}
```

Logs of `start.sh`: `logs/`; the PIDs it started: `pids/` (`bash stop.sh` stops
them, should `start.sh` itself have been killed).

## Who keeps what

| folder | party | private (never leaves it) | also |
| --- | --- | --- | --- |
| `aggregator/` | aggregator ({d.aggregator_jurisdiction}) | `keys/aggregator.key.json`\
{", `certs/ca.key`, `certs/superlink.key`" if d.tls else ""} | SuperLink at `{d.superlink}` |
{region_rows}

Only public bundles (`*.pub.json`) travel between parties: the aggregator holds
every region's in `aggregator/keys/` (with its own key pair: the ServerApp's
`keys-dir`), each region holds `keys/aggregator.pub.json`. Private key files are
mode 0600 and `fedciuic init` never overwrites one.

Policies: each region enforces its own copy (`regions/REGION/*.yaml`, named in
its `node-config.toml`); the aggregator checks every update against its copy of
the sender's (`aggregator/policies/`, the ServerApp's `policies-dir`).

{tls}

- `aggregator/run-config.toml`: what `run.sh` passes to `flwr run` (regions,
  keys, policies, `output-dir` = `aggregator/runs`, `audit-dir` = `aggregator/audit`).
- `aggregator/flwr-home/config.toml`: the `{CONNECTION}` connection `flwr` uses.
- `regions/REGION/data/`: the region's training data; `state/`: its privacy
  ledger and audit log.
"""


# -- helpers the scripts call ---------------------------------------------------------


def run_config_pairs(path: Path) -> str:
    """A run-config TOML file as ``k=v`` pairs for ``flwr run --run-config``."""
    with open(path, "rb") as handle:
        return toml_pairs(tomllib.load(handle))


def wait_healthy(url: str, ca: str, pid_file: Path, log: Path, timeout: float = 60.0) -> int:
    """Wait until the SuperLink answers on ``/health``; 1 with its log's end if it exits."""
    try:
        superlink = psutil.Process(int(pid_file.read_text().strip()))
    except psutil.Error:
        superlink = None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if superlink is None or not running(superlink):
            print(f"start.sh: flower-superlink exited; {log}:\n{tail(log)}", file=sys.stderr)
            return 1
        if healthy(url, ca or None):
            return 0
        time.sleep(0.3)
    print(
        f"start.sh: flower-superlink did not answer at {url} within {timeout:.0f}s; see {log}",
        file=sys.stderr,
    )
    return 1


def check_run(log: Path, config: Path) -> int:
    """0 if the run that ``flwr run`` started (its log) completed, else 1 with why."""
    match = STARTED_RUN.search(log.read_text(errors="replace"))
    if not match:
        print("run.sh: flwr run started no run; see its output above", file=sys.stderr)
        return 1
    with open(config, "rb") as handle:
        output = Path(tomllib.load(handle)["output-dir"])
    metrics = output / f"run-{match.group(1)}" / METRICS_FILE
    try:
        status = json.loads(metrics.read_text(encoding="utf-8"))["run"]["status"]
    except (OSError, ValueError, KeyError, TypeError):
        print(
            f"run.sh: run {match.group(1)} wrote no {metrics} (output-dir overridden?); see "
            "the SuperLink's log",
            file=sys.stderr,
        )
        return 1
    print(f"run.sh: run {match.group(1)} {status}; results in {metrics.parent}")
    if status == NO_AGGREGATE:
        data = json.loads(metrics.read_text(encoding="utf-8"))
        print(
            f"run.sh: run {match.group(1)} published no aggregate in any round, so nothing was "
            "trained and no adapter was saved. Why:\n"
            + "\n".join(
                f"  {line}" for line in data["run"].get("reasons") or no_aggregate_reasons(data)
            ),
            file=sys.stderr,
        )
        return EXIT_NO_AGGREGATE
    return 0 if status == COMPLETED else 1


def settle_runs(runs_dir: Path, since: float) -> list[Path]:
    """Mark ``interrupted`` each run in ``runs_dir`` that still says ``running`` and was
    written since ``since`` (Unix time): start.sh calls this once every process it
    started is gone, so such a run can no longer end."""
    marked = []
    for metrics in sorted(runs_dir.glob(f"run-*/{METRICS_FILE}")):
        try:
            fresh = metrics.stat().st_mtime >= since - 1.0
            status = json.loads(metrics.read_text(encoding="utf-8"))["run"]["status"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if (
            fresh
            and status == RUNNING
            and mark_unfinished(
                metrics.parent, "start.sh stopped the federation before the run ended"
            )
        ):
            marked.append(metrics.parent)
    return marked


def tracked(pids_dir: Path) -> list[psutil.Process]:
    """The live processes named in ``pids_dir/*.pid``.

    A PID file written before its process started names a reused PID (a process
    start.sh did not start), which is left out.
    """
    found = []
    for pid_file in sorted(pids_dir.glob("*.pid")):
        try:
            proc = psutil.Process(int(pid_file.read_text().strip()))
            if running(proc) and proc.create_time() <= pid_file.stat().st_mtime + 1.0:
                found.append(proc)
        except (ValueError, OSError, psutil.Error):
            continue
    return found


def stop_processes(pids_dir: Path, grace: float = 10.0) -> list[int]:
    """Stop every process named in ``pids_dir/*.pid`` and all its descendants, by PID
    (each leads its own process group: start.sh runs with set -m). Returns the roots."""
    roots = [proc.pid for proc in tracked(pids_dir)]
    # Also what outlived its parent: every process start.sh started carries its mark.
    stop_process_trees(roots, grace, owner=start_owner(Path(os.path.abspath(pids_dir.parent))))
    return roots


def _main(argv: Sequence[str]) -> int:
    """``python -m fedciuic.ops.deploy ACTION ARGS``, for the generated scripts."""
    action, *args = argv or ["help"]
    if action == "run-config" and len(args) == 1:
        print(run_config_pairs(Path(args[0])))
        return 0
    if action == "wait-healthy" and len(args) == 4:
        return wait_healthy(args[0], args[1], Path(args[2]), Path(args[3]))
    if action == "check-run" and len(args) == 2:
        return check_run(Path(args[0]), Path(args[1]))
    if action == "running" and len(args) == 1:  # exit 1 if any tracked process is alive
        live = tracked(Path(args[0]))
        for proc in live:
            print(f"{args[0]}: process {proc.pid} ({proc.name()}) is running", file=sys.stderr)
        return 1 if live else 0
    if action == "settle" and len(args) == 2:
        for run_dir in settle_runs(Path(args[0]), float(args[1])):
            print(f"start.sh: {run_dir.name} did not end; marked interrupted")
        return 0
    if action == "stop" and len(args) == 1:
        stopped = stop_processes(Path(args[0]))
        print(f"stopped {len(stopped)} process group(s) named in {args[0]}")
        return 0
    print(
        "usage: python -m fedciuic.ops.deploy run-config FILE | wait-healthy URL CA PIDFILE LOG "
        "| check-run LOG FILE | settle RUNS_DIR SINCE | running PIDS_DIR | stop PIDS_DIR",
        file=sys.stderr,
    )
    return 2


__all__ = ["Deployment", "Region", "init_deployment", "next_steps", "parse_regions"]

if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
