"""DP-SGD wiring checked against gradients computed one example at a time."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fedciuic.config import ModelSpec
from fedciuic.data.corpus import Batch, ExampleSet
from fedciuic.model.adapter import AdapterModel
from fedciuic.model.train import lm_loss
from fedciuic.privacy.dpsgd import PrivateTrainer, parameter_device, physical_parts
from fedciuic.privacy.ledger import PrivacyError
from fedciuic.privacy.noise import secure_generator

BATCH = 8


@pytest.fixture(scope="module")
def model() -> AdapterModel:
    return AdapterModel(ModelSpec(), device=torch.device("cpu"))


@pytest.fixture(scope="module")
def blocks() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (4 * BATCH, 24), generator=gen)  # 4 batches: q = 1/4


@pytest.fixture(autouse=True)
def _fresh(model):
    state = model.adapter_state()
    # Non-zero LoRA B so that every adapter has a gradient.
    model.load_adapter_state({k: v + 0.01 if "lora_B" in k else v for k, v in state.items()})
    yield
    model.load_adapter_state(state)


def make_trainer(
    model: AdapterModel, rows: torch.Tensor, units: list[int] | None = None, **changes: Any
) -> PrivateTrainer:
    """DP-SGD on ``rows`` (one unit per row unless ``units`` says otherwise): batch size
    ``BATCH``, learning rate, noise multiplier and clipping norm 1, unless ``changes``
    say otherwise."""
    settings: dict[str, Any] = {
        "batch_size": BATCH,
        "learning_rate": 1.0,
        "noise_multiplier": 1.0,
        "max_grad_norm": 1.0,
        **changes,
    }
    return PrivateTrainer(model, ExampleSet.of_rows(rows, units=units), **settings)


def per_sample_grads(model: AdapterModel, batch: torch.Tensor) -> list[torch.Tensor]:
    """Each example's gradient, by plain autograd on that example alone (flattened)."""
    params = model.trainable_parameters()
    grads = []
    for row in batch:
        loss = lm_loss(model.model, Batch.of_ids(row[None]))
        grads.append(torch.cat([g.flatten() for g in torch.autograd.grad(loss, params)]))
    return grads


def flat(model: AdapterModel) -> torch.Tensor:
    return torch.cat([p.detach().flatten().clone() for p in model.trainable_parameters()])


def dp_update(
    model, blocks, batch, *, noise, clip, mode="hooks", seed=0, secure_mode=False
) -> torch.Tensor:
    """One DP-SGD step (SGD, lr 1) from the current adapters, which are then restored.
    A ``seed`` without secure mode is the insecure reproducible noise meant for tests."""
    return stepped(
        model,
        blocks,
        len(batch),  # batch = blocks[:n]: units 0..n-1
        noise_multiplier=noise,
        max_grad_norm=clip,
        mode=mode,
        seed=seed,
        optimizer="sgd",
        secure_mode=secure_mode,
    )


def stepped(
    model: AdapterModel,
    rows: torch.Tensor,
    count: int,
    *,
    check: Any = None,
    units: list[int] | None = None,
    **changes: Any,
) -> torch.Tensor:
    """The update of one DP-SGD step on units 0..count-1 of ``rows`` (the trainer as
    :func:`make_trainer` makes it, with ``changes``; ``check`` sees it first); the
    adapters are restored after."""
    before = flat(model)
    trainer = make_trainer(model, rows, units=units, **changes)
    try:
        if check is not None:
            check(trainer)
        trainer.step(torch.arange(count))
    finally:
        trainer.close()
    return restore(model, before)


