"""Weighted aggregation of adapter deltas (pure NumPy, no Flower).

FedAvg over deltas: ``global + server_lr * sum_i w_i * delta_i / sum_i w_i``, with
``w_i`` the number of training examples of region ``i``. Starting every region from
the same global adapter makes this equal to averaging the local adapters when
``server_lr`` is 1.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from fedciuic.model import check_same_layout


def check_update(delta: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray]) -> None:
    """Raise ``ValueError`` unless ``delta`` has the reference's keys, shapes and finite values."""
    check_same_layout(delta, reference, what="update")
    for name, value in delta.items():
        if not np.all(np.isfinite(value)):
            raise ValueError(f"update {name}: contains NaN or infinite values")


def weighted_mean(
    deltas: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float]
) -> dict[str, np.ndarray]:
    """Weighted mean of deltas, accumulated in place (one buffer per tensor)."""
    if not deltas or len(deltas) != len(weights):
        raise ValueError("need one positive weight per delta and at least one delta")
    total = float(sum(weights))
    if total <= 0:
        raise ValueError(f"weights must sum to a positive number, got {total}")
    mean = {name: np.zeros_like(value, dtype=np.float64) for name, value in deltas[0].items()}
    for delta, weight in zip(deltas, weights, strict=True):
        for name, acc in mean.items():
            acc += (weight / total) * delta[name]
    return {name: acc.astype(np.float32) for name, acc in mean.items()}


def apply_delta(
    current: Mapping[str, np.ndarray], delta: Mapping[str, np.ndarray], server_lr: float
) -> dict[str, np.ndarray]:
    """The next global adapter: ``current + server_lr * delta``."""
    return {
        name: (value + server_lr * delta[name]).astype(np.float32)
        for name, value in current.items()
    }
