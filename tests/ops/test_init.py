"""`fedciuic init`: the deployment folder it writes, and every input it refuses (no Flower)."""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from flwr.common.config import parse_config_args

from fedciuic.agent.config import AgentConfig
from fedciuic.config import RunConfig
from fedciuic.crypto.keys import load_bundle, load_keypair
from fedciuic.crypto.parties import aggregator_keys
from fedciuic.data.demo import CHAT_FILE, DOCS_FILE, INSTRUCTIONS_FILE
from fedciuic.data.sources import discover
from fedciuic.errors import DataError
from fedciuic.flower.relay import AGENT
from fedciuic.ops import deploy, scripts, separation
from fedciuic.ops.cli import main
from fedciuic.policy.rules import load_policy
from fedciuic.region.secure import peers_of
from tests.conftest import ROOT, SHIPPED_POLICIES, app_config, unit_config

REGIONS = ("eu", "cn", "us")


def _init(tmp_path: Path, *extra: str, directory: Path | None = None) -> int:
    """``fedciuic init``; the relay as the region's own user unless ``extra`` names one
    (the relay's own OS user is tested below, on its own)."""
    target = directory or tmp_path / "dep"
    relay = [] if "--relay-user" in extra else ["--relay-user", ""]
    return main(["init", str(target), "--app", str(ROOT), "--port", "19092", *relay, *extra])


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def deployment(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    assert _init(tmp_path, "--regions", ",".join(REGIONS)) == 0
    return tmp_path / "dep"


def test_each_party_gets_its_keys_policy_and_scripts(deployment):
    agg = deployment / "aggregator"
    # The aggregator: its key pair and every region's public bundle (the ServerApp's keys-dir).
    assert _mode(agg / "keys" / "aggregator.key.json") == 0o600
    assert load_keypair(agg / "keys" / "aggregator.key.json").bundle.jurisdiction == "EU"
    keys = aggregator_keys(str(agg / "keys"), 1 << 20)
    assert sorted(b.party for b in keys.regions.values()) == sorted(REGIONS)
    assert sorted(p.name for p in (agg / "policies").iterdir()) == sorted(SHIPPED_POLICIES.values())
    for name in ("ca.key", "superlink.key"):
        assert _mode(agg / "certs" / name) == 0o600
    for region in REGIONS:
        here = deployment / "regions" / region
        private = here / "keys" / f"{region}.key.json"
        assert _mode(private) == 0o600
        assert _mode(here / "auth" / f"{region}.auth.key") == 0o600
        assert load_keypair(private).bundle.jurisdiction == region.upper()
        # Only public halves cross between parties, and they are the same keys.
        assert (
            load_bundle(here / "keys" / "aggregator.pub.json").key_id == keys.keypair.bundle.key_id
        )
        assert (agg / "keys" / f"{region}.pub.json").read_bytes() == (
            here / "keys" / f"{region}.pub.json"
        ).read_bytes()
        assert (agg / "auth" / f"{region}.auth.pub").read_bytes() == (
            here / "auth" / f"{region}.auth.pub"
        ).read_bytes()
        assert (here / "auth" / "ca.pem").read_bytes() == (agg / "certs" / "ca.pem").read_bytes()
        policy_file = here / SHIPPED_POLICIES[region.upper()]
        assert load_policy(policy_file).policy.jurisdiction == region.upper()
        assert (here / "data" / "README.md").exists() and (here / "state").is_dir()
    private_keys = sorted(p.relative_to(deployment) for p in deployment.rglob("*.key*"))
    assert [str(p) for p in private_keys] == [
        "aggregator/certs/ca.key",
        "aggregator/certs/superlink.key",
        "aggregator/keys/aggregator.key.json",
        *(
            f"regions/{r}/{k}"
            for r in sorted(REGIONS)
            for k in (f"auth/{r}.auth.key", f"keys/{r}.key.json")
        ),
    ]


def test_each_region_trusts_its_enrolled_peers_and_the_readme_lists_every_fingerprint(
    deployment,
):
    """A secure sum needs each region's peers' bundles: its own operator's copies in its
    peers/ (never the aggregator's, never its own), which its agent config names; the
    README lists each party's fingerprint and how a region enrols its peers."""
    readme = (deployment / "README.md").read_text()
    with open(deployment / "aggregator" / "run-config.toml", "rb") as handle:
        run = RunConfig.from_user_config({**unit_config(), **tomllib.load(handle)}, source="test")
    for region in REGIONS:
        here = deployment / "regions" / region
        agent = AgentConfig.load(here / "agent.toml")
        assert Path(agent.peer_bundles) == here / "peers" and _mode(here / "peers") == 0o700
        others = sorted(r for r in REGIONS if r != region)
        # What a secure round reads: these, and without them none: never what lies
        # beside the aggregator's bundle (here, a peer's bundle put there).
        node = agent.node_for(run)
        assert sorted(peers_of(run, node, region)) == others
        stray = here / "keys" / f"{others[0]}.pub.json"
        shutil.copyfile(here / "peers" / stray.name, stray)
        assert peers_of(run, node.model_copy(update={"peer_bundles": ""}), region) == {}
        stray.unlink()
        assert sorted(p.name for p in (here / "peers").iterdir()) == [
            f"{r}.pub.json" for r in others
        ]
        for peer in others:
            assert (here / "peers" / f"{peer}.pub.json").read_bytes() == (
                deployment / "regions" / peer / "keys" / f"{peer}.pub.json"
            ).read_bytes()
        key_id = load_bundle(here / "keys" / f"{region}.pub.json").key_id.hex()
        assert f"| {region} | `{key_id}` | `regions/{region}/keys/{region}.pub.json` |" in readme
    key_id = load_bundle(deployment / "aggregator" / "keys" / "aggregator.pub.json").key_id.hex()
    assert f"| aggregator | `{key_id}` |" in readme
    assert "regions/REGION/peers/" in readme and "fedciuic keys show peers/PEER.pub.json" in readme


def test_run_config_validates_and_node_configs_name_existing_files(deployment):
    agg = deployment / "aggregator"
    with open(agg / "run-config.toml", "rb") as handle:
        overrides = tomllib.load(handle)
    run = RunConfig.from_user_config({**unit_config(), **overrides}, source="test")
    assert run.regions == REGIONS and run.policy.aggregator_jurisdiction == "EU"
    assert (
        Path(run.sealing.keys_dir) == agg / "keys"
        and Path(run.policy.policies_dir) == agg / "policies"
    )
    assert (
        Path(run.output.output_dir) == agg / "runs" and Path(run.output.audit_dir) == agg / "audit"
    )
    # What run.sh hands `flwr run`: the file as pairs, with the caller's overrides after it.
    pairs = scripts.run_config_pairs(agg / "run-config.toml")
    assert parse_config_args([pairs]) == overrides
    assert parse_config_args([pairs, "num-server-rounds=1 local-steps=2"]) == {
        **overrides,
        "num-server-rounds": 1,
        "local-steps": 2,
    }
    for region in REGIONS:
        here = deployment / "regions" / region
        with open(here / "node-config.toml", "rb") as handle:
            values = tomllib.load(handle)
        # Flower reads a --node-config that ends in .toml as a file; the ClientApp (code
        # the aggregator ships) learns only where the region's agent listens.
        assert parse_config_args([str(here / "node-config.toml")]) == values
        assert values == {AGENT: str(here / "agent" / "agent.sock")}
        agent = AgentConfig.load(here / "agent.toml")
        node = agent.node_for(run)
        assert node.region == region and node.state_dir == here / "state"
        assert Path(agent.socket) == here / "agent" / "agent.sock" and agent.relay_user == ""
        assert agent.epsilon_budget == 8.0
        # The regions it makes start on this machine together: each takes a share.
        assert agent.cpu_threads == max(1, (os.cpu_count() or 1) // len(REGIONS))
        for key in ("data_path", "state_path", "key_file", "aggregator_bundle", "policy"):
            assert Path(getattr(agent, key)).is_absolute(), key
            assert Path(getattr(agent, key)).exists(), key
        assert load_keypair(Path(node.key_file)).bundle.party == region
        # What only the region may read is its own: data, state and keys are 0700.
        for private in ("data", "state", "keys"):
            assert _mode(here / private) == 0o700, private
        script = (here / "start-supernode.sh").read_text()
        assert f"--node-config {here / 'node-config.toml'}" in script
        assert "--isolation process" in script
        assert f"agent --config {here / 'agent.toml'}" in script
    supernodes = [deployment / "regions" / r / "start-supernode.sh" for r in REGIONS]
    ports = [port for s in supernodes for port in re.findall(r"--port (\d+)", s.read_text())]
    assert ports == ["19093", "19094", "19095"]  # one each, from --port + 1


#: Run-config keys a deployment sets for itself: where things are, who takes part. None
#: of them changes what a region trains or spends.
PLACES = {
    "regions",
    "aggregator-jurisdiction",
    "keys-dir",
    "policies-dir",
    "output-dir",
    "audit-dir",
    "data-root",
}


def test_start_sh_trains_what_simulate_trains_for_the_same_setup(deployment):
    """simulate and start.sh give the same numbers for the same setup: the deployment's run
    config overrides only places and parties, and each agent's own settings (its budget,
    its training processes) are what the app's run config gives a simulated region."""
    with open(deployment / "aggregator" / "run-config.toml", "rb") as handle:
        overrides = tomllib.load(handle)
    assert set(overrides) <= PLACES, sorted(set(overrides) - PLACES)
    run = RunConfig.from_user_config(app_config(), source="test")
    for region in REGIONS:
        agent = AgentConfig.load(deployment / "regions" / region / "agent.toml")
        assert agent.epsilon_budget == run.privacy.epsilon_budget
        assert agent.processes(run) == run.cluster.train_processes


def test_flower_connection_and_scripts(deployment):
    agg = deployment / "aggregator"
    with open(agg / "flwr-home" / "config.toml", "rb") as handle:
        connection = tomllib.load(handle)["superlink"]
    assert connection["default"] == "fedciuic"
    assert connection["fedciuic"]["address"] == "127.0.0.1:19092"
    assert connection["fedciuic"]["insecure"] is False
    assert Path(connection["fedciuic"]["root-certificates"]) == agg / "certs" / "ca.pem"
    written = [
        deployment / "start.sh",
        deployment / "stop.sh",
        agg / "start-superlink.sh",
        agg / "register-supernodes.sh",
        agg / "run.sh",
        *(deployment / "regions" / r / "start-supernode.sh" for r in REGIONS),
    ]
    bin_dir = str(Path(sys.executable).parent)
    for script in written:
        assert _mode(script) & 0o111 == 0o111, script
        text = script.read_text()
        assert text.startswith("#!/usr/bin/env bash\n") and "set -euo pipefail" in text
        assert "FLWR_TELEMETRY_ENABLED=0" in text and "FLWR_HOME=" in text
        assert f"BIN={bin_dir}" in text
        checked = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert checked.returncode == 0, (script, checked.stderr)
    superlink = (agg / "start-superlink.sh").read_text()
    assert "--enable-supernode-auth" in superlink and "--insecure" not in superlink
    start = (deployment / "start.sh").read_text()
    assert "trap stop_all EXIT" in start and "register-supernodes.sh" in start
    readme = (deployment / "README.md").read_text()
    assert "bash " + str(deployment / "start.sh") in readme and "*.pub.json" in readme


def test_next_steps_are_printed(tmp_path, capsys):
    assert _init(tmp_path, "--regions", "eu") == 0
    out = capsys.readouterr().out
    assert f"bash {tmp_path / 'dep' / 'start.sh'}" in out
    assert f"bash {tmp_path / 'dep' / 'regions' / 'eu' / 'start-supernode.sh'}" in out
    assert "region's data" in out  # no --demo-data: data/ is the user's to fill
    # What a run spends, as the app and the agent default it, and where to see the rest.
    target, budget = app_config()["target-epsilon"], AgentConfig.model_fields["epsilon_budget"]
    assert f"target-epsilon ({target:g} by default)" in out
    assert f"{budget.default:g} by default" in out
    assert f"fedciuic budget {tmp_path / 'dep' / 'regions'}/*/agent.toml" in out


def test_insecure_with_demo_data(tmp_path, capsys):
    assert _init(tmp_path, "--regions", "eu,cn", "--insecure", "--demo-data") == 0
    dep = tmp_path / "dep"
    agg = dep / "aggregator"
    assert not (agg / "certs").exists() and not (agg / "register-supernodes.sh").exists()
    assert not any(dep.rglob("*.auth.*"))
    assert "--insecure" in (agg / "start-superlink.sh").read_text()
    assert "--insecure" in (dep / "regions" / "cn" / "start-supernode.sh").read_text()
    assert "register" not in (dep / "start.sh").read_text()
    with open(agg / "flwr-home" / "config.toml", "rb") as handle:
        assert tomllib.load(handle)["superlink"]["fedciuic"]["insecure"] is True
    # Demo data is data; the folder's README is not.
    data = [s.name for s in discover(dep / "regions" / "eu" / "data")]
    assert data == sorted((CHAT_FILE, DOCS_FILE, INSTRUCTIONS_FILE))
    for script in dep.rglob("*.sh"):
        assert subprocess.run(["bash", "-n", str(script)]).returncode == 0


def test_a_region_named_for_its_jurisdiction_and_the_aggregators_in_any_case(tmp_path, capsys):
    assert _init(tmp_path, "--regions", "eu, paris=eu", "--aggregator-jurisdiction", "eu") == 0
    dep = tmp_path / "dep"
    paris = dep / "regions" / "paris"
    assert load_keypair(paris / "keys" / "paris.key.json").bundle.jurisdiction == "EU"
    assert load_policy(paris / "eu-gdpr.yaml").policy.jurisdiction == "EU"
    text = (dep / "aggregator" / "run-config.toml").read_text()
    assert 'regions = "eu,paris"' in text and 'aggregator-jurisdiction = "EU"' in text
    with pytest.raises(DataError, match="holds no"):
        discover(paris / "data")  # its README is not data


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--regions", "eu,xx"], "--regions:xx: no policy for jurisdiction XX in "),
        (["--regions", "eu,paris=ZZ"], "--regions:paris: no policy for jurisdiction ZZ"),
        (["--regions", "eu,sg", "--policies", str(ROOT / "tests")], "--regions:eu: no policy"),
        (["--regions", "eu,cn,eu"], "--regions:eu: listed twice; list each region once"),
        (["--regions", "EU"], "--regions:EU: not a region name"),
        (["--regions", ","], "--regions: empty"),
        (["--regions", "aggregator"], "--regions:aggregator: the aggregator's name"),
        (
            ["--aggregator-jurisdiction", "ZZ"],
            "--aggregator-jurisdiction: ZZ is not a jurisdiction",
        ),
        (["--aggregator-jurisdiction", "US"], "region cn's policy (cn-pipl.yaml) lets its"),
        (["--app", "."], "--app:"),
        (
            ["--policies", "/nonexistent/policies"],
            "--policies:/nonexistent/policies: no such folder",
        ),
        (
            ["--regions", "eu,paris=EU", "--demo-data"],
            "--demo-data: no demo corpus for region paris",
        ),
        (["--supernode-port-base", "19091"], "gives a SuperNode the SuperLink's --port 19092"),
        (["--port", "0"], "--port: 0 is not a usable TCP port"),
        (["--host", "two words"], "--host: 'two words' is not a name or address"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_nothing_written(
    tmp_path, capsys, monkeypatch, args, message
):
    monkeypatch.chdir(tmp_path)  # --app . is then not an app folder
    assert _init(tmp_path, *args) == 2
    err = capsys.readouterr().err
    assert err.startswith("fedciuic: error: ") and err.count("\n") == 1, err
    assert message in err, err
    assert "Traceback" not in err
    assert not (tmp_path / "dep").exists()


def test_a_used_folder_is_refused_and_left_as_it_was(tmp_path, capsys):
    assert _init(tmp_path, "--regions", "eu") == 0
    before = {p: p.read_bytes() for p in (tmp_path / "dep").rglob("*") if p.is_file()}
    capsys.readouterr()
    assert _init(tmp_path, "--regions", "eu") == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'dep'}: exists and is not empty; choose another DIR or remove it" in err
    assert {p: p.read_bytes() for p in (tmp_path / "dep").rglob("*") if p.is_file()} == before
    (tmp_path / "file").write_text("x")
    assert _init(tmp_path, directory=tmp_path / "file") == 2
    assert "exists and is not a folder" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert _init(tmp_path, "--regions", "eu", directory=tmp_path / "empty") == 0


def test_a_failure_while_writing_leaves_nothing(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("fedciuic.ops.layout.generate_server_tls", broken)
    with pytest.raises(OSError, match="disk full"):
        deploy.init_deployment(tmp_path / "dep", "eu", app_dir=ROOT, relay_user="")
    assert not (tmp_path / "dep").exists()


def test_templates_render_only_with_exactly_their_placeholders(monkeypatch, tmp_path):
    from fedciuic.ops import render

    assert render.render("stop.sh", preamble="P", pids="/x") == (
        "#!/usr/bin/env bash\n"
        "# Stop every process start.sh started (pids/*.pid) and everything they started.\n"
        'P\n"$BIN/python" -m fedciuic.ops.scripts stop /x\n'
    )
    with pytest.raises(KeyError, match="no value for: pids"):
        render.render("stop.sh", preamble="P")
    with pytest.raises(KeyError, match="no placeholder for: other"):
        render.render("stop.sh", preamble="P", pids="/x", other="y")
    # Notes (@@#) are not rendered; a stray @@ is an error, never rendered as is.
    (tmp_path / "templates").mkdir()
    (tmp_path / "templates" / "t").write_text("@@# note\na @@{b} $c ${d} @@@@\n")
    (tmp_path / "templates" / "bad").write_text("a @@ b\n")
    monkeypatch.setattr("importlib.resources.files", lambda package: tmp_path)
    render._load.cache_clear()
    try:
        assert render.render("t", b="B") == "a B $c ${d} @@\n"
        with pytest.raises(ValueError, match="template bad"):
            render.render("bad")
    finally:
        render._load.cache_clear()


def test_every_template_is_used_and_the_apps_import_none(tmp_path):
    templates = ROOT / "fedciuic" / "ops" / "templates"
    source = (ROOT / "fedciuic" / "ops" / "layout.py").read_text()
    for template in templates.iterdir():
        assert f'"{template.name}"' in source, template.name
    # The FAB carries no templates (Flower admits no *.sh): the apps must not need them.
    code = "import sys, server.app, clients.app; print(sorted(sys.modules))"
    loaded = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert "fedciuic.ops.render" not in loaded and "fedciuic.ops.layout" not in loaded


def test_help_explains_every_option_and_ends_with_an_example(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["init", "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    for option in (
        "--regions",
        "--aggregator-jurisdiction",
        "--app",
        "--policies",
        "--host",
        "--port",
        "--supernode-port-base",
        "--insecure",
        "--demo-data",
    ):
        assert option in out
    assert out.rstrip().splitlines()[-2:][0] == "example:"
    assert "fedciuic init" in out.rstrip().splitlines()[-1]


def test_check_run_reads_the_outcome_of_the_run_flwr_started(tmp_path, capsys):
    config = tmp_path / "run-config.toml"
    config.write_text(f'output-dir = "{tmp_path / "runs"}"\n')
    log = tmp_path / "log"
    log.write_text("nothing started\n")
    assert scripts.check_run_log(log, config) == 1
    log.write_text("Successfully started run 42\n")
    assert scripts.check_run_log(log, config) == 1  # no metrics.json
    metrics = tmp_path / "runs" / "run-42" / "metrics.json"
    metrics.parent.mkdir(parents=True)
    metrics.write_text(json.dumps({"run": {"run_id": 42, "status": "failed"}}))
    assert scripts.check_run_log(log, config) == 1
    metrics.write_text(json.dumps({"run": {"run_id": 42, "status": "completed"}}))
    assert scripts.check_run_log(log, config) == 0


def test_the_scripts_python_steps_import_neither_flower_torch_nor_the_config():
    """Each step is a process of its own, several a script: its imports are its start."""
    heavy = {"flwr", "torch", "numpy", "pydantic", "transformers", "peft", "cryptography"}
    probe = (
        "import sys, fedciuic.ops.scripts; "
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({sorted(heavy)!r})))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr


def test_stop_ends_each_process_tree_named_in_pids_and_spares_reused_pids(tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    tree = subprocess.Popen(["bash", "-c", "sleep 60 & sleep 60 & wait"], start_new_session=True)
    (pids / "tree.pid").write_text(f"{tree.pid}\n")
    time.sleep(0.3)
    children = psutil.Process(tree.pid).children(recursive=True)
    assert len(children) == 2
    # A PID file written before its process started names a PID that was reused.
    other = subprocess.Popen(["sleep", "60"])
    stale = pids / "stale.pid"
    stale.write_text(f"{other.pid}\n")
    old = time.time() - 60
    os.utime(stale, (old, old))
    try:
        assert [p.pid for p in scripts.tracked(pids)] == [tree.pid]  # not the reused PID
        assert scripts.stop_processes(pids, grace=5) == [tree.pid]
        tree.wait(timeout=5)
        assert not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children)
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()


def test_start_sh_refuses_before_starting_anything(tmp_path, capsys):
    """Regions without data, or an earlier start.sh still running: nothing is started."""
    assert _init(tmp_path, "--regions", "eu,cn", "--insecure") == 0
    dep = tmp_path / "dep"
    done = subprocess.run(["bash", str(dep / "start.sh")], capture_output=True, text=True)
    assert done.returncode == 1
    assert f"eu: {dep / 'regions' / 'eu' / 'data'} holds no data files" in done.stderr
    assert not list((dep / "pids").glob("*.pid"))

    for region in ("eu", "cn"):
        (dep / "regions" / region / "data" / "notes.txt").write_text("some text")
    earlier = subprocess.Popen(["sleep", "60"])
    (dep / "pids" / "superlink.pid").write_text(f"{earlier.pid}\n")
    try:
        done = subprocess.run(["bash", str(dep / "start.sh")], capture_output=True, text=True)
        assert done.returncode == 1
        assert "an earlier start.sh is still running" in done.stderr
        assert earlier.poll() is None  # refusing stops nothing
        assert [p.pid for p in scripts.tracked(dep / "pids")] == [earlier.pid]
    finally:
        earlier.kill()
        earlier.wait()


# -- the relay's own OS user ------------------------------------------------------------


def test_a_relay_user_that_is_root_or_yourself_is_refused(tmp_path, capsys):
    me = pwd.getpwuid(os.geteuid()).pw_name
    for user in {"root", me}:
        assert _init(tmp_path, "--regions", "eu", "--relay-user", user) == 2
        assert f"--relay-user: {user} is root or yourself" in capsys.readouterr().err
    assert not (tmp_path / "dep").exists()


def test_a_relay_user_that_cannot_run_this_python_is_refused_naming_the_folder(
    tmp_path, capsys, monkeypatch
):
    closed = tmp_path / "closed"
    (closed / "venv" / "bin").mkdir(parents=True)
    closed.chmod(0o700)
    python = closed / "venv" / "bin" / "python"
    python.touch(mode=0o755)
    monkeypatch.setattr(separation, "interpreter_paths", lambda: [python])
    # nobody exists everywhere; a user of its own is what matters, not which.
    assert _init(tmp_path, "--regions", "eu", "--relay-user", "nobody") == 2
    err = capsys.readouterr().err
    first = separation.closed_to_others([python])  # the first closed folder on the way
    assert first is not None and first in (closed, *closed.parents)
    assert f"{first} is closed to other users" in err and f"chmod o+x {first}" in err
    assert '--relay-user ""' in err  # and the way to run without the separation


@pytest.fixture
def passable(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A folder other users may pass through (not list), as a deployment with a relay
    user of its own needs (pytest's own tmp_path is closed to them); and a Python they
    may run."""
    monkeypatch.setattr(separation, "interpreter_paths", lambda: [Path("/")])
    folder = Path(tempfile.mkdtemp(prefix="fedciuic-init-", dir="/tmp"))
    folder.chmod(0o711)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_with_a_relay_user_the_agent_config_names_it_and_the_script_drops_to_it(passable):
    dep = passable / "dep"
    assert _init(dep, "--regions", "eu", "--relay-user", "nobody", "--insecure", directory=dep) == 0
    here = dep / "regions" / "eu"
    assert AgentConfig.load(here / "agent.toml").relay_user == "nobody"
    script = (here / "start-supernode.sh").read_text()
    socket = here / "agent" / "agent.sock"
    assert f"fedciuic.ops.scripts relay-setup nobody {here / 'relay'} {socket}" in script
    assert f"fedciuic.ops.scripts relay nobody {here / 'relay'} $$ --" in script
    # The relay, started anew for every message, is the only one that runs as nobody.
    assert script.index("relay-setup") < script.index("agent --config")
    # The SuperNode dies with the script, as the relay does.
    assert 'fedciuic.ops.scripts tied $$ -- "$BIN/flower-supernode"' in script


def test_init_where_the_relay_user_cannot_pass_is_refused_naming_the_folder(passable, capsys):
    """Every folder above the regions' relay homes and agent sockets must let the relay's
    user pass: one that does not is named, with the fix, and nothing is written."""
    closed = passable / "closed"
    closed.mkdir(mode=0o700)
    closed.chmod(0o700)
    dep = closed / "a" / "dep"
    assert _init(dep, "--regions", "eu,cn", "--relay-user", "nobody", directory=dep) == 2
    err = capsys.readouterr().err
    assert err.startswith("fedciuic: error: ") and err.count("\n") == 1, err
    assert f"--relay-user nobody: cannot reach its home {dep / 'regions' / 'eu' / 'relay'}" in err
    assert f"{closed} is closed to other users; chmod o+x {closed}" in err
    assert not (closed / "a").exists()
    # An empty DIR of its own that others cannot pass is named itself.
    closed.chmod(0o711)
    (closed / "a").mkdir(mode=0o700)
    (closed / "a").chmod(0o700)
    assert _init(dep, "--regions", "eu", "--relay-user", "nobody", directory=closed / "a") == 2
    assert f"{closed / 'a'} is closed to other users" in capsys.readouterr().err
    # Without a relay user of its own (the relay runs as the region), any folder will do.
    assert _init(dep, "--regions", "eu", directory=closed / "a") == 0


def test_the_folders_init_makes_let_the_relay_pass_whatever_the_umask(passable):
    dep = passable / "made" / "by" / "init"
    old = os.umask(0o077)
    try:
        assert _init(dep, "--regions", "eu", "--relay-user", "nobody", directory=dep) == 0
    finally:
        os.umask(old)
    for folder in (passable / "made", passable / "made" / "by", dep, dep / "regions"):
        assert _mode(folder) == 0o755, folder
    here = dep / "regions" / "eu"
    for folder in separation.relay_folders(here / "relay", here / "agent" / "agent.sock").values():
        assert separation.first_closed(folder) is None, folder
    for private in ("data", "state", "keys", "peers"):
        assert _mode(here / private) == 0o700, private


def test_relay_setup_refuses_a_home_or_socket_the_relay_cannot_reach_before_making_anything(
    passable,
):
    """At each start too (a folder closed since init): one line naming it and the fix,
    before the user, its home or the agent is made."""
    region = passable / "regions" / "eu"
    region.mkdir(parents=True)
    (passable / "regions").chmod(0o700)
    home, socket = region / "relay", region / "agent" / "agent.sock"
    with pytest.raises(separation.SeparationError) as refused:
        scripts.relay_setup("fedciuic-no-such-user", home, socket)
    message = str(refused.value)
    assert message == (
        f"relay-user fedciuic-no-such-user: cannot reach its home {home}: "
        f"{passable / 'regions'} is closed to other users; chmod o+x {passable / 'regions'} "
        "(let others pass through it), or keep the deployment in a folder others may pass "
        "through"
    )
    assert not home.exists()
    (passable / "regions").chmod(0o755)
    region.chmod(0o700)  # the agent's socket is in the region's folder too
    with pytest.raises(separation.SeparationError, match=f"cannot reach its home {home}: {region}"):
        scripts.relay_setup("fedciuic-no-such-user", home, socket)
    problem = separation.reach_problem("x", {"the agent's socket": socket.parent.parent})
    assert problem is not None and f"{region} is closed" in problem


def test_the_default_relay_user_is_its_own_only_for_root(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert separation.default_relay_user() == separation.RELAY_USER
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert separation.default_relay_user() == ""
