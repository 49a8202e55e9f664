"""The trainer on a CUDA GPU: tokens/s and peak GPU memory, DP-SGD vs non-DP, bf16 vs NF4.

Runs the ``small`` preset and two checkpoints shaped as published distills, random-init
and built and saved locally (nothing is downloaded), with fewer layers: R1-Distill-Qwen
(``qwen2``, :data:`DISTILL_SHAPE`) and R1-0528-Qwen3-8B (``qwen3``, :data:`QWEN3_SHAPE`).
Each runs with and without DP, with the base in bf16 and as a 4-bit NF4 base, adapters
on ``lora-targets = auto``, and it prints one row per case plus the DP/non-DP ratio per
model and precision. Each case runs in its own process so that peak memory is its own.
``bash scripts/gpu-check.sh`` installs bitsandbytes and runs it.

    .venv/bin/python benchmarks/gpu.py [--steps 20] [--batch-size 8] [--seq-len 256] [--model NAME]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from dp_overhead import make_step  # the same step as the CPU benchmark (scripts side by side)

from fedciuic.config import ModelSpec
from fedciuic.model.adapter import AdapterModel, save_model_checkpoint

DISTILL_SHAPE: dict[str, Any] = {  # R1-Distill-Qwen-1.5B's layout, fewer layers
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 8,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
}
QWEN3_SHAPE: dict[str, Any] = {  # DeepSeek-R1-0528-Qwen3-8B's layout, 4 of its 36 layers
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 4,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "tie_word_embeddings": False,
    "max_position_embeddings": 4096,
}
#: checkpoint name -> (``model_type``, shape): what :func:`shaped_checkpoint` builds
SHAPED: dict[str, tuple[str, dict[str, Any]]] = {
    "r1-distill-qwen-shape": ("qwen2", DISTILL_SHAPE),
    "r1-0528-qwen3-shape": ("qwen3", QWEN3_SHAPE),
}


def shaped_checkpoint(directory: Path, model_type: str, shape: dict[str, Any]) -> Path:
    """A random-init ``model_type`` model of ``shape`` with the BPE tokenizer, saved in
    bf16 (the dtype the cases load) as a checkpoint folder."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from fedciuic.model.presets import bpe_tokenizer, save_tokenizer

    tokenizer = bpe_tokenizer()
    config = AutoConfig.for_model(model_type, vocab_size=len(tokenizer), **shape)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
        config, dtype=torch.bfloat16, trust_remote_code=False
    )
    model.save_pretrained(directory)
    save_tokenizer(tokenizer, directory)
    return directory


def measure(case: dict[str, Any]) -> dict[str, Any]:
    """One case, in this process: steps of DP-SGD (hooks) or plain AdamW."""
    spec = ModelSpec(
        model_path=case["path"],
        dtype="bf16",
        quantization=case["quantization"],
        lora_rank=8,
        lora_targets="auto",
    )
    model = AdapterModel(spec, device=torch.device("cuda"))
    vocab = len(model.tokenizer)
    shape = (case["batch_size"] * 4, case["seq_len"])
    blocks = torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(0))
    batch = blocks[: case["batch_size"]].cuda()
    step = make_step("hooks" if case["dp"] else "non-dp", model, blocks, case["batch_size"])
    step(batch)  # warm-up (kernels, allocator)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(case["steps"]):
        step(batch)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    tokens = case["steps"] * case["batch_size"] * case["seq_len"]
    return {
        **case,
        "tokens_per_s": tokens / seconds,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "trainable": model.counts().trainable,
        "total": model.counts().total,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument(
        "--model",
        action="append",
        choices=["small", *SHAPED],
        help="measure only this model (repeatable; default: every one)",
    )
    parser.add_argument("--case", help=argparse.SUPPRESS)  # a child process's one case
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu.json"))
    args = parser.parse_args()
    if args.case:
        print(json.dumps(measure(json.loads(args.case))))
        return 0
    if not torch.cuda.is_available():
        print("benchmarks/gpu.py needs a CUDA GPU; this machine has none", file=sys.stderr)
        return 2
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        wanted = args.model or ["small", *SHAPED]
        models = {}
        if "small" in wanted:
            models["small"] = save_model_checkpoint(
                ModelSpec(model_preset="small"), Path(tmp) / "small"
            )
        for name, (model_type, shape) in SHAPED.items():
            if name in wanted:
                models[name] = shaped_checkpoint(Path(tmp) / name, model_type, shape)
        for name, path in models.items():
            for quantization in ("none", "nf4"):
                for dp in (False, True):
                    case = {
                        "model": name,
                        "path": str(path),
                        "quantization": quantization,
                        "dp": dp,
                        "steps": args.steps,
                        "batch_size": args.batch_size,
                        "seq_len": args.seq_len,
                    }
                    done = subprocess.run(
                        [sys.executable, __file__, "--case", json.dumps(case)],
                        capture_output=True,
                        text=True,
                        check=False,
                    )
                    if done.returncode != 0:
                        print(f"{name} {quantization} dp={dp}: FAILED\n{done.stderr[-2000:]}")
                        continue
                    rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"{'model':24} {'base':5} {'DP':5} {'tokens/s':>10} {'peak GiB':>9} {'DP/non-DP':>10}")
    for row in rows:
        base = next(
            (
                r
                for r in rows
                if r["model"] == row["model"]
                and r["quantization"] == row["quantization"]
                and not r["dp"]
            ),
            None,
        )
        ratio = f"{row['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base and row["dp"] else ""
        precision = "nf4" if row["quantization"] == "nf4" else "bf16"
        print(
            f"{row['model']:24} {precision:5} {row['dp']!s:5} {row['tokens_per_s']:10.0f} "
            f"{row['peak_gib']:9.2f} {ratio:>10}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=2)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
