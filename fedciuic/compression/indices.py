"""Sorted top-k indices coded near their entropy bound, vectorised (no per-index loops).

Any set of k of n positions needs log2 C(n, k) bits; the gaps between kept indices are
close to geometric, for which a Rice code is within a few percent of that bound. Kept
entries cluster, so each block of :data:`BLOCK` gaps picks its own Rice parameter b and
may flag its zero gaps with a bit each (``Z``). Format 2 is laid out in
``docs/compression.md``; its streams are kept apart so both directions are array operations.
"""

from __future__ import annotations

import math

import numpy as np

from fedciuic.compression.errors import MalformedUpdate

BLOCK = 256  # gaps per parameter byte (0.03 bits per index)
MAX_B = 31
ZERO_FLAGS = 0x80
_U32 = np.dtype("<u4")
#: A high stream longer than this is refused before it is unpacked (8 bytes per bit).
MAX_HIGH_BYTES = 1 << 28


def bound_bits(n: int, k: int) -> float:
    """log2 C(n, k): the fewest bits any coding of k sorted positions of n needs."""
    if not 0 <= k <= n:
        raise ValueError(f"k={k} outside 0..{n}")
    return (math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)) / math.log(2)


def _parameters(gaps: np.ndarray) -> np.ndarray:
    """Per block, the (b, Z) that minimise its bits: plain, len (b + 1) + sum(g >> b);
    Z, len + nonzero (b + 1) + sum((g - 1) >> b) over the non-zero gaps."""
    blocks = math.ceil(gaps.size / BLOCK)
    table = np.pad(gaps, (0, blocks * BLOCK - gaps.size)).reshape(blocks, BLOCK)
    sizes = np.minimum(BLOCK, gaps.size - BLOCK * np.arange(blocks))
    nonzero = np.count_nonzero(table, axis=1)
    less_one = np.maximum(table - 1, 0)  # padding and zero gaps add nothing below
    best = np.zeros(blocks, np.int64)
    best_cost = sizes + table.sum(axis=1)  # plain, b = 0
    for b in range(min(MAX_B, int(gaps.max()).bit_length()) + 1):
        for flag, cost in (
            (0, sizes * (b + 1) + (table >> b).sum(axis=1)),
            (ZERO_FLAGS, sizes + nonzero * (b + 1) + (less_one >> b).sum(axis=1)),
        ):
            better = cost < best_cost
            best[better], best_cost[better] = b | flag, cost[better]
    return best.astype(np.uint8)


def _pack(offsets: np.ndarray, widths: np.ndarray, values: np.ndarray, total: int) -> bytes:
    """``values[i]`` in ``widths[i]`` bits at bit ``offsets[i]``, LSB first, packed."""
    bits = np.zeros(total, np.uint8)
    for j in range(int(widths.max()) if widths.size else 0):
        on = widths > j
        bits[offsets[on] + j] = (values[on] >> j) & 1
    return np.packbits(bits, bitorder="little").tobytes()


def _bits(data: memoryview) -> np.ndarray:
    """The bits of ``data``, LSB first."""
    return np.unpackbits(np.frombuffer(data, np.uint8), bitorder="little")


def _unpack(data: np.ndarray, offsets: np.ndarray, widths: np.ndarray) -> np.ndarray:
    """The inverse of :func:`_pack` (``data`` padded with 8 zero bytes)."""
    window = np.zeros(offsets.size, np.uint64)
    byte = offsets >> 3
    for i in range(5):  # 40 bits hold any field of <= 31 bits at any bit offset
        window |= data[byte + i].astype(np.uint64) << np.uint64(8 * i)
    masks = (np.uint64(1) << widths.astype(np.uint64)) - np.uint64(1)
    return ((window >> (offsets & 7).astype(np.uint64)) & masks).astype(np.int64)


