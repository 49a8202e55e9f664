"""DP-SGD on a region's adapters with Opacus: Poisson sampling, per-sample clipping, noise.

Opacus hooks are attached to the cached model for one round and removed after it
(``wrap_model=False``), so the same model serves evaluation and later rounds.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any, Literal

import torch
from opacus import PrivacyEngine
from opacus.data_loader import switch_generator
from opacus.grad_sample.grad_sample_module_fast_gradient_clipping import (
    GradSampleModuleFastGradientClipping,
)
from opacus.grad_sample.linear import compute_linear_norm_sample
from torch.utils.data import DataLoader, TensorDataset

from fedciuic._opacus_logging import undo_opacus_basic_config
from fedciuic.model import AdapterModel
from fedciuic.train import Optimizer, TrainStats, lm_loss, make_optimizer, shifted_logits

undo_opacus_basic_config()
GradSampleMode = Literal["hooks", "ghost"]
log = logging.getLogger(__name__)
_warned_insecure = False


def _linear_norm_sample_any_rank(
    layer: torch.nn.Linear, activations: list[torch.Tensor], backprops: torch.Tensor
) -> dict[torch.nn.Parameter, torch.Tensor]:
    """Ghost-clipping norms for ``nn.Linear`` inputs of any rank.

    Opacus handles ``[B, D]`` and ``[B, T, D]``; MLA's ``kv_b_proj`` sees
    ``[B, 1, T, D]``. Folding the middle dimensions gives the same per-sample
    gradient (a sum of outer products over all positions), so we fold them.
    """
    if backprops.dim() > 3:
        backprops = backprops.reshape(backprops.shape[0], -1, backprops.shape[-1])
        activations = [a.reshape(a.shape[0], -1, a.shape[-1]) for a in activations]
    norms: dict[torch.nn.Parameter, torch.Tensor] = compute_linear_norm_sample(
        layer, activations, backprops
    )
    return norms


GradSampleModuleFastGradientClipping.NORM_SAMPLERS[torch.nn.Linear] = _linear_norm_sample_any_rank


def secure_generator() -> tuple[torch.Generator, str]:
    """A generator for noise and sampling that nobody can replay, and what it is.

    Opacus' secure mode expects ``torchcsprng``, which has no build for current
    PyTorch releases. Without it we seed PyTorch's generator with 64 bits from the
    operating system's CSPRNG (``os.urandom``): unpredictable, but not itself a
    CSPRNG. ``docs/privacy.md`` states this limit.
    """
    try:
        import torchcsprng

        gen: torch.Generator = torchcsprng.create_random_device_generator("/dev/urandom")
        return gen, "torchcsprng"
    except ImportError:
        gen = torch.Generator()
        gen.manual_seed(int.from_bytes(os.urandom(8), "little"))
        return gen, "torch generator seeded from os.urandom"


def warn_insecure_once() -> None:
    """Say once per process, loudly, that noise comes from a seeded PRNG."""
    global _warned_insecure
    if not _warned_insecure:
        _warned_insecure = True
        log.warning(
            "fedciuic: secure-mode is OFF: DP noise and Poisson sampling use a seeded "
            "pseudo-random generator. Fine for experiments; set secure-mode = true for "
            "production runs."
        )


class _Engine(PrivacyEngine):  # type: ignore[misc]
    """Opacus' engine with fedciuic's secure generator; accounting happens in the ledger."""

    def __init__(self, secure_mode: bool) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # we say it once ourselves
            super().__init__(accountant="prv", secure_mode=False)
        if secure_mode:
            self.secure_mode = True
            self.secure_rng, _ = secure_generator()


class PrivateTrainer:
    """One round of DP-SGD on ``model``'s adapters; call :meth:`close` when done."""

    def __init__(
        self,
        model: AdapterModel,
        blocks: torch.Tensor,
        *,
        batch_size: int,
        learning_rate: float,
        noise_multiplier: float,
        max_grad_norm: float,
        mode: GradSampleMode = "hooks",
        secure_mode: bool = False,
        seed: int = 0,
        optimizer: Optimizer = "adamw",
    ) -> None:
        self.model = model
        self.mode = mode
        self.blocks = blocks
        engine = _Engine(secure_mode)
        if not secure_mode:
            warn_insecure_once()
        noise_gen = None if secure_mode else torch.Generator().manual_seed(seed)
        loader = DataLoader(TensorDataset(blocks), batch_size=batch_size)
        opt = make_optimizer(optimizer, model.trainable_parameters(), learning_rate)
        model.model.train()
        made: Any = engine.make_private(
            module=model.model,
            optimizer=opt,
            criterion=torch.nn.CrossEntropyLoss(),
            data_loader=loader,
            noise_multiplier=noise_multiplier,
            max_grad_norm=max_grad_norm,
            poisson_sampling=True,
            grad_sample_mode=mode,
            # Ghost clipping needs Opacus' wrapper module; hooks mode works on the
            # model itself, so the cached model stays untouched between rounds.
            wrap_model=mode == "ghost",
            noise_generator=noise_gen,
        )
        if mode == "ghost":
            self.hooks, self.optimizer, self.criterion, self.loader = made
            self.net: torch.nn.Module = self.hooks
        else:
            self.hooks, self.optimizer, self.loader = made
            self.criterion = None
            self.net = model.model
        if not secure_mode:
            # Reproducible Poisson sampling, independent of the global torch RNG.
            self.loader = switch_generator(
                data_loader=self.loader, generator=torch.Generator().manual_seed(seed + 1)
            )
        self.sample_rate = 1.0 / len(loader)

    def step(self, batch: torch.Tensor) -> float:
        """One DP-SGD step on ``batch``; returns the batch loss."""
        batch = batch.to(self.model.device)
        self.optimizer.zero_grad(set_to_none=True)
        if self.criterion is not None:  # ghost clipping: Opacus runs both backward passes
            logits, targets = shifted_logits(self.net, batch)
            loss = self.criterion(
                logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), shape=targets.shape
            )
        else:
            loss = lm_loss(self.net, batch)
        loss.backward()
        self.optimizer.step()
        return float(loss.detach())

    def run(self, steps: int) -> TrainStats:
        """``steps`` steps on Poisson-sampled batches (an empty batch releases nothing)."""
        losses: list[float] = []
        done = 0
        while done < steps:
            for (batch,) in self.loader:
                if done == steps:
                    break
                done += 1
                if batch.shape[0] == 0:
                    continue
                losses.append(self.step(batch))
        mean = sum(losses) / len(losses) if losses else float("nan")
        return TrainStats(loss=mean, steps=steps, num_examples=self.blocks.shape[0])

    def close(self) -> None:
        """Remove Opacus' hooks and per-sample buffers from the model."""
        if self.mode == "ghost":
            self.hooks._close()
        else:
            self.hooks.cleanup()
        for param in self.model.trainable_parameters():
            for attr in ("grad_sample", "_forward_counter", "summed_grad"):
                if hasattr(param, attr):
                    delattr(param, attr)
