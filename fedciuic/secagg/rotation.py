"""A random rotation shared by a secure sum's regions: a permutation, then the randomized
Walsh-Hadamard transform ``H D / sqrt(P)`` (``D`` random signs, both from the session)
on windows of ``P`` values, the largest power of two within the size: the first ``P``
values, then (if needed) the overlapping last ``P``, so nothing is padded.

It is orthonormal, so it keeps the L2 norm (the DP sensitivity) and commutes with the
sum. Every rotated value is then about the norm over sqrt(size), never one spike, so the
scale follows the values' spread and far fewer bits carry the sum (DDGauss, 2021).
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
    """The orthonormal Walsh-Hadamard transform (its own inverse)."""
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


def _order(seed: bytes, size: int) -> np.ndarray:
    """A permutation from ``seed``, so each window holds its share of the update's energy."""
    state = int.from_bytes(hashlib.sha256(_LABEL + b" order" + seed).digest(), "little")
    return np.random.default_rng(state).permutation(size)


def rotate(x: np.ndarray, seed: bytes) -> np.ndarray:
    """``x`` permuted and rotated with the session's ``seed`` (as many values as ``x``)."""
    values = np.asarray(x, np.float64).ravel()
    out: np.ndarray = values[_order(seed, values.size)]
    for i, window in enumerate(_windows(out.size)):
        out[window] = _hadamard(out[window] * _signs(seed, i, block(out.size)))
    return out


def unrotate(y: np.ndarray, seed: bytes) -> np.ndarray:
    """:func:`rotate`'s inverse."""
    out = np.array(y, dtype=np.float64).ravel()
    windows = _windows(out.size)
    for i in reversed(range(len(windows))):
        out[windows[i]] = _hadamard(out[windows[i]]) * _signs(seed, i, block(out.size))
    back = np.empty_like(out)
    back[_order(seed, out.size)] = out
    return back


#: A sent norm is rounded up to a power of 2^(1/NORM_STEPS): it says no more than the
#: update's scale, and costs the sum under a tenth of a bit.
NORM_STEPS = 16


def sent_norm(values: np.ndarray, clip: float) -> float:
    """The norm a region sends in a secure round: its update's, at most ``clip``, rounded up."""
    norm = min(float(np.linalg.norm(np.asarray(values, np.float64))), clip)
    return 2.0 ** (math.ceil(NORM_STEPS * math.log2(norm)) / NORM_STEPS) if norm > 0 else 0.0
