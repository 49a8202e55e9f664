"""DP-SGD overhead: step time and peak memory of Opacus' hooks and ghost modes vs non-DP.

Same model, same batch, same optimizer; modes are interleaved round by round so that
a noisy machine slows them alike, and the figures are ratios to non-DP training.

    .venv/bin/python benchmarks/dp_overhead.py                 # tiny preset, CPU
    .venv/bin/python benchmarks/dp_overhead.py --preset small  # on a GPU

Peak memory: on CUDA, ``torch.cuda.max_memory_allocated``; on CPU, the growth of the
process's peak RSS (VmHWM, reset after building the model) over its size, each mode in
its own process (CPU allocations have no per-mode counter).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import psutil
import torch
from report import Row, verdict

from fedciuic.data.corpus import ExampleSet
from fedciuic.model.adapter import AdapterModel, ModelSpec
from fedciuic.model.train import lm_loss, make_optimizer
from fedciuic.privacy.dpsgd import PrivateTrainer

MODES = ("non-dp", "hooks", "ghost")


def make_step(
    mode: str, model: AdapterModel, blocks: torch.Tensor, batch_size: int
) -> Callable[[torch.Tensor], None]:
    # Both sides read their examples the same way (rows of a memory-mapped table, padded
    # per batch); ``batch`` is the first rows of ``blocks``, so the DP side steps on the
    # same rows as units 0..B-1.
    examples = ExampleSet.of_rows(blocks)
    if mode == "non-dp":
        opt = make_optimizer("adamw", model.trainable_parameters(), 1e-3)

        def step(batch: torch.Tensor) -> None:
            rows = examples.batch(range(batch.shape[0])).to(model.device)
            loss = lm_loss(model.model, rows)
            opt.zero_grad(set_to_none=True)
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()

        return step
    trainer = PrivateTrainer(
        model,
        examples,
        batch_size=batch_size,
        learning_rate=1e-3,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        mode=mode,  # type: ignore[arg-type]
    )
    return lambda batch: (trainer.step(torch.arange(batch.shape[0])), None)[1]


def setup(preset: str, batch_size: int, seq_len: int) -> tuple[AdapterModel, torch.Tensor]:
    model = AdapterModel(ModelSpec(preset=preset))
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (batch_size * 8, seq_len), generator=gen)
    return model, blocks


def time_modes(args: argparse.Namespace) -> dict[str, float]:
    """Median seconds per step of each mode, interleaved over ``args.rounds`` rounds."""
    per_mode: dict[str, list[float]] = {m: [] for m in MODES}
    models = {}
    for mode in MODES:
        model, blocks = setup(args.preset, args.batch_size, args.seq_len)
        models[mode] = (make_step(mode, model, blocks, args.batch_size), blocks, model)
    cuda = torch.cuda.is_available()
    for _ in range(args.rounds):
        for mode, (step, blocks, model) in models.items():
            batch = blocks[: args.batch_size].to(model.device)
            step(batch)  # warm
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(args.steps):
                step(batch)
            if cuda:
                torch.cuda.synchronize()
            per_mode[mode].append((time.perf_counter() - start) / args.steps)
    return {m: statistics.median(v) for m, v in per_mode.items()}


def peak_memory(args: argparse.Namespace, mode: str) -> float:
    """Peak bytes that ``args.steps`` steps of ``mode`` add on top of the built model."""
    model, blocks = setup(args.preset, args.batch_size, args.seq_len)
    batch = blocks[: args.batch_size].to(model.device)
    step = make_step(mode, model, blocks, args.batch_size)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(args.steps):
            step(batch)
        torch.cuda.synchronize()
        return float(torch.cuda.max_memory_allocated() - base)
    base = psutil.Process().memory_info().rss
    # Linux: writing 5 to clear_refs resets the peak RSS (VmHWM) to the current RSS,
    # so the peak below is the training steps' own, not the model build's.
    with open("/proc/self/clear_refs", "w", encoding="ascii") as handle:
        handle.write("5")
    for _ in range(args.steps):
        step(batch)
    return float(max(_vm_hwm() - base, 0))


def _vm_hwm() -> int:
    with open("/proc/self/status", encoding="ascii") as handle:
        for line in handle:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def rows(result: dict[str, Any]) -> list[Row]:
    out: list[Row] = []
    for mode in ("hooks", "ghost"):
        if mode in result["modes"]:
            r = result["modes"][mode]
            out.append(
                [
                    f"DP-SGD cost, {mode}",
                    f"{r['time_ratio']:.2f}x time, {r['memory_ratio']:.2f}x memory of non-DP",
                    "<= 1.5x time",
                    verdict(r["time_ratio"] <= 1.5)
                    if mode == "hooks"
                    else "- (the default is hooks)",
                ]
            )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10, help="steps per timing round")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--memory-of", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_of:  # child process: one mode's peak memory
        print(peak_memory(args, args.memory_of))
        return 0

    torch.manual_seed(0)
    times = time_modes(args)
    memory = {}
    for mode in MODES:
        cmd = [
            sys.executable,
            __file__,
            "--memory-of",
            mode,
            "--preset",
            args.preset,
            "--batch-size",
            str(args.batch_size),
            "--seq-len",
            str(args.seq_len),
            "--steps",
            str(args.steps),
        ]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        memory[mode] = float(out.strip().splitlines()[-1])
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    threads = torch.get_num_threads()
    print(
        f"DP-SGD overhead, preset {args.preset}, batch {args.batch_size} x {args.seq_len} "
        f"tokens, {device}, {threads} thread(s)"
    )
    print(f"{'mode':<8} {'ms/step':>9} {'time ratio':>11} {'peak MiB':>9} {'memory ratio':>13}")
    result: dict[str, Any] = {"preset": args.preset, "device": device, "modes": {}}
    for mode in MODES:
        t_ratio = times[mode] / times["non-dp"]
        m_ratio = memory[mode] / memory["non-dp"] if memory["non-dp"] > 0 else float("nan")
        result["modes"][mode] = {
            "seconds_per_step": times[mode],
            "time_ratio": t_ratio,
            "peak_bytes": memory[mode],
            "memory_ratio": m_ratio,
        }
        print(
            f"{mode:<8} {times[mode] * 1e3:>9.2f} {t_ratio:>11.2f} "
            f"{memory[mode] / 2**20:>9.1f} {m_ratio:>13.2f}"
        )
    best = min(("hooks", "ghost"), key=lambda m: times[m])
    verdict = "meets" if times[best] / times["non-dp"] <= 1.5 else "MISSES"
    print(
        f"fastest DP mode: {best}, {times[best] / times['non-dp']:.2f}x non-DP time "
        f"({verdict} the 1.5x target)"
    )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(result, handle, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
