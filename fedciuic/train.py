"""Local training and evaluation of a region's adapters on its own blocks.

Pure PyTorch, no Flower: the ClientApp calls these with the region's data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fedciuic.model import AdapterModel


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


def train_local(
    model: AdapterModel,
    blocks: torch.Tensor,
    *,
    steps: int,
    batch_size: int,
    learning_rate: float,
    generator: torch.Generator,
) -> TrainStats:
    """Run ``steps`` AdamW steps on batches drawn from ``blocks`` by ``generator``."""
    net = model.model
    net.train()
    optimizer = torch.optim.AdamW(model.trainable_parameters(), lr=learning_rate)
    losses = []
    for _ in range(steps):
        index = torch.randint(
            0, blocks.shape[0], (min(batch_size, blocks.shape[0]),), generator=generator
        )
        batch = blocks[index].to(model.device)
        loss = net(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
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
