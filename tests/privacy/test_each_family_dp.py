"""DP-SGD on every supported architecture's own checkpoint: Opacus' per-sample
gradients through its LoRA targets equal plain autograd one example at a time (with
and without gradient checkpointing), and its global adapter loads back with peft and
generates."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedciuic.config import ModelSpec
from fedciuic.data.corpus import Batch, ExampleSet
from fedciuic.model.adapter import AdapterLayout, AdapterModel
from fedciuic.model.presets import TINY_FAMILIES, TINY_VOCAB_SIZE
from fedciuic.model.train import lm_loss
from fedciuic.privacy.dpsgd import PrivateTrainer

CPU = torch.device("cpu")
BATCH = 3


def _model(path: str, checkpointing: bool = False) -> AdapterModel:
    model = AdapterModel(
        ModelSpec(model_path=path, gradient_checkpointing=checkpointing), device=CPU
    )
    state = model.adapter_state()  # LoRA B is zero at init: make every adapter matter
    model.load_adapter_state({k: v + 0.01 if "lora_B" in k else v for k, v in state.items()})
    return model


def _rows() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(3, TINY_VOCAB_SIZE, (BATCH, 12), generator=gen)


def opacus_grads(model: AdapterModel, rows: torch.Tensor) -> torch.Tensor:
    """Opacus' per-sample gradients of ``model``'s adapters on ``rows`` in one batch:
    one flat row per example."""
    trainer = PrivateTrainer(
        model,
        ExampleSet.of_rows(rows),
        batch_size=len(rows),
        learning_rate=0.01,
        noise_multiplier=0.0,
        max_grad_norm=1e6,
        secure_mode=False,
        seed=1,
    )
    try:
        lm_loss(trainer.net, Batch.of_ids(rows)).backward()
        return torch.cat(
            [
                getattr(p, "grad_sample").reshape(len(rows), -1)  # noqa: B009
                for p in model.trainable_parameters()
            ],
            dim=1,
        )
    finally:
        trainer.close()


def autograd_grads(model: AdapterModel, rows: torch.Tensor) -> torch.Tensor:
    """Each row's gradient of the trainable parameters, one example at a time: what
    Opacus' per-sample gradients must equal."""
    params = model.trainable_parameters()
    return torch.stack(
        [
            torch.cat(
                [
                    g.flatten()
                    for g in torch.autograd.grad(
                        lm_loss(model.model, Batch.of_ids(r[None])), params
                    )
                ]
            )
            for r in rows
        ]
    )


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_per_sample_gradients_equal_autograd_one_example_at_a_time(tiny_checkpoints, family):
    rows = _rows()
    model = _model(str(tiny_checkpoints[family]))
    expected = autograd_grads(model, rows)
    assert float(expected.abs().max()) > 0
    torch.testing.assert_close(opacus_grads(model, rows), expected, rtol=1e-3, atol=1e-6)
    # Only the adapters train: the router, norms and everything else stay frozen.
    frozen = [n for n, p in model.model.named_parameters() if not p.requires_grad]
    assert frozen and all("lora_" not in n for n in frozen)
    assert all("lora_" in n for n, p in model.model.named_parameters() if p.requires_grad)


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_gradient_checkpointing_keeps_the_per_sample_gradients(tiny_checkpoints, family):
    rows = _rows()
    plain = opacus_grads(_model(str(tiny_checkpoints[family])), rows)
    checkpointed = opacus_grads(_model(str(tiny_checkpoints[family]), checkpointing=True), rows)
    torch.testing.assert_close(checkpointed, plain, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_the_global_adapter_loads_back_with_peft_and_generates(tiny_checkpoints, family, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoints[family]
    layout = AdapterLayout.of(ModelSpec(model_path=str(path)))
    trained = {k: v + 0.05 for k, v in layout.initial.items()}
    layout.save(trained, tmp_path / "adapter")
    base = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=False)
    loaded = PeftModel.from_pretrained(base, tmp_path / "adapter")
    params = dict(loaded.named_parameters())
    for name, value in trained.items():
        np.testing.assert_array_equal(params[name].detach().numpy(), value)
    prompt = _rows()[:1]
    out = loaded.generate(input_ids=prompt, max_new_tokens=3, do_sample=False)
    assert out.shape == (1, prompt.shape[1] + 3)
