"""Adapter update modes (adapter-mode): what each trains and sends, that the fixed-factor
modes average exactly (the published change to every adapted weight is the
example-weighted mean of the regions' changes) while ``lora`` does not, that DP-SGD's
per-sample gradients are right in each, and that the saved adapter loads with peft and
computes what the trained model computes."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fedciuic.aggregator.aggregation import Bounds, check, make_aggregator, staleness_weight
from fedciuic.aggregator.server_optim import ServerOptimizer
from fedciuic.compression import get_codec
from fedciuic.config import ADAPTER_MODES, AdapterMode, ModelSpec, NodeConfig, RunConfig
from fedciuic.data.corpus import ExampleSet
from fedciuic.model.adapter import (
    ADAPTER_MODE_FILE,
    LORA_A,
    LORA_B,
    LORA_R,
    AdapterLayout,
    AdapterModel,
    build_base,
    lora_factors,
    save_model_checkpoint,
)
from fedciuic.model.presets import TINY_FAMILIES, TINY_VOCAB_SIZE, preset_config
from fedciuic.model.train import train_local
from fedciuic.policy.binding import RegionPolicy
from fedciuic.privacy.dpsgd import PrivateTrainer
from fedciuic.privacy.ledger import PrivacyLedger
from fedciuic.region.trainer import Region, train_info
from fedciuic.wire import ADAPTER_MODE
from tests.conftest import EXACT_RELEASES
from tests.privacy.test_each_family_dp import autograd_grads, opacus_grads

CPU = torch.device("cpu")
#: Three regions: their example counts (the FedAvg weights) and data seeds.
REGIONS = ((12, 1), (30, 2), (60, 3))
#: Token ids every model here embeds (the tiny preset's and the tiny checkpoints').
VOCAB = min(TINY_VOCAB_SIZE, preset_config("tiny").vocab_size)


def _spec(mode: AdapterMode) -> ModelSpec:
    return ModelSpec(model_preset="tiny", adapter_mode=mode)


@pytest.fixture(scope="module", params=ADAPTER_MODES)
def built(request: pytest.FixtureRequest) -> tuple[AdapterModel, AdapterLayout]:
    spec = _spec(request.param)
    return AdapterModel(spec, device=CPU), AdapterLayout.of(spec)


def _rows(seed: int, count: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (count, 12), generator=gen)


def _scaling(spec: ModelSpec) -> float:
    return spec.lora_alpha / spec.lora_rank


def effective(factors: dict[str, np.ndarray], scaling: float) -> dict[str, np.ndarray]:
    """Each adapted module's weight change ``scaling * B A``, in float64."""
    return {
        name.removesuffix(LORA_A): scaling
        * (factors[name.removesuffix(LORA_A) + LORA_B].astype(np.float64) @ factors[name])
        for name in factors
        if name.endswith(LORA_A)
    }


def test_each_mode_trains_and_sends_only_its_own_tensors(built):
    model, layout = built
    mode = model.spec.adapter_mode
    trained, fixed = model.adapter_state(), model.fixed_state()
    assert layout.shapes == {k: v.shape for k, v in trained.items()}
    suffix = {"lora": (LORA_A, LORA_B), "lora-fa": (LORA_B,), "lora-sb": (LORA_R,)}[mode]
    assert trained and all(name.endswith(suffix) for name in trained)
    # The fixed factors are derived, the same, by the aggregator (meta device) and regions.
    assert sorted(fixed) == sorted(layout.fixed)
    assert all(np.array_equal(fixed[k], layout.fixed[k]) for k in fixed)
    assert not any(p.requires_grad for n, p in model.model.named_parameters() if n in fixed)
    assert not fixed if mode == "lora" else fixed
    if mode == "lora-fa":  # A as lora starts it
        lora = AdapterLayout.of(_spec("lora")).initial
        assert all(np.array_equal(v, lora[k]) for k, v in fixed.items())
    if mode == "lora-sb":  # orthonormal rows (A) and columns (B); R = 0
        for name, value in fixed.items():
            gram = value @ value.T if name.endswith(LORA_A) else value.T @ value
            np.testing.assert_allclose(gram, np.eye(len(gram)), atol=1e-5)
        assert all(not np.any(v) for v in layout.initial.values())
        r = model.spec.lora_rank
        assert all(v.shape == (r, r) for v in trained.values())