def _layout(params: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per gap: its Rice parameter and whether its block flags zero gaps."""
    per_gap = np.repeat(params.astype(np.int64), BLOCK)[:k]
    return per_gap & MAX_B, (per_gap & ZERO_FLAGS) != 0


def encode(indices: np.ndarray) -> bytes:
    """Code sorted, unique, non-negative indices (at least one)."""
    gaps = np.diff(indices.astype(np.int64), prepend=-1) - 1
    params = _parameters(gaps)
    widths, flagged = _layout(params, gaps.size)
    zero = flagged & (gaps == 0)
    flags = np.packbits(zero[flagged], bitorder="little").tobytes()
    coded = ~zero
    values, widths = gaps[coded] - flagged[coded], widths[coded]
    ends = np.cumsum(widths)
    low = _pack(ends - widths, widths, values, int(ends[-1]) if ends.size else 0)
    high_bits = np.zeros(int((values >> widths).sum()) + values.size, np.uint8)
    high_bits[np.cumsum((values >> widths) + 1) - 1] = 1  # where each unary code ends
    high = np.packbits(high_bits, bitorder="little").tobytes()
    return np.array([len(high)], _U32).tobytes() + params.tobytes() + flags + low + high


def decode(data: memoryview, k: int, n: int) -> tuple[np.ndarray, int]:
    """``k`` indices below ``n`` (int64, sorted, unique) and the bytes used; every size is
    checked against the bytes present before anything of that size is allocated."""
    blocks = math.ceil(k / BLOCK)
    if len(data) < 4 + blocks:
        raise MalformedUpdate("index block truncated")
    high_len = int(np.frombuffer(data[:4], _U32)[0])
    params = np.frombuffer(data[4 : 4 + blocks], np.uint8)
    if np.any(params & ~np.uint8(MAX_B | ZERO_FLAGS)):
        raise MalformedUpdate("index block: a block parameter has unknown bits set")
    widths, flagged = _layout(params, k)
    at = 4 + blocks
    flag_count = int(np.count_nonzero(flagged))
    flag_len = math.ceil(flag_count / 8)
    if len(data) < at + flag_len:
        raise MalformedUpdate("index block truncated")
    zero = np.zeros(k, bool)
    zero[flagged] = _bits(data[at : at + flag_len])[:flag_count].astype(bool)
    at += flag_len
    coded = ~zero
    widths = widths[coded]
    ends = np.cumsum(widths)
    low_len = math.ceil(int(ends[-1]) / 8) if ends.size else 0
    high_at = at + low_len
    if high_len > MAX_HIGH_BYTES or len(data) < high_at + high_len:
        raise MalformedUpdate("index block truncated or malformed")
    ones = np.flatnonzero(_bits(data[high_at : high_at + high_len]))
    if ones.size != widths.size or (ones.size and ones[-1] < 8 * (high_len - 1)):
        raise MalformedUpdate(
            f"index block codes {ones.size} gaps where its parameters say {widths.size}"
        )
    low = np.zeros(low_len + 8, np.uint8)
    low[:low_len] = np.frombuffer(data[at:high_at], np.uint8)
    quotients = np.diff(ones, prepend=-1) - 1  # < 2**31: no overflow when shifted
    gaps = np.zeros(k, np.int64)
    gaps[coded] = ((quotients << widths) | _unpack(low, ends - widths, widths)) + flagged[coded]
    if gaps.max() >= n:
        raise MalformedUpdate(f"index gap {int(gaps.max())} out of range for {n} entries")
    indices = np.cumsum(gaps.astype(np.uint64) + np.uint64(1)) - np.uint64(1)
    if indices[-1] >= n:
        raise MalformedUpdate(f"index {int(indices[-1])} out of range for {n} entries")
    return indices.astype(np.int64), high_at + high_len


def decode_v1(data: memoryview, k: int, n: int) -> tuple[np.ndarray, int]:
    """Format 1 (one width w, then the k gaps w bits each), so an older update still opens."""
    if len(data) < 1:
        raise MalformedUpdate("index block missing")
    width = data[0]
    nbytes = math.ceil(k * width / 8)
    if not 1 <= width <= 32 or len(data) < 1 + nbytes:
        raise MalformedUpdate("index block truncated or malformed")
    gaps = _bits(data[1 : 1 + nbytes])[: k * width].reshape(k, width).astype(np.int64) @ (
        np.int64(1) << np.arange(width, dtype=np.int64)
    )
    indices = np.cumsum(gaps + 1) - 1
    if k and (indices[-1] >= n):
        raise MalformedUpdate(f"index {int(indices[-1])} out of range for {n} entries")
    return indices, 1 + nbytes
