"""A random rotation shared by a secure sum's regions: the randomized Walsh-Hadamard
transform, ``H D / sqrt(n)`` with ``D`` random signs drawn from the session, on each
block of :func:`block` values of the update (padded with zeros to whole blocks: a power
of two up to 2^16, so that padding costs at most a block).

It is orthonormal, so it keeps an update's L2 norm (its DP sensitivity) and the sum of
rotated updates is the rotation of their sum (the aggregator turns the sum back). What
it buys: after it, every value of a clipped update is about ``clip / sqrt(n)``, never one
large spike, so the fixed point's scale can be set by the values' spread instead of the
whole norm, and a ring of far fewer bits carries the sum (DDGauss, Kairouz, Liu and
Steinke 2021).
"""

from __future__ import annotations

import hashlib

import numpy as np

_LABEL = b"fedciuic-secagg/1 rotation"


#: The largest block rotated as one: a value of a rotated block is about its norm over
#: sqrt(2^16) = 256, whatever the update held.
MAX_BLOCK = 1 << 16


def block(size: int) -> int:
    """The blocks' length: ``size`` rounded up to a power of two, at most :data:`MAX_BLOCK`."""
    return min(1 << max(size - 1, 0).bit_length(), MAX_BLOCK)


def padded(size: int) -> int:
    """The rotation's length: ``size`` rounded up to whole blocks."""
    b = block(size)
    return -(-size // b) * b


def _signs(seed: bytes, length: int) -> np.ndarray:
    bits = np.unpackbits(
        np.frombuffer(hashlib.shake_256(_LABEL + seed).digest(length // 8 + 1), np.uint8)
    )
    return np.where(bits[:length] == 1, 1.0, -1.0)


def _hadamard(x: np.ndarray, n: int) -> np.ndarray:
    """The Walsh-Hadamard transform of each block of ``n`` values of ``x`` (``n`` a power
    of two), divided by sqrt(n): its own inverse."""
    y = np.array(x, dtype=np.float64).reshape(-1, n)
    h = 1
    while h < n:
        view = y.reshape(y.shape[0], -1, 2, h)
        a, b = view[:, :, 0, :].copy(), view[:, :, 1, :]
        view[:, :, 0, :] += b
        view[:, :, 1, :] = a - b
        h *= 2
    out: np.ndarray = y.reshape(-1) / np.sqrt(n)
    return out


def rotate(x: np.ndarray, seed: bytes) -> np.ndarray:
    """``x`` padded to :func:`padded` length and rotated (the session's ``seed``)."""
    values = np.asarray(x, np.float64).ravel()
    length = padded(values.size)
    out = np.zeros(length)
    out[: values.size] = values
    return _hadamard(out * _signs(seed, length), block(values.size))


def unrotate(y: np.ndarray, seed: bytes, size: int) -> np.ndarray:
    """:func:`rotate`'s inverse for an update of ``size`` values."""
    values = np.asarray(y, np.float64).ravel()
    out: np.ndarray = (_hadamard(values, block(size)) * _signs(seed, values.size))[:size]
    return out
