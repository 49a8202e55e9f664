"""``fedciuic init``: a deployment folder, laid out per party, with the scripts that run it.

:func:`init_deployment` checks everything before it writes anything (a refused
deployment leaves nothing behind), then writes one folder per party, so that each can be
copied to its own machine: private keys never leave their party's folder.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedciuic.config import RunConfig
from fedciuic.crypto import AGGREGATOR, NAME_PATTERN
from fedciuic.errors import ConfigError
from fedciuic.jurisdictions import JURISDICTIONS, simulated_jurisdiction
from fedciuic.ops.layout import (
    DeployedRegion,
    Deployment,
    region_socket,
    relay_home,
    run_overrides,
    write_deployment,
)
from fedciuic.ops.runconfig import app_run_config
from fedciuic.ops.separation import (
    default_relay_user,
    reach_problem,
    reachability_problem,
    relay_folders,
)
from fedciuic.policy import LoadedPolicy, PolicyError, PolicySet, load_policies

DEFAULT_PORT = 9092


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
        fix = (
            "add one or pass --policies DIR"
            if jurisdiction in JURISDICTIONS
            else f"{jurisdiction} is not a jurisdiction fedciuic knows: name the region's as "
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


def _relay_problems(user: str, folders: dict[str, Path]) -> list[str]:
    """Why ``user`` cannot be the relay's user here (it must run this Python, reach ``folders``)."""
    if not re.fullmatch(r"[a-z_][a-z0-9_-]{0,31}", user):
        return [f"--relay-user: {user!r} is not a user name (lower-case, at most 32 characters)"]
    try:
        if pwd.getpwnam(user).pw_uid in (0, os.geteuid()):
            return [f"--relay-user: {user} is root or yourself; the relay needs a user of its own"]
    except KeyError:
        if os.geteuid() != 0:
            return [
                f"--relay-user: no user {user}; create it (as root), or run init as root so "
                "that start-supernode.sh creates it"
            ]
    problems = [reachability_problem(user), reach_problem(user, folders, "--relay-user")]
    return [p for p in problems if p]


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
    relay_user: str | None = None,
) -> Deployment:
    """Check everything (ConfigError with every problem), then write the deployment folder."""
    from fedciuic.data import FAMILIES

    directory = Path(os.path.abspath(directory.expanduser()))
    app = app_dir.expanduser().resolve()
    policies_path = (policies_dir.expanduser() if policies_dir else app / "policies").resolve()
    aggregator = aggregator_jurisdiction.strip().upper()
    problems = _check_directory(directory)
    parsed, region_problems = parse_regions(regions)
    problems += region_problems
    defaults: dict[str, Any] = {}
    try:
        defaults = app_run_config(app)
    except ConfigError as err:
        problems += err.problems
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
    relay = default_relay_user() if relay_user is None else relay_user.strip()
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
    loaded: list[DeployedRegion] = []
    for (name, jurisdiction), node_port in zip(parsed, ports, strict=True):
        policy, policy_problems = _region_policy(
            name, jurisdiction, policies_path, policies, aggregator
        )
        problems += policy_problems
        if policy is not None:
            loaded.append(DeployedRegion(name, jurisdiction, policy, node_port))
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
        relay_user=relay,
    )
    if relay:
        # The relay's user must pass the folders above each region's relay home and socket.
        folders: dict[str, Path] = {}
        for region in deployment.regions:
            folders |= relay_folders(
                relay_home(deployment, region.name), region_socket(deployment, region.name)
            )
        problems += _relay_problems(relay, folders)
    if not problems:
        # The run config the aggregator will submit must be one the ServerApp accepts.
        try:
            RunConfig.from_user_config(
                {**defaults, **run_overrides(deployment)}, source="run config"
            )
        except ConfigError as err:
            problems += err.problems
    if problems:
        raise ConfigError(problems)

    existed = directory.is_dir()
    made = [f for f in (directory, *directory.parents) if not f.exists()]
    directory.mkdir(parents=True, exist_ok=True)
    for folder in made:  # whatever the umask: the relay's user passes through them
        folder.chmod(0o755)
    try:
        write_deployment(deployment, policies)
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
