"""Aggregation of compressed adapter deltas, with validation (pure NumPy, no Flower).

FedAvg over deltas (the default): ``global + server_lr * sum_i w_i * delta_i / sum_i
w_i``, with ``w_i`` the number of training examples of region ``i``. Each update is
decoded and validated on its own (codec, size, finite values, norm bound, a
plausible example count) and added straight into one float64 accumulator, by
scatter-add for sparse codecs: memory is the model size plus one update, whatever
the number of regions.

For federations where a region may be malicious, ``median`` and
``trimmed-mean:F`` aggregate coordinate-wise over the (norm-bounded) decoded deltas,
unweighted: one region cannot drag the result far, at the price of keeping every
delta in memory and of pulling honest but very different regions towards the
middle (docs/robustness.md).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np

from fedciuic.compression import Codec, Sparse
from fedciuic.errors import FedciuicError


class ImplausibleUpdate(FedciuicError, ValueError):
    """A well-formed update outside the bounds of a plausible one (rejected alone)."""


@dataclass(frozen=True)
class Bounds:
    """What a plausible update looks like; anything else is rejected (or clipped)."""

    max_norm: float = 0.0  # L2 norm of the decoded delta; 0: no bound
    norm_action: Literal["reject", "clip"] = "reject"
    max_examples: int = 10_000_000


@dataclass(frozen=True)
class Checked:
    """A decoded, validated update: its weight, L2 norm and the scale applied to it."""

    update: Sparse
    weight: float
    norm: float
    scale: float = 1.0

    @property
    def clipped(self) -> bool:
        return self.scale < 1.0


def check(
    codec: Codec, data: bytes | bytearray | memoryview, n: int, weight: float, bounds: Bounds
) -> Checked:
    """Decode and validate one update; ``ValueError`` says what is wrong with it."""
    if not (weight >= 1 and math.isfinite(weight) and weight == int(weight)):
        raise ImplausibleUpdate(f"num-examples must be a positive whole number, got {weight}")
    if weight > bounds.max_examples:
        raise ImplausibleUpdate(
            f"num-examples {weight:.0f} is over max-examples {bounds.max_examples}; an "
            "implausible count would dominate the weighted mean"
        )
    decoded = codec.decode(data, n)  # codec, size, structure and finite values
    norm = float(np.linalg.norm(decoded.values.astype(np.float64)))
    scale = 1.0
    if bounds.max_norm and norm > bounds.max_norm:
        if bounds.norm_action == "reject":
            raise ImplausibleUpdate(
                f"update norm {norm:.4g} is over max-update-norm {bounds.max_norm:g}"
            )
        scale = bounds.max_norm / norm
    return Checked(decoded, weight, norm, scale)


class Aggregator(Protocol):
    count: int
    weight: float

    def add(self, checked: Checked) -> None: ...

    def mean(self) -> np.ndarray: ...


class Accumulator:
    """``sum_i w_i * delta_i`` over validated updates, then the weighted mean."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.total = np.zeros(n, dtype=np.float64)
        self.weight = 0.0
        self.count = 0

    def add(self, checked: Checked) -> None:
        checked.update.add_into(self.total, checked.weight * checked.scale)
        self.weight += checked.weight
        self.count += 1

    def mean(self) -> np.ndarray:
        if self.count == 0:
            raise ValueError("no update was added")
        return (self.total / self.weight).astype(np.float32)


class Robust:
    """Coordinate-wise median, or mean after trimming ``trim`` of the values at each end."""

    def __init__(self, n: int, trim: float | None) -> None:
        self.n = n
        self.trim = trim  # None: median
        self.rows: list[np.ndarray] = []
        self.weight = 0.0
        self.count = 0

    def add(self, checked: Checked) -> None:
        self.rows.append(checked.update.dense(self.n) * np.float32(checked.scale))
        self.weight += checked.weight
        self.count += 1

    def mean(self) -> np.ndarray:
        if not self.rows:
            raise ValueError("no update was added")
        stack = np.stack(self.rows)
        if self.trim is None:
            middle: np.ndarray = np.median(stack, axis=0)
        else:
            cut = int(self.trim * len(self.rows))
            middle = np.sort(stack, axis=0)[cut : len(self.rows) - cut].mean(axis=0)
        return middle.astype(np.float32)


def make_aggregator(method: str, n: int) -> Aggregator:
    """``fedavg``, ``median`` or ``trimmed-mean:F`` (F in [0, 0.5): trimmed at each end)."""
    name, _, arg = method.partition(":")
    if name == "fedavg" and not arg:
        return Accumulator(n)
    if name == "median" and not arg:
        return Robust(n, None)
    if name == "trimmed-mean":
        try:
            trim = float(arg)
        except ValueError:
            trim = -1.0
        if 0 <= trim < 0.5:
            return Robust(n, trim)
        raise ValueError(f"trimmed-mean:{arg}: the trimmed fraction must be in [0, 0.5)")
    raise ValueError(f"unknown aggregation {method!r}; use fedavg, median or trimmed-mean:F")


def apply_delta(
    current: Mapping[str, np.ndarray], delta: Mapping[str, np.ndarray], server_lr: float
) -> dict[str, np.ndarray]:
    """The next global adapter: ``current + server_lr * delta``."""
    return {
        name: (value + server_lr * delta[name]).astype(np.float32)
        for name, value in current.items()
    }
