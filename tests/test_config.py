from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedciuic.config import RUN_KEYS, NodeConfig, RunConfig
from fedciuic.errors import ConfigError
from tests.conftest import app_config, unit_config


def test_app_defaults_are_a_valid_run_config():
    run = RunConfig.from_user_config(app_config(), source="pyproject.toml")
    assert run.regions == ("eu", "cn", "us")


def test_all_problems_are_reported_at_once_with_source_and_field():
    values = {**unit_config(), "num-server-rounds": 0, "learning-rate": -1, "regions": "EU,cn"}
    with pytest.raises(ConfigError) as info:
        RunConfig.from_user_config(values, source="run config")
    text = str(info.value)
    assert len(info.value.problems) == 3
    for field in ("run config:num-server-rounds", "run config:learning-rate", "run config:regions"):
        assert field in text


def test_unknown_run_config_key_is_an_error_naming_the_nearest_known_one():
    with pytest.raises(ConfigError) as info:
        RunConfig.from_user_config(
            {**unit_config(), "lerning-rate": 0.1, "seq_length": 64}, source="run config"
        )
    assert info.value.problems == [
        "run config:lerning-rate: unknown key; did you mean learning-rate?",
        "run config:seq_length: unknown key; did you mean seq-len?",
    ]


def test_an_unknown_run_config_key_like_no_other_says_where_the_keys_are():
    with pytest.raises(ConfigError) as info:
        RunConfig.from_user_config({**unit_config(), "zzz": 1}, source="run config")
    assert info.value.problems == [
        "run config:zzz: unknown key; remove it (the run config's keys are those of "
        "pyproject.toml's [tool.flwr.app.config])"
    ]


def test_duplicate_regions_are_refused():
    with pytest.raises(ConfigError, match="listed twice"):
        RunConfig.from_user_config({**unit_config(), "regions": "eu,eu"}, source="run config")


def test_deployment_node_config_names_region_and_data_path(run_config):
    node = NodeConfig.resolve({"region": "cn", "data-path": "/data/cn"}, run_config)
    assert (node.region, node.data_path) == ("cn", "/data/cn")


def test_region_unknown_to_the_run_is_refused_with_the_known_ones(run_config):
    with pytest.raises(ConfigError, match=r"node config:region: 'sg' is not a region.*eu, cn, us"):
        NodeConfig.resolve({"region": "sg", "data-path": "/data/sg"}, run_config)


def test_missing_data_path_in_node_config_is_named(run_config):
    with pytest.raises(ConfigError, match="node config:data-path: Field required"):
        NodeConfig.resolve({"region": "eu"}, run_config)


def test_simulation_partition_maps_to_region_and_its_folder(run_config):
    node = NodeConfig.resolve({"partition-id": 1, "num-partitions": 3}, run_config)
    assert node.region == "cn"
    assert node.data_path.endswith("/cn")


def test_partition_without_region_is_refused(run_config):
    with pytest.raises(ConfigError, match="partition-id: 3 has no region"):
        NodeConfig.resolve({"partition-id": 3, "num-partitions": 4}, run_config)


def test_node_config_with_nothing_says_how_to_start_a_supernode(run_config):
    with pytest.raises(ConfigError, match="--node-config"):
        NodeConfig.resolve({}, run_config)


@pytest.mark.parametrize(
    ("key", "value", "allowed"),
    [
        ("server-optimizer", "fedsgd", "'none', 'fedavgm', 'fedadam' or 'fedyogi'"),
        ("aggregation-mode", "async", "'sync' or 'buffered'"),
        ("local-time-budget", -1.0, "greater than or equal to 0"),
        ("keep-checkpoints", 0, "greater than or equal to 1"),
        ("max-missed-rounds", -2, "greater than or equal to 0"),
        ("proximal-mu", -0.1, "greater than or equal to 0"),
    ],
)
def test_bad_heterogeneity_settings_name_the_key_and_allowed_values(key, value, allowed):
    with pytest.raises(ConfigError) as info:
        RunConfig.from_user_config({**unit_config(), key: value}, source="run config")
    assert info.value.problems == [
        p for p in info.value.problems if p.startswith(f"run config:{key}:")
    ]
    assert len(info.value.problems) == 1
    assert allowed in str(info.value)


def test_a_buffer_larger_than_the_federation_is_refused_with_the_range():
    values = {**unit_config(), "aggregation-mode": "buffered", "buffer-size": 4}
    with pytest.raises(ConfigError, match=r"run config:buffer-size: .*3 regions.*use 1 to 3"):
        RunConfig.from_user_config(values, source="run config")
    ok = RunConfig.from_user_config({**values, "buffer-size": 3}, source="run config")
    assert ok.schedule.buffer_size == 3


