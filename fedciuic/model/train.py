"""Local training and evaluation of a region's adapters on its own examples.

Pure PyTorch, no Flower: the ClientApp calls these with the region's data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from fedciuic.data.corpus import Batch, ExampleSet
from fedciuic.data.tokenized import IGNORE
from fedciuic.model.adapter import AdapterModel

Optimizer = Literal["adamw", "sgd"]


@dataclass(frozen=True)
class TrainStats:
    loss: float  # mean training loss over the round's steps
    steps: int
    num_examples: int  # examples available for training (the FedAvg weight)


@dataclass(frozen=True)
class Shard:
    """This process's place among a region's training processes (``torch.distributed``
    rank ``rank`` of ``size``); one process is ``Shard()``, and trains as it always did."""

    rank: int = 0
    size: int = 1

    @property
    def distributed(self) -> bool:
        return self.size > 1


#: One process: training as it always was (no process group).
ONE_PROCESS = Shard()


def sum_across_ranks(tensors: list[torch.Tensor]) -> None:
    """All-reduce (SUM) ``tensors`` in place over the default process group, as one
    flat buffer (one collective per step, not one per adapter)."""
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.SUM)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


@dataclass(frozen=True)
class EvalStats:
    loss: float  # mean next-token cross-entropy over all held-out tokens
    num_examples: int

    @property
    def perplexity(self) -> float:
        return math.exp(min(self.loss, 50.0))


def make_optimizer(
    name: Optimizer, params: list[torch.nn.Parameter], learning_rate: float
) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=learning_rate)
    return torch.optim.AdamW(params, lr=learning_rate)


def shifted_logits(model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token logits ``[B, T-1, V]`` and their labels ``[B, T-1]`` (``-100``: no loss)."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    return logits[:, :-1, :], batch.labels[:, 1:]


def example_losses(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """Each example's mean next-token cross-entropy over its labelled tokens, ``[B]``."""
    logits, targets = shifted_logits(model, batch)
    per_token = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        targets.reshape(-1),
        reduction="none",
        ignore_index=IGNORE,
    ).view(targets.shape)
    counted = (targets != IGNORE).sum(dim=1).clamp(min=1)
    return per_token.sum(dim=1) / counted


def lm_loss(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """Mean over the batch of each example's mean cross-entropy on its labelled tokens.

    Written per example (not per token over the batch) so that DP-SGD's
    per-sample gradients are gradients of each example's own loss.
    """
    return example_losses(model, batch).mean()


def train_local(
    model: AdapterModel,
    examples: ExampleSet,
    *,
    steps: int,
    batch_size: int,
    learning_rate: float,
    generator: torch.Generator,
    optimizer: Optimizer = "adamw",
    shard: Shard = ONE_PROCESS,
) -> TrainStats:
    """Non-private training: ``steps`` steps on batches drawn by ``generator``.

    With a ``shard`` of several processes, every rank draws the same global batch (the
    generator is seeded alike) and trains on its share of it, its loss weighted by
    that share; the gradients are summed over the ranks, so each step equals one
    process's step on the whole batch and every rank ends with the same adapters.
    """
    net = model.model
    net.train()
    params = model.trainable_parameters()
    opt = make_optimizer(optimizer, params, learning_rate)
    losses = []
    for _ in range(steps):
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
        if shard.distributed:
            grads = []
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.append(p.grad)
            sum_across_ranks([*grads, value])
        opt.step()
        losses.append(float(value))
    return TrainStats(loss=sum(losses) / len(losses), steps=steps, num_examples=len(examples))


@torch.no_grad()
def evaluate(model: AdapterModel, examples: ExampleSet, *, batch_size: int) -> EvalStats:
    """Mean cross-entropy of the model over every labelled token of ``examples``."""
    net = model.model
    net.eval()
    total, tokens = 0.0, 0
    for batch in examples.batches(batch_size):
        logits, targets = shifted_logits(net, batch.to(model.device))
        total += float(
            F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]),
                targets.reshape(-1),
                reduction="sum",
                ignore_index=IGNORE,
            )
        )
        tokens += int((targets != IGNORE).sum())
    return EvalStats(loss=total / max(tokens, 1), num_examples=len(examples))
