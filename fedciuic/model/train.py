"""Local training and evaluation of a region's adapters on its own blocks.

Pure PyTorch, no Flower: the ClientApp calls these with the region's data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from fedciuic.model.adapter import AdapterModel

Optimizer = Literal["adamw", "sgd"]


@dataclass(frozen=True)
class TrainStats:
    loss: float  # mean training loss over the round's steps
    steps: int
    num_examples: int  # blocks available for training (the FedAvg weight)


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


def shifted_logits(
    model: torch.nn.Module, batch: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token logits ``[B, T-1, V]`` and their targets ``[B, T-1]``."""
    logits = model(input_ids=batch).logits
    return logits[:, :-1, :], batch[:, 1:]


def lm_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Mean over the batch of each example's mean next-token cross-entropy.

    Written per example (not per token over the batch) so that DP-SGD's
    per-sample gradients are gradients of each example's own loss.
    """
    logits, targets = shifted_logits(model, batch)
    per_token = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none"
    )
    return per_token.view(targets.shape).mean(dim=1).mean()


def train_local(
    model: AdapterModel,
    blocks: torch.Tensor,
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
        size = min(batch_size, blocks.shape[0])
        index = torch.randint(0, blocks.shape[0], (size,), generator=generator)
        loss = lm_loss(net, blocks[index].to(model.device))
        opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        losses.append(float(loss.detach()))
    return TrainStats(loss=sum(losses) / len(losses), steps=steps, num_examples=blocks.shape[0])


@torch.no_grad()
def evaluate(model: AdapterModel, blocks: torch.Tensor, *, batch_size: int) -> EvalStats:
    """Token-weighted mean cross-entropy of the model on ``blocks``."""
    net = model.model
    net.eval()
    total, tokens = 0.0, 0
    for start in range(0, blocks.shape[0], batch_size):
        batch = blocks[start : start + batch_size].to(model.device)
        n = batch.numel() - batch.shape[0]  # one target fewer than tokens per row
        total += float(net(input_ids=batch, labels=batch).loss) * n
        tokens += n
    return EvalStats(loss=total / tokens, num_examples=blocks.shape[0])
