"""A random rotation shared by a secure sum's regions: the randomized Walsh-Hadamard
transform, ``H D / sqrt(P)`` with ``D`` random signs drawn from the session, on a
window of ``P`` values, ``P`` the largest power of two within the update's size. An
update of another size is rotated in two windows that overlap, the first ``P`` values
and then the last ``P``: every value is mixed, and nothing is padded (a masked vector
has exactly as many values as the update).

It is orthonormal, so it keeps an update's L2 norm (its DP sensitivity) and the sum of
rotated updates is the rotation of their sum (the aggregator turns the sum back). What
it buys: after it, every value of a clipped update is about its norm over sqrt(size)
(at most over sqrt(``P``), which is at most sqrt(2) more), never one large spike, so
the fixed point's scale can be set by the values' spread instead of the whole norm,
and a ring of far fewer bits carries the sum (DDGauss, Kairouz, Liu and Steinke 2021).
"""

from __future__ import annotations

import hashlib
import math

import numpy as np

_LABEL = b"fedciuic-secagg/2 rotation"


def block(size: int) -> int:
    """The windows' length: the largest power of two within ``size`` (1 at least)."""
    return 1 << max(size.bit_length() - 1, 0)


def _windows(size: int) -> list[slice]:
    p = block(size)
    return [slice(0, p)] if p >= size else [slice(0, p), slice(size - p, size)]


def _signs(seed: bytes, window: int, length: int) -> np.ndarray:
    label = _LABEL + bytes([window]) + seed
    bits = np.unpackbits(np.frombuffer(hashlib.shake_256(label).digest(length // 8 + 1), np.uint8))
    return np.where(bits[:length] == 1, 1.0, -1.0)


def _hadamard(x: np.ndarray) -> np.ndarray:
    """The Walsh-Hadamard transform of ``x`` (a power of two long), divided by
    sqrt(its length): its own inverse."""
    n = x.size
    y = np.array(x, dtype=np.float64)
    h = 1
    while h < n:
        view = y.reshape(-1, 2, h)
        a, b = view[:, 0, :].copy(), view[:, 1, :]
        view[:, 0, :] += b
        view[:, 1, :] = a - b
        h *= 2
    out: np.ndarray = y / np.sqrt(n)
    return out


def rotate(x: np.ndarray, seed: bytes) -> np.ndarray:
    """``x`` rotated with the session's ``seed`` (as many values as ``x``)."""
    out = np.array(x, dtype=np.float64).ravel()
    for i, window in enumerate(_windows(out.size)):
        out[window] = _hadamard(out[window] * _signs(seed, i, block(out.size)))
    return out


def unrotate(y: np.ndarray, seed: bytes) -> np.ndarray:
    """:func:`rotate`'s inverse."""
    out = np.array(y, dtype=np.float64).ravel()
    windows = _windows(out.size)
    for i in reversed(range(len(windows))):
        out[windows[i]] = _hadamard(out[windows[i]]) * _signs(seed, i, block(out.size))
    return out


def rotation_norm(x: np.ndarray) -> float:
    """The L2 norm ``x`` acts as in :func:`rotate`: after it, a value is about this over
    sqrt(size). That is ``x``'s norm when its energy is spread evenly; more when a window
    holds more than its share (at most sqrt(size / ``P``) times more). The second
    window's energy is its expectation over the signs (it holds the first window's
    rotated overlap)."""
    values = np.asarray(x, np.float64).ravel()
    size, p = values.size, block(values.size)
    if size == 0:
        return 0.0
    first = float(np.dot(values[:p], values[:p]))
    if p >= size:
        return float(np.sqrt(first))
    rest = values[p:]
    second = float(np.dot(rest, rest)) + first * (2 * p - size) / p
    return float(np.sqrt(size / p * max(first, second)))


#: A norm a region sends is rounded up to a power of 2^(1/NORM_STEPS): it says no more
#: than the update's scale, and costs the sum under a tenth of a bit.
NORM_STEPS = 16


def sent_norm(values: np.ndarray, clip: float) -> float:
    """The norm a region sends with its trained reply in a secure round: the
    :func:`rotation_norm` of its update clipped to ``clip`` (as the sum takes it),
    rounded up."""
    x = np.asarray(values, np.float64).ravel()
    norm = float(np.linalg.norm(x))
    clipped = x * (clip / norm) if norm > clip else x
    spread = rotation_norm(clipped)
    return 2.0 ** (math.ceil(NORM_STEPS * math.log2(spread)) / NORM_STEPS) if spread > 0 else 0.0
