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
) -> TrainStats:
    """Non-private training: ``steps`` steps on batches drawn by ``generator``."""
    net = model.model
    net.train()
    opt = make_optimizer(optimizer, model.trainable_parameters(), learning_rate)
    losses = []
    for _ in range(steps):
        size = min(batch_size, len(examples))
        index = torch.randint(0, len(examples), (size,), generator=generator)
        loss = lm_loss(net, examples.batch(index.tolist()).to(model.device))
        opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        losses.append(float(loss.detach()))
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
