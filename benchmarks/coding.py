"""Update coding at a real adapter's size: index bits against log2 C(n, k), bytes per
codec against dense, and encode + decode time on one core.

A 13.8M-entry delta (the size of LoRA r=256 on a 225M DeepSeek-V3-shaped model) in
four shapes: flat (a DP-SGD delta: every entry bounded by steps x learning rate),
normal, per-tensor (one tensor in 20 moved 10x more, so top-k clusters there) and
row runs (neighbours move together). Format 1 (fedciuic before issue 20: every gap
at the widest gap's bit width) is computed alongside as the reference.

    .venv/bin/python benchmarks/coding.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one core, as the target says

import numpy as np
from report import Row, best_seconds, verdict

from fedciuic.compression import get_codec
from fedciuic.compression import indices as index_coding
from fedciuic.compression.codecs import top_k

CODECS = ["topk-int8:0.015", "topk-int4:0.015", "topk-sign:0.015", "topk-int8:0.005"]


def delta(shape: str, n: int, rng: np.random.Generator) -> np.ndarray:
    if shape == "flat":
        return rng.uniform(-1, 1, n).astype(np.float32)
    if shape == "normal":
        return rng.standard_normal(n).astype(np.float32)
    if shape == "per-tensor":
        scale = np.ones(n, np.float32)
        scale[: n // 20] = 10
        return (rng.uniform(-1, 1, n) * scale).astype(np.float32)
    # row runs: rows of 256 entries share a magnitude drawn per row
    rows = rng.lognormal(0, 1, math.ceil(n / 256)).astype(np.float32)
    return (rng.uniform(-1, 1, n).astype(np.float32) * np.repeat(rows, 256)[:n]).astype(np.float32)


def v1_index_bytes(indices: np.ndarray) -> int:
    gaps = np.diff(indices, prepend=-1) - 1
    return 1 + math.ceil(indices.size * max(1, int(gaps.max()).bit_length()) / 8)


def measure(n: int, density: float, repeats: int) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    shapes: dict[str, Any] = {}
    for shape in ("flat", "normal", "per-tensor", "row-runs"):
        x = delta(shape, n, rng)
        k = math.ceil(density * n)
        top = top_k(x, k)
        bound = index_coding.bound_bits(n, k) / 8
        v2 = len(index_coding.encode(top))
        shapes[shape] = {
            "bound_bytes": bound,
            "index_bytes": v2,
            "v1_index_bytes": v1_index_bytes(top),
            "efficiency": bound / v2,
            "v1_efficiency": bound / v1_index_bytes(top),
        }
    x = delta("flat", n, rng)
    codecs: dict[str, Any] = {}
    for spec in ["dense", *CODECS]:
        codec = get_codec(spec)
        blob = codec.encode(x, rng)
        codecs[spec] = {
            "bytes": len(blob),
            "ratio": 4 * n / len(blob),
            "encode_s": best_seconds(lambda c=codec: c.encode(x, rng), repeats),
            "decode_s": best_seconds(lambda c=codec, b=blob: c.decode(b, n), repeats),
        }
    return {"entries": n, "density": density, "shapes": shapes, "codecs": codecs}


def rows(result: dict[str, Any]) -> list[Row]:
    n, density = result["entries"], result["density"]
    name, worst = min(result["shapes"].items(), key=lambda kv: kv[1]["efficiency"])
    v1 = min(s["v1_efficiency"] for s in result["shapes"].values())
    effs = ", ".join(f"{k} {s['efficiency']:.3f}" for k, s in result["shapes"].items())
    out: list[Row] = [
        [
            f"top-k index coding, {n / 1e6:.1f}M entries, density {density}",
            f"{effs} of log2 C(n,k) (format 1 before: down to {v1:.2f}); {name}: "
            f"{worst['index_bytes'] / 1e3:.0f} KB vs bound {worst['bound_bytes'] / 1e3:.0f} KB",
            ">= 0.95 of log2 C(n,k), clustered too",
            verdict(worst["efficiency"] >= 0.95),
        ]
    ]
    slowest = max(
        c["encode_s"] + c["decode_s"] for s, c in result["codecs"].items() if s != "dense"
    )
    sizes = ", ".join(f"{s} {c['ratio']:.0f}x" for s, c in result["codecs"].items() if s != "dense")
    out.append(
        [
            f"encode + decode, {n / 1e6:.1f}M-entry update, one core",
            f"at most {slowest:.3f} s over the top-k codecs; sizes vs dense: {sizes}",
            "well under 1 s",
            verdict(slowest < 0.5),
        ]
    )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--entries", type=int, default=13_800_000)
    parser.add_argument("--density", type=float, default=0.015)
    parser.add_argument("--repeats", type=int, default=3, help="keep the fastest")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    result = measure(args.entries, args.density, args.repeats)
    print(f"index coding, {args.entries:,} entries, k = {args.density} n")
    print(f"{'shape':<12} {'bound KB':>9} {'format 2':>9} {'eff':>6} {'format 1':>9} {'eff':>6}")
    for shape, s in result["shapes"].items():
        print(
            f"{shape:<12} {s['bound_bytes'] / 1e3:>9.1f} {s['index_bytes'] / 1e3:>9.1f} "
            f"{s['efficiency']:>6.3f} {s['v1_index_bytes'] / 1e3:>9.1f} {s['v1_efficiency']:>6.3f}"
        )
    print(f"{'codec':<18} {'bytes':>10} {'vs dense':>9} {'encode s':>9} {'decode s':>9}")
    for spec, c in result["codecs"].items():
        print(
            f"{spec:<18} {c['bytes']:>10} {c['ratio']:>8.1f}x {c['encode_s']:>9.3f} "
            f"{c['decode_s']:>9.3f}"
        )
    for row in rows(result):
        print(" | ".join(row))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
