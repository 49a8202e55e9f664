"""Local training and evaluation of a region's adapters on its own examples (pure PyTorch)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.nn.functional as F

from fedciuic.config import LocalOptimizer
from fedciuic.data import IGNORE, Batch, ExampleSet
from fedciuic.model.adapter import AdapterModel

T = TypeVar("T")


@dataclass(frozen=True)
class TrainStats:
    loss: float  # mean training loss over the round's steps
    steps: int  # steps actually taken (with a local-time-budget, up to local-steps)
    num_examples: int  # examples available for training (the FedAvg weight)


@dataclass(frozen=True)
class Shard:
    """This process's ``torch.distributed`` rank among a region's training processes."""

    rank: int = 0
    size: int = 1

    @property
    def distributed(self) -> bool:
        return self.size > 1


#: One process (no process group).
ONE_PROCESS = Shard()


def sum_across_ranks(tensors: list[torch.Tensor]) -> None:
    """All-reduce (SUM) ``tensors`` in place as one buffer: one collective a step, not one each."""
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.SUM)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def lockstep(passes: int, device: torch.device) -> int:
    """The most passes any rank takes this step: with a sharded base every pass gathers
    from every rank, so each takes that many, blank ones after its own."""
    most = torch.tensor([passes], dtype=torch.long, device=device)
    torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX)
    return int(most.item())


def blank_batch(device: torch.device) -> Batch:
    """Two tokens: with its loss times zero, a pass that meets the other ranks' collectives
    and adds nothing (every gradient, per-sample ones too, is zero)."""
    return Batch.of_ids(torch.zeros((1, 2), dtype=torch.long)).to(device)


def paced(step: Callable[[], T], slowdown: float = 1.0) -> tuple[T, float]:
    """Run one local training step: its result and seconds. Every loop paces steps here, so
    a ``slowdown`` (tests only) slows a region alike everywhere (docs/heterogeneity.md)."""
    began = time.perf_counter()
    result = step()
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        torch.cuda.synchronize()  # the step's kernels, not just their launch
    took = time.perf_counter() - began
    if slowdown > 1.0:
        time.sleep((slowdown - 1.0) * took)
    return result, took * max(slowdown, 1.0)


def add_proximal_term(
    optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], mu: float
) -> torch.utils.hooks.RemovableHandle | None:
    """FedProx: add ``mu * (w - w_start)`` to each gradient right before ``optimizer``
    steps (None for ``mu = 0``). Under DP-SGD this runs after clipping, noise and the sum
    over ranks: post-processing of the privatized gradient, at no privacy cost."""
    if mu == 0.0:
        return None
    anchors = [p.detach().clone() for p in params]

    def hook(*_: object) -> None:
        with torch.no_grad():
            for param, anchor in zip(params, anchors, strict=True):
                pull = (param - anchor).mul_(mu)
                if param.grad is None:
                    param.grad = pull
                else:
                    param.grad.add_(pull)

    return optimizer.register_step_pre_hook(hook)


@dataclass(frozen=True)
class EvalStats:
    loss: float  # mean next-token cross-entropy over all held-out tokens
    num_examples: int
    #: Seconds a local DP-SGD step takes here (a synthetic worst-shape batch, nothing private).
    step_seconds: float | None = None
    #: A DP evaluation's release (epsilon, ledger head) for the audit log; None if exact.
    released: dict[str, object] | None = None

    @property
    def perplexity(self) -> float:
        return math.exp(min(self.loss, 50.0))


def make_optimizer(
    name: LocalOptimizer, params: list[torch.nn.Parameter], learning_rate: float
) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=learning_rate)
    return torch.optim.AdamW(params, lr=learning_rate)


def shifted_logits(model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token logits ``[B, T-1, V]`` and their labels ``[B, T-1]`` (``-100``: no loss)."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    return logits[:, :-1, :], batch.labels[:, 1:]


def _cross_entropy(logits: torch.Tensor, targets: torch.Tensor, reduction: str) -> torch.Tensor:
    flat = logits.reshape(-1, logits.shape[-1])
    return F.cross_entropy(flat, targets.reshape(-1), reduction=reduction, ignore_index=IGNORE)


def example_losses(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """Each example's mean next-token cross-entropy over its labelled tokens, ``[B]``."""
    logits, targets = shifted_logits(model, batch)
    per_token = _cross_entropy(logits, targets, "none").view(targets.shape)
    counted = (targets != IGNORE).sum(dim=1).clamp(min=1)
    return per_token.sum(dim=1) / counted


