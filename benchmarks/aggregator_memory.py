"""The aggregator's memory does not grow with the base model.

Side by side, each in its own process, on the ``realistic`` preset (207M parameters,
0.83 GB in fp32): the peak RSS growth of what the aggregator builds (the adapter's
layout and initial values, from the base on the ``meta`` device) and of what a region
builds (the base itself, with adapters). Prints both, the base's size, and their ratio.

    .venv/bin/python benchmarks/aggregator_memory.py [--preset realistic]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import psutil


def _hwm_bytes() -> int:
    """Peak RSS (VmHWM) of this process."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return int(psutil.Process().memory_info().rss)


def _child(what: str, preset: str) -> dict[str, float]:
    import torch

    from fedciuic.config import ModelSpec
    from fedciuic.model.adapter import AdapterLayout, AdapterModel
    from fedciuic.model.presets import preset_tokenizer

    preset_tokenizer(preset)  # trained and cached once, outside the measurement
    before = _hwm_bytes()
    spec = ModelSpec(model_preset=preset)
    if what == "aggregator":
        layout = AdapterLayout.of(spec)
        adapter = sum(a.nbytes for a in layout.initial.values())
    else:
        model = AdapterModel(spec, device=torch.device("cpu"))
        adapter = sum(a.nbytes for a in model.adapter_state().values())
    return {"growth": _hwm_bytes() - before, "adapter": adapter}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="realistic")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.child, args.preset)))
        return 0
    from fedciuic.model.presets import preset_config

    config = preset_config(args.preset)
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())  # type: ignore[no-untyped-call]
    base_bytes = params * 4
    results = {}
    for what in ("aggregator", "region"):
        done = subprocess.run(
            [sys.executable, __file__, "--preset", args.preset, "--child", what],
            capture_output=True,
            text=True,
            check=True,
        )
        results[what] = json.loads(done.stdout.strip().splitlines()[-1])
    agg, region = results["aggregator"]["growth"], results["region"]["growth"]
    mib = 2**20
    print(
        f"preset {args.preset}: {params / 1e6:.1f}M parameters, {base_bytes / mib:.0f} MiB in fp32"
    )
    print(f"adapter: {results['aggregator']['adapter'] / mib:.1f} MiB")
    print(f"peak RSS growth, aggregator (meta layout): {agg / mib:8.1f} MiB")
    print(f"peak RSS growth, region (base + adapters): {region / mib:8.1f} MiB")
    print(
        f"aggregator / base size: {agg / base_bytes:.3f}; aggregator / region: {agg / region:.3f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
