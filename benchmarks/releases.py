"""What releasing only DP figures costs: the share of a run's target that a region's
DP count of units (``count-noise``) and its DP held-out losses (``eval-noise``) take,
what that does to the training noise, and how far off each DP figure is.

    .venv/bin/python benchmarks/releases.py
    .venv/bin/python benchmarks/releases.py --units 400 --eval-units 48 --json out.json

For one region's run (``--rounds`` x ``--steps`` DP-SGD steps of ``--batch`` units out
of ``--units``, target epsilon ``--target`` at delta 1e-5, the PRV accountant) and each
setting of the two noises, the figures come from the region's own code: the training
noise ``calibrate_noise_after`` sets with the count and the run's ``rounds + 2``
evaluations in the target, beside the noise without them; each release's epsilon on
its own; the count's standard deviation relative to ``--units``; and the standard
deviation of a DP held-out loss over ``--eval-units`` units (``noise x clip / units``,
the count's noise aside). Training and evaluation compute are unchanged by either
noise (the same forward passes: the per-unit losses replace one mean), so a round's
time changes by the calibration alone, which is timed here (once a run, cached).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from report import Row

from fedciuic.config import DPSettings
from fedciuic.privacy.ledger import (
    calibrate_noise,
    calibrate_noise_after,
    count_steps,
    epsilon_of,
    poisson_sample_rate,
    run_prefix,
)

DELTA = 1e-5
#: (count-noise, eval-noise) pairs measured; the first is the one the rows report.
SETTINGS = ((10.0, 20.0), (5.0, 10.0), (20.0, 50.0), (10.0, 0.0), (0.0, 20.0))
CLIP = 10.0  # eval-loss-clip's default


def measure(
    *,
    units: int,
    eval_units: int,
    batch: int,
    rounds: int,
    steps: int,
    target: float,
    settings: tuple[tuple[float, float], ...] = SETTINGS,
) -> dict[str, Any]:
    rate = poisson_sample_rate(units, batch)
    planned = rounds * steps
    alone = calibrate_noise(target, DELTA, rate, planned, "prv")
    out: list[dict[str, Any]] = []
    for count_noise, eval_noise in settings:
        dp = DPSettings(count_noise=count_noise, eval_noise=eval_noise)
        prefix, count = run_prefix(dp, rounds), count_steps(dp)
        evals = prefix[len(count) :]
        started = time.perf_counter()
        sigma = calibrate_noise_after(prefix, target, DELTA, rate, planned, "prv")
        seconds = time.perf_counter() - started
        history = [*count, *evals, (sigma, rate, planned)]
        out.append(
            {
                "count_noise": count_noise,
                "eval_noise": eval_noise,
                "sigma": sigma,
                "sigma_increase": sigma / alone - 1.0,
                "epsilon": epsilon_of(history, DELTA, "prv"),
                "count_epsilon": epsilon_of(list(count), DELTA, "prv"),
                "evals_epsilon": epsilon_of(list(evals), DELTA, "prv"),
                "count_error": count_noise / units,
                "loss_std": eval_noise * CLIP / eval_units,
                "calibration_seconds": seconds,
            }
        )
    return {
        "where": (
            f"one region, {units} units ({eval_units} held out), {rounds} rounds x {steps} "
            f"steps of {batch}, target epsilon {target:g} at delta {DELTA:g} (PRV)"
        ),
        "sigma_alone": alone,
        "settings": out,
    }


def rows(result: dict[str, Any]) -> list[Row]:
    out: list[Row] = []
    for s in result["settings"]:
        out.append(
            [
                f"releases only DP figures, count-noise {s['count_noise']:g}, eval-noise "
                f"{s['eval_noise']:g}; {result['where']}",
                f"training noise {s['sigma']:.3f} vs {result['sigma_alone']:.3f} "
                f"(+{100 * s['sigma_increase']:.1f} %); the count alone epsilon "
                f"{s['count_epsilon']:.2f} (std {100 * s['count_error']:.1f} % of the "
                f"units), the evaluations alone {s['evals_epsilon']:.2f} (a held-out "
                f"loss's std {s['loss_std']:.2f} nats); the run's epsilon "
                f"{s['epsilon']:.3f}",
                "the run's epsilon within its target",
                "reported",
            ]
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--units", type=int, default=2000)
    parser.add_argument("--eval-units", type=int, default=200)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--target", type=float, default=4.0)
    parser.add_argument("--json", type=Path)
    options = vars(parser.parse_args(argv))
    out = options.pop("json")
    result = measure(**options)
    for row in rows(result):
        print(f"{row[0]}:\n  {row[1]}")
    worst = max(s["calibration_seconds"] for s in result["settings"])
    print(f"the calibration, once a run: at most {worst:.2f} s")
    if out:
        out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
