"""What a secure round costs against a plain one, measured side by side in one process.

    .venv/bin/python benchmarks/secagg.py                       # 3, 8, 16, 32 regions
    .venv/bin/python benchmarks/secagg.py --regions 3,8 --modes lora-sb

For each adapter size (the ``realistic`` preset's trained entries: ``lora-sb``, the
default mode, and ``lora``, LoRA r=64 on the attention projections) and each number of
regions, one secure sum runs through both real ends of the protocol
(``fedciuic.secagg.lab``: every message signed, sealed where it says, passed as JSON
and parsed back): with every region there, and with a tenth of them (at least one)
dropping after they shared, before their masked vectors. Printed per case:

* bytes each region sends and receives, per phase (masked vector, shares and pair
  seeds, keys, consents and reveals), and what a plain round sends (the update coded
  ``int8``, the default codec, sealed);
* seconds per phase: a region's own work (the mean over regions) and the aggregator's;
  unmasking with dropouts against without (what dropout recovery costs);
* bits per value on the wire, against the research bar (central-DP accuracy at under 16
  bits per value: DDGauss, Kairouz et al. 2021; under 1.2 bits per parameter with sparse
  random projections: Chen et al. 2022);
* the rounding error of the published mean at 12, 16, 20, 24 and 32 bits (relative L2
  error against the exact mean of the clipped updates, 8 regions), so the bits can be
  chosen; and per region count, the mean's error at 12 to 20 bits (a ring element
  travels in its own bits: 12 bits are 1.5 bytes) beside the plain ``int8`` path's.

The updates are random (normal, clipped to norm 1): the protocol's cost does not
depend on what they hold. Results: ``benchmarks/results/secagg.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any, cast

import numpy as np

from fedciuic.compression import get_codec
from fedciuic.config import AdapterMode, ModelSpec
from fedciuic.crypto import Keypair, read_update_payload, update_payload
from fedciuic.crypto.envelope import open_envelope, seal
from fedciuic.model import AdapterLayout
from fedciuic.secagg import (
    Phase,
    Ring,
    SecureSumRegion,
    Session,
    from_ring,
    noised,
    ring_bits,
    ring_sum,
    rotate,
    run_secure_sum,
    unrotate,
)

RESULTS = Path(__file__).parent / "results" / "secagg.json"
CLIP = 1.0
#: Ring sizes whose mean's error is set against the plain int8 path's, per region count.
ERROR_BITS = (12, 14, 16, 17, 18, 20)


def size_of(mode: AdapterMode) -> int:
    layout = AdapterLayout.of(ModelSpec(model_preset="realistic", adapter_mode=mode, lora_rank=64))
    return sum(int(np.prod(a.shape)) for a in layout.initial.values())


def names(n: int) -> list[str]:
    return [f"r{i:02d}" for i in range(n)]


def updates(n: int, size: int, rng: np.random.Generator) -> list[np.ndarray]:
    out = []
    for _ in range(n):
        x = rng.normal(size=size)
        out.append(x / np.linalg.norm(x) * CLIP * rng.uniform(0.5, 1.0))
    return out


def plain_round(size: int, n: int, rng: np.random.Generator) -> dict[str, float]:
    """A plain round's upload per region: the update coded int8, sealed; and the time to
    code and seal it (a region) and to open, decode and add it (the aggregator, for
    ``n`` updates)."""
    sender, aggregator = Keypair.generate("r00", "EU"), Keypair.generate("aggregator", "EU")
    codec = get_codec("int8")
    x = updates(1, size, rng)[0].astype(np.float32)
    start = time.perf_counter()
    payload = update_payload({"update": np.frombuffer(codec.encode(x, rng), np.uint8)}, {}, {})
    sealed = seal(
        payload,
        sender=sender,
        recipient=aggregator.bundle,
        run_id=1,
        server_round=1,
        region="r00",
        suite="xwing-aes256gcm",
        policy_hash=b"",
    )
    region_s = time.perf_counter() - start
    start = time.perf_counter()
    opened = open_envelope(
        sealed,
        recipient=aggregator,
        senders={sender.bundle.key_id: sender.bundle},
        max_size=1 << 34,
    )
    arrays, _, _ = read_update_payload(opened.payload)
    total = np.zeros(size, np.float32)
    codec.decode(arrays["update"].tobytes(), size).add_into(total, 1.0)
    aggregator_s = time.perf_counter() - start
    return {"bytes": len(sealed), "region_s": region_s, "aggregator_s": aggregator_s * n}


def session_for(regions: list[str], size: int, bits: int) -> Session:
    return Session.propose(
        run_id=1,
        server_round=1,
        regions=tuple(regions),
        threshold=len(regions) // 2 + 1,
        bits=bits,
        size=size,
        clip=CLIP,
        noise=0.0,
    )


def encoded_updates(
    session: Session, xs: list[np.ndarray], rng: np.random.Generator
) -> list[np.ndarray]:
    """Each update as its region masks it: rotated, rounded at the session's scale."""
    ring, ddp = Ring(session.bits), session.distributed()
    return [noised(rotate(x, session.sid()), ddp, ring, rng) for x in xs]


