"""Codecs: a flat float32 delta to bytes and back, under one versioned header.

Every encoding starts with the same 10-byte header::

    magic "FZ" | codec id (u8) | format version (u8) | n (u32 LE, entries) | reserved (u16)

then the codec's body (``docs/compression.md``). Encoders write :data:`UPDATE_FORMAT`;
decoders also read format 1, so an update sealed before an upgrade still opens.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np

from fedciuic.compression import indices as index_coding
from fedciuic.compression import values as value_coding
from fedciuic.compression.errors import MalformedUpdate

HEADER = struct.Struct("<2sBBIH")
UPDATE_MAGIC = b"FZ"
UPDATE_FORMAT = 2
READS = (1, 2)


def update_entries(data: bytes | bytearray | memoryview) -> int:
    """The entries an update's header says it holds; :class:`MalformedUpdate` if it has none."""
    view = memoryview(data)
    if len(view) < HEADER.size:
        raise MalformedUpdate("update shorter than its header")
    magic, _, _, count, _ = HEADER.unpack_from(view)
    if magic != UPDATE_MAGIC:
        raise MalformedUpdate("not a fedciuic compressed update")
    return int(count)


@dataclass(frozen=True)
class _Values:
    encode: value_coding.Encode
    decode: value_coding.Decode


FP32 = _Values(value_coding.fp32_encode, value_coding.fp32_decode)
INT8 = _Values(value_coding.int8_encode, value_coding.int8_decode)
INT4 = _Values(value_coding.int4_encode, value_coding.int4_decode)
INT2 = _Values(value_coding.int2_encode, value_coding.int2_decode)
SIGN = _Values(value_coding.sign_encode, value_coding.sign_decode)


#: Entries per span of a whole-update pass: its float64 scratch stays in the cache.
_SPAN = 1 << 16


def _spans(n: int) -> list[slice]:
    return [slice(start, start + _SPAN) for start in range(0, n, _SPAN)]


@dataclass(frozen=True)
class Sparse:
    """A decoded update as (sorted unique indices, values); dense codecs use all indices."""

    indices: np.ndarray | None  # None: every entry, in order
    values: np.ndarray  # float32

    def add_into(self, acc: np.ndarray, weight: float) -> None:
        """``acc += weight * update`` without materialising a dense copy for sparse ones."""
        if self.indices is None:
            for part in _spans(self.values.size):  # no update-sized temporary
                acc[part] += weight * self.values[part]
        else:
            acc[self.indices] += weight * self.values  # indices are unique

    def norm(self) -> float:
        """The L2 norm, summed in float64 a span at a time (no float64 copy of the update)."""
        total = 0.0
        for part in _spans(self.values.size):
            wide = self.values[part].astype(np.float64)
            total += float(wide @ wide)
        return math.sqrt(total)

    def subtract_from(self, acc: np.ndarray) -> None:
        """``acc -= update`` in place, without a dense copy of the update."""
        if self.indices is None:
            acc -= self.values
        else:
            acc[self.indices] -= self.values  # indices are unique

    def dense(self, n: int) -> np.ndarray:
        if self.indices is None:
            return self.values.astype(np.float32, copy=True)
        out = np.zeros(n, dtype=np.float32)
        out[self.indices] = self.values
        return out


