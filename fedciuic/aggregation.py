"""Weighted aggregation of compressed adapter deltas (pure NumPy, no Flower).

FedAvg over deltas: ``global + server_lr * sum_i w_i * delta_i / sum_i w_i``, with
``w_i`` the number of training examples of region ``i``. Each update is decoded
(and validated) on its own and added straight into one float64 accumulator, by
scatter-add for sparse codecs: memory is the model size plus one update, whatever
the number of regions.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from fedciuic.compression import Codec


class Accumulator:
    """``sum_i w_i * delta_i`` over validated updates, then the weighted mean."""

    def __init__(self, codec: Codec, n: int) -> None:
        self.codec = codec
        self.n = n
        self.total = np.zeros(n, dtype=np.float64)
        self.weight = 0.0
        self.count = 0

    def add(self, update: bytes | bytearray | memoryview, weight: float) -> None:
        """Decode, check and add one update; ``ValueError`` leaves the sum untouched."""
        if not weight > 0 or not np.isfinite(weight):
            raise ValueError(f"num-examples must be a positive number, got {weight}")
        decoded = self.codec.decode(update, self.n)  # raises before anything is added
        decoded.add_into(self.total, weight)
        self.weight += weight
        self.count += 1

    def mean(self) -> np.ndarray:
        if self.count == 0:
            raise ValueError("no update was added")
        return (self.total / self.weight).astype(np.float32)


def apply_delta(
    current: Mapping[str, np.ndarray], delta: Mapping[str, np.ndarray], server_lr: float
) -> dict[str, np.ndarray]:
    """The next global adapter: ``current + server_lr * delta``."""
    return {
        name: (value + server_lr * delta[name]).astype(np.float32)
        for name, value in current.items()
    }