def secure_round(
    size: int, n: int, dropping: int, bits: int, rng: np.random.Generator
) -> dict[str, Any]:
    regions = names(n)
    keys = {r: Keypair.generate(r, "EU") for r in regions}
    bundles = {r: k.bundle for r, k in keys.items()}
    session = session_for(regions, size, bits)
    start = time.perf_counter()
    encoded = dict(zip(regions, encoded_updates(session, updates(n, size, rng), rng), strict=True))
    encode_s = (time.perf_counter() - start) / n
    ends = {
        r: SecureSumRegion(keys[r], {p: b for p, b in bundles.items() if p != r}) for r in regions
    }
    silent = {Phase.MASKED: set(regions[:dropping])} if dropping else None
    start = time.perf_counter()
    total, run = run_secure_sum(session, ends, encoded, bundles, silent=silent)
    wall = time.perf_counter() - start
    survivors = [r for r in regions if r not in regions[:dropping]]
    assert np.array_equal(total, ring_sum([encoded[r] for r in survivors], Ring(bits)))
    start = time.perf_counter()
    run.aggregator.mean(total)
    decode_s = time.perf_counter() - start
    per_region = {p.value: run.seconds[p.value] / len(run.by_phase[p.value]) for p in Phase}
    return {
        "threshold": session.threshold,
        "dropping": dropping,
        "length": session.length,
        "encode_s": encode_s,
        "region_s": per_region,
        "aggregator_s": {
            **{p.value: run.seconds[f"aggregator {p.value}"] for p in Phase},
            "decode": decode_s,
        },
        "wall_s": wall,
        "sent": {p: max(v.values()) for p, v in run.by_phase.items()},
        "received": max(run.received.values()),
        "sent_total": max(run.sent.values()),
    }


def rounding_error(size: int, n: int, bits: int, rng: np.random.Generator) -> float:
    """Relative L2 error of the published mean of ``n`` clipped updates through a ring of
    ``bits``, against their exact mean."""
    session = session_for(names(n), size, bits)
    xs = updates(n, size, rng)
    ring = Ring(bits)
    total = from_ring(
        ring_sum(encoded_updates(session, xs, rng), ring), scale=session.scale, ring=ring
    )
    mean = unrotate(total / n, session.sid())
    exact = np.mean(xs, axis=0)
    return float(np.linalg.norm(mean - exact) / np.linalg.norm(exact))


def plain_error(size: int, n: int, rng: np.random.Generator) -> float:
    """Relative L2 error of the mean of ``n`` clipped updates each sent plain through the
    default codec (``int8``, stochastic rounding), against their exact mean: the error a
    secure sum's ring should be no worse than."""
    codec = get_codec("int8")
    xs = [x.astype(np.float32) for x in updates(n, size, rng)]
    total = np.zeros(size, np.float32)
    for x in xs:
        codec.decode(codec.encode(x, rng), size).add_into(total, 1.0)
    exact = np.mean(xs, axis=0)
    return float(np.linalg.norm(total / n - exact) / np.linalg.norm(exact))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--regions", default="3,8,16,32")
    parser.add_argument("--modes", default="lora-sb,lora")
    parser.add_argument(
        "--bits", type=int, default=0, help="ring bits (secure-ring-bits; 0: the run's choice)"
    )
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    result: dict[str, Any] = {"clip": CLIP, "ring_bits": args.bits, "modes": {}}
    for mode in cast(list[AdapterMode], args.modes.split(",")):
        size = size_of(mode)
        cases = {}
        for n in (int(v) for v in args.regions.split(",")):
            plain = plain_round(size, n, rng)
            bits_used = ring_bits(args.bits, regions=n, size=size, distributed_dp=False)
            full = secure_round(size, n, 0, bits_used, rng)
            dropped = secure_round(size, n, max(1, n // 10), bits_used, rng)
            bits = 8 * full["sent_total"] / size
            cases[n] = {
                "plain": plain,
                "secure": full,
                "dropouts": dropped,
                "bits_per_value": bits,
                "ring_bits": bits_used,
            }
            region_s = sum(full["region_s"].values()) + full["encode_s"]
            aggregator_s = sum(full["aggregator_s"].values())
            print(
                f"{mode:8s} {size:>9,} values  {n:2d} regions, {bits_used}-bit ring: sends "
                f"{full['sent_total']:>12,} B "
                f"(plain {plain['bytes']:>11,} B, x{full['sent_total'] / plain['bytes']:.2f}), "
                f"{bits:.2f} bits/value; region {region_s:.2f} s (plain "
                f"{plain['region_s']:.2f} s), aggregator {aggregator_s:.2f} s (plain "
                f"{plain['aggregator_s']:.2f} s); unmasking "
                f"{full['aggregator_s']['reveal']:.2f} s, with {dropped['dropping']} dropped "
                f"{dropped['aggregator_s']['reveal']:.2f} s"
            )
        errors = {b: rounding_error(size, 8, b, rng) for b in (12, 16, 20, 24, 32)}
        print(
            f"{mode:8s} rounding error of the mean of 8 regions by ring bits: "
            + ", ".join(f"{b}: {e:.2e}" for b, e in errors.items())
        )
        against = {}
        for n in (int(v) for v in args.regions.split(",")):
            ring = {b: rounding_error(size, n, b, rng) for b in ERROR_BITS}
            against[n] = {"plain_int8": plain_error(size, n, rng), "ring": ring}
            print(
                f"{mode:8s} {n:2d} regions: mean's error plain int8 "
                f"{against[n]['plain_int8']:.2e}; secure by ring bits (bytes a value): "
                + ", ".join(f"{b} ({Ring(b).size(8) / 8:g} B): {e:.2e}" for b, e in ring.items())
            )
        result["modes"][mode] = {
            "size": size,
            "cases": cases,
            "rounding_error_8_regions": errors,
            "error_against_plain": against,
        }
    Path(args.out).write_text(json.dumps(result, indent=1, default=float))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
