"""Seal+open throughput of fedciuic envelopes against raw AES-256-GCM, measured side by side.

    .venv/bin/python benchmarks/sealing.py

For each payload size, the raw baseline is one AES-256-GCM encrypt and one decrypt
with ``cryptography``; an envelope is ``seal`` (X-Wing encapsulation, HKDF, AEAD,
SHA-256 over the envelope, Ed25519 signature) plus ``open_envelope`` (verification,
X-Wing decapsulation, AEAD). Runs are interleaved and the best of several is kept.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from report import Row, verdict

from fedciuic.crypto.envelope import Suite, open_envelope, seal
from fedciuic.crypto.keys import Keypair

SIZES = {"1 KiB": 1 << 10, "1 MiB": 1 << 20, "64 MiB": 64 << 20}


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def rows(result: dict[str, Any]) -> list[Row]:
    out: list[Row] = []
    for size in ("1 MiB", "64 MiB"):
        if size in result["sizes"]:
            r = result["sizes"][size]
            out.append(
                [
                    f"sealing at {size}",
                    f"{r['envelope_ratio']:.2f} of raw AES-256-GCM "
                    f"({r['envelope_mb_s']:.0f} vs {r['raw_mb_s']:.0f} MB/s); "
                    f"X-Wing {result['xwing_ms']:.2f} ms per update",
                    ">= 0.80 of raw AES-GCM",
                    verdict(r["envelope_ratio"] >= 0.8),
                ]
            )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()

    aggregator, region = Keypair.generate("aggregator", "EU"), Keypair.generate("eu", "EU")
    senders = {region.bundle.key_id: region.bundle}
    aes = AESGCM(AESGCM.generate_key(256))
    nonce = os.urandom(12)

    def raw(payload: bytes) -> None:
        aes.decrypt(nonce, aes.encrypt(nonce, payload, b"header"), b"header")

    def envelope(payload: bytes, suite: Suite) -> int:
        sealed = seal(
            payload,
            sender=region,
            recipient=aggregator.bundle,
            run_id=1,
            server_round=1,
            region="eu",
            suite=suite,
        )
        open_envelope(sealed, recipient=aggregator, senders=senders, max_size=1 << 31)
        return len(sealed)

    results: dict[str, dict[str, float]] = {}
    print("seal+open throughput (MB/s) and ratio to raw AES-256-GCM encrypt+decrypt")
    print(
        f"{'payload':>8} {'raw GCM':>9} {'envelope':>9} {'ratio':>6} {'fernet':>8} "
        f"{'ratio':>6} {'fernet size':>12}"
    )
    for label, size in SIZES.items():
        payload = os.urandom(size)
        repeats = args.repeats if size < (32 << 20) else max(2, args.repeats // 2)
        times = {"raw": [], "gcm": [], "fernet": []}  # type: dict[str, list[float]]
        for _ in range(repeats):  # interleaved
            times["raw"].append(best_seconds(partial(raw, payload), 1))
            times["gcm"].append(best_seconds(partial(envelope, payload, "xwing-aes256gcm"), 1))
            times["fernet"].append(best_seconds(partial(envelope, payload, "xwing-fernet"), 1))
        mbps = {k: size / min(v) / 1e6 for k, v in times.items()}
        gcm_len = envelope(payload, "xwing-aes256gcm")
        fernet_len = envelope(payload, "xwing-fernet")
        results[label] = {
            "raw_mb_s": mbps["raw"],
            "envelope_mb_s": mbps["gcm"],
            "fernet_mb_s": mbps["fernet"],
            "envelope_ratio": mbps["gcm"] / mbps["raw"],
            "fernet_ratio": mbps["fernet"] / mbps["raw"],
            "envelope_overhead_bytes": gcm_len - size,
            "fernet_size_ratio": fernet_len / gcm_len,
        }
        r = results[label]
        print(
            f"{label:>8} {mbps['raw']:>9.1f} {mbps['gcm']:>9.1f} {r['envelope_ratio']:>6.2f} "
            f"{mbps['fernet']:>8.1f} {r['fernet_ratio']:>6.2f} {r['fernet_size_ratio']:>11.2f}x"
        )

    kem = best_seconds(
        lambda: aggregator.xwing.decapsulate(aggregator.bundle.xwing.encapsulate()[1]), 20
    )
    fixed = best_seconds(lambda: envelope(b"", "xwing-aes256gcm"), 20)
    print(
        f"X-Wing encapsulate+decapsulate: {kem * 1e3:.2f} ms; whole envelope of an empty "
        f"payload (KEM, signature, verification): {fixed * 1e3:.2f} ms; "
        f"envelope overhead {results['1 KiB']['envelope_overhead_bytes']:.0f} bytes"
    )
    at_scale = min(results[k]["envelope_ratio"] for k in ("1 MiB", "64 MiB"))
    verdict = "meets" if at_scale >= 0.8 else "MISSES"
    print(f"envelope at >= 1 MiB: {at_scale:.2f} of raw AES-GCM ({verdict} the 0.80 target)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(
                {"sizes": results, "xwing_ms": kem * 1e3, "fixed_ms": fixed * 1e3}, handle, indent=2
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