def restore(model: AdapterModel, before: torch.Tensor) -> torch.Tensor:
    """Put the adapters back to ``before``; returns the update they had taken."""
    update = flat(model) - before
    with torch.no_grad():
        start = 0
        for p in model.trainable_parameters():
            p.copy_(before[start : start + p.numel()].view_as(p))
            start += p.numel()
    return update


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_each_per_sample_gradient_is_clipped_to_max_grad_norm(model, blocks, mode):
    batch = blocks[:BATCH]
    grads = per_sample_grads(model, batch)
    clip = 0.5 * float(torch.stack([g.norm() for g in grads]).median())
    clipped = [g * min(1.0, clip / (float(g.norm()) + 1e-6)) for g in grads]
    assert any(float(g.norm()) > clip for g in grads), "the test must actually clip"
    assert all(float(c.norm()) <= clip + 1e-6 for c in clipped)
    expected = -torch.stack(clipped).sum(0) / BATCH  # SGD, lr 1, mean over expected batch
    got = dp_update(model, blocks, batch, noise=0.0, clip=clip, mode=mode)
    torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-6)


def test_opacus_per_sample_gradients_equal_autograd_one_example_at_a_time(model, blocks):
    batch = blocks[:BATCH]
    expected = per_sample_grads(model, batch)
    trainer = make_trainer(model, blocks, noise_multiplier=0.0, optimizer="sgd")
    try:
        lm_loss(trainer.net, Batch.of_ids(batch)).backward()
        got = torch.cat(
            [p.grad_sample.reshape(BATCH, -1) for p in model.trainable_parameters()], dim=1
        )
    finally:
        trainer.close()
    torch.testing.assert_close(got, torch.stack(expected), rtol=1e-3, atol=1e-6)


def test_without_noise_and_clipping_the_update_equals_plain_sgd(model, blocks):
    batch = blocks[:BATCH]
    params = model.trainable_parameters()
    grads = torch.autograd.grad(lm_loss(model.model, Batch.of_ids(batch)), params)
    expected = -torch.cat([g.flatten() for g in grads])
    got = dp_update(model, blocks, batch, noise=0.0, clip=1e6)
    torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-6)


def test_noise_is_added_and_depends_on_the_seed(model, blocks):
    batch = blocks[:BATCH]
    clean = dp_update(model, blocks, batch, noise=0.0, clip=1.0)
    a = dp_update(model, blocks, batch, noise=1.0, clip=1.0, seed=1)
    b = dp_update(model, blocks, batch, noise=1.0, clip=1.0, seed=2)
    a_again = dp_update(model, blocks, batch, noise=1.0, clip=1.0, seed=1)
    assert not torch.allclose(a, b)
    torch.testing.assert_close(a, a_again)
    # The noise has the calibrated scale: std = noise * clip / expected batch size.
    assert float((a - clean).std()) == pytest.approx(1.0 * 1.0 / BATCH, rel=0.1)


def test_hooks_are_removed_after_a_round(model, blocks):
    trainer = make_trainer(model, blocks, learning_rate=0.01)
    trainer.run(2)
    trainer.close()
    assert not model.model._forward_hooks
    assert all(not hasattr(p, "grad_sample") for p in model.trainable_parameters())
    for module in model.model.modules():
        assert not module._forward_hooks and not module._backward_hooks


def park_hooks(model: AdapterModel, blocks: torch.Tensor) -> Any:
    """The hooks of a one-step round, parked on ``model`` (its adapters restored)."""
    before = flat(model)
    trainer = make_trainer(model, blocks, learning_rate=0.01)
    trainer.run(1)
    trainer.close(park=True)
    restore(model, before)
    return trainer.hooks


