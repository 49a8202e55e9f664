"""DP-SGD on a region's adapters with Opacus: Poisson sampling, per-sample clipping, noise.

Opacus hooks work on the cached model itself, which also serves evaluation; a round parks
them, disabled and empty, for the next, since building them walks the whole model.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from opacus import PrivacyEngine
from opacus.data_loader import DPDataLoader, switch_generator
from opacus.grad_sample.grad_sample_module_fast_gradient_clipping import (
    GradSampleModuleFastGradientClipping,
)
from opacus.grad_sample.linear import compute_linear_norm_sample
from opacus.optimizers.optimizer import _check_processed_flag, _generate_noise, _mark_as_processed
from torch.utils.data import DataLoader, TensorDataset

from fedciuic.config import (
    REPRODUCIBLE_NOISE_WARNING,
    DPMode,
    DPSettings,
    LocalOptimizer,
    LocalTraining,
)
from fedciuic.data import Batch, ExampleSet
from fedciuic.model import (
    ONE_PROCESS,
    AdapterModel,
    Shard,
    TrainStats,
    add_proximal_term,
    blank_batch,
    lm_loss,
    lockstep,
    make_optimizer,
    paced,
    pause_on_recompute,
    shifted_logits,
    sum_across_ranks,
)
from fedciuic.opacus_logging import undo_opacus_basic_config
from fedciuic.privacy.ledger import PrivacyError
from fedciuic.privacy.noise import SecureNoise, secure_generator, seeded_generator

undo_opacus_basic_config()
log = logging.getLogger(__name__)
_warned: set[str] = set()


#: The privacy unit of each example of the pass under way (0, 1, ... in order), while
#: ghost clipping clips units of several examples; None: each example is its own unit.
_PASS_UNITS: list[torch.Tensor | None] = [None]


def _linear_norm_sample_any_rank(
    layer: torch.nn.Linear, activations: list[torch.Tensor], backprops: torch.Tensor
) -> dict[torch.nn.Parameter, torch.Tensor]:
    """Ghost-clipping norms for ``nn.Linear`` inputs of any rank (MLA's ``kv_b_proj`` sees
    ``[B, 1, T, D]``): folding the middle dimensions gives the same per-sample gradient."""
    if backprops.dim() > 3:
        backprops = backprops.reshape(backprops.shape[0], -1, backprops.shape[-1])
        activations = [a.reshape(a.shape[0], -1, a.shape[-1]) for a in activations]
    owners = _PASS_UNITS[0]
    if owners is not None:
        return _unit_norms(layer, activations[0], backprops, owners)
    norms: dict[torch.nn.Parameter, torch.Tensor] = compute_linear_norm_sample(
        layer, activations, backprops
    )
    return norms


def _unit_norms(
    layer: torch.nn.Linear, inputs: torch.Tensor, backprops: torch.Tensor, owners: torch.Tensor
) -> dict[torch.nn.Parameter, torch.Tensor]:
    """Per example and trainable tensor of ``layer``, the norm of its unit's mean gradient."""
    count = int(owners.max()) + 1
    sizes = torch.bincount(owners, minlength=count).to(backprops.dtype)
    grads: dict[torch.nn.Parameter, torch.Tensor] = {}
    weight = layer.weight
    if isinstance(weight, torch.nn.Parameter) and weight.requires_grad:
        grads[weight] = torch.einsum("n...o,n...i->noi", backprops, inputs)
    bias = layer.bias
    if isinstance(bias, torch.nn.Parameter) and bias.requires_grad:
        grads[bias] = backprops.reshape(backprops.shape[0], -1, backprops.shape[-1]).sum(1)
    norms = {}
    for param, per_example in grads.items():
        summed = per_example.new_zeros((count, *per_example.shape[1:]))
        summed.index_add_(0, owners, per_example)
        norms[param] = (summed.flatten(1).norm(dim=1) / sizes)[owners]
    return norms


