"""Aggregation of compressed adapter deltas, with validation (pure NumPy, no Flower).

FedAvg over deltas (the default), weighted by each region's examples ``n_i``, each update
decoded, validated and added straight into one float64 accumulator: memory is the model
plus one update. ``median`` and ``trimmed-mean:F`` aggregate coordinate-wise and
unweighted, so one malicious region cannot drag the result far, at the price of keeping
every delta in memory (docs/robustness.md). Two factors on top (p_i = n_i / sum n):

* local steps ``tau_i`` (FedNova, Wang et al. 2020): ``tau_eff * sum_i p_i delta_i /
  tau_i``, ``tau_eff = sum_i p_i tau_i``, so whoever stepped most does not pull the mean;
  equal steps give FedAvg bit for bit;
* staleness ``s`` (FedBuff, Nguyen et al. 2022): ``w(s) = 1/sqrt(1+s)`` *without*
  renormalising, so a buffer of only stale updates moves the model less.

The robust rules apply the same factors to each row (``tau_bar``: the unweighted mean).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from fedciuic.compression import Codec, Sparse
from fedciuic.config import NormAction, aggregation_rule
from fedciuic.errors import FedciuicError


class ImplausibleUpdate(FedciuicError, ValueError):
    """A well-formed update outside the bounds of a plausible one (rejected alone)."""


@dataclass(frozen=True)
class Bounds:
    """What a plausible update looks like; anything else is rejected (or clipped)."""

    max_norm: float = 0.0  # L2 norm of the decoded delta; 0: no bound
    norm_action: NormAction = "reject"
    max_examples: int = 10_000_000
    max_steps: int = 0  # local steps an update may claim (the run's local-steps); 0: no cap
    max_staleness: int = 0  # buffered mode: global versions an update's base may lag


def _whole(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def staleness_weight(staleness: int) -> float:
    """FedBuff's staleness weight ``1 / sqrt(1 + s)``: an older update counts less."""
    return 1.0 / math.sqrt(1.0 + staleness)


def check_staleness(staleness: int, max_staleness: int) -> None:
    """Refuse an update whose base is more than ``max_staleness`` versions old."""
    if not (_whole(staleness) and staleness >= 0):
        raise ImplausibleUpdate(f"staleness must be a whole number >= 0, got {staleness!r}")
    if staleness > max_staleness:
        raise ImplausibleUpdate(
            f"update is {staleness} global versions old, over max-staleness {max_staleness}"
        )


def check_steps(steps: int, max_steps: int) -> None:
    """Refuse an implausible step count: FedNova divides by it."""
    if not (_whole(steps) and steps >= 1):
        raise ImplausibleUpdate(f"steps must be a whole number >= 1, got {steps!r}")
    if max_steps and steps > max_steps:
        raise ImplausibleUpdate(
            f"update claims {steps} local steps, over local-steps {max_steps}; an "
            "implausible count would dominate the step-normalised mean"
        )


@dataclass(frozen=True)
class Checked:
    """A decoded, validated update; ``scale``: a norm clip applied to it."""

    update: Sparse
    weight: float
    norm: float
    scale: float = 1.0
    steps: int = 1
    staleness: int = 0

    @property
    def clipped(self) -> bool:
        return self.scale < 1.0


def check(
    codec: Codec,
    data: bytes | bytearray | memoryview,
    n: int,
    weight: float,
    bounds: Bounds,
    *,
    steps: int = 1,
    staleness: int = 0,
) -> Checked:
    """Decode and validate one update; ``ValueError`` says what is wrong with it."""
    check_steps(steps, bounds.max_steps)
    check_staleness(staleness, bounds.max_staleness)
    if not (weight >= 1 and math.isfinite(weight) and weight == int(weight)):
        raise ImplausibleUpdate(f"num-examples must be a positive whole number, got {weight}")
    if weight > bounds.max_examples:
        raise ImplausibleUpdate(
            f"num-examples {weight:.0f} is over max-examples {bounds.max_examples}; an "
            "implausible count would dominate the weighted mean"
        )
    decoded = codec.decode(data, n)  # codec, size, structure and finite values
    norm = decoded.norm()
    scale = 1.0
    if bounds.max_norm and norm > bounds.max_norm:
        if bounds.norm_action == "reject":
            raise ImplausibleUpdate(
                f"update norm {norm:.4g} is over max-update-norm {bounds.max_norm:g}"
            )
        scale = bounds.max_norm / norm
    return Checked(decoded, weight, norm, scale, steps, staleness)


class Aggregator(Protocol):
    count: int
    weight: float

    def add(self, checked: Checked) -> None: ...

    def mean(self) -> np.ndarray: ...


class Accumulator:
    """``tau_eff * sum_i n_i w(s_i) delta_i / tau_i / sum_i n_i``, with steps relative to
    the first update's so that equal steps give FedAvg bit for bit."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.total = np.zeros(n, dtype=np.float64)
        self.weight = 0.0  # sum n_i
        self.weighted_steps = 0.0  # sum n_i tau_i
        self.first_steps = 0
        self.count = 0

    def add(self, checked: Checked) -> None:
        if self.count == 0:
            self.first_steps = checked.steps
        factor = checked.weight * checked.scale * staleness_weight(checked.staleness)
        if checked.steps != self.first_steps:
            factor *= self.first_steps / checked.steps
        checked.update.add_into(self.total, factor)
        self.weight += checked.weight
        self.weighted_steps += checked.weight * checked.steps
        self.count += 1

    def mean(self) -> np.ndarray:
        if self.count == 0:
            raise ValueError("no update was added")
        mean = np.empty(self.n, np.float32)  # computed in float64, stored as float32
        rescale = self.weighted_steps / (self.first_steps * self.weight)  # tau_eff / tau_0
        if rescale == 1.0:
            np.divide(self.total, self.weight, out=mean, casting="same_kind")
        else:
            np.multiply(self.total / self.weight, rescale, out=mean, casting="same_kind")
        return mean


class Robust:
    """Coordinate-wise median, or mean after trimming ``trim`` of the values at each end."""

    def __init__(self, n: int, trim: float | None) -> None:
        self.n = n
        self.trim = trim  # None: median
        self.rows: list[np.ndarray] = []
        self.weight = 0.0
        self.steps: list[int] = []
        self.count = 0

    def add(self, checked: Checked) -> None:
        # Rows relative to the first update's steps; the result is rescaled by
        # tau_bar / tau_0 (both rules commute with a positive scale).
        factor = checked.scale * staleness_weight(checked.staleness)
        if self.steps and checked.steps != self.steps[0]:
            factor *= self.steps[0] / checked.steps
        self.rows.append(checked.update.dense(self.n) * np.float32(factor))
        self.weight += checked.weight
        self.steps.append(checked.steps)
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
        rescale = sum(self.steps) / (len(self.steps) * self.steps[0])  # tau_bar / tau_0
        if rescale != 1.0:
            middle = middle * rescale
        return middle.astype(np.float32)


def make_aggregator(method: str, n: int) -> Aggregator:
    """The rule ``method`` names (:func:`fedciuic.config.aggregation_rule` reads it)."""
    name, trim = aggregation_rule(method)
    return Accumulator(n) if name == "fedavg" else Robust(n, trim)
