"""Timeouts that follow this machine's measured pace, not fixed seconds.

An end-to-end test waits for real processes that train: on a loaded machine every step
takes longer, and a fixed timeout that an idle machine meets fails a healthy run. Each
test starts by timing a small training step (forward and backward of a model shaped like
the tiny preset's layers, the work a region does); :func:`patient` scales a wait chosen
on an idle 2-core machine by how much slower that step is now (never less, at most
:data:`MAX_FACTOR` times). A test that waits for something that never comes still ends.
"""

from __future__ import annotations

import statistics
import time

import torch

#: Median seconds of :func:`_step` on an idle 2-core machine (the CI machine's shape),
#: measured with ``python -m tests.e2e.pace``.
REFERENCE_STEP_S = 0.013
#: The most a wait is stretched: a hang still fails, within a CI job's limit.
MAX_FACTOR = 4.0

_factor = 1.0


def _step(model: torch.nn.Module, batch: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    model(batch).square().mean().backward()


def measure() -> float:
    """The median of a few timed steps, in seconds (the first, warm-up, is dropped)."""
    generator = torch.Generator().manual_seed(0)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)
        )
    batch = torch.randn(8, 64, 256, generator=generator)
    threads = torch.get_num_threads()
    # One thread: with two, a step waits for the busier core, and the figure jumps
    # between modes instead of following the load.
    torch.set_num_threads(1)
    try:
        times = []
        for _ in range(12):
            start = time.perf_counter()
            _step(model, batch)
            times.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return statistics.median(times[1:])


def calibrate() -> float:
    """Time the step now and keep the factor :func:`patient` scales by."""
    global _factor
    _factor = min(max(measure() / REFERENCE_STEP_S, 1.0), MAX_FACTOR)
    return _factor


def factor() -> float:
    return _factor


def patient(seconds: float) -> float:
    """``seconds`` (enough on an idle machine) stretched by the measured slowdown."""
    return seconds * _factor


if __name__ == "__main__":
    print(f"step {measure():.4f}s (reference {REFERENCE_STEP_S}s), factor {calibrate():.2f}")