def _unit_coefficients(hooks: Any) -> Any:
    """Ghost clipping's coefficients over each example's unit size, so the second backward
    pass sums each unit's clipped mean gradient, as hooks mode does."""
    per_example = hooks.get_clipping_coef

    def coefficients() -> torch.Tensor:
        coefficient: torch.Tensor = per_example()
        owners = _PASS_UNITS[0]
        if owners is None:
            return coefficient
        sizes = torch.bincount(owners).to(coefficient)
        return coefficient / sizes[owners.to(coefficient.device)]

    return coefficients


GradSampleModuleFastGradientClipping.NORM_SAMPLERS[torch.nn.Linear] = _linear_norm_sample_any_rank


def parameter_device(params: Iterable[torch.Tensor]) -> torch.device:
    """The one device that holds every trainable parameter: Opacus draws all noise with
    one generator, which fails on parameters of another device."""
    devices = {p.device for p in params}
    if not devices:
        raise PrivacyError("DP-SGD: the model has no trainable parameters")
    if len(devices) > 1:
        raise PrivacyError(
            "DP-SGD: the trainable parameters are spread over "
            f"{', '.join(sorted(str(d) for d in devices))}; the adapters must sit on one "
            "device so that their noise comes from one generator on it"
        )
    return devices.pop()


def _release_noise(size: int, std: float, *, secure_mode: bool, seed: int | None) -> list[float]:
    """``size`` Gaussian draws of ``std`` as DP-SGD's (``seed``: tests only, not secure)."""
    if seed is not None and not secure_mode:
        gen = seeded_generator("cpu", seed)
    else:
        gen, _ = secure_generator("cpu")
    reference = torch.zeros(size, dtype=torch.float64)
    return [float(z) for z in _generate_noise(std, reference, gen, secure_mode)]


def dp_count(count: int, std: float, *, secure_mode: bool, seed: int | None = None) -> int:
    """``count`` plus Gaussian noise of ``std``, rounded and at least 0 (post-processing):
    the Gaussian mechanism of sensitivity 1 (a unit more or less changes a count by one)."""
    (noise,) = _release_noise(1, std, secure_mode=secure_mode, seed=seed)
    return max(0, round(count + noise))


def dp_mean(
    values: Sequence[float],
    clip: float,
    noise: float,
    *,
    secure_mode: bool,
    seed: int | None = None,
) -> tuple[float, int]:
    """The mean of ``values`` (one per unit) clipped to [0, ``clip``], and their count, from
    a noised sum and count: one Gaussian mechanism of L2 sensitivity sqrt(2)."""
    on_sum, on_count = _release_noise(2, noise, secure_mode=secure_mode, seed=seed)
    total = sum(min(max(v, 0.0), clip) for v in values) + clip * on_sum
    count = len(values) + on_count
    return min(max(total, 0.0) / max(count, 1.0), clip), max(1, round(count))


def warn_once(message: str) -> None:
    """Say ``message`` once per process, loudly (where the DP noise comes from)."""
    if message not in _warned:
        _warned.add(message)
        log.warning(message)


class _Engine(PrivacyEngine):  # type: ignore[misc]
    """Opacus' engine in plain mode (its secure mode would sample and noise from one CPU
    generator; the trainer sets its own); ``parked``: an earlier round's hooks."""

    def __init__(self, parked: Any = None) -> None:
        self.parked = parked
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # we say it ourselves
            super().__init__(accountant="prv", secure_mode=False)

    def _prepare_model(self, module: torch.nn.Module, **settings: Any) -> Any:
        if self.parked is None:
            return super()._prepare_model(module, **settings)
        self.parked.enable_hooks()
        return self.parked


#: Per model, the hooks-mode hooks its last round parked, and the trainable parameters
#: they were built for (hooks on other parameters are not taken up).
_PARKED: weakref.WeakKeyDictionary[AdapterModel, tuple[tuple[int, ...], Any]] = (
    weakref.WeakKeyDictionary()
)


