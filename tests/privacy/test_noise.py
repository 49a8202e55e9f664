"""Secure noise drawn in parallel streams: each value Opacus' sum of four Gaussians,
halved, from generators nobody else can replay."""

from __future__ import annotations

import pytest
import torch

from fedciuic.config import ModelSpec
from fedciuic.data.corpus import ExampleSet
from fedciuic.model.adapter import AdapterModel
from fedciuic.privacy import noise as noise_module
from fedciuic.privacy.dpsgd import PrivateTrainer
from fedciuic.privacy.noise import SecureNoise, secure_generator


def test_each_value_is_a_sum_of_four_gaussian_draws_halved():
    references = [torch.zeros(3, 5), torch.zeros(7)]
    drawn = SecureNoise(torch.Generator().manual_seed(11)).draw(2.0, references)
    replay = torch.Generator().manual_seed(11)
    torch.normal(0.0, 2.0, size=(1, 1), generator=replay)  # thrown away, as Opacus does
    expected = torch.empty(22).normal_(0.0, 2.0, generator=replay)
    for _ in range(3):
        expected.add_(torch.empty(22).normal_(0.0, 2.0, generator=replay))
    expected.mul_(0.5)
    assert [d.shape for d in drawn] == [torch.Size([3, 5]), torch.Size([7])]
    assert torch.equal(torch.cat([d.flatten() for d in drawn]), expected)


def test_a_chunk_larger_than_the_scratch_buffer_is_drawn_whole(monkeypatch):
    monkeypatch.setattr(noise_module, "_SCRATCH", 4)
    drawn = SecureNoise(torch.Generator().manual_seed(5)).draw(1.0, [torch.zeros(10)])[0]
    assert torch.all(drawn != 0)
    assert len(set(drawn.tolist())) == 10


def test_parallel_streams_draw_the_gaussian_mechanisms_noise():
    noise = SecureNoise(secure_generator()[0], streams=2)
    try:
        (drawn,) = noise.draw(3.0, [torch.zeros(1_000_000)])
        half = drawn.numel() // 2
        for part in (drawn[:half], drawn[half:]):  # each stream's chunk on its own
            assert abs(float(part.std()) - 3.0) < 0.03
            assert abs(float(part.mean())) < 0.03
        assert len({g.initial_seed() for g in noise.generators}) == 2
        (again,) = noise.draw(3.0, [torch.zeros(1_000_000)])
        assert not torch.equal(drawn, again)
    finally:
        noise.close()


def test_a_cpu_draw_has_the_streams_asked_for_and_at_least_one():
    assert len(SecureNoise(torch.Generator(), streams=3).generators) == 3
    assert len(SecureNoise(torch.Generator(), streams=0).generators) == 1


def test_zero_std_is_no_noise_and_dtypes_are_kept():
    drawn = SecureNoise(torch.Generator(), streams=2).draw(
        0.0, [torch.zeros(4), torch.zeros(2, dtype=torch.float64)]
    )
    assert [d.dtype for d in drawn] == [torch.float32, torch.float64]
    assert all(torch.count_nonzero(d) == 0 for d in drawn)


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_a_secure_dp_step_draws_its_noise_from_the_parallel_streams(mode):
    model = AdapterModel(ModelSpec(), device=torch.device("cpu"))
    rows = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(0))
    trainer = PrivateTrainer(
        model,
        ExampleSet.of_rows(rows),
        batch_size=8,
        learning_rate=1.0,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        mode=mode,
        optimizer="sgd",
    )
    try:
        assert trainer.secure_noise is not None
        assert trainer.optimizer.secure_noise is trainer.secure_noise
        assert trainer.secure_noise.generators[0] is trainer.noise_generator
        calls: list[float] = []
        draw = trainer.secure_noise.draw

        def counted(std, references):
            calls.append(std)
            return draw(std, references)

        trainer.secure_noise.draw = counted
        trainer.step(torch.arange(8))
        assert calls == [1.0]  # once per step, for every parameter, at multiplier x clip
    finally:
        trainer.close()