def test_parked_hooks_idle_until_the_next_trainer_takes_them_up_unchanged(model, blocks):
    batch = blocks[:BATCH]
    settings: dict[str, Any] = {"noise_multiplier": 1.0, "max_grad_norm": 0.5, "seed": 3}
    settings.update(optimizer="sgd", secure_mode=False)
    fresh = stepped(model, blocks, BATCH, **settings)  # hooks built, then removed
    parked = park_hooks(model, blocks)
    # Parked, they do nothing: a plain backward pass leaves no per-sample state.
    assert not parked.hooks_enabled
    lm_loss(model.model, Batch.of_ids(batch)).backward()
    model.model.zero_grad(set_to_none=True)
    assert all(not hasattr(p, "grad_sample") for p in model.trainable_parameters())
    assert not any(getattr(m, "activations", None) for m in model.model.modules())
    taken: list[Any] = []
    again = stepped(model, blocks, BATCH, check=lambda t: taken.append(t.hooks), **settings)
    assert taken == [parked]  # taken up, not built again
    torch.testing.assert_close(again, fresh)  # and the same step as fresh hooks take
    for module in model.model.modules():  # a trainer's own close removes them
        assert not module._forward_hooks and not module._backward_hooks


def test_hooks_parked_by_a_round_give_way_to_ghost_clipping(model, blocks):
    batch = blocks[:BATCH]
    expected = dp_update(model, blocks, batch, noise=0.0, clip=0.5, mode="ghost")
    park_hooks(model, blocks)
    got = dp_update(model, blocks, batch, noise=0.0, clip=0.5, mode="ghost")
    torch.testing.assert_close(got, expected)


def test_secure_mode_uses_an_unreplayable_generator(model, blocks):
    batch = blocks[:BATCH]
    first = dp_update(model, blocks, batch, noise=1.0, clip=1.0, seed=1, secure_mode=True)
    second = dp_update(model, blocks, batch, noise=1.0, clip=1.0, seed=1, secure_mode=True)
    assert not torch.allclose(first, second)  # the seed is ignored in secure mode


def test_secure_noise_is_the_default(model, blocks):
    # No seed and no setting: noise from generators seeded by the OS, never replayable.
    trainer = make_trainer(model, blocks)
    try:
        assert not trainer.reproducible and trainer.optimizer.secure_mode
    finally:
        trainer.close()
    batch = blocks[:BATCH]
    first = dp_update(model, blocks, batch, noise=1.0, clip=1.0, seed=None, secure_mode=False)
    second = dp_update(model, blocks, batch, noise=1.0, clip=1.0, seed=None, secure_mode=False)
    assert not torch.allclose(first, second)  # unpredictable even without secure mode


def empty_batch_trainer(model, mode="hooks", seed=3):
    # 4 examples at batch size 1: q = 1/4, so a batch is empty with probability 0.32.
    rows = torch.randint(0, 256, (4, 24), generator=torch.Generator().manual_seed(1))
    return make_trainer(
        model, rows, batch_size=1, mode=mode, optimizer="sgd", secure_mode=False, seed=seed
    )


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_empty_poisson_batch_takes_noise_step(model, mode):
    trainer = empty_batch_trainer(model, mode)
    stepped = []
    inner = trainer.optimizer.original_optimizer
    original_step = inner.step

    def counting_step(*args, **kwargs):
        stepped.append(flat(model))
        return original_step(*args, **kwargs)

    inner.step = counting_step
    try:
        stats = trainer.run(40)
    finally:
        inner.step = original_step
        trainer.close()
    # Every accounted step took an optimizer step with noise, the empty batches included.
    assert stats.steps == trainer.steps_taken == len(stepped) == 40
    assert trainer.empty_steps >= 5  # P(empty) = 0.32: about 13 of 40
    assert all(bool(p.isfinite().all()) for p in model.trainable_parameters())


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_an_empty_batch_step_moves_the_parameters_by_noise(model, mode):
    trainer = empty_batch_trainer(model, mode)
    try:
        before = flat(model)
        trainer.noise_step()
        moved = flat(model) - before
    finally:
        trainer.close()
    # SGD, lr 1: the update is the noise, std = sigma * C / expected batch size (1 here).
    assert float(moved.abs().max()) > 0
    assert float(moved.std()) == pytest.approx(1.0, rel=0.1)
    assert float(moved.mean()) == pytest.approx(0.0, abs=0.05)


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_a_secure_mode_noise_step_moves_by_the_mechanisms_noise(model, mode):
    # Secure mode: each value a halved sum of four draws, still N(0, (sigma * C)^2).
    rows = torch.randint(0, 256, (4, 24), generator=torch.Generator().manual_seed(1))
    trainer = make_trainer(model, rows, batch_size=1, mode=mode, optimizer="sgd", secure_mode=True)
    try:
        assert trainer.optimizer.secure_mode
        before = flat(model)
        trainer.noise_step()
        moved = flat(model) - before
    finally:
        trainer.close()
    assert float(moved.std()) == pytest.approx(1.0, rel=0.1)  # SGD at lr 1: the noise
    assert float(moved.mean()) == pytest.approx(0.0, abs=0.05)