def _take_parked(model: AdapterModel, mode: DPMode) -> Any:
    """The hooks parked on ``model`` if a trainer in ``mode`` can take them up, else None
    and they are removed (a model holds one set of hooks at a time)."""
    built, hooks = _PARKED.pop(model, ((), None))
    if hooks is None:
        return None
    if mode == "hooks" and built == tuple(map(id, model.trainable_parameters())):
        return hooks
    hooks.cleanup()
    return None


def _park(model: AdapterModel, hooks: Any) -> None:
    """Leave ``hooks`` on ``model`` for its next round, disabled and holding no state."""
    hooks.disable_hooks()
    for module in model.model.modules():
        for attr in ("activations", "max_batch_len"):
            if hasattr(module, attr):
                delattr(module, attr)
    params = model.trainable_parameters()
    for param in params:
        param._forward_counter = 0  # type: ignore[attr-defined]
    _PARKED[model] = (tuple(map(id, params)), hooks)


class _SecureNoiseOptimizer:
    """Opacus' secure noise for a whole step at once, in parallel streams: the same sums."""

    params: list[torch.nn.Parameter]
    noise_multiplier: float
    max_grad_norm: float
    secure_noise: SecureNoise

    def add_noise(self) -> None:
        sums = [p.summed_grad for p in self.params]  # type: ignore[attr-defined]
        for summed in sums:
            _check_processed_flag(summed)
        multiplier = getattr(self, "_adjusted_noise_multiplier", self.noise_multiplier)
        noises = self.secure_noise.draw(multiplier * self.max_grad_norm, sums)
        for p, summed, noise in zip(self.params, sums, noises, strict=True):
            p.grad = (summed + noise).view_as(p)
            _mark_as_processed(summed)


class _AcrossRanks:
    """Turns an Opacus DP optimizer into DP-DDP over the default process group: each
    rank clips and sums its own units, rank 0 alone adds the noise, and the sum over
    the ranks is scaled by the *global* expected batch, so the update is one Gaussian
    mechanism on the global Poisson batch, as the ledger accounts it."""

    rank: int
    params: list[torch.nn.Parameter]
    original_optimizer: torch.optim.Optimizer

    def add_noise(self) -> None:
        if self.rank == 0:
            super().add_noise()  # type: ignore[misc]
        else:
            for p in self.params:
                p.grad = p.summed_grad.view_as(p)  # type: ignore[attr-defined]

    def step(self, closure: Any = None) -> Any:
        if self.pre_step(closure):  # type: ignore[attr-defined]
            sum_across_ranks([p.grad for p in self.params if p.grad is not None])
            return self.original_optimizer.step()
        return None


def _mixed(optimizer: Any, mixin: type, **attrs: Any) -> Any:
    """``optimizer`` (any Opacus DP optimizer) with ``mixin``'s methods and ``attrs``, in place."""
    cls, name = type(optimizer), mixin.__name__.strip("_").removesuffix("Optimizer")
    optimizer.__class__ = type(f"{name}{cls.__name__}", (mixin, cls), {})
    vars(optimizer).update(attrs)
    return optimizer


class _ShardSampler:
    """Poisson sampling of this rank's units (index = rank mod ranks) at the global rate q,
    so the union over ranks is one Poisson sample at q; each yields every batch, empty too."""

    def __init__(self, shard: Shard, count: int, rate: float, passes: int, gen: torch.Generator):
        self.units = torch.arange(shard.rank, count, shard.size)
        self.rate, self.passes, self.generator = rate, passes, gen

    def __len__(self) -> int:
        return self.passes

    def __iter__(self) -> Any:
        for _ in range(self.passes):
            mask = torch.rand(len(self.units), generator=self.generator) < self.rate
            yield (self.units[mask],)


def physical_parts(owners: torch.Tensor, size: int) -> list[tuple[int, int]]:
    """``(start, stop)`` parts of a batch whose ``owners`` (units) are in order: whole
    units, at most ``size`` examples (a larger unit alone; 0: the whole batch)."""
    total = len(owners)
    if size <= 0 or total <= size:
        return [(0, total)]
    starts = [0, *(torch.nonzero(owners[1:] != owners[:-1]).flatten() + 1).tolist(), total]
    parts: list[tuple[int, int]] = []
    begin = 0
    for end, following in itertools.pairwise(starts[1:]):
        if following - begin > size:
            parts.append((begin, end))
            begin = end
    parts.append((begin, total))
    return parts


