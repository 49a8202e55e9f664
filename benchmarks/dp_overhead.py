"""DP-SGD overhead: step time and peak memory of Opacus' hooks and ghost modes vs non-DP.

Same model, same batch, same optimizer (AdamW on the LoRA adapters); modes are
interleaved round by round so that a noisy machine slows them alike, and the figures
are ratios to non-DP training. The DP side is fedciuic's own ``PrivateTrainer`` with
its defaults: secure-mode noise (a sum of Gaussians), one example per privacy unit.

    .venv/bin/python benchmarks/dp_overhead.py                   # realistic preset, CPU
    .venv/bin/python benchmarks/dp_overhead.py --preset tiny --lora-rank 8 \\
        --lora-targets auto --batch-size 16 --seq-len 64 --steps 10 --rounds 5

By default: the ``realistic`` preset (207M parameters, DeepSeek-V3 layout), LoRA rank
64 on the attention and dense/shared-expert MLP projections (``auto+mlp``, 10.3M
adapter entries), 4 sequences of 128 tokens per step. Each mode is warmed for one
step, then ``--rounds`` interleaved rounds of ``--steps`` steps; a mode's figure is the
median of its rounds' mean step times.

Where the DP time goes (hooks mode, ``breakdown`` in the JSON): seconds per step in
Opacus' per-sample gradient computation (the ``nn.Linear`` grad sampler its backward
hooks call), per-sample clipping and summing, noise, and the wrapped optimizer's step;
timed by wrapping those functions in this process only (the library is untouched).

Against Opacus' own (mode ``opacus``): the step a hand-written app takes, Opacus'
``make_private`` on the same model and batch with its plain noise (one Gaussian a value,
not secure), so the ``hooks`` row also says what fedciuic's step costs beyond it
(secure noise, examples grouped by privacy unit).

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
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import psutil
import torch
from opacus import PrivacyEngine
from opacus.grad_sample.grad_sample_module import GradSampleModule
from report import Row, proc_bytes, verdict
from torch.utils.data import DataLoader, TensorDataset

from fedciuic.config import ModelSpec
from fedciuic.data.corpus import ExampleSet
from fedciuic.model.adapter import AdapterModel
from fedciuic.model.train import lm_loss, make_optimizer
from fedciuic.privacy.dpsgd import PrivateTrainer

MODES = ("non-dp", "hooks", "ghost", "opacus")
#: The default mode's target (issue 20: DP cost at real size).
TARGET = 1.2

#: Seconds spent in each timed part of a DP step since the last reset.
_spent: dict[str, float] = defaultdict(float)


def _timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _spent[name] += time.perf_counter() - began

    return wrapper


def _time_grad_sampler() -> None:
    # Opacus looks its grad samplers up per call, so wrapping the Linear one times every
    # per-sample gradient the hooks compute (the LoRA A and B matrices are nn.Linear).
    samplers = GradSampleModule.GRAD_SAMPLERS
    samplers[torch.nn.Linear] = _timed("per-sample grads", samplers[torch.nn.Linear])


def _time_optimizer(optimizer: Any) -> None:
    for method, name in (
        ("clip_and_accumulate", "clip + sum"),
        ("add_noise", "noise"),
    ):
        setattr(optimizer, method, _timed(name, getattr(optimizer, method)))
    inner = optimizer.original_optimizer
    inner.step = _timed("optimizer step", inner.step)


def make_step(
    mode: str, model: AdapterModel, blocks: torch.Tensor, batch_size: int
) -> Callable[[torch.Tensor], None]:
    # Both sides read their examples the same way (rows of a memory-mapped table, padded
    # per batch); ``batch`` is the first rows of ``blocks``, so the DP side steps on the
    # same rows as units 0..B-1.
    examples = ExampleSet.of_rows(blocks)
    model.model.train()
    if mode in ("non-dp", "opacus"):
        net: torch.nn.Module = model.model
        opt: Any = make_optimizer("adamw", model.trainable_parameters(), 1e-3)
        if mode == "opacus":  # the step a hand-written app takes: Opacus' own, plain noise
            loader = DataLoader(TensorDataset(torch.arange(len(examples))), batch_size=batch_size)
            net, opt, _ = PrivacyEngine().make_private(
                module=net,
                optimizer=opt,
                data_loader=loader,
                noise_multiplier=1.0,
                max_grad_norm=1.0,
                poisson_sampling=True,
            )
            _time_optimizer(opt)
        else:
            opt.step = _timed("optimizer step", opt.step)

        def step(batch: torch.Tensor) -> None:
            rows = examples.batch(range(batch.shape[0])).to(model.device)
            loss = lm_loss(net, rows)
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
    _time_optimizer(trainer.optimizer)
    return lambda batch: (trainer.step(torch.arange(batch.shape[0])), None)[1]


def spec(args: argparse.Namespace) -> ModelSpec:
    return ModelSpec(
        model_preset=args.preset,
        lora_rank=args.lora_rank,
        lora_alpha=2 * args.lora_rank,
        lora_targets=args.lora_targets,
    )


def setup(args: argparse.Namespace) -> tuple[AdapterModel, torch.Tensor]:
    model = AdapterModel(spec(args))
    gen = torch.Generator().manual_seed(0)
    vocab = int(model.model.config.vocab_size)
    # Ids 0-4 are the BPE tokenizer's special tokens (0-255 are bytes for the byte one).
    blocks = torch.randint(5, vocab, (args.batch_size * 8, args.seq_len), generator=gen)
    return model, blocks


def time_modes(
    args: argparse.Namespace,
) -> tuple[dict[str, list[float]], dict[str, Any], int]:
    """Each mode's mean seconds per step in each of ``args.rounds`` interleaved rounds,
    the seconds per step in each timed part of each mode, and the adapters' size."""
    per_mode: dict[str, list[float]] = {m: [] for m in args.modes}
    parts: dict[str, dict[str, list[float]]] = {m: defaultdict(list) for m in args.modes}
    models = {}
    _time_grad_sampler()
    for mode in args.modes:
        model, blocks = setup(args)
        step = make_step(mode, model, blocks, args.batch_size)
        batch = blocks[: args.batch_size].to(model.device)
        step(batch)  # warm: allocator, Opacus' first-call set-up
        models[mode] = (step, batch)
        trainable = sum(p.numel() for p in model.trainable_parameters())
    cuda = torch.cuda.is_available()
    for _ in range(args.rounds):
        for mode, (step, batch) in models.items():
            if cuda:
                torch.cuda.synchronize()
            _spent.clear()
            start = time.perf_counter()
            for _ in range(args.steps):
                step(batch)
            if cuda:
                torch.cuda.synchronize()
            per_mode[mode].append((time.perf_counter() - start) / args.steps)
            for name, seconds in _spent.items():
                parts[mode][name].append(seconds / args.steps)
    breakdown = {
        mode: {name: statistics.median(v) for name, v in named.items()}
        for mode, named in parts.items()
    }
    return per_mode, breakdown, trainable