def test_the_noise_generator_is_on_the_parameters_device(model, blocks):
    assert parameter_device(model.trainable_parameters()) == torch.device("cpu")
    meta = [torch.nn.Parameter(torch.empty(2, 3, device="meta")) for _ in range(2)]
    assert parameter_device(meta) == torch.device("meta")
    with pytest.raises(PrivacyError, match="spread over cpu, meta"):
        parameter_device([*meta, torch.nn.Parameter(torch.zeros(1))])
    gen, kind = secure_generator(torch.device("cpu"))
    assert gen.device == torch.device("cpu") and "os.urandom" in kind
    trainer = make_trainer(model, blocks)
    try:
        # The generator Opacus draws noise with is the one made for the parameters' device.
        assert trainer.optimizer.generator is trainer.noise_generator
        assert trainer.noise_generator.device == model.trainable_parameters()[0].device
    finally:
        trainer.close()


def test_parameter_device_on_cuda_when_available():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device here")
    params = [torch.nn.Parameter(torch.zeros(3, device="cuda"))]
    device = parameter_device(params)
    gen, _ = secure_generator(device)
    assert gen.device.type == "cuda"
    torch.normal(0.0, 1.0, size=(3,), device=device, generator=gen)  # Opacus' draw


#: Units of the user-level tests: 3 users own 2, 3 and 1 rows; 3 more own 1 each.
OWNERS = [0, 0, 1, 1, 1, 2, 3, 4, 5]


def test_a_users_examples_are_clipped_as_one_mean_gradient(model, blocks):
    """User-level DP-SGD: the clipped quantity is the mean of one user's gradients."""
    rows = blocks[: len(OWNERS)]
    grads = per_sample_grads(model, rows)
    users = sorted(set(OWNERS))
    means = [
        torch.stack([g for g, o in zip(grads, OWNERS, strict=True) if o == u]).mean(0)
        for u in users
    ]
    clip = 0.5 * float(torch.stack([m.norm() for m in means]).median())
    assert any(float(m.norm()) > clip for m in means), "the test must actually clip"
    clipped = [m * min(1.0, clip / (float(m.norm()) + 1e-6)) for m in means]
    # Opacus divides by the expected number of units per step: n_units * q.
    expected_batch = len(users) / -(-len(users) // 2)
    expected = -torch.stack(clipped).sum(0) / expected_batch

    def check(trainer: PrivateTrainer) -> None:
        assert trainer.units.count == len(users) and trainer.sample_rate == 1 / 3

    got = stepped(
        model,
        rows,
        len(users),
        check=check,
        units=OWNERS,
        batch_size=2,
        max_examples_per_unit=3,
        noise_multiplier=0.0,
        max_grad_norm=clip,
        optimizer="sgd",
        secure_mode=False,
        seed=0,
    )
    torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-6)


def test_a_step_takes_at_most_max_examples_per_unit_of_a_user(model, blocks):
    trainer = make_trainer(
        model,
        blocks[: len(OWNERS)],
        units=OWNERS,
        batch_size=2,
        max_examples_per_unit=2,
        secure_mode=False,
        seed=0,
    )
    try:
        batch, owners = trainer.gather(torch.tensor([1, 0]))  # users own 3 and 2 rows
        assert owners.tolist() == [0, 0, 1, 1] and len(batch) == 4
    finally:
        trainer.close()