@torch.no_grad()
def unit_losses(model: AdapterModel, examples: ExampleSet, *, batch_size: int) -> list[float]:
    """Each privacy unit's held-out loss, its examples' mean (what a DP evaluation clips)."""
    net = model.model
    net.eval()
    losses = torch.empty(len(examples), dtype=torch.float64)
    for positions, batch in examples.batches(batch_size):
        batch_losses = example_losses(net, batch.to(model.device)).double().cpu()
        losses[torch.as_tensor(positions)] = batch_losses
    units = examples.grouped
    return [float(losses[units.examples(u)].mean()) for u in range(units.count)]


def lm_loss(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """The mean of example losses, not token losses: per-sample gradients are per example."""
    return example_losses(model, batch).mean()


def train_local(
    model: AdapterModel,
    examples: ExampleSet,
    *,
    steps: int,
    batch_size: int,
    learning_rate: float,
    generator: torch.Generator,
    optimizer: LocalOptimizer = "adamw",
    shard: Shard = ONE_PROCESS,
    time_budget: float = 0.0,
    slowdown: float = 1.0,
    proximal_mu: float = 0.0,
) -> TrainStats:
    """Non-private training: ``steps`` steps on batches drawn by ``generator``.

    A ``time_budget`` stops after the first step ending past it (no privacy at stake; rank
    0's clock decides). Every rank of a ``shard`` draws the same batch and trains on its
    share, loss weighted by it, so summed gradients equal one process's step on it all.
    """
    net = model.model
    net.train()
    params = model.trainable_parameters()
    opt = make_optimizer(optimizer, params, learning_rate)
    prox = add_proximal_term(opt, params, proximal_mu)
    deadline = time.monotonic() + time_budget if time_budget > 0 else math.inf

    def one_step() -> tuple[float, bool]:
        size = min(batch_size, len(examples))
        index = torch.randint(0, len(examples), (size,), generator=generator)
        mine = index[shard.rank :: shard.size]
        opt.zero_grad(set_to_none=True)
        if len(mine):
            loss = lm_loss(net, examples.batch(mine.tolist()).to(model.device))
            loss = loss * (len(mine) / size)
            loss.backward()  # type: ignore[no-untyped-call]
            value = loss.detach().reshape(1).clone()
        else:
            value = torch.zeros(1, device=model.device)
            if model.sharded:  # the other ranks' passes gather from this one
                blank = lm_loss(net, blank_batch(model.device)) * 0.0
                blank.backward()  # type: ignore[no-untyped-call]
        late = shard.rank == 0 and time.monotonic() >= deadline
        if shard.distributed:
            grads = []
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.append(p.grad)
            flag = torch.tensor([float(late)], device=model.device)
            sum_across_ranks([*grads, value, flag])
            late = bool(flag.item() > 0)
        opt.step()
        return float(value), late

    losses: list[float] = []
    try:
        while len(losses) < steps:
            (loss, late), _ = paced(one_step, slowdown)
            losses.append(loss)
            if late or (not shard.distributed and time.monotonic() >= deadline):
                break
    finally:
        if prox is not None:
            prox.remove()
    return TrainStats(loss=sum(losses) / len(losses), steps=len(losses), num_examples=len(examples))


@torch.no_grad()
def evaluate(model: AdapterModel, examples: ExampleSet, *, batch_size: int) -> EvalStats:
    """Mean cross-entropy of the model over every labelled token of ``examples``."""
    net = model.model
    net.eval()
    total, tokens = 0.0, 0
    for _, batch in examples.batches(batch_size):
        logits, targets = shifted_logits(net, batch.to(model.device))
        total += float(_cross_entropy(logits, targets, "sum"))
        tokens += int((targets != IGNORE).sum())
    return EvalStats(loss=total / max(tokens, 1), num_examples=len(examples))