def peak_memory(args: argparse.Namespace, mode: str) -> float:
    """Peak bytes that ``args.steps`` steps of ``mode`` add on top of the built model."""
    model, blocks = setup(args)
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
    return float(max(proc_bytes("/proc/self/status", "VmHWM")[0] - base, 0))


def settings(result: dict[str, Any]) -> str:
    """The measured configuration in words, as `` (...)`` (older results: nothing)."""
    if "lora_rank" not in result:
        return ""
    return (
        f" ({result['preset']}, LoRA r={result['lora_rank']} {result['lora_targets']} "
        f"({result['trainable'] / 1e6:.3g}M), {result['batch_size']} x {result['seq_len']} tokens)"
    )


def rows(result: dict[str, Any]) -> list[Row]:
    target = result.get("target", 1.5)
    out: list[Row] = []
    for mode in ("hooks", "ghost"):
        if mode in result["modes"]:
            r = result["modes"][mode]
            memory = r["memory_ratio"]
            memory_text = "memory not measured" if memory != memory else f"{memory:.2f}x memory"
            out.append(
                [
                    f"DP-SGD cost, {mode}",
                    f"{r['time_ratio']:.2f}x time, {memory_text} of non-DP{settings(result)}",
                    f"<= {target:g}x time",
                    verdict(r["time_ratio"] <= target)
                    if mode == "hooks"
                    else "- (the default is hooks)",
                ]
            )
    modes = result["modes"]
    if "hooks" in modes and "opacus" in modes:
        own = modes["opacus"]["seconds_per_step"]
        out.append(
            [
                "DP-SGD step, fedciuic's hooks vs Opacus' own make_private (plain noise)",
                f"{modes['hooks']['seconds_per_step'] / own:.2f}x time"
                f" ({own:.2f} s a step){settings(result)}",
                "reported",
                "reported",
            ]
        )
    return out


