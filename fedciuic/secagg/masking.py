"""Pairwise masking in the ring of integers modulo 2^bits: each region's fixed-point
update plus a self mask plus one mask per other region, added towards a higher index and
subtracted towards a lower one, so the pair masks cancel in the sum. The self masks come
off once the survivors' seeds are revealed, and the pair masks of a region that dropped
after masking with the pair seeds recovered from shares (SecAgg, Bonawitz et al. 2017).
Integer arithmetic throughout, so the unmasked sum is exact; masks are SHAKE-256 streams.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import numpy as np

from fedciuic.errors import FedciuicError

#: Ring sizes offered, in bits: every sum stays exact in uint64, and a signed value fits.
MIN_BITS, MAX_BITS = 8, 62
#: Domain separation of the two kinds of mask, versioned with the stream's layout.
_SELF, _PAIR = b"fedciuic-secagg/1 self", b"fedciuic-secagg/1 pair"
#: The wrap check: random linear hashes of a region's integer update in the widest ring,
#: masked like it, so the aggregator learns them of the sum only and sees a wrap.
SKETCH_VALUES = 2
SKETCH_BITS = MAX_BITS
SKETCH_BYTES = 8 * SKETCH_VALUES
SKETCH_LABEL = b" sketch"
_COEFFICIENTS = b"fedciuic-secagg/2 sketch coefficients"
_CHUNK = 1 << 20


class RingTooSmall(FedciuicError):
    """A sum of this many clipped, scaled updates could wrap around the ring."""


@dataclass(frozen=True)
class Ring:
    """Integers modulo 2^bits, held as uint64 (exact mod 2^64, which 2^bits divides)."""

    bits: int

    def __post_init__(self) -> None:
        if not MIN_BITS <= self.bits <= MAX_BITS:
            raise ValueError(f"a ring of {self.bits} bits: {MIN_BITS} to {MAX_BITS} are supported")

    @property
    def mask(self) -> np.uint64:
        return np.uint64((1 << self.bits) - 1)

    def reduce(self, values: np.ndarray) -> np.ndarray:
        return np.asarray(values, np.uint64) & self.mask

    def size(self, count: int) -> int:
        """Bytes of ``count`` elements on the wire, ``bits`` each, packed."""
        return (count * self.bits + 7) // 8

    @property
    def _group(self) -> tuple[int, int]:
        """Elements per group and its bytes: ``8 / gcd(bits, 8)`` elements end on a byte."""
        count = 8 // math.gcd(self.bits, 8)
        return count, count * self.bits // 8

    def pack(self, values: np.ndarray) -> bytes:
        """Elements as one little-endian bit stream, ``bits`` each, zero-padded."""
        v = np.asarray(values, np.uint64).reshape(-1)
        if self.bits % 8 == 0:  # whole bytes: each element's low bytes
            wide = np.ascontiguousarray(v.astype("<u8")).view(np.uint8).reshape(-1, 8)
            return np.ascontiguousarray(wide[:, : self.bits // 8]).tobytes()
        count, width = self._group
        groups = -(-v.size // count)
        padded = np.zeros(groups * count, np.uint64)
        padded[: v.size] = v
        grouped = padded.reshape(groups, count)
        out = np.zeros((groups, width + 9), np.uint8)  # 9 spare bytes: a value's top bits
        for j in range(count):
            byte, shift = divmod(j * self.bits, 8)
            low = (grouped[:, j] << np.uint64(shift)).astype("<u8")
            out[:, byte : byte + 8] |= low.view(np.uint8).reshape(groups, 8)
            if shift and self.bits + shift > 64:  # the bits that shifted past 64
                out[:, byte + 8] |= (grouped[:, j] >> np.uint64(64 - shift)).astype(np.uint8)
        return out[:, :width].tobytes()[: self.size(values.size)]

    def unpack(self, data: bytes, count: int) -> np.ndarray:
        """:meth:`pack`'s inverse; ``ValueError`` unless ``data`` is exactly ``count``."""
        if len(data) != self.size(count):
            raise ValueError(f"{len(data)} bytes, not {count} values of {self.bits} bits")
        tail = count * self.bits % 8
        if tail and data[-1] >> tail:
            raise ValueError(f"{count} values of {self.bits} bits with a non-zero pad")
        if self.bits % 8 == 0:
            return _whole_bytes(data, self.bits // 8, count)
        per, width = self._group
        groups = -(-count // per)
        raw = np.zeros((groups, width + 9), np.uint8)
        flat = np.frombuffer(data, np.uint8)
        full = flat.size // width
        raw[:full, :width] = flat[: full * width].reshape(full, width)
        if full < groups:
            raw[full, : flat.size - full * width] = flat[full * width :]
        out = np.empty((groups, per), np.uint64)
        for j in range(per):
            byte, shift = divmod(j * self.bits, 8)
            low = np.ascontiguousarray(raw[:, byte : byte + 8]).view("<u8").reshape(-1)
            value = low >> np.uint64(shift)
            if shift and self.bits + shift > 64:
                value |= raw[:, byte + 8].astype(np.uint64) << np.uint64(64 - shift)
            out[:, j] = value & self.mask
        return out.reshape(-1)[:count]


def _whole_bytes(data: bytes, width: int, count: int) -> np.ndarray:
    """``count`` little-endian unsigned integers of ``width`` bytes each, as uint64."""
    wide = np.zeros((count, 8), np.uint8)
    wide[:, :width] = np.frombuffer(data, np.uint8).reshape(count, width)
    return wide.view("<u8").reshape(-1)


def sketch(values: np.ndarray, bits: int, sid: bytes) -> np.ndarray:
    """Hashes of ``values`` (signed): sums times random 63-bit coefficients from the session
    id, mod 2^:data:`SKETCH_BITS`. A sum that wrapped differs by 2^bits times a non-zero
    vector, missed with chance ~2^-(SKETCH_BITS - bits)."""
    signed = to_signed(values, Ring(bits)).astype(np.uint64)  # two's complement mod 2^64
    seed = int.from_bytes(hashlib.sha256(_COEFFICIENTS + sid).digest(), "little")
    rng = np.random.default_rng(seed)
    out = np.zeros(SKETCH_VALUES, np.uint64)
    for start in range(0, signed.size, _CHUNK):
        part = signed[start : start + _CHUNK]
        coefficients = rng.integers(0, 1 << 63, (SKETCH_VALUES, part.size), np.uint64)
        with np.errstate(over="ignore"):
            out += (coefficients * part).sum(axis=1, dtype=np.uint64)
    return Ring(SKETCH_BITS).reduce(out)


def stream(seed: bytes, size: int, ring: Ring, kind: bytes) -> np.ndarray:
    """``size`` ring elements from ``seed`` (SHAKE-256; ``kind``: self or pair)."""
    width = (ring.bits + 7) // 8
    raw = hashlib.shake_256(kind + seed).digest(width * size)
    return ring.reduce(_whole_bytes(raw, width, size))


def mask(
    encoded: np.ndarray,
    *,
    me: int,
    self_seed: bytes,
    pair_seeds: Mapping[int, bytes],
    ring: Ring,
    label: bytes = b"",
) -> np.ndarray:
    """Region ``me``'s masked vector: ``encoded``, its self mask, plus each pair mask to a
    higher-numbered region, minus each to a lower one (``label``: the sketch's streams)."""
    if me in pair_seeds:
        raise ValueError(f"region {me} has a pair seed with itself")
    size = encoded.size
    out = ring.reduce(encoded) + stream(self_seed, size, ring, _SELF + label)
    for other, seed in pair_seeds.items():
        pair = stream(seed, size, ring, _PAIR + label)
        out = out + pair if me < other else out - pair
    return ring.reduce(out)


def unmask(
    total: np.ndarray,
    *,
    survivors: Collection[int],
    self_seeds: Mapping[int, bytes],
    dropped_pairs: Mapping[tuple[int, int], bytes],
    ring: Ring,
    label: bytes = b"",
) -> np.ndarray:
    """The survivors' plain sum from their masked vectors' ``total``, less their self masks
    and each pair mask shared with a region that dropped (keyed (survivor, dropped))."""
    if set(self_seeds) != set(survivors):
        raise ValueError("one self seed per survivor, and none for a region that dropped")
    for i, j in dropped_pairs:
        if i not in survivors or j in survivors:
            raise ValueError(f"pair ({i}, {j}) is not (survivor, dropped)")
    size = total.size
    out = ring.reduce(total)
    for seed in self_seeds.values():
        out = out - stream(seed, size, ring, _SELF + label)
    for (i, j), seed in dropped_pairs.items():
        pair = stream(seed, size, ring, _PAIR + label)
        out = out - pair if i < j else out + pair  # what survivor i added towards j
    return ring.reduce(out)


def ring_sum(vectors: Collection[np.ndarray], ring: Ring) -> np.ndarray:
    """The sum of ring vectors, modulo 2^bits."""
    return ring.reduce(np.asarray(np.sum(np.stack(list(vectors)), axis=0, dtype=np.uint64)))


def to_ring(
    values: np.ndarray,
    *,
    clip: float,
    scale: float,
    regions: int,
    ring: Ring,
    rng: np.random.Generator,
) -> np.ndarray:
    """A float update clipped, scaled and rounded into a ring its sum cannot wrap."""
    largest = regions * (clip * scale + 1)
    if largest >= 2 ** (ring.bits - 1):
        raise RingTooSmall(
            f"{regions} region(s) x (clip {clip:g} x scale {scale:g} + 1) = {largest:.3g} "
            f"does not fit a signed {ring.bits}-bit sum; use more bits or a smaller scale"
        )
    rounded = round_stochastically(clip_norm(values, clip) * scale, rng)
    return ring.reduce(rounded.astype(np.uint64))


def clip_norm(values: np.ndarray, clip: float) -> np.ndarray:
    """``values`` (as float64) scaled down to L2 norm ``clip`` when longer."""
    x = np.asarray(values, np.float64)
    norm = float(np.linalg.norm(x))
    return x * (clip / norm) if norm > clip else x


def round_stochastically(scaled: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Each value to an adjacent integer, up with probability its fraction (unbiased)."""
    low = np.floor(scaled)
    rounded: np.ndarray = (low + (rng.random(scaled.shape) < scaled - low)).astype(np.int64)
    return rounded


def to_signed(values: np.ndarray, ring: Ring) -> np.ndarray:
    """Ring elements as the signed integers they stand for: the upper half is negative."""
    signed = np.asarray(values, np.uint64).astype(np.int64)
    out: np.ndarray = np.where(signed >= 2 ** (ring.bits - 1), signed - 2**ring.bits, signed)
    return out


def from_ring(total: np.ndarray, *, scale: float, ring: Ring) -> np.ndarray:
    """A ring sum back to floats: the upper half of the ring is negative."""
    return to_signed(total, ring).astype(np.float64) / scale
