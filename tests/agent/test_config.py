"""The agent's own config file: read strictly, every problem named at once, paths
relative to the file, and a lifetime budget that no run config can raise."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from fedciuic.agent.config import DEFAULT_EPSILON_BUDGET, AgentConfig
from fedciuic.config import RunConfig
from fedciuic.crypto.parties import generate_federation_keys
from fedciuic.errors import ConfigError
from tests.conftest import unit_config

GOOD = """\
# A region's agent
region = "eu"
data-path = "data"
state-path = "state"
key-file = "keys/eu.key.json"
aggregator-bundle = "keys/aggregator.pub.json"
policy = "eu-gdpr.yaml"
socket = "agent/agent.sock"
"""


def write(tmp_path: Path, text: str | bytes, name: str = "agent.toml") -> Path:
    folder = tmp_path / "region"
    folder.mkdir(exist_ok=True)
    path = folder / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def problems(path: Path) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        AgentConfig.load(path)
    return caught.value.problems


def run_config(**overrides: object) -> RunConfig:
    return RunConfig.from_user_config({**unit_config(), **overrides}, source="run config")


def test_a_good_file_reads_with_paths_relative_to_its_own_folder(tmp_path, monkeypatch):
    write(tmp_path, GOOD + 'relay-user = "fedciuic-relay"\nmax-request-bytes = 65536\n')
    monkeypatch.chdir(tmp_path)  # not the file's folder: paths must not follow the cwd
    config = AgentConfig.load(Path("region") / "agent.toml")
    here = (tmp_path / "region").resolve()
    assert config.region == "eu"
    assert Path(config.data_path) == here / "data"
    assert config.state_dir == here / "state"
    assert Path(config.key_file) == here / "keys" / "eu.key.json"
    assert Path(config.aggregator_bundle) == here / "keys" / "aggregator.pub.json"
    assert Path(config.policy) == here / "eu-gdpr.yaml"
    assert Path(config.socket) == here / "agent" / "agent.sock"
    assert config.relay_user == "fedciuic-relay" and config.max_request_bytes == 65536
    assert config.train_processes == 1 and config.epsilon_budget == DEFAULT_EPSILON_BUDGET


def test_absolute_paths_stay_as_written(tmp_path):
    text = GOOD.replace('"data"', f'"{tmp_path / "elsewhere"}"')
    config = AgentConfig.load(write(tmp_path, text))
    assert Path(config.data_path) == tmp_path / "elsewhere"


def test_a_missing_file_is_named_with_the_fix(tmp_path):
    missing = tmp_path / "nowhere" / "agent.toml"
    (problem,) = problems(missing)
    assert problem.startswith(f"{missing}: cannot read the agent config (No such file")
    assert "fedciuic init" in problem


def test_a_file_that_is_not_utf8_is_named(tmp_path):
    path = write(tmp_path, GOOD.encode() + b'relay-user = "\xff\xfe"\n')
    (problem,) = problems(path)
    assert problem.startswith(f"{path}: cannot read the agent config (not UTF-8 text)")


def test_a_toml_syntax_error_names_the_file_and_the_line(tmp_path):
    path = write(tmp_path, GOOD + "policy = = broken\n")
    (problem,) = problems(path)
    assert problem.startswith(f"{path}: not TOML")
    assert "line 9" in problem and "fix that line" in problem


def test_an_unknown_key_is_named(tmp_path):
    path = write(tmp_path, GOOD + "epsilon-budgett = 100.0\n")
    assert problems(path) == [f"{path}:epsilon-budgett: Extra inputs are not permitted (got 100.0)"]


def test_every_missing_required_key_is_named_at_once(tmp_path):
    required = ("key-file", "aggregator-bundle", "policy", "socket")
    text = "".join(line + "\n" for line in GOOD.splitlines() if line.split(" =")[0] not in required)
    path = write(tmp_path, text)
    assert problems(path) == [f"{path}:{key}: Field required" for key in required]


@pytest.mark.parametrize("value", ['""', "1.0", "[]"])
def test_an_empty_or_mistyped_required_key_is_refused(tmp_path, value):
    path = write(tmp_path, GOOD.replace('policy = "eu-gdpr.yaml"', f"policy = {value}"))
    (problem,) = problems(path)
    assert problem.startswith(f"{path}:policy: ")


@pytest.mark.parametrize("region", ["EU", "eu region", "", "../eu", "eu/x"])
def test_a_bad_region_name_is_refused(tmp_path, region):
    path = write(tmp_path, GOOD.replace('region = "eu"', f'region = "{region}"'))
    (problem,) = problems(path)
    assert problem.startswith(f"{path}:region: String should match pattern")


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ("epsilon-budget = 0", "epsilon-budget"),
        ("epsilon-budget = -1.0", "epsilon-budget"),
        ("train-processes = 0", "train-processes"),
        ("max-request-bytes = 1024", "max-request-bytes"),
    ],
)
def test_out_of_range_settings_are_refused(tmp_path, line, field):
    path = write(tmp_path, GOOD + line + "\n")
    (problem,) = problems(path)
    assert problem.startswith(f"{path}:{field}: ")


def test_node_for_refuses_a_run_that_does_not_list_the_region(tmp_path):
    config = AgentConfig.load(write(tmp_path, GOOD))
    with pytest.raises(ConfigError) as caught:
        config.node_for(run_config(regions="cn,us"))
    (problem,) = caught.value.problems
    assert problem.startswith("agent config:region: 'eu' is not a region of this run (cn, us)")


def test_the_lifetime_budget_is_the_agents_whatever_the_run_config_says(tmp_path):
    config = AgentConfig.load(write(tmp_path, GOOD))
    for budget in (1.0, 8.0, 1000.0):
        node = config.node_for(run_config(**{"epsilon-budget": budget}))
        assert node.epsilon_budget == DEFAULT_EPSILON_BUDGET == 8.0
    own = AgentConfig.load(write(tmp_path, GOOD + "epsilon-budget = 2.5\n"))
    assert own.node_for(run_config(**{"epsilon-budget": 1000.0})).epsilon_budget == 2.5


def test_the_node_a_round_sees_is_the_agents_own(tmp_path):
    config = AgentConfig.load(write(tmp_path, GOOD + "train-processes = 3\n"))
    node = config.node_for(run_config(**{"train-processes": 7, "data-root": "/elsewhere"}))
    assert node.region == "eu" and node.data_path == config.data_path
    assert node.state_dir == config.state_dir and node.key_file == config.key_file
    assert node.policy == config.policy and node.train_processes == 3


# -- peer-bundles: whom the region trusts in a secure sum -------------------------------


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    """eu's keys folder (its key, the aggregator's bundle) as GOOD names it, and, apart,
    the bundles of every party of a federation of eu, cn and us."""
    every = generate_federation_keys(tmp_path / "every", ("eu", "cn", "us"))
    own = tmp_path / "region" / "keys"
    own.mkdir(parents=True)
    for name in ("aggregator.pub.json", "eu.pub.json", "eu.key.json"):
        shutil.copy2(every / name, own / name)
    return every


def peers(tmp_path: Path, keys: Path, *names: str, as_: dict[str, str] | None = None) -> Path:
    """An agent config whose peer-bundles folder holds the bundles ``names`` (each under
    its own name unless ``as_`` gives another)."""
    folder = tmp_path / "region" / "peers"
    folder.mkdir(exist_ok=True)
    for name in names:
        shutil.copyfile(
            keys / f"{name}.pub.json", folder / (as_ or {}).get(name, f"{name}.pub.json")
        )
    return write(tmp_path, GOOD + 'peer-bundles = "peers"\n')


def test_enrolled_peers_and_no_peers_are_fine(tmp_path, keys):
    path = peers(tmp_path, keys, "cn", "us")
    assert Path(AgentConfig.load(path).peer_bundles) == (tmp_path / "region" / "peers").resolve()
    assert AgentConfig.load(peers(tmp_path, keys)).peer_bundles  # cn and us: unchanged
    empty = tmp_path / "region" / "peers"
    for bundle in empty.iterdir():
        bundle.unlink()
    AgentConfig.load(path)  # an empty folder: no peers (the region declines secure sums)
    AgentConfig.load(write(tmp_path, GOOD + 'peer-bundles = ""\n'))  # no folder: the same


def test_a_missing_peer_folder_is_named_with_the_fix(tmp_path):
    path = write(tmp_path, GOOD + 'peer-bundles = "peers"\n')
    (problem,) = problems(path)
    assert problem.startswith(
        f"{path}:peer-bundles: {(tmp_path / 'region' / 'peers').resolve()} is not a folder; "
    )
    assert 'peer-bundles = ""' in problem


@pytest.mark.parametrize(
    ("names", "renamed", "says"),
    [
        (("cn", "eu"), {}, "eu.pub.json is this region's own bundle; only its peers' belong"),
        (("cn", "aggregator"), {}, "aggregator.pub.json is the aggregator's bundle"),
        (
            ("cn", "us"),
            {"us": "zz.pub.json"},
            "zz.pub.json holds 'us''s bundle; name it us.pub.json",
        ),
    ],
)
def test_a_peer_folder_with_the_regions_own_the_aggregators_or_a_misnamed_bundle_is_refused(
    tmp_path, keys, names, renamed, says
):
    path = peers(tmp_path, keys, *names, as_=renamed)
    (problem,) = problems(path)
    assert problem.startswith(f"{path}:peer-bundles: {(tmp_path / 'region' / 'peers').resolve()}/")
    assert says in problem, problem


def test_a_peer_bundle_that_does_not_load_is_named(tmp_path, keys):
    path = peers(tmp_path, keys, "cn")
    bundle = tmp_path / "region" / "peers" / "cn.pub.json"
    bundle.write_text(bundle.read_text().replace('"key_id": "', '"key_id": "00'), encoding="utf-8")
    (problem,) = problems(path)
    assert problem.startswith(f"{path}:peer-bundles: {bundle.resolve()}")


def test_the_aggregators_keys_under_a_peers_name_are_refused_by_their_key(tmp_path, keys):
    """The party in a bundle is not covered by its key id: the aggregator's keys relabelled
    as a peer's are still the aggregator's."""
    path = peers(tmp_path, keys)
    forged = tmp_path / "region" / "peers" / "us.pub.json"
    text = (keys / "aggregator.pub.json").read_text()
    forged.write_text(text.replace('"party": "aggregator"', '"party": "us"'), encoding="utf-8")
    (problem,) = problems(path)
    assert f"{forged.resolve()} is the aggregator's bundle" in problem


def test_a_base_sharded_over_one_process_is_refused_with_the_fix(tmp_path):
    (problem,) = problems(write(tmp_path, GOOD + 'train-sharding = "shard"\n'))
    assert problem.startswith(f"{tmp_path / 'region' / 'agent.toml'}:train-sharding:")
    assert "train-processes is 1" in problem and 'train-sharding = "replicate"' in problem
    config = AgentConfig.load(
        write(tmp_path, GOOD + 'train-sharding = "shard"\ntrain-processes = 2\n')
    )
    assert config.train_sharding == "shard"
    (problem,) = problems(write(tmp_path, GOOD + 'train-sharding = "half"\n'))
    assert "train-sharding" in problem and "replicate" in problem