def test_each_mode_starts_as_the_base(built):
    model, layout = built
    rows = _rows(0, 2)
    model.load_adapter_state(layout.initial)
    base = build_base(model.spec, CPU).model
    with torch.no_grad():
        torch.testing.assert_close(model.model(input_ids=rows).logits, base(input_ids=rows).logits)


def _aggregate(run: RunConfig, start: dict[str, np.ndarray], deltas, weights, staleness=None):
    """The aggregator's path: each delta encoded with the run's codec, decoded and
    validated, averaged by examples (FedBuff-weighted by ``staleness`` where given), and
    stepped onto the global adapter by the run's server optimiser."""
    names = sorted(start)
    n = sum(start[k].size for k in names)
    into = make_aggregator(run.compression.aggregation, n)
    stale = staleness or [0] * len(deltas)
    bounds = Bounds(max_staleness=max(stale))
    for delta, weight, late in zip(deltas, weights, stale, strict=True):
        flat = np.concatenate([delta[k].reshape(-1) for k in names])
        data = run.compression.codec.encode(flat, np.random.default_rng(0))
        into.add(check(run.compression.codec, data, n, weight, bounds, staleness=late))
    return ServerOptimizer(run.server).step(start, into.mean())


def test_the_published_weight_change_is_the_example_weighted_mean_in_the_exact_modes(
    built, run_config
):
    model, layout = built
    mode, scaling = model.spec.adapter_mode, _scaling(model.spec)
    run = run_config.updated(
        **{"codec": get_codec("dense"), "adapter_mode": mode}, **EXACT_RELEASES
    )
    rng = np.random.default_rng(5)
    # A global adapter some rounds in: every trained tensor away from its start.
    start = {
        k: v + rng.normal(0, 0.02, v.shape).astype(np.float32) for k, v in layout.initial.items()
    }
    fixed = layout.fixed
    before = effective(lora_factors(mode, start, fixed), scaling)
    deltas, changes, weights = [], [], []
    for count, seed in REGIONS:
        model.load_adapter_state(start)
        train_local(
            model,
            ExampleSet.of_rows(_rows(seed, count)),
            steps=3,
            batch_size=4,
            learning_rate=0.05,
            generator=torch.Generator().manual_seed(seed),
            optimizer="sgd",
        )
        end = model.adapter_state()
        deltas.append({k: end[k] - start[k] for k in start})
        after = effective(lora_factors(mode, end, model.fixed_state()), scaling)
        changes.append({k: after[k] - before[k] for k in before})
        weights.append(count)
    published = effective(
        lora_factors(mode, _aggregate(run, start, deltas, weights), fixed), scaling
    )
    total = sum(weights)
    errors = []
    for module, old in before.items():
        want = sum(w * c[module] for w, c in zip(weights, changes, strict=True)) / total
        got = published[module] - old
        assert np.linalg.norm(want) > 0
        errors.append(np.linalg.norm(got - want) / np.linalg.norm(want))
    worst = max(errors)
    if mode == "lora":  # A and B averaged apart: the mean of products is not the product
        assert worst > 1e-3, worst
    else:
        assert worst < 1e-4, worst


