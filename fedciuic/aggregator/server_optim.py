"""The aggregator's step on the aggregated delta: server optimisers (pure NumPy).

Reddi et al. 2021, Algorithm 2: the delta ``d`` is a pseudo-gradient over the flat
float32 adapter vector ``x``:

* ``none``: ``x += lr * d`` (FedAvg with a server learning rate);
* ``fedavgm``: ``m = beta * m + d; x += lr * m`` (server momentum);
* ``fedadam``: ``m = b1 m + (1-b1) d; v = b2 v + (1-b2) d^2; x += lr m / (sqrt(v) + tau)``;
* ``fedyogi``: as fedadam with ``v = v - (1-b2) d^2 sign(v - d^2)``: v grows
  additively, so one large delta does not shrink the step for many rounds.

As in the paper there is no bias correction and ``v`` starts at ``tau^2``, so the first
steps are about ``lr`` per coordinate (Flower's FedAdam starts at 0 and bias-corrects).
The moments go into each checkpoint: without them a resumed run would step differently.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedciuic.compression import flatten, layout_id, layout_of, unflatten
from fedciuic.config import OPTIMIZERS, ServerSettings
from fedciuic.errors import FedciuicError

MOMENTS: dict[str, tuple[str, ...]] = {
    "none": (),
    "fedavgm": ("m",),
    "fedadam": ("m", "v"),
    "fedyogi": ("m", "v"),
}


class OptimizerStateError(FedciuicError, ValueError):
    """A server optimiser's state that does not fit this run (optimizer, layout, size)."""


@dataclass(frozen=True)
class OptimizerState:
    """What a checkpoint keeps of a server optimiser: name, hyperparameters, layout, moments."""

    name: str
    hyperparameters: dict[str, float]
    steps: int  # aggregates applied so far
    layout: str  # layout_id of the adapter the moments follow; "" before the first step
    size: int
    arrays: dict[str, np.ndarray] = field(default_factory=dict)

    def meta(self) -> dict[str, Any]:
        """Everything but the arrays, as JSON."""
        return {
            "name": self.name,
            "hyperparameters": dict(self.hyperparameters),
            "steps": self.steps,
            "layout": self.layout,
            "size": self.size,
        }


class ServerOptimizer:
    """One of :data:`OPTIMIZERS` over the flat adapter; moments are made on the first step."""

    def __init__(self, settings: ServerSettings) -> None:
        if settings.server_optimizer not in MOMENTS:
            raise OptimizerStateError(
                f"unknown server optimizer {settings.server_optimizer!r}; "
                f"use {', '.join(OPTIMIZERS)}"
            )
        self.settings = settings
        self.name = settings.server_optimizer
        self.steps = 0
        self.layout = ""
        self.size = 0
        self.moments: dict[str, np.ndarray] = {}

    @property
    def hyperparameters(self) -> dict[str, float]:
        return {
            "learning_rate": self.settings.server_learning_rate,
            "momentum": self.settings.server_momentum,
            "beta2": self.settings.server_beta2,
            "epsilon": self.settings.server_epsilon,
        }

    def _bind(self, layout: str, size: int) -> None:
        if not self.layout:
            self.layout, self.size = layout, size
            self.moments = {k: np.zeros(size, np.float32) for k in MOMENTS[self.name]}
            if "v" in self.moments:
                self.moments["v"].fill(self.settings.server_epsilon**2)
        elif (layout, size) != (self.layout, self.size):
            raise OptimizerStateError(
                f"server optimizer state is for another adapter (layout {self.layout}, "
                f"{self.size} values; this one is {layout}, {size})"
            )

    def step(self, current: Mapping[str, np.ndarray], delta: np.ndarray) -> dict[str, np.ndarray]:
        """The next global adapter from ``current`` and the aggregated flat ``delta``."""
        layout = layout_of(current)
        x = flatten(current)  # a float32 copy
        d = np.asarray(delta, np.float32).reshape(-1)
        if d.size != x.size:
            raise OptimizerStateError(f"delta has {d.size} values, the adapter {x.size}")
        self._bind(layout_id(layout), x.size)
        s = self.settings
        lr, beta1, beta2 = s.server_learning_rate, s.server_momentum, s.server_beta2
        if self.name == "none":
            x += lr * d
        elif self.name == "fedavgm":
            m = self.moments["m"]
            m *= beta1
            m += d
            x += lr * m
        else:
            m, v = self.moments["m"], self.moments["v"]
            m *= beta1
            m += (1.0 - beta1) * d
            sq = np.square(d)
            if self.name == "fedadam":
                v *= beta2
                sq *= 1.0 - beta2
                v += sq
            else:  # fedyogi
                sign = np.subtract(v, sq)
                np.sign(sign, out=sign)
                sign *= sq
                sign *= 1.0 - beta2
                v -= sign
                del sign
            np.sqrt(v, out=sq)
            sq += self.settings.server_epsilon
            np.divide(m, sq, out=sq)
            sq *= lr
            x += sq
        self.steps += 1
        return unflatten(x, layout)

    def state(self) -> OptimizerState:
        """A copy of the state, for a checkpoint."""
        return OptimizerState(
            name=self.name,
            hyperparameters=self.hyperparameters,
            steps=self.steps,
            layout=self.layout,
            size=self.size,
            arrays={k: v.copy() for k, v in self.moments.items()},
        )

    @classmethod
    def from_state(
        cls,
        settings: ServerSettings,
        state: OptimizerState,
        layout: list[tuple[str, tuple[int, ...]]],
    ) -> ServerOptimizer:
        """This run's optimiser continued from ``state`` (same optimizer, this ``layout``)."""
        fresh = cls(settings)
        if state.name != fresh.name:
            raise OptimizerStateError(
                f'run config:server-optimizer: "{fresh.name}", but the checkpoint holds '
                f'"{state.name}" state; resume with server-optimizer = "{state.name}" or '
                "start a new run"
            )
        size = sum(int(np.prod(shape)) for _, shape in layout)
        expected = set(MOMENTS[state.name]) if state.layout else set()
        problems = []
        if state.layout and (state.layout, state.size) != (layout_id(layout), size):
            problems.append(f"layout {state.layout} of {state.size} values")
        if set(state.arrays) != expected:
            problems.append(f"moments {sorted(state.arrays)}, expected {sorted(expected)}")
        for key, value in state.arrays.items():
            if value.dtype != np.float32 or value.shape != (size,):
                problems.append(f"{key} is {value.dtype}{list(value.shape)}")
            elif not np.all(np.isfinite(value)):
                problems.append(f"{key} is not finite")
        if isinstance(state.steps, bool) or not isinstance(state.steps, int) or state.steps < 0:
            problems.append(f"steps {state.steps!r}")
        if problems:
            raise OptimizerStateError(
                f"server optimizer state does not fit this adapter ({layout_id(layout)}, "
                f"{size} values): {'; '.join(problems)}"
            )
        fresh.steps = state.steps
        if state.layout:
            fresh.layout, fresh.size = state.layout, state.size
            fresh.moments = {k: np.array(v, np.float32) for k, v in state.arrays.items()}
        return fresh