def _memory_of(args: argparse.Namespace, mode: str) -> float:
    cmd = [
        sys.executable,
        __file__,
        "--memory-of",
        mode,
        "--preset",
        args.preset,
        "--lora-rank",
        str(args.lora_rank),
        "--lora-targets",
        args.lora_targets,
        "--batch-size",
        str(args.batch_size),
        "--seq-len",
        str(args.seq_len),
        "--steps",
        str(args.memory_steps),
        *(["--threads", str(args.threads)] if args.threads else []),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return float(out.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--preset", default="realistic")
    parser.add_argument("--lora-rank", type=int, default=64)
    parser.add_argument("--lora-targets", default="auto+mlp")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=2, help="steps per timing round")
    parser.add_argument("--rounds", type=int, default=4, help="interleaved timing rounds")
    parser.add_argument(
        "--memory-steps", type=int, default=2, help="steps in each peak-memory process"
    )
    parser.add_argument(
        "--modes",
        default="hooks,ghost,opacus",
        help="DP modes to measure against non-DP (comma list of hooks, ghost, opacus)",
    )
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory processes")
    parser.add_argument(
        "--threads", type=int, help="torch threads (default: torch's own, one per core)"
    )
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--memory-of", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_of:  # child process: one mode's peak memory
        print(peak_memory(args, args.memory_of))
        return 0
    args.modes = ["non-dp", *(m for m in MODES[1:] if m in args.modes.split(","))]

    began = time.perf_counter()
    torch.manual_seed(0)
    per_round, breakdown, trainable = time_modes(args)
    times = {m: statistics.median(v) for m, v in per_round.items()}
    nan = float("nan")
    memory = {m: nan if args.no_memory else _memory_of(args, m) for m in args.modes}
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    threads = torch.get_num_threads()
    result: dict[str, Any] = {
        "preset": args.preset,
        "lora_rank": args.lora_rank,
        "lora_targets": args.lora_targets,
        "trainable": trainable,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "steps": args.steps,
        "rounds": args.rounds,
        "device": device,
        "threads": threads,
        "target": TARGET,
        "modes": {},
    }
    print(
        f"DP-SGD overhead{settings(result)}, {args.rounds} rounds x {args.steps} steps, "
        f"{device}, {threads} thread(s)"
    )
    print(f"{'mode':<8} {'ms/step':>9} {'time ratio':>11} {'peak MiB':>9} {'memory ratio':>13}")
    for mode in args.modes:
        t_ratio = times[mode] / times["non-dp"]
        m_ratio = memory[mode] / memory["non-dp"] if memory["non-dp"] > 0 else nan
        result["modes"][mode] = {
            "seconds_per_step": times[mode],
            "round_seconds_per_step": per_round[mode],
            "time_ratio": t_ratio,
            "peak_bytes": memory[mode],
            "memory_ratio": m_ratio,
            "breakdown": breakdown[mode],
        }
        print(
            f"{mode:<8} {times[mode] * 1e3:>9.1f} {t_ratio:>11.2f} "
            f"{memory[mode] / 2**20:>9.1f} {m_ratio:>13.2f}"
        )
    for mode in args.modes:
        parts = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in breakdown[mode].items())
        print(f"  {mode}: {parts}")
    hooks = result["modes"].get("hooks")
    if hooks:
        met = "meets" if hooks["time_ratio"] <= TARGET else "MISSES"
        print(f"default mode hooks: {hooks['time_ratio']:.2f}x non-DP time ({met} <= {TARGET}x)")
    result["seconds"] = time.perf_counter() - began
    print(f"took {result['seconds']:.0f} s")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(result, handle, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