@pytest.mark.parametrize("mode", ["lora-fa", "lora-sb"])
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_per_sample_gradients_equal_autograd_in_the_fixed_factor_modes(
    tiny_checkpoints, family, mode
):
    model = AdapterModel(
        ModelSpec(model_path=str(tiny_checkpoints[family]), adapter_mode=mode), CPU
    )
    state = model.adapter_state()  # B or R away from zero: every factor matters
    model.load_adapter_state({k: v + 0.01 for k, v in state.items()})
    rows = _rows(0, 3)
    expected = autograd_grads(model, rows)
    assert float(expected.abs().max()) > 0
    torch.testing.assert_close(opacus_grads(model, rows), expected, rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("mode", ["lora-fa", "lora-sb"])
def test_gradient_checkpointing_keeps_the_per_sample_gradients_in_each_mode(mode):
    rows = _rows(0, 3)
    grads = []
    for checkpointing in (False, True):
        spec = ModelSpec(
            model_preset="tiny", adapter_mode=mode, gradient_checkpointing=checkpointing
        )
        model = AdapterModel(spec, CPU)
        model.load_adapter_state({k: v + 0.01 for k, v in model.adapter_state().items()})
        grads.append(opacus_grads(model, rows))
    assert float(grads[0].abs().max()) > 0
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("dp_mode", ["hooks", "ghost"])
def test_dp_sgd_moves_only_the_trained_tensors(dp_mode):
    model = AdapterModel(_spec("lora-sb"), CPU)
    fixed, start = model.fixed_state(), model.adapter_state()
    trainer = PrivateTrainer(
        model,
        ExampleSet.of_rows(_rows(1, 16)),
        batch_size=8,
        learning_rate=0.05,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        mode=dp_mode,
        secure_mode=False,
        seed=3,
    )
    try:
        trainer.run(2)
    finally:
        trainer.close()
    assert all(np.array_equal(v, fixed[k]) for k, v in model.fixed_state().items())
    assert any(not np.array_equal(v, start[k]) for k, v in model.adapter_state().items())


@pytest.mark.parametrize("mode", ADAPTER_MODES)
def test_the_saved_adapter_loads_with_peft_and_computes_the_trained_models_output(tmp_path, mode):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ckpt = save_model_checkpoint(ModelSpec(model_preset="tiny"), tmp_path / "base")
    spec = ModelSpec(model_path=str(ckpt), adapter_mode=mode)
    model = AdapterModel(spec, CPU)
    train_local(
        model,
        ExampleSet.of_rows(_rows(1, 8)),
        steps=3,
        batch_size=4,
        learning_rate=0.05,
        generator=torch.Generator().manual_seed(0),
    )
    rows = _rows(2, 2)
    model.model.eval()
    with torch.no_grad():
        want = model.model(input_ids=rows).logits
    # The aggregator's export (meta-device layout) and the region's own write the same.
    layout = AdapterLayout.of(spec)
    layout.save(model.adapter_state(), tmp_path / "global")
    model.save_adapter(tmp_path / "region")
    for folder in ("global", "region"):
        assert json.loads((tmp_path / folder / ADAPTER_MODE_FILE).read_text()) == {
            "adapter-mode": mode
        }
        loaded = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(ckpt), tmp_path / folder
        )
        loaded.eval()
        with torch.no_grad():
            got = loaded(input_ids=rows).logits
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    base = AutoModelForCausalLM.from_pretrained(ckpt)
    with torch.no_grad():
        assert float((want - base(input_ids=rows).logits).abs().max()) > 1e-4  # it learnt


@pytest.mark.parametrize("mode", ["lora-fa", "lora-sb"])
def test_a_dp_region_round_sends_only_the_trained_tensors_and_declares_its_mode(
    run_config, demo_root, tmp_path, mode
):
    run = run_config.updated(
        **{"adapter_mode": mode, "local_steps": 2, "seq_len": 64}, **EXACT_RELEASES
    )
    layout = AdapterLayout.of(run.model)  # the aggregator's
    region = Region(
        run, NodeConfig(region="eu", data_path=str(demo_root / "eu"), state_path=str(tmp_path))
    )
    try:
        installed = region.model.fixed_state()
        outcome = region.train_round(
            layout.initial, server_round=1, base_fingerprint=layout.fingerprint, run_id=5
        )
    finally:
        region.close()
    assert all(np.array_equal(v, layout.fixed[k]) for k, v in installed.items())
    assert outcome.privacy is not None and outcome.stats.steps == 2
    assert {k: v.shape for k, v in outcome.delta.items()} == layout.shapes
    assert any(np.any(v) for v in outcome.delta.values())
    size = sum(v.size for v in layout.initial.values())
    run.compression.codec.decode(outcome.update, size)  # refused unless it has the mode's size
    assert train_info(outcome, RegionPolicy.none("eu"), "c" * 64)[ADAPTER_MODE] == mode


