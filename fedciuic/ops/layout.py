"""What ``fedciuic init`` writes: the deployment's folders, keys, configs and scripts.

:mod:`fedciuic.ops.deploy` checks a :class:`Deployment` first; the scripts and READMEs
are rendered from ``templates/`` with the values worked out here.
"""

from __future__ import annotations

import os
import shlex
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedciuic.agent import AgentConfig
from fedciuic.audit import AGGREGATOR_LOG, REGION_LOG
from fedciuic.config import DPSettings
from fedciuic.crypto import (
    AGGREGATOR,
    Keypair,
    bundle_path,
    generate_server_tls,
    generate_supernode_key,
    load_bundle,
    write_keys,
)
from fedciuic.errors import EXIT_NO_AGGREGATE
from fedciuic.flower import AGENT, CONNECTION, FLOWER_ENV, connection_toml
from fedciuic.ops.render import fragment, render
from fedciuic.ops.runconfig import app_run_config
from fedciuic.ops.scripts import start_owner
from fedciuic.policy import LoadedPolicy, PolicySet
from fedciuic.processes import OWNER_ENV, toml_value

#: Each region's agent config, in its folder.
AGENT_CONFIG = "agent.toml"
#: Each region's folder of its peers' public bundles (its operator's copies, enrolled
#: by the region itself): what its agent trusts in a secure sum, and nothing else.
PEERS_DIR = "peers"
#: A demo region's dictionary of its synthetic customers' names, beside its agent config.
DEMO_DICTIONARY_FILE = "deid-dictionary.txt"
#: A bash function dropping ANSI colour codes (Flower's), so that logs read as plain text.
PLAIN = render("_plain.sh")


@dataclass(frozen=True)
class DeployedRegion:
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
    regions: tuple[DeployedRegion, ...]
    aggregator_jurisdiction: str
    host: str
    port: int
    tls: bool
    demo_data: bool
    bin_dir: Path  # the venv whose Flower executables the scripts run
    #: The OS user each region's relay (Flower's ClientApp) runs as; "": the region's own.
    relay_user: str = ""

    @property
    def aggregator(self) -> Path:
        return self.directory / "aggregator"

    def region_dir(self, name: str) -> Path:
        return self.directory / "regions" / name

    @property
    def superlink(self) -> str:
        return f"{self.host}:{self.port}"


def run_overrides(d: Deployment) -> dict[str, Any]:
    """The run config ``run.sh`` submits on top of the app's defaults."""
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


def region_socket(d: Deployment, region: str) -> Path:
    """The region agent's socket (its folder is the agent's, mode 0711)."""
    return d.region_dir(region) / "agent" / "agent.sock"


def relay_home(d: Deployment, region: str) -> Path:
    """The home of the region's relay user (its FLWR_HOME, where Flower unpacks the app)."""
    return d.region_dir(region) / "relay"


def _agent_config(d: Deployment, region: DeployedRegion) -> AgentConfig:
    """Everything the region's agent holds, in a file only the region keeps."""
    here = d.region_dir(region.name)
    return AgentConfig(
        region=region.name,
        data_path=str(here / "data"),
        state_path=str(here / "state"),
        key_file=str(here / "keys" / f"{region.name}.key.json"),
        aggregator_bundle=str(here / "keys" / f"{AGGREGATOR}.pub.json"),
        peer_bundles=str(here / PEERS_DIR),
        policy=str(here / region.policy.path.name),
        socket=str(region_socket(d, region.name)),
        relay_user=d.relay_user,
        cpu_threads=cpu_share(len(d.regions)),
        # The demo's names to scrub (the region's own list: never in the FAB or data/).
        deid_dictionary=str(here / DEMO_DICTIONARY_FILE) if d.demo_data else "",
    )


def cpu_share(regions: int) -> int:
    """Each region's share of this machine's cores: start.sh starts all ``regions`` here."""
    return max(1, (os.cpu_count() or 1) // max(1, regions))


def _toml(values: dict[str, Any], comment: str) -> str:
    lines = [f"# {line}".rstrip() for line in comment.splitlines()]
    return "\n".join([*lines, *(f"{k} = {toml_value(v)}" for k, v in values.items())]) + "\n"


def _private_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o700)
    return path


