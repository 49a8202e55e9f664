"""A region's base sharded over two gloo processes (FSDP2, ``train-sharding = "shard"``):
the same DP round, the same evaluation and the same records as one process holding the
whole base, for a tiny V3 and a tiny V4 checkpoint, with and without gradient
checkpointing, per-unit clipping by hooks and by ghost clipping."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.distributed.tensor import DTensor

from fedciuic.cluster import check_sharding
from fedciuic.cluster.dist import ClusterError
from fedciuic.config import NodeConfig, RunConfig
from fedciuic.errors import ModelError
from fedciuic.model import AdapterModel, evaluate, unit_losses
from fedciuic.model.adapter import ADAPTER_MARK, initial_adapter
from fedciuic.privacy.dpsgd import physical_parts
from fedciuic.privacy.ledger import PrivacyLedger
from fedciuic.region.trainer import Region, TrainOutcome
from tests.cluster.test_cluster import (
    alive,
    assert_one_process_training,
    assert_one_process_update,
    kill_at_next_step,
    make_region,
    worker_pids,
)
from tests.conftest import EXACT_RELEASES, unit_config

#: Examples per pass of a DP-SGD step.
PHYSICAL = 8
#: Every unit in every batch (q = 1) with all its examples, so sampling is the same in
#: one process and in two; user-level units of several examples, in passes of at most
#: 8 examples, so the ranks take different numbers of passes (blank ones fill in);
#: noise from the round's seed (tests only), so rank 0 draws what one process draws.
SETTINGS = {
    **EXACT_RELEASES,
    "local-steps": 2,
    "num-server-rounds": 3,
    "batch-size": 100_000,
    "privacy-unit": "user",
    "max-examples-per-unit": 1024,
    "max-physical-batch-size": PHYSICAL,
    "optimizer": "sgd",
    "learning-rate": 0.5,
    "secure-mode": False,
    "insecure-reproducible-noise": True,
    "epsilon-budget": 1000.0,
    "collective-timeout": 20.0,
    "seq-len": 32,
    "lora-targets": "auto+mlp",
}
#: Each family with and without gradient checkpointing, and each clipping mode with both.
CASES = [
    ("deepseek_v3", False, "hooks"),
    ("deepseek_v3", True, "ghost"),
    ("deepseek_v4", False, "ghost"),
    ("deepseek_v4", True, "hooks"),
]
IDS = [f"{f}-gc{int(g)}-{m}" for f, g, m in CASES]
#: One case of each family, for what neither checkpointing nor the clipping mode
#: changes: loading a rank's slice, and resharding after a kill.
each_family = pytest.mark.parametrize(
    "pair", [CASES[0], CASES[3]], indirect=True, ids=[IDS[0], IDS[3]]
)


@pytest.fixture(scope="module", params=CASES, ids=IDS)
def pair(
    request: pytest.FixtureRequest,
    tiny_checkpoints: dict[str, Path],
    data_root: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Region, Region]]:
    """A sharded 2-process region and a 1-process one on the same checkpoint and data;
    every process the sharded one started is gone afterwards."""
    family, checkpointing, mode = request.param
    values = {
        **unit_config(),
        **SETTINGS,
        "data-root": str(data_root),
        "model-path": str(tiny_checkpoints[family]),
        "gradient-checkpointing": checkpointing,
        "dp-mode": mode,
    }
    run = RunConfig.from_user_config(values, source="test")
    whole = make_region(run, data_root, tmp_path_factory.mktemp("whole"), 1)
    sharded = make_region(run, data_root, tmp_path_factory.mktemp("sharded"), 2, "shard")
    started: set[int] = set()
    try:
        yield sharded, whole
        started.update(worker_pids(sharded))
    finally:
        started.update(worker_pids(sharded))
        sharded.close()
    assert not [pid for pid in started if alive(pid)]


def _round(r: Region, adapter: dict[str, np.ndarray], server_round: int) -> TrainOutcome:
    return r.train_round(
        adapter, server_round=server_round, base_fingerprint=r.model.base_fingerprint, run_id=1
    )


def test_the_ranks_take_different_numbers_of_passes(pair: tuple[Region, Region]) -> None:
    """What the next test relies on to exercise the blank passes."""
    sharded, _ = pair
    units = sharded.data.train.grouped
    counts = []
    for rank in (0, 1):
        sizes = [len(units.examples(u)) for u in range(rank, units.count, 2)]
        owners = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
        counts.append(len(physical_parts(owners, PHYSICAL)))
    assert counts[0] != counts[1] and min(counts) >= 1, counts


@each_family
def test_a_sharded_region_never_holds_the_whole_base(pair: tuple[Region, Region]) -> None:
    """Before its processes start, the region's base is a skeleton on ``meta`` (no memory)
    whose adapters start where round 1's global adapter does; each rank then reads and
    keeps its slice alone."""
    sharded, whole = pair
    fresh = AdapterModel(sharded.model.spec, skeleton=True)
    base = [p for n, p in fresh.model.named_parameters() if ADAPTER_MARK not in n]
    assert base and all(p.is_meta for p in base)
    # The checkpoint's own files (V3's per-expert tensors, V4's own keys), no converted copy.
    folder = Path(fresh.spec.model_path)
    assert fresh.files and all(f.parent == folder for f in fresh.files), fresh.files
    state = fresh.adapter_state()
    shapes = {name: value.shape for name, value in state.items()}
    for name, value in initial_adapter(shapes, fresh.spec.seed).items():
        np.testing.assert_array_equal(state[name], value)
    sharded.evaluate(whole.model.adapter_state(), base_fingerprint=fresh.base_fingerprint)
    held = [p for n, p in sharded.model.model.named_parameters() if ADAPTER_MARK not in n]
    assert all(isinstance(p, DTensor) for p in held)
    mine = sum(p.to_local().numel() for p in held)  # type: ignore[attr-defined]
    assert mine <= sum(p.numel() for p in held) // 2 + 64 * len(held)  # about half


def test_an_fp8_checkpoint_is_refused_with_the_command_that_converts_it(
    tiny_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    folder = tmp_path / "fp8"
    shutil.copytree(tiny_checkpoints["deepseek_v3"], folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (folder / "config.json").write_text(json.dumps(config))
    run = RunConfig.from_user_config({**unit_config(), "model-path": str(folder)}, source="t")
    with pytest.raises(ModelError, match=r"FP8 weights.*fp8_cast_bf16\.py"):
        AdapterModel(run.model, skeleton=True)


def test_a_sharded_dp_round_sends_the_one_process_update(pair: tuple[Region, Region]) -> None:
    sharded, whole = pair
    start = whole.model.adapter_state()
    one = _round(whole, start, 1)
    two = _round(sharded, start, 1)
    assert isinstance(
        next(p for p in sharded.model.model.parameters() if not p.requires_grad), DTensor
    )
    assert any(np.abs(d).max() > 1e-4 for d in one.delta.values())  # it trained
    for name, delta in one.delta.items():
        np.testing.assert_allclose(two.delta[name], delta, atol=2e-5, err_msg=name)
    assert two.stats.steps == one.stats.steps == 2
    assert one.privacy is not None and two.privacy is not None
    for field in ("epsilon", "noise_multiplier", "sample_rate", "max_grad_norm", "unit"):
        assert getattr(two.privacy, field) == getattr(one.privacy, field), field
    rounds = [PrivacyLedger.load(r.ledger_path).rounds for r in (sharded, whole)]
    keys = ("run_id", "round", "noise_multiplier", "sample_rate", "steps", "epsilon")
    assert [[getattr(rec, k) for k in keys] for rec in rounds[0]] == [
        [getattr(rec, k) for k in keys] for rec in rounds[1]
    ]


def test_without_noise_the_sharded_clipped_sums_are_one_processes(
    pair: tuple[Region, Region],
) -> None:
    """The same two steps with no noise at all: what is left is the clipped per-unit sums,
    to float tolerance (the noisy round above would hide a small difference)."""
    assert_one_process_update(*pair, atol=1e-6)


def test_without_dp_a_sharded_round_is_one_processes(pair: tuple[Region, Region]) -> None:
    assert_one_process_training(*pair)


def test_a_sharded_evaluation_is_the_whole_models(pair: tuple[Region, Region]) -> None:
    sharded, whole = pair
    adapter = whole.model.adapter_state()
    got = sharded.evaluate(adapter, base_fingerprint=sharded.model.base_fingerprint)
    size = whole.local.batch_size
    want = evaluate(whole.model, whole.data.eval, batch_size=size)
    assert got.loss == pytest.approx(want.loss, rel=1e-5)
    assert got.step_seconds is not None and got.step_seconds > 0  # timed on every rank
    losses = sharded._forward("losses")
    assert losses == pytest.approx(
        unit_losses(whole.model, whole.data.eval, batch_size=size), rel=1e-5
    )


@each_family
def test_a_rank_killed_mid_round_releases_nothing_and_the_next_round_reshards(
    pair: tuple[Region, Region], monkeypatch: pytest.MonkeyPatch
) -> None:
    sharded, whole = pair
    adapter = whole.model.adapter_state()
    _round(sharded, adapter, 2)  # the cluster is up
    victim = kill_at_next_step(sharded, monkeypatch)
    with pytest.raises(ClusterError, match=rf"rank 1 \(pid {victim}\) died .* during round 3"):
        _round(sharded, adapter, 3)
    assert sharded._cluster is None and not alive(victim)
    ledger = PrivacyLedger.load(sharded.ledger_path)
    assert 3 not in [r.round for r in ledger.rounds if r.run_id == 1]
    monkeypatch.undo()
    again = _round(sharded, adapter, 3)  # a whole base again, sharded over new ranks
    assert again.stats.steps == 2 and sharded.model.sharded
    (fresh,) = worker_pids(sharded)
    assert fresh != victim and alive(fresh)


@pytest.mark.parametrize(
    ("changes", "problem"),
    [({"quantization": "nf4"}, 'set quantization = "none"')],
)
def test_what_sharding_cannot_do_yet_is_refused_before_loading(
    changes: dict[str, Any], problem: str
) -> None:
    run = RunConfig.from_user_config(
        {**unit_config(), **changes, "train-sharding": "shard", "train-processes": 2},
        source="test",
    )
    node = NodeConfig(region="eu", data_path="/nowhere")
    with pytest.raises(ClusterError, match=problem):
        check_sharding(run, node)
    check_sharding(run, node.model_copy(update={"train_sharding": "replicate"}))
    check_sharding(run, node.model_copy(update={"train_processes": 1}))