@pytest.mark.parametrize("mode", ["lora-fa", "lora-sb"])
@pytest.mark.parametrize("server", ["none", "fedadam"])
def test_buffered_and_server_optimised_rounds_stay_exact_in_the_fixed_factor_modes(
    mode, server, run_config
):
    """FedBuff's staleness weights are linear in what is summed, so the published change
    to every adapted weight is the staleness- and example-weighted mean of the regions'
    changes; a server optimiser steps the trained tensors alone (the fixed factors never
    move) and publishes exactly the weight change of its step."""
    spec = _spec(mode)
    layout, scaling = AdapterLayout.of(spec), _scaling(spec)
    run = run_config.updated(
        **{
            "codec": get_codec("dense"),
            "adapter_mode": mode,
            "server_optimizer": server,
            "server_learning_rate": 1.0 if server == "none" else 0.01,
        }
    )
    rng = np.random.default_rng(7)
    start = {k: rng.normal(0, 0.02, v.shape).astype(np.float32) for k, v in layout.initial.items()}
    deltas = [
        {k: rng.normal(0, 0.01, v.shape).astype(np.float32) for k, v in start.items()}
        for _ in REGIONS
    ]
    weights, staleness = [count for count, _ in REGIONS], [0, 3, 8]
    published = _aggregate(run, start, deltas, weights, staleness)
    fixed = layout.fixed

    def change(adapter: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        before = effective(lora_factors(mode, start, fixed), scaling)
        after = effective(lora_factors(mode, adapter, fixed), scaling)
        return {k: after[k] - before[k] for k in before}

    coefficients = [w * staleness_weight(s) for w, s in zip(weights, staleness, strict=True)]
    assert sorted(published) == sorted(layout.shapes)  # no fixed factor among them
    if server == "none":
        regions = [change({k: start[k] + d[k] for k in start}) for d in deltas]
        for module, value in change(published).items():
            mixed = np.stack([c * r[module] for c, r in zip(coefficients, regions, strict=True)])
            np.testing.assert_allclose(value, mixed.sum(0) / sum(weights), rtol=1e-4, atol=1e-9)
    else:  # Adam steps from the same weighted mean of the trained tensors
        names = sorted(start)
        rows = np.stack([np.concatenate([d[k].reshape(-1) for k in names]) for d in deltas])
        mean = np.asarray(coefficients, np.float64) @ rows.astype(np.float64) / sum(weights)
        stepped = ServerOptimizer(run.server).step(start, mean.astype(np.float32))
        for name in names:
            np.testing.assert_allclose(published[name], stepped[name], rtol=1e-5, atol=1e-8)
            assert np.all(published[name] != start[name])  # elementwise: every entry moves


@pytest.mark.parametrize("mode", ["lora-fa", "lora-sb"])
def test_a_time_budgeted_dp_round_in_each_fixed_factor_mode_records_the_steps_it_took(
    run_config, demo_root, tmp_path, mode
):
    run = run_config.updated(
        **EXACT_RELEASES,
        **{
            "adapter_mode": mode,
            "local_steps": 6,
            "seq_len": 32,
            "batch_size": 2,
            "num_server_rounds": 1,
            "dp_accountant": "rdp",
            "local_time_budget": 60.0,
        },
    )
    layout = AdapterLayout.of(run.model)
    region = Region(
        run, NodeConfig(region="eu", data_path=str(demo_root / "eu"), state_path=str(tmp_path))
    )
    try:
        outcome = region.train_round(
            layout.initial, server_round=1, base_fingerprint=layout.fingerprint, run_id=5
        )
        (record,) = PrivacyLedger.load(region.ledger_path).rounds
    finally:
        region.close()
    assert 1 <= outcome.stats.steps == record.steps <= run.training.local_steps
    assert {k: v.shape for k, v in outcome.delta.items()} == layout.shapes