def test_slowdown_names_known_regions_and_factors():
    run = RunConfig.from_user_config(
        {**unit_config(), "test-region-slowdown": "us=4"}, source="run config"
    )
    assert (run.training.slowdown("us"), run.training.slowdown("eu")) == (4.0, 1.0)
    for bad, says in (("sg=2", "not regions"), ("us=0.5", "1 to 1000"), ("us", "REGION=FLOAT")):
        with pytest.raises(ConfigError, match=f"run config:test-region-slowdown: .*{says}"):
            RunConfig.from_user_config(
                {**unit_config(), "test-region-slowdown": bad}, source="run config"
            )


#: Run configs and the form the aggregator signed them in before the sections were
#: nested (commit bcd5580): what is signed must not change.
SIGNED = json.loads((Path(__file__).parent / "golden" / "signed_run_configs.json").read_text())


#: Keys added since, at their defaults: everything else is signed exactly as it was.
ADDED_SINCE = {
    "count-noise": 10.0,
    "eval-noise": 10.0,
    "eval-loss-clip": 10.0,
    "max-physical-batch-size": 2,
    "train-sharding": "replicate",
}


@pytest.mark.parametrize("name", sorted(SIGNED))
def test_the_signed_form_is_the_flat_one_signed_before_the_sections(name):
    case = SIGNED[name]
    run = RunConfig.from_user_config(case["input"], source="test")
    signed = json.loads(run.canonical_json())
    assert {key: signed.pop(key) for key in ADDED_SINCE} == ADDED_SINCE
    assert json.dumps(signed, sort_keys=True, separators=(",", ":")) == case["signed"]
    assert RunConfig.from_user_config(json.loads(case["signed"]), source="test") == run


def test_each_key_is_read_once_under_its_own_name_in_its_section(run_config):
    """Every flat key lands in one section under its own name, and a changed key is seen
    there (validated again), never in a stale copy."""
    run = run_config
    fields = sum(
        len(type(getattr(run, name)).model_fields)
        for name in RunConfig.model_fields
        if name != "regions"
    )
    flat = run.flat()
    assert fields + 1 == len(RUN_KEYS) == len(flat)
    for key, (section, name) in RUN_KEYS.items():
        holder = getattr(run, section) if section else run
        assert flat[key] == holder.model_dump(mode="json")[name], key
    changed_keys = []
    for key, (section, name) in RUN_KEYS.items():
        value = getattr(getattr(run, section), name) if section else None
        if isinstance(value, bool):
            changed: object = not value
        elif isinstance(value, int) and value:
            changed = value + 1
        else:
            continue
        try:
            copied = run.updated(**{key: changed})
        except ValueError:
            continue  # a neighbouring check refuses it (secure-threshold above regions, ...)
        assert getattr(getattr(copied, section), name) == changed, key
        changed_keys.append(key)
    assert len(changed_keys) >= 25, changed_keys  # the bool and non-zero int keys no check refuses


def test_a_run_config_is_changed_through_its_keys_never_copied_with_an_update(run_config):
    with pytest.raises(TypeError, match="updated"):
        run_config.model_copy(update={"dp": False})
    assert run_config.updated(dp=False).privacy.dp is False
    assert run_config.updated(**{"target-epsilon": 2.0}).privacy.target_epsilon == 2.0


def test_the_adapter_mode_is_signed_with_the_run_config_and_reaches_the_model(run_config):
    sb = run_config.updated(**{"adapter_mode": "lora-sb"})
    assert json.loads(sb.canonical_json())["adapter-mode"] == "lora-sb"
    assert sb.canonical_json() != run_config.canonical_json()  # the hash tells them apart
    assert RunConfig.from_user_config(json.loads(sb.canonical_json()), source="x") == sb
    assert sb.model.adapter_mode == "lora-sb" and run_config.model.adapter_mode == "lora"
    with pytest.raises(ConfigError) as info:
        RunConfig.from_user_config({**unit_config(), "adapter-mode": "dora"}, source="run config")
    (problem,) = info.value.problems
    assert problem.startswith("run config:adapter-mode: Input should be 'lora', 'lora-fa' or")


@pytest.mark.parametrize(
    "codec", ["topk:0.1", "topk-int8:0.015", "topk-int4:0.025", "topk-sign:0.2"]
)
def test_a_secure_sum_refuses_a_per_region_sparse_codec_at_start_naming_codec(codec):
    """Each region's top-k keeps coordinates of its own: one that only one region kept
    would carry that region's value alone in the unmasked sum."""
    values = {**app_config(), "secure-aggregation": True, "codec": codec}
    with pytest.raises(ConfigError) as caught:
        RunConfig.from_user_config(values, source="run config")
    [problem] = caught.value.problems
    assert problem.startswith("run config:secure-aggregation:")
    assert f"not codec = {codec!r}" in problem and "alone in the unmasked sum" in problem


@pytest.mark.parametrize("codec", ["dense", "int8", "int4", "int2", "sign"])
def test_a_secure_sum_takes_every_dense_codec(codec):
    values = {**app_config(), "secure-aggregation": True, "codec": codec}
    assert RunConfig.from_user_config(values, source="run config").secure.secure_aggregation
