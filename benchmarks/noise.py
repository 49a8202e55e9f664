"""What DP noise costs per million entries: plain Gaussian noise and Opacus' secure mode
on one thread, and fedciuic's secure noise (the same sums in parallel streams), side by side.

    .venv/bin/python benchmarks/noise.py                     # the realistic adapter's size
    .venv/bin/python benchmarks/noise.py --entries 1000000 --repeats 3

Secure mode defends against floating-point attacks on the Gaussian mechanism by making
each noise value a sum of four Gaussian draws, halved (Holohan and Braghin 2021, section
5.1); Opacus draws the four with five calls per tensor and adds them in four passes,
and ``one-call`` draws the same four in one call and adds them in one pass (tried as
a cheaper secure mode: on an idle machine it costs the same, since the four draws are
the cost). ``fedciuic`` is what a region's DP-SGD draws (:class:`SecureNoise`): the
same sums for all tensors at once, each of ``--streams`` chunks (default: every core)
from its own OS-seeded generator on its own thread. Each figure is the best of
``--repeats`` over the adapter's tensors (the ``realistic`` preset's LoRA r=64 on 96
modules: 10.3M entries in 192 tensors by default), the kinds interleaved so that a
busy machine slows them alike.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch
from opacus.optimizers.optimizer import _generate_noise
from report import Row, best_seconds, verdict

from fedciuic.privacy.noise import SecureNoise, secure_generator


def one_call(std: float, reference: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Opacus' secure noise with the four draws made in one call."""
    draws = torch.empty((4, *reference.shape), dtype=reference.dtype)
    draws.normal_(0.0, std, generator=generator)
    return draws.sum(0).div_(2)


#: The target: secure noise at no more than this many times plain noise's cost.
TARGET = 2.0


def tensors(entries: int, count: int) -> list[torch.Tensor]:
    per = entries // count
    return [torch.zeros(per) for _ in range(count)]


def measure(entries: int, count: int, repeats: int, streams: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    refs = tensors(entries, count)
    gen = torch.Generator().manual_seed(0)
    parallel = SecureNoise(secure_generator()[0], streams)
    kinds = {
        "plain": lambda: [_generate_noise(1.0, r, gen, secure_mode=False) for r in refs],
        "opacus-secure": lambda: [_generate_noise(1.0, r, gen, secure_mode=True) for r in refs],
        "one-call": lambda: [one_call(1.0, r, gen) for r in refs],
        "fedciuic": lambda: parallel.draw(1.0, refs),
    }
    best = dict.fromkeys(kinds, float("inf"))
    for _ in range(repeats):
        for name, draw in kinds.items():
            best[name] = min(best[name], best_seconds(draw, 1))
    parallel.close()
    total = sum(r.numel() for r in refs)
    per_million = {name: 1000 * s / (total / 1e6) for name, s in best.items()}
    return {
        "entries": total,
        "tensors": count,
        "streams": streams,
        "ms_per_million": per_million,
        "secure_vs_plain": {
            "opacus": per_million["opacus-secure"] / per_million["plain"],
            "one-call": per_million["one-call"] / per_million["plain"],
            "fedciuic": per_million["fedciuic"] / per_million["plain"],
        },
    }


def rows(result: dict[str, Any]) -> list[Row]:
    ms, ratio = result["ms_per_million"], result["secure_vs_plain"]
    measured = (
        f"{ms['fedciuic']:.1f} ms per million entries over {result['streams']} stream(s), "
        f"{ratio['fedciuic']:.2f}x plain noise on one thread ({ms['plain']:.1f} ms); Opacus' "
        f"secure mode {ms['opacus-secure']:.1f} ms ({ratio['opacus']:.2f}x)"
    )
    figure, ours = "secure-mode DP noise (fedciuic's streams) vs plain noise", ratio["fedciuic"]
    return [[figure, measured, f"<= {TARGET:.1f}x", verdict(ours <= TARGET)]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--entries", type=int, default=10_346_496)
    parser.add_argument("--tensors", type=int, default=192)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--streams", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = measure(args.entries, args.tensors, args.repeats, args.streams)
    for row in rows(result):
        print(f"{row[0]}: {row[1]} (target {row[2]}: {row[3]})")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
