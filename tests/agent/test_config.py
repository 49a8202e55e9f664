"""The agent's own config file: read strictly, every problem named at once, paths
relative to the file, and a lifetime budget that no run config can raise."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedciuic.agent.config import DEFAULT_EPSILON_BUDGET, AgentConfig
from fedciuic.config import RunConfig
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
    assert config.socket_path == here / "agent" / "agent.sock"
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