class PrivateTrainer:
    """One round of DP-SGD on ``model``'s adapters; call :meth:`close` when done.

    Each step Poisson-samples privacy units (a record, or a user's records) and clips the
    mean gradient of up to ``max_examples_per_unit`` of each one's examples (user-level
    sampling, Chua et al. 2024); with one example per unit this is Opacus' DP-SGD.
    """

    def __init__(
        self,
        model: AdapterModel,
        examples: ExampleSet,
        *,
        batch_size: int,
        max_examples_per_unit: int = 1,
        learning_rate: float,
        noise_multiplier: float,
        max_grad_norm: float,
        mode: DPMode = "hooks",
        secure_mode: bool = True,
        seed: int | None = None,
        optimizer: LocalOptimizer = "adamw",
        shard: Shard = ONE_PROCESS,
        proximal_mu: float = 0.0,
        units: int | None = None,
        physical_batch: int = 0,
    ) -> None:
        """``seed`` makes noise and sampling reproducible, and predictable to whoever knows
        it: tests only, ignored in ``secure_mode``. ``units``: the DP count the rate and
        averaging follow from. ``physical_batch``: most examples a pass (0: all)."""
        self.model, self.mode, self.examples = model, mode, examples
        self.physical_batch = physical_batch
        self.units = examples.grouped
        self.per_unit = min(max_examples_per_unit, self.units.largest)
        engine = _Engine(_take_parked(model, mode))
        self._stack = contextlib.ExitStack()
        device = parameter_device(model.trainable_parameters())
        self.reproducible = seed is not None and not secure_mode
        if seed is not None and not secure_mode:
            warn_once(REPRODUCIBLE_NOISE_WARNING)
            noise_gen = seeded_generator(device, seed)
            sample_gen = seeded_generator("cpu", seed + 1 + shard.rank)
        else:  # noise where the parameters are; Opacus' sampler draws on the CPU
            noise_gen, _ = secure_generator(device)
            sample_gen, _ = secure_generator("cpu")
        self.noise_generator, self.sample_generator = noise_gen, sample_gen
        # Opacus Poisson-samples the units' numbers; each step then gathers their examples.
        loader = DataLoader(TensorDataset(torch.arange(self.units.count)), batch_size=batch_size)
        opt = make_optimizer(optimizer, model.trainable_parameters(), learning_rate)
        # FedProx on the inner optimizer: after clipping, noise and the sum over ranks.
        prox = add_proximal_term(opt, model.trainable_parameters(), proximal_mu)
        if prox is not None:
            self._stack.callback(prox.remove)
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
            # Ghost clipping needs Opacus' wrapper; hooks mode leaves the cached model as is.
            wrap_model=mode == "ghost",
            noise_generator=noise_gen,
        )
        if mode == "ghost":
            self.hooks, self.optimizer, self.criterion, self.loader = made
            self.net: torch.nn.Module = self.hooks
            self.hooks.get_clipping_coef = _unit_coefficients(self.hooks)
        else:
            self.hooks, self.optimizer, self.loader = made
            self.criterion = None
            self.net = model.model
        # Checkpointed layers are recomputed in the backward pass: the hooks skip that.
        self._stack.enter_context(pause_on_recompute(self.hooks))
        # Opacus' secure noise (sums of Gaussians, against floating-point attacks).
        self.optimizer.secure_mode = secure_mode
        self.secure_noise: SecureNoise | None = None
        if secure_mode:
            # One stream per thread torch computes with (a ClientApp's CPU share).
            self.secure_noise = SecureNoise(noise_gen, torch.get_num_threads())
            self._stack.callback(self.secure_noise.close)
            self.optimizer = _mixed(
                self.optimizer, _SecureNoiseOptimizer, secure_noise=self.secure_noise
            )
        self.loader = switch_generator(data_loader=self.loader, generator=sample_gen)
        passes = len(loader)
        if units is not None:
            # Rate and averaging from the DP count, not the exact one (docs/privacy.md).
            passes = math.ceil(units / batch_size)
            self.loader = DPDataLoader(
                TensorDataset(torch.arange(self.units.count)),
                sample_rate=1.0 / passes,
                generator=sample_gen,
            )
            self.optimizer.expected_batch_size = int(units / passes)
        self.sample_rate = 1.0 / passes
        if shard.distributed:
            self.optimizer = _mixed(self.optimizer, _AcrossRanks, rank=shard.rank)
            if self.criterion is not None:
                self.criterion.optimizer = self.optimizer
            self.loader = _ShardSampler(
                shard, self.units.count, self.sample_rate, passes, sample_gen
            )
        self.max_examples_per_unit, self.batch_size = max_examples_per_unit, batch_size
        #: DP-SGD steps taken (each one noised), and how many had an empty Poisson batch.
        self.steps_taken = self.empty_steps = 0

    @classmethod
    def for_run(
        cls,
        model: AdapterModel,
        examples: ExampleSet,
        local: LocalTraining,
        dp: DPSettings,
        *,
        noise_multiplier: float,
        seed: int,
        shard: Shard = ONE_PROCESS,
        units: int | None = None,
    ) -> PrivateTrainer:
        """The trainer a region's round uses."""
        return cls(
            model,
            examples,
            batch_size=local.batch_size,
            max_examples_per_unit=dp.max_examples_per_unit,
            learning_rate=local.learning_rate,
            noise_multiplier=noise_multiplier,
            max_grad_norm=dp.max_grad_norm,
            mode=dp.dp_mode,
            secure_mode=dp.secure_mode,
            # The run config's seed is the aggregator's: it reaches the noise only on request.
            seed=seed if dp.insecure_reproducible_noise else None,
            optimizer=local.optimizer,
            shard=shard,
            proximal_mu=local.proximal_mu,
            units=units,
            physical_batch=local.max_physical_batch_size,
        )

    def gather(self, units: torch.Tensor) -> tuple[Batch, torch.Tensor]:
        """The sampled units' examples (at most ``per_unit`` each) as one batch, and the
        position of each example's unit in ``units``."""
        positions: list[int] = []
        owners: list[int] = []
        for slot, unit in enumerate(units.tolist()):
            owned = self.units.examples(int(unit))
            if len(owned) > self.per_unit:
                pick = torch.randperm(len(owned), generator=self.sample_generator)
                owned = owned[pick[: self.per_unit].numpy()]
            positions.extend(int(p) for p in owned)
            owners.extend([slot] * len(owned))
        return self.examples.batch(positions), torch.tensor(owners, dtype=torch.long)

    def step(self, units: torch.Tensor) -> float:
        """One DP-SGD step on the sampled ``units``; returns the batch loss."""
        batch, owners = self.gather(units)
        return self._step_batch(batch, owners)

    def _step_batch(self, batch: Batch, owners: torch.Tensor) -> float:
        """One DP-SGD step on ``batch`` of units ``owners`` (0, 1, ... in order), in
        passes of whole units, noised once at the end (as Opacus' ``BatchMemoryManager``)."""
        parts = physical_parts(owners, self.physical_batch)
        return self._take(batch, owners, parts, self._passes(len(parts)))

    def _passes(self, own: int) -> int:
        """This rank's passes, or with a sharded base the most any rank takes."""
        return lockstep(own, self.model.device) if self.model.sharded else own

    def _take(
        self, batch: Batch, owners: torch.Tensor, parts: list[tuple[int, int]], passes: int
    ) -> float:
        """``passes`` passes over ``parts`` (any more blank), then the step; the mean loss."""
        total = 0.0
        for index in range(passes):
            # Clears the per-sample gradients; the sum of the parts before is kept.
            self.optimizer.zero_grad(set_to_none=True)
            if index < len(parts):
                total += self._pass(batch, owners, *parts[index])
            else:  # a sharded base: the other ranks' passes gather from this one
                (self._loss(blank_batch(self.model.device)) * 0.0).backward()
            self.optimizer.signal_skip_step(do_skip=index < passes - 1)
            self.optimizer.step()
        return total / max(len(batch), 1)

    def _pass(self, batch: Batch, owners: torch.Tensor, start: int, stop: int) -> float:
        """Forward and backward on ``start:stop`` (whole units); their summed loss."""
        first, last = int(owners[start]), int(owners[stop - 1])
        grouped = stop - start > last - first + 1  # a unit of several examples
        mine = (owners[start:stop] - first).to(self.model.device)
        loss = self._loss(batch.rows(start, stop).to(self.model.device))
        _PASS_UNITS[0] = mine if grouped and self.criterion is not None else None
        try:
            loss.backward()
        finally:
            _PASS_UNITS[0] = None
        if grouped and self.criterion is None:
            self._per_unit_gradients(mine, last - first + 1)
        return float(loss.detach()) * (stop - start)

    def _loss(self, part: Batch) -> Any:
        """``part``'s loss; with ghost clipping, Opacus' that runs both backward passes."""
        if self.criterion is None:
            return lm_loss(self.net, part)
        logits, targets = shifted_logits(self.net, part)
        return self.criterion(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), shape=targets.shape
        )

    def worst_batch(self, seq_len: int) -> tuple[Batch, torch.Tensor]:
        """A synthetic batch of the largest shape a step plans for, from public sizes alone
        (units and examples counts, already released); not clamped to the largest unit's
        size, which is private (how many records one user has)."""
        count = max(1, min(self.batch_size, self.units.count))
        total = max(count, min(count * self.max_examples_per_unit, len(self.examples)))
        vocab = int(self.model.model.get_input_embeddings().num_embeddings)
        ids = torch.randint(0, vocab, (total, seq_len), generator=torch.Generator().manual_seed(0))
        return Batch.of_ids(ids), torch.arange(total) * count // total

    def time_step(self, seq_len: int, slowdown: float = 1.0) -> float:
        """Seconds of one DP-SGD step on :meth:`worst_batch` after a warm-up, reading no
        record; the adapters and optimizer state are restored."""
        params = self.optimizer.params
        saved = [p.detach().clone() for p in params]
        batch, owners = self.worst_batch(seq_len)
        try:
            self._step_batch(batch.first(1), owners[:1])
            return paced(partial(self._step_batch, batch, owners), slowdown)[1]
        finally:
            self.optimizer.zero_grad(set_to_none=True)
            self.optimizer.original_optimizer.state.clear()
            with torch.no_grad():
                for param, value in zip(params, saved, strict=True):
                    param.copy_(value)

    def _per_unit_gradients(self, owners: torch.Tensor, count: int) -> None:
        """Per-example gradients to their mean per unit, so units are clipped, not examples."""
        sizes = torch.bincount(owners, minlength=count).clamp(min=1)
        for param in self.optimizer.params:
            per_example = getattr(param, "grad_sample", None)
            if per_example is None:
                continue
            summed = per_example.new_zeros((count, *per_example.shape[1:]))
            summed.index_add_(0, owners, per_example)
            view = (count,) + (1,) * (per_example.dim() - 1)
            param.grad_sample = summed / sizes.view(view).to(summed.dtype)

    def noise_step(self) -> None:
        """A DP-SGD step on an empty Poisson batch, noised as any other: the accountant
        counts every step, and skipping one would reveal the batch was empty."""
        passes = self._passes(0)
        if passes:  # a sharded base: blank passes while another rank trains
            empty = torch.zeros((0, 2), dtype=torch.long)
            self._take(Batch.of_ids(empty), empty[:, 0], [], passes)
            return
        self.optimizer.zero_grad(set_to_none=True)
        for param in self.optimizer.params:
            if self.mode == "ghost":
                param.grad = torch.zeros_like(param)
            else:
                param.grad_sample = param.new_zeros((0, *param.shape))
        self.optimizer.step()

    def run(self, steps: int, slowdown: float = 1.0) -> TrainStats:
        """Exactly ``steps`` DP-SGD steps, never cut short by a clock (a stop that depends
        on the sampled records is not what the ledger accounts)."""
        losses: list[float] = []
        done = 0
        while done < steps:
            for (units,) in self.loader:
                if done == steps:
                    break
                if units.shape[0] == 0:
                    paced(self.noise_step, slowdown)
                    self.empty_steps += 1
                else:
                    losses.append(paced(partial(self.step, units), slowdown)[0])
                done += 1
                self.steps_taken += 1
        mean = sum(losses) / len(losses) if losses else float("nan")
        return TrainStats(loss=mean, steps=self.steps_taken, num_examples=len(self.examples))

    def close(self, park: bool = False) -> None:
        """Remove Opacus' buffers and hooks, or with ``park`` leave the hooks for the next."""
        self._stack.close()
        if self.mode == "ghost":
            self.hooks._close()
        elif not park:
            self.hooks.cleanup()
        for param in self.model.trainable_parameters():
            for attr in ("grad_sample", "_current_grad_sample", "_forward_counter", "summed_grad"):
                if hasattr(param, attr):
                    delattr(param, attr)
        if park and self.mode == "hooks":
            _park(self.model, self.hooks)


