"""Value bodies: fp32; int8, int4 and int2 with stochastic rounding (unbiased); and
sign; each but fp32 with one fp32 scale per :data:`CHUNK` entries. Each ``decode``
checks that the body holds what its sizes say before reading it.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from fedciuic.compression.errors import MalformedUpdate

CHUNK = 256  # entries per scale

#: A value body's encoder (the rng drives stochastic rounding) and decoder.
Encode = Callable[[np.ndarray, np.random.Generator], bytes | memoryview]
Decode = Callable[[memoryview, int], tuple[np.ndarray, int]]


def finite(values: np.ndarray, what: str) -> None:
    if not np.all(np.isfinite(values)):
        raise MalformedUpdate(f"{what} contain NaN or infinite values")


def _chunks(x: np.ndarray) -> np.ndarray:
    """``x`` as rows of :data:`CHUNK` entries, the last zero-padded (a view if none is needed)."""
    pad = (-x.size) % CHUNK
    return (np.pad(x, (0, pad)) if pad else x).reshape(-1, CHUNK)


def _split(body: memoryview, n: int, size: int, what: str) -> tuple[np.ndarray, memoryview, int]:
    """The scales of ``n`` entries, the ``size`` bytes after them, and the bytes used, checked."""
    head = 4 * math.ceil(n / CHUNK)
    if len(body) < head + size:
        raise MalformedUpdate(f"{what} body truncated")
    scales = np.frombuffer(body[:head], np.float32)
    finite(scales, f"{what} scales")
    return scales, body[head : head + size], head + size


def _scaled(q: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Each entry of ``q`` times its chunk's scale, in float32 (no per-entry scale copy)."""
    n = q.size
    out = np.empty(n, np.float32)
    full = n - n % CHUNK
    rows = full // CHUNK
    np.multiply(
        q[:full].reshape(rows, CHUNK),
        scales[:rows, None],
        out=out[:full].reshape(rows, CHUNK),
        dtype=np.float32,
    )
    if full < n:
        np.multiply(q[full:], scales[rows], out=out[full:], dtype=np.float32)
    return out


#: Uniforms drawn per call while rounding: a 10M-entry update takes no second copy.
_DRAWS = 1 << 20


def _quantise(x: np.ndarray, levels: int, rng: np.random.Generator) -> tuple[bytes, np.ndarray]:
    """Scales ``max|chunk| / levels`` and ``q = clip(floor(x / scale + u), -levels, levels)``,
    u uniform in [0, 1): unbiased, and ``|x - q * scale| < scale``."""
    chunks = _chunks(x)
    peak = np.maximum(chunks.max(axis=1), -chunks.min(axis=1))  # max |x|, no |x| copy
    scales = (peak / levels).astype(np.float32)
    divisors = np.where(scales > 0, scales, np.float32(1.0))[:, None]
    out = np.empty(x.size, np.int8)
    scratch = np.empty((min(_DRAWS, chunks.size) // CHUNK, CHUNK), np.float32)
    draws = np.empty(min(_DRAWS, x.size), np.float32)
    rows = _DRAWS // CHUNK
    for start in range(0, x.size, _DRAWS):  # a span at a time: no update-sized scratch
        row = start // CHUNK
        span = chunks[row : row + rows]
        q = np.divide(span, divisors[row : row + rows], out=scratch[: len(span)])
        part = q.reshape(-1)[: min(_DRAWS, x.size - start)]
        part += rng.random(out=draws[: part.size], dtype=np.float32)  # one call's stream
        np.floor(part, out=part)
        np.clip(part, -levels, levels, out=part)
        out[start : start + part.size] = part
    return scales.tobytes(), out


def fp32_encode(x: np.ndarray, _: np.random.Generator) -> memoryview:
    return x.data.cast("B")  # no copy: the caller joins it into the update once


def fp32_decode(body: memoryview, n: int) -> tuple[np.ndarray, int]:
    if len(body) < 4 * n:
        raise MalformedUpdate("fp32 values truncated")
    return np.frombuffer(body[: 4 * n], np.float32), 4 * n


def int8_encode(x: np.ndarray, rng: np.random.Generator) -> bytes:
    scales, q = _quantise(x, 127, rng)
    return b"".join((scales, q.data))


def int8_decode(body: memoryview, n: int) -> tuple[np.ndarray, int]:
    scales, data, used = _split(body, n, n, "int8")
    return _scaled(np.frombuffer(data, np.int8), scales), used


def _packed(width: int) -> tuple[Encode, Decode]:
    """The codec of ``width``-bit values (4: -7..7, 2: -1..1), rounded like int8 and stored
    as ``q + 2**(width-1)``, earlier entries in lower bits; a 0 code is padding only."""
    what, offset, per = f"int{width}", 1 << (width - 1), 8 // width
    levels, mask = offset - 1, (1 << width) - 1
    shifts = np.arange(0, 8, width, dtype=np.uint8)

    def encode(x: np.ndarray, rng: np.random.Generator) -> bytes:
        scales, q = _quantise(x, levels, rng)
        codes = np.zeros(per * math.ceil(x.size / per), np.uint8)
        codes[: x.size] = (q + offset).astype(np.uint8)
        packed: np.ndarray = np.bitwise_or.reduce(codes.reshape(-1, per) << shifts, axis=1)
        return scales + packed.astype(np.uint8).tobytes()

    def decode(body: memoryview, n: int) -> tuple[np.ndarray, int]:
        scales, data, used = _split(body, n, math.ceil(n / per), what)
        codes = ((np.frombuffer(data, np.uint8)[:, None] >> shifts) & mask).ravel()
        if np.any(codes[:n] == 0) or np.any(codes[n:] != 0):
            raise MalformedUpdate(
                f"{what} body holds a value outside -{levels}..{levels} or a non-zero pad"
            )
        return _scaled(codes[:n].astype(np.int8) - offset, scales), used

    return encode, decode


int4_encode, int4_decode = _packed(4)
int2_encode, int2_decode = _packed(2)


def sign_encode(x: np.ndarray, _: np.random.Generator) -> bytes:
    """One bit per entry (1 for x >= 0, LSB first); scale: the mean |x| of the chunk's entries."""
    counts = np.minimum(CHUNK, x.size - CHUNK * np.arange(math.ceil(x.size / CHUNK)))
    scales: np.ndarray = np.abs(_chunks(x)).sum(axis=1).astype(np.float32) / counts
    return scales.astype(np.float32).tobytes() + np.packbits(x >= 0, bitorder="little").tobytes()


def sign_decode(body: memoryview, n: int) -> tuple[np.ndarray, int]:
    scales, data, used = _split(body, n, math.ceil(n / 8), "sign")
    bits = np.unpackbits(np.frombuffer(data, np.uint8), bitorder="little")
    return _scaled(bits[:n].astype(np.float32) * 2 - 1, scales), used