def test_ghost_clipping_clips_a_users_examples_as_one_mean_gradient(model, blocks):
    """Units of several examples under ghost clipping: the norm of each unit's mean
    gradient, from the layers' activations and backprops (no per-sample gradient kept),
    is the one per-example autograd gives; the step is hooks mode's, clipping active."""
    rows = blocks[: len(OWNERS)]
    grads = per_sample_grads(model, rows)
    sizes = torch.bincount(torch.tensor(OWNERS)).tolist()
    means = [
        torch.stack([g for g, o in zip(grads, OWNERS, strict=True) if o == unit]).mean(0)
        for unit in range(len(sizes))
    ]
    seen: list[torch.Tensor] = []

    def record(trainer: PrivateTrainer) -> None:
        coefficients = trainer.hooks.get_clipping_coef

        def spy() -> torch.Tensor:
            seen.append(trainer.hooks.get_norm_sample().clone())
            coefficient: torch.Tensor = coefficients()
            return coefficient

        trainer.hooks.get_clipping_coef = spy

    updates = {
        mode: stepped(
            model,
            rows,
            len(sizes),
            units=OWNERS,
            max_examples_per_unit=4,
            max_grad_norm=0.05,
            noise_multiplier=0.0,
            mode=mode,
            optimizer="sgd",
            check=record if mode == "ghost" else None,
        )
        for mode in ("hooks", "ghost")
    }
    (norms,) = seen
    per_unit = [float(norms[OWNERS.index(unit)]) for unit in range(len(sizes))]
    assert per_unit == pytest.approx([float(m.norm()) for m in means], rel=1e-4)
    assert min(per_unit) > 0.05  # every unit clipped: the coefficients matter
    torch.testing.assert_close(updates["ghost"], updates["hooks"], rtol=1e-4, atol=1e-7)


def test_physical_parts_are_whole_units_of_at_most_the_size():
    owners = torch.tensor([0, 0, 1, 2, 2, 2, 2, 3, 4, 4])
    assert physical_parts(owners, 0) == [(0, 10)]
    assert physical_parts(owners, 10) == [(0, 10)]
    # Unit 2 (4 examples) is over the size: alone in its part.
    assert physical_parts(owners, 3) == [(0, 3), (3, 7), (7, 10)]
    assert physical_parts(owners, 1) == [(0, 2), (2, 3), (3, 7), (7, 8), (8, 10)]


@pytest.mark.parametrize(
    ("mode", "units"),
    [("hooks", None), ("ghost", None), ("hooks", [*OWNERS, 5, 5]), ("ghost", [*OWNERS, 5, 5])],
)
def test_a_step_in_physical_parts_equals_the_whole_batch_step(model, blocks, mode, units):
    """Parts of the batch through the model one at a time, clipped sums added, the
    noise drawn once: the same update, with at most the part's examples in a pass."""
    rows = blocks[: len(units)] if units else blocks[:BATCH]
    count = len(set(units)) if units else BATCH
    seen: list[int] = []
    embeddings = model.model.get_input_embeddings()
    hook = embeddings.register_forward_hook(lambda _m, args, _o: seen.append(len(args[0])))
    updates = []
    try:
        for physical in (0, 3):
            seen.clear()
            update = stepped(
                model,
                rows,
                count,
                units=units,
                max_examples_per_unit=3,
                max_grad_norm=0.05,
                mode=mode,
                optimizer="sgd",
                secure_mode=False,
                seed=7,
                physical_batch=physical,
            )
            updates.append(update)
            assert max(seen) == (len(rows) if physical == 0 else 3) and sum(seen) >= len(rows)
    finally:
        hook.remove()
    whole, parts = updates
    assert float(whole.norm()) > 0
    torch.testing.assert_close(parts, whole, rtol=1e-4, atol=1e-6)