@dataclass(frozen=True)
class Codec:
    """A named encoding of flat float32 deltas: every entry, or the top-k (``sparse``)."""

    name: str  # the spec it was parsed from: ``dense``, ``topk-int8:0.015``
    ident: int
    values: _Values
    sparse: bool = False
    fraction: float = 1.0  # kept fraction, for top-k codecs

    @property
    def family(self) -> str:
        """The name without its argument: what policies allow or refuse."""
        return self.name.partition(":")[0]

    def __str__(self) -> str:
        return self.name

    def k(self, n: int) -> int:
        return max(1, min(n, math.ceil(self.fraction * n)))

    def encode(self, x: np.ndarray, rng: np.random.Generator) -> bytes:
        """The update's bytes; NaN or infinite entries are refused (top-k would drop them)."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        if not np.isfinite(x).all():
            raise ValueError("the delta to compress has NaN or infinite entries")
        head = HEADER.pack(UPDATE_MAGIC, self.ident, UPDATE_FORMAT, x.size, 0)
        if not self.sparse:
            return b"".join((head, self.values.encode(x, rng)))
        k = self.k(x.size)
        top = top_k(x, k)
        return b"".join(
            (head, struct.pack("<I", k), index_coding.encode(top), self.values.encode(x[top], rng))
        )

    def decode(self, data: bytes | bytearray | memoryview, n: int) -> Sparse:
        """Parse and check an encoding of ``n`` entries; ``ValueError`` says what is wrong."""
        view = memoryview(data)
        count = update_entries(view)
        _, ident, version, _, _ = HEADER.unpack_from(view)
        if version not in READS:
            raise MalformedUpdate(
                f"update in wire format {version}; this fedciuic reads formats "
                f"{', '.join(map(str, READS))}: run the same fedciuic version everywhere"
            )
        if ident != self.ident:
            raise MalformedUpdate(f"update uses codec id {ident}, the run uses {self.name!r}")
        if count != n:
            raise MalformedUpdate(f"update has {count} entries, the adapter has {n}")
        body = view[HEADER.size :]
        indices: np.ndarray | None = None
        if not self.sparse:
            if self.values is FP32 and len(body) != 4 * n:
                raise MalformedUpdate(f"dense body of {len(body)} bytes, expected {4 * n}")
            values, used = self.values.decode(body, n)
        else:
            if len(body) < 4:
                raise MalformedUpdate("top-k count missing")
            (k,) = struct.unpack_from("<I", body)
            if not 1 <= k <= n or k != self.k(n):
                raise MalformedUpdate(f"top-k update keeps {k} entries, the run keeps {self.k(n)}")
            read = index_coding.decode if version == UPDATE_FORMAT else index_coding.decode_v1
            indices, used_idx = read(body[4:], k, n)
            values, used_vals = self.values.decode(body[4 + used_idx :], k)
            used = 4 + used_idx + used_vals
        if used != len(body):
            raise MalformedUpdate(f"update has {len(body) - used} trailing bytes")
        value_coding.finite(values, "update values")
        return Sparse(indices, values)


def top_k(x: np.ndarray, k: int) -> np.ndarray:
    """The sorted indices of the ``k`` largest ``|x|`` (ties: the lowest indices), the
    threshold found among candidates a strided sample bounds (no full partition)."""
    a = np.abs(x)
    if k >= a.size:
        return np.arange(a.size)
    threshold = _kth_largest(a, k)
    keep = a > threshold
    short = k - int(np.count_nonzero(keep))
    keep[np.flatnonzero(a == threshold)[:short]] = True
    return np.flatnonzero(keep)


def _kth_largest(a: np.ndarray, k: int) -> float:
    if a.size > _SAMPLE:
        sample = a[:: a.size // _SAMPLE]
        # A value below which about 1.5 k + margin entries lie in the sample's scale.
        j = max(0, sample.size - math.ceil(1.5 * k * sample.size / a.size) - 64)
        candidates = a[a >= np.partition(sample, j)[j]]
        if candidates.size >= k:  # else the sample misled: the exact, slower way
            return float(np.partition(candidates, candidates.size - k)[candidates.size - k])
    return float(np.partition(a, a.size - k)[a.size - k])


_SAMPLE = 1 << 16


def _topk(name: str, ident: int, values: _Values) -> Callable[[str], Codec]:
    def make(arg: str) -> Codec:
        try:
            fraction = float(arg)
        except ValueError:
            fraction = float("nan")
        if not 0 < fraction <= 1:
            raise ValueError(f"{name}:{arg}: the kept fraction must be in (0, 1]")
        return Codec(f"{name}:{arg}", ident, values, sparse=True, fraction=fraction)

    return make


#: A codec's name without its argument: what a policy's ``allowed_codecs`` lists.
CodecFamily = Literal[
    "dense", "int8", "int4", "int2", "sign", "topk", "topk-int8", "topk-int4", "topk-sign"
]

#: Registry (its keys are exactly :data:`CodecFamily`): a name, or ``name:fraction``
#: for top-k codecs. Ids are wire values: never reuse one.
CODECS: dict[str, Callable[[str], Codec]] = {
    "dense": lambda _: Codec("dense", 1, FP32),
    "int8": lambda _: Codec("int8", 2, INT8),
    "int4": lambda _: Codec("int4", 8, INT4),
    "int2": lambda _: Codec("int2", 9, INT2),
    "sign": lambda _: Codec("sign", 4, SIGN),
    "topk": _topk("topk", 3, FP32),
    "topk-int8": _topk("topk-int8", 5, INT8),
    "topk-int4": _topk("topk-int4", 6, INT4),
    "topk-sign": _topk("topk-sign", 7, SIGN),
}
_KNOWN = ", ".join(f"{name}:FRACTION" if name.startswith("topk") else name for name in CODECS)


def get_codec(spec: str | Codec) -> Codec:
    """A codec by name (``dense``, ``topk-int8:0.01``, ...); else ``ValueError`` naming
    the known ones (the run config turns it into ``run config:codec: ...``)."""
    if isinstance(spec, Codec):
        return spec
    name, _, arg = spec.partition(":")
    if name not in CODECS:
        raise ValueError(f"unknown codec {spec!r}; known: {_KNOWN}")
    if name.startswith("topk") and not arg:
        raise ValueError(f"{name} needs a fraction, e.g. {name}:0.01")
    if arg and not name.startswith("topk"):
        raise ValueError(f"{name} takes no argument")
    return CODECS[name](arg)