def write_deployment(d: Deployment, policies: PolicySet | None) -> None:
    """Write the checked deployment ``d`` into its (existing, empty) folder."""
    from fedciuic.data import DEMO_DICTIONARIES, write_demo_corpora

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
    # The relay passes through to its home and the agent's socket, whatever the umask.
    (d.directory / "regions").mkdir(mode=0o755)
    (d.directory / "regions").chmod(0o755)
    for region in d.regions:
        here = d.region_dir(region.name)
        keys = _private_dir(here / "keys")
        write_keys(Keypair.generate(region.name, region.jurisdiction), keys)
        shutil.copyfile(bundle_path(keys, region.name), bundle_path(agg_keys, region.name))
        shutil.copyfile(bundle_path(agg_keys, AGGREGATOR), bundle_path(keys, AGGREGATOR))
        shutil.copyfile(region.policy.path, here / region.policy.path.name)
        shutil.copyfile(region.policy.path, agg / "policies" / region.policy.path.name)
        here.chmod(0o755)
        _private_dir(here / "state")
        data = _private_dir(here / "data")
        (data / "README.md").write_text(
            render("data-README.md.tmpl", region=region.name), encoding="utf-8"
        )
        if d.demo_data:
            with tempfile.TemporaryDirectory(dir=here) as tmp:
                corpus = write_demo_corpora(Path(tmp), (region.name,))[region.name]
                for file in corpus.iterdir():
                    shutil.move(file, data / file.name)
                names = Path(tmp) / DEMO_DICTIONARIES / f"{region.name}.txt"
                shutil.move(names, here / DEMO_DICTIONARY_FILE)
                (here / DEMO_DICTIONARY_FILE).chmod(0o600)  # names: the region's alone
        if d.tls:
            auth = _private_dir(here / "auth")
            _, public = generate_supernode_key(auth, region.name)
            shutil.copyfile(public, agg / "auth" / public.name)
            shutil.copyfile(server.ca_cert, auth / "ca.pem")
        (here / "node-config.toml").write_text(
            _toml(
                {AGENT: str(region_socket(d, region.name))},
                f"Node config of region {region.name} ({region.jurisdiction}): "
                "flower-supernode --node-config FILE.\nThe ClientApp (code the aggregator "
                "ships) reads only the agent's socket. Generated by fedciuic init.",
            ),
            encoding="utf-8",
        )
        (here / AGENT_CONFIG).write_text(
            _agent_config(d, region).toml(
                f"Region {region.name}'s agent (fedciuic agent --config FILE): the only "
                "process that reads\nits data, state, keys and policy. epsilon-budget is "
                "this dataset's lifetime budget;\nno aggregator can raise it. relay-user: "
                'the OS user Flower\'s ClientApp runs as ("": this\nuser, no OS '
                "separation). allow-pickle-weights: load a model-path whose weights are "
                "only\npickle files (loading them runs code); the region's choice alone. "
                "cpu-threads: this\nmachine's cores shared among the regions init made "
                "here; 0 on a machine of the\nregion's own. deid-dictionary (its customers' "
                "names, one per line) or deid-ner-model\n(a spaCy pipeline it installed): "
                "a policy that requires names (the shipped CN and EU\nones) declines a "
                "region with neither. Generated by fedciuic init.",
            ),
            encoding="utf-8",
        )
        _script(here / "start-supernode.sh", _supernode_script(d, region))
    _enrol_peers(d)
    (agg / "run-config.toml").write_text(
        _toml(
            run_overrides(d),
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
    _script(
        d.directory / "stop.sh",
        render("stop.sh", preamble=_preamble(d, d.directory, home), pids=_q(d.directory / "pids")),
    )
    (d.directory / "README.md").write_text(_readme(d), encoding="utf-8")


def _enrol_peers(d: Deployment) -> None:
    """Each region's copies of its peers' public bundles, as its operator would copy them
    over a trusted channel (fingerprints compared out of band; the README lists them):
    never the aggregator's to hand out at run time."""
    for region in d.regions:
        peers = _private_dir(d.region_dir(region.name) / PEERS_DIR)
        for peer in d.regions:
            if peer.name != region.name:
                own = bundle_path(d.region_dir(peer.name) / "keys", peer.name)
                shutil.copyfile(own, bundle_path(peers, peer.name))


def fingerprints(d: Deployment) -> dict[str, str]:
    """Each party's key id (the fingerprint its peers compare)."""
    parties = {AGGREGATOR: d.aggregator / "keys"}
    parties |= {r.name: d.region_dir(r.name) / "keys" for r in d.regions}
    return {
        name: load_bundle(bundle_path(keys, name)).key_id.hex() for name, keys in parties.items()
    }


def connection_config(d: Deployment) -> str:
    """``$FLWR_HOME/config.toml``: the ``fedciuic`` connection that ``flwr`` commands use."""
    return connection_toml(d.superlink, d.aggregator / "certs" / "ca.pem" if d.tls else None)


# -- scripts --------------------------------------------------------------------------


def _q(path: Path | str) -> str:
    return shlex.quote(str(path))


def _script(path: Path, body: str) -> None:
    path.write_text(body, encoding="utf-8")
    path.chmod(0o755)


def _preamble(d: Deployment, party: Path, flwr_home: Path | None = None) -> str:
    return fragment(
        "_preamble.sh",
        flower_env=" ".join(f"{k}={_q(v)}" for k, v in FLOWER_ENV.items()),
        flwr_home=_q(flwr_home or party / "flwr-home"),
        bin=_q(d.bin_dir),
        party=_q(party),
    )


def _superlink_script(d: Deployment) -> str:
    certs = d.aggregator / "certs"
    security = (
        f"--ssl-ca-certfile {_q(certs / 'ca.pem')} --ssl-certfile {_q(certs / 'superlink.pem')} "
        f"--ssl-keyfile {_q(certs / 'superlink.key')} --enable-supernode-auth"
        if d.tls
        else "--insecure"
    )
    return render(
        "start-superlink.sh",
        superlink=d.superlink,
        preamble=_preamble(d, d.aggregator),
        security=security,
        host=_q(d.host),
        port=d.port,
    )


def _register_script(d: Deployment) -> str:
    registrations = [
        fragment(
            "_register-supernode.sh",
            public_key=_q(d.aggregator / "auth" / f"{r.name}.auth.pub"),
            connection=CONNECTION,
            region=r.name,
        )
        for r in d.regions
    ]
    return render(
        "register-supernodes.sh",
        preamble=_preamble(d, d.aggregator),
        registrations="\n".join(registrations),
    )


def _data_check(data: Path, region: str) -> str:
    message = f"{region}: {data} holds no data files; put the region's data there"
    return fragment(
        "_data-check.sh", data=_q(data), message=_q(f"{message} (see {data}/README.md)")
    )


def _supernode_script(d: Deployment, region: DeployedRegion) -> str:
    here = d.region_dir(region.name)
    security = (
        f"--root-certificates {_q(here / 'auth' / 'ca.pem')} "
        f"--auth-supernode-private-key {_q(here / 'auth' / f'{region.name}.auth.key')}"
        if d.tls
        else "--insecure"
    )
    return render(
        "start-supernode.sh",
        region=region.name,
        policy=region.policy.path.name,
        preamble=_preamble(d, here),
        data_check=_data_check(here / "data", region.name),
        agent=_q(here / AGENT_CONFIG),
        relay_user=_q(d.relay_user),
        relay_home=_q(relay_home(d, region.name)),
        socket=_q(region_socket(d, region.name)),
        as_user=f"as {d.relay_user}" if d.relay_user else "as this user (no OS separation)",
        # (a user name is letters, digits, - and _: safe inside the script's quotes)
        relay=f"relay (flower-superexec as {d.relay_user})"
        if d.relay_user
        else "relay (flower-superexec)",
        security=security,
        superlink=_q(d.superlink),
        port=region.port,
        node_config=_q(here / "node-config.toml"),
    )


def _run_script(d: Deployment) -> str:
    return render(
        "run.sh",
        no_aggregate=EXIT_NO_AGGREGATE,
        preamble=_preamble(d, d.aggregator),
        config=_q(d.aggregator / "run-config.toml"),
        plain=PLAIN.removesuffix("\n"),
        app=_q(d.app),
        connection=CONNECTION,
    )


def _start_script(d: Deployment) -> str:
    agg = d.aggregator
    scheme = "https" if d.tls else "http"
    launches = [f"bash {_q(agg / 'register-supernodes.sh')}"] if d.tls else []
    launches += [
        fragment(
            "_launch-supernode.sh",
            region=r.name,
            script=_q(d.region_dir(r.name) / "start-supernode.sh"),
        )
        for r in d.regions
    ]
    logs = [agg / "audit" / AGGREGATOR_LOG]
    logs += [d.region_dir(r.name) / "state" / REGION_LOG for r in d.regions]
    return render(
        "start.sh",
        preamble=_preamble(d, d.directory, agg / "flwr-home"),
        plain=PLAIN.removesuffix("\n"),
        dir=_q(d.directory),
        owner_env=OWNER_ENV,
        owner=_q(start_owner(d.directory)),
        data_checks="\n".join(
            _data_check(d.region_dir(r.name) / "data", r.name) for r in d.regions
        ),
        app=_q(d.app),
        run_config=_q(agg / "run-config.toml"),
        agent_configs=" ".join(
            f"--agent-config {_q(d.region_dir(r.name) / AGENT_CONFIG)}" for r in d.regions
        ),
        start_superlink=_q(agg / "start-superlink.sh"),
        health_url=_q(f"{scheme}://{d.superlink}/health"),
        ca=_q(agg / "certs" / "ca.pem") if d.tls else "''",
        launch_supernodes="\n".join(launches),
        run=_q(agg / "run.sh"),
        keys=_q(agg / "keys"),
        audit_logs=" ".join(f"--audit-log {_q(log)}" for log in logs),
        no_aggregate=EXIT_NO_AGGREGATE,
    )


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
            "First put each region's data (JSON Lines, JSON, CSV, Parquet, text or a "
            "save_to_disk folder; check it with `fedciuic data check DIR`) in "
            + ", ".join(str(d.region_dir(r.name) / "data") for r in d.regions),
            "",
        ]
    target = app_run_config(d.app).get("target-epsilon", DPSettings().target_epsilon)
    budget = AgentConfig.model_fields["epsilon_budget"].default
    lines += [
        "Everything on this machine, one command (stops every process when the run ends):",
        f"  bash {_q(top / 'start.sh')}",
        f'  bash {_q(top / "start.sh")} --run-config "num-server-rounds=5 local-steps=50"',
        f"Each run spends up to its target-epsilon ({target:g} by default) of each region's",
        f"lifetime budget (epsilon-budget in its agent.toml, {budget:g} by default). What each",
        f"has spent and has left: {_q(d.bin_dir)}/fedciuic budget {top / 'regions'}/*/agent.toml",
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
    region_rows = [
        fragment(
            "_readme-region.md.tmpl",
            region=r.name,
            jurisdiction=r.jurisdiction,
            auth_key=f", `auth/{r.name}.auth.key`" if d.tls else "",
            policy=r.policy.path.name,
            port=r.port,
        )
        for r in d.regions
    ]
    bundles = {AGGREGATOR: bundle_path(Path("aggregator") / "keys", AGGREGATOR)}
    bundles |= {r.name: bundle_path(Path("regions") / r.name / "keys", r.name) for r in d.regions}
    rows = [
        fragment(
            "_readme-fingerprint.md.tmpl", party=party, key_id=key_id, bundle=str(bundles[party])
        )
        for party, key_id in fingerprints(d).items()
    ]
    return render(
        "README.md.tmpl",
        fingerprints="\n".join(rows),
        app=str(d.app),
        bin=str(d.bin_dir),
        next_steps=next_steps(d),
        aggregator_jurisdiction=d.aggregator_jurisdiction,
        aggregator_certs=", `certs/ca.key`, `certs/superlink.key`" if d.tls else "",
        superlink=d.superlink,
        region_rows="\n".join(region_rows),
        security=fragment("_readme-tls.md.tmpl" if d.tls else "_readme-insecure.md.tmpl"),
        connection=CONNECTION,
    )