@dataclass(frozen=True)
class PrivateRound:
    """What one round of DP-SGD did; its steps (empty batches included) must match the ledger."""

    stats: TrainStats
    steps_taken: int
    empty_steps: int


def private_round(
    model: AdapterModel,
    examples: ExampleSet,
    local: LocalTraining,
    dp: DPSettings,
    *,
    noise_multiplier: float,
    sample_rate: float,
    steps: int,
    seed: int,
    who: str,
    shard: Shard = ONE_PROCESS,
    slowdown: float = 1.0,
    units: int | None = None,
) -> PrivateRound:
    """``steps`` DP-SGD steps, refused if the trainer would sample at another rate than the
    ledger accounts."""
    trainer = PrivateTrainer.for_run(
        model,
        examples,
        local,
        dp,
        noise_multiplier=noise_multiplier,
        seed=seed,
        shard=shard,
        units=units,
    )
    ended = False
    try:
        if trainer.sample_rate != sample_rate:
            raise PrivacyError(
                f"{who}: the trainer samples at rate {trainer.sample_rate:g}, the ledger "
                f"would account {sample_rate:g}; nothing was trained or sent"
            )
        stats = trainer.run(steps, slowdown)
        ended = True
    finally:
        trainer.close(park=ended)
    return PrivateRound(stats, trainer.steps_taken, trainer.empty_steps)


def plan_private_steps(local: LocalTraining, timer: Callable[[], float]) -> int:
    """local-steps, or as many as fit in local-time-budget by ``timer``, a worst-shape
    synthetic step: stopping on the clock would make the step count depend on the private
    data, which the accounting does not cover."""
    if local.local_time_budget <= 0:
        return local.local_steps
    seconds = timer()
    fits = math.floor(local.local_time_budget / seconds) if seconds > 0 else local.local_steps
    return max(1, min(local.local_steps, fits))


def time_private_step(
    model: AdapterModel,
    examples: ExampleSet,
    local: LocalTraining,
    dp: DPSettings,
    noise_multiplier: float = 1.0,
    slowdown: float = 1.0,
) -> float:
    """Seconds of one DP-SGD step here, leaving no trace: torch's random state is restored
    too, so a reproducible run draws the same numbers."""
    with torch.random.fork_rng():
        trainer = PrivateTrainer.for_run(
            model, examples, local, dp, noise_multiplier=noise_multiplier, seed=0
        )
        timed = False
        try:
            seconds = trainer.time_step(local.seq_len, slowdown)
            timed = True
            return seconds
        finally:
            trainer.close(park=timed)
