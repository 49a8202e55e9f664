"""Codecs for adapter deltas, with error feedback (pure NumPy, no Flower).

A delta is a flat float32 vector (the adapter tensors in name order; both sides know
the layout from the global adapter). A codec turns it into bytes and back. Every
encoding starts with the same 10-byte header::

    magic "FZ" | codec id (u8) | version (u8) | n (u32 LE, entries) | reserved (u16)

then the codec's body (little-endian throughout; ``docs/compression.md``).

Codecs are picked by name from :data:`CODECS`: ``dense``, ``int8``, ``sign``,
``topk:F`` and ``topk-int8:F`` (F, the kept fraction, in (0, 1]).

Error feedback: a region keeps what compression dropped (its residual) and adds it
to the next round's delta, so nothing is lost, only delayed:
``sent + new_residual == delta + old_residual``.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedciuic.errors import FedciuicError

HEADER = struct.Struct("<2sBBIH")
MAGIC = b"FZ"
CHUNK = 256  # entries per scale in int8 and sign


class MalformedUpdate(FedciuicError, ValueError):
    """An encoded update that is not what its codec writes (untrusted input: each
    check names what is wrong, and the aggregator rejects that update alone)."""


class ResidualError(FedciuicError):
    """The error-feedback residual on disk is corrupted or belongs to something else."""


@dataclass(frozen=True)
class Sparse:
    """A decoded update as (sorted unique indices, values); dense codecs use all indices."""

    indices: np.ndarray | None  # None: every entry, in order
    values: np.ndarray  # float32

    def add_into(self, acc: np.ndarray, weight: float) -> None:
        """``acc += weight * update`` without materialising a dense copy for sparse ones."""
        if self.indices is None:
            acc += weight * self.values
        else:
            acc[self.indices] += weight * self.values  # indices are unique

    def dense(self, n: int) -> np.ndarray:
        if self.indices is None:
            return self.values.astype(np.float32, copy=True)
        out = np.zeros(n, dtype=np.float32)
        out[self.indices] = self.values
        return out


# -- bit packing of index gaps ---------------------------------------------------------


def _pack_gaps(indices: np.ndarray) -> bytes:
    gaps = np.diff(indices, prepend=-1) - 1  # >= 0 for sorted unique indices
    width = max(1, int(gaps.max()).bit_length()) if gaps.size else 1
    bits = ((gaps[:, None] >> np.arange(width, dtype=np.int64)) & 1).astype(np.uint8)
    return bytes([width]) + np.packbits(bits.reshape(-1), bitorder="little").tobytes()


def _unpack_gaps(data: memoryview, k: int, n: int) -> tuple[np.ndarray, int]:
    if len(data) < 1:
        raise MalformedUpdate("index block missing")
    width = data[0]
    nbytes = math.ceil(k * width / 8)
    if not 1 <= width <= 32 or len(data) < 1 + nbytes:
        raise MalformedUpdate("index block truncated or malformed")
    bits = np.unpackbits(np.frombuffer(data[1 : 1 + nbytes], np.uint8), bitorder="little")
    gaps = bits[: k * width].reshape(k, width).astype(np.int64) @ (
        np.int64(1) << np.arange(width, dtype=np.int64)
    )
    indices = np.cumsum(gaps + 1) - 1
    if k and (indices[-1] >= n):
        raise MalformedUpdate(f"index {int(indices[-1])} out of range for {n} entries")
    return indices, 1 + nbytes


# -- int8 and sign bodies ---------------------------------------------------------------


def _chunk_scales(x: np.ndarray, reduce: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    pad = (-x.size) % CHUNK
    padded = np.pad(np.abs(x), (0, pad)).reshape(-1, CHUNK)
    return reduce(padded).astype(np.float32)


def _int8_encode(x: np.ndarray, rng: np.random.Generator) -> bytes:
    scales = _chunk_scales(x, lambda a: a.max(axis=1) / 127.0)
    s = np.repeat(scales, CHUNK)[: x.size]
    safe = np.where(s > 0, s, 1.0)
    q = np.floor(x / safe + rng.random(x.size, dtype=np.float32))  # stochastic rounding
    q = np.clip(q, -127, 127).astype(np.int8)
    return scales.tobytes() + q.tobytes()


def _int8_decode(body: memoryview, n: int) -> tuple[np.ndarray, int]:
    n_chunks = math.ceil(n / CHUNK)
    need = 4 * n_chunks + n
    if len(body) < need:
        raise MalformedUpdate("int8 body truncated")
    scales = np.frombuffer(body[: 4 * n_chunks], np.float32)
    q = np.frombuffer(body[4 * n_chunks : need], np.int8)
    _finite(scales, "int8 scales")
    return (q.astype(np.float32) * np.repeat(scales, CHUNK)[:n]).astype(np.float32), need


def _sign_encode(x: np.ndarray) -> bytes:
    scales = _chunk_scales(x, lambda a: a.mean(axis=1))
    return scales.tobytes() + np.packbits(x >= 0, bitorder="little").tobytes()


def _sign_decode(body: memoryview, n: int) -> tuple[np.ndarray, int]:
    n_chunks = math.ceil(n / CHUNK)
    need = 4 * n_chunks + math.ceil(n / 8)
    if len(body) < need:
        raise MalformedUpdate("sign body truncated")
    scales = np.frombuffer(body[: 4 * n_chunks], np.float32)
    _finite(scales, "sign scales")
    bits = np.unpackbits(np.frombuffer(body[4 * n_chunks : need], np.uint8), bitorder="little")
    signs = bits[:n].astype(np.float32) * 2 - 1
    return (signs * np.repeat(scales, CHUNK)[:n]).astype(np.float32), need


def _finite(values: np.ndarray, what: str) -> None:
    if not np.all(np.isfinite(values)):
        raise MalformedUpdate(f"{what} contain NaN or infinite values")


# -- codecs -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Codec:
    """A named encoding of flat float32 deltas."""

    name: str  # the spec it was parsed from: ``dense``, ``topk-int8:0.015``
    ident: int
    fraction: float = 1.0  # kept fraction, for top-k codecs

    @property
    def family(self) -> str:
        """The name without its argument (``topk-int8:0.015`` is ``topk-int8``): what
        policies allow or refuse."""
        return self.name.partition(":")[0]

    def __str__(self) -> str:
        return self.name

    def k(self, n: int) -> int:
        return max(1, min(n, math.ceil(self.fraction * n)))

    def encode(self, x: np.ndarray, rng: np.random.Generator) -> bytes:
        x = np.ascontiguousarray(x, dtype=np.float32)
        head = HEADER.pack(MAGIC, self.ident, 1, x.size, 0)
        if self.ident == 1:  # dense
            return head + x.tobytes()
        if self.ident == 2:  # int8
            return head + _int8_encode(x, rng)
        if self.ident == 4:  # sign
            return head + _sign_encode(x)
        k = self.k(x.size)
        top = np.sort(np.argpartition(np.abs(x), x.size - k)[x.size - k :])
        values = x[top]
        body = _int8_encode(values, rng) if self.ident == 5 else values.tobytes()
        return head + struct.pack("<I", k) + _pack_gaps(top) + body

    def decode(self, data: bytes | bytearray | memoryview, n: int) -> Sparse:
        """Parse and check an encoding of ``n`` entries; ``ValueError`` says what is wrong."""
        view = memoryview(data)
        if len(view) < HEADER.size:
            raise MalformedUpdate("update shorter than its header")
        magic, ident, version, count, _ = HEADER.unpack_from(view)
        if magic != MAGIC or version != 1:
            raise MalformedUpdate("not a fedciuic compressed update")
        if ident != self.ident:
            raise MalformedUpdate(f"update uses codec id {ident}, the run uses {self.name!r}")
        if count != n:
            raise MalformedUpdate(f"update has {count} entries, the adapter has {n}")
        body = view[HEADER.size :]
        indices: np.ndarray | None = None
        if self.ident == 1:
            if len(body) != 4 * n:
                raise MalformedUpdate(f"dense body of {len(body)} bytes, expected {4 * n}")
            values, used = np.frombuffer(body, np.float32), 4 * n
        elif self.ident == 2:
            values, used = _int8_decode(body, n)
        elif self.ident == 4:
            values, used = _sign_decode(body, n)
        else:
            if len(body) < 4:
                raise MalformedUpdate("top-k count missing")
            (k,) = struct.unpack_from("<I", body)
            if not 1 <= k <= n or k != self.k(n):
                raise MalformedUpdate(f"top-k update keeps {k} entries, the run keeps {self.k(n)}")
            indices, used_idx = _unpack_gaps(body[4:], k, n)
            rest = body[4 + used_idx :]
            if self.ident == 5:
                values, used_vals = _int8_decode(rest, k)
            else:
                if len(rest) < 4 * k:
                    raise MalformedUpdate("top-k values truncated")
                values, used_vals = np.frombuffer(rest[: 4 * k], np.float32), 4 * k
            used = 4 + used_idx + used_vals
        if used != len(body):
            raise MalformedUpdate(f"update has {len(body) - used} trailing bytes")
        _finite(values, "update values")
        return Sparse(indices, values)


def _topk(name: str, ident: int) -> Callable[[str], Codec]:
    def make(arg: str) -> Codec:
        try:
            fraction = float(arg)
        except ValueError:
            fraction = float("nan")
        if not 0 < fraction <= 1:
            raise ValueError(f"{name}:{arg}: the kept fraction must be in (0, 1]")
        return Codec(f"{name}:{arg}", ident, fraction)

    return make


#: Registry: a name, or ``name:fraction`` for top-k codecs.
CODECS: dict[str, Callable[[str], Codec]] = {
    "dense": lambda _: Codec("dense", 1),
    "int8": lambda _: Codec("int8", 2),
    "sign": lambda _: Codec("sign", 4),
    "topk": _topk("topk", 3),
    "topk-int8": _topk("topk-int8", 5),
}


def get_codec(spec: str | Codec) -> Codec:
    """``dense``, ``int8``, ``sign``, ``topk:0.01``, ``topk-int8:0.01``; else ``ValueError``
    naming the known ones (the run config turns it into ``run config:codec: ...``)."""
    if isinstance(spec, Codec):
        return spec
    name, _, arg = spec.partition(":")
    if name not in CODECS:
        raise ValueError(
            f"unknown codec {spec!r}; known: dense, int8, sign, topk:FRACTION, topk-int8:FRACTION"
        )
    if name.startswith("topk") and not arg:
        raise ValueError(f"{name} needs a fraction, e.g. {name}:0.01")
    if arg and not name.startswith("topk"):
        raise ValueError(f"{name} takes no argument")
    return CODECS[name](arg)


# -- layout and error feedback ----------------------------------------------------------


def layout_of(arrays: Mapping[str, np.ndarray]) -> list[tuple[str, tuple[int, ...]]]:
    return [(name, tuple(np.shape(arrays[name]))) for name in sorted(arrays)]


def layout_id(layout: list[tuple[str, tuple[int, ...]]]) -> str:
    return hashlib.sha256(json.dumps(layout).encode()).hexdigest()[:16]


def flatten(arrays: Mapping[str, np.ndarray]) -> np.ndarray:
    return np.concatenate(
        [np.asarray(arrays[name], np.float32).reshape(-1) for name in sorted(arrays)]
    )


def unflatten(
    vector: np.ndarray, layout: list[tuple[str, tuple[int, ...]]]
) -> dict[str, np.ndarray]:
    out, start = {}, 0
    for name, shape in layout:
        size = int(np.prod(shape))
        out[name] = vector[start : start + size].reshape(shape).astype(np.float32)
        start += size
    return out


RESIDUAL_FORMAT = "fedciuic-residual/1"


class ErrorFeedback:
    """A region's residual, kept at ``path`` between rounds and runs."""

    def __init__(self, path: Path, codec: Codec, layout: str, n: int) -> None:
        self.path, self.codec, self.layout, self.n = path, codec, layout, n

    def load(self) -> np.ndarray:
        if not self.path.exists():
            return np.zeros(self.n, np.float32)
        fix = "delete it to start over (its content is only delayed update, not privacy state)"
        try:
            raw = self.path.read_bytes()
            (size,) = struct.unpack_from("<I", raw)
            meta = json.loads(raw[4 : 4 + size])
            data = raw[4 + size :]
            vector = np.frombuffer(data, np.float32)
        except (struct.error, ValueError, OSError) as err:
            raise ResidualError(f"{self.path}: unreadable residual ({err}); {fix}") from None
        if (
            meta.get("format") != RESIDUAL_FORMAT
            or meta.get("sha256") != hashlib.sha256(data).hexdigest()
        ):
            raise ResidualError(f"{self.path}: corrupted residual (checksum); {fix}")
        if meta.get("codec") != self.codec.name or meta.get("layout") != self.layout:
            raise ResidualError(
                f"{self.path}: residual of codec {meta.get('codec')!r} and adapter layout "
                f"{meta.get('layout')}, this run uses {self.codec.name!r} and {self.layout}; {fix}"
            )
        if vector.size != self.n or not np.all(np.isfinite(vector)):
            raise ResidualError(f"{self.path}: residual has the wrong size or bad values; {fix}")
        return vector.copy()

    def save(self, residual: np.ndarray) -> None:
        data = np.ascontiguousarray(residual, np.float32).tobytes()
        meta = json.dumps(
            {
                "format": RESIDUAL_FORMAT,
                "codec": self.codec.name,
                "layout": self.layout,
                "sha256": hashlib.sha256(data).hexdigest(),
            }
        ).encode()
        tmp = self.path.with_suffix(".tmp")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(struct.pack("<I", len(meta)) + meta + data)
        tmp.replace(self.path)


def compress_with_feedback(
    delta: np.ndarray, residual: np.ndarray, codec: Codec, rng: np.random.Generator
) -> tuple[bytes, np.ndarray]:
    """Encode ``delta + residual``; return the bytes and the new residual (what was dropped)."""
    target = (delta + residual).astype(np.float32)
    encoded = codec.encode(target, rng)
    sent = codec.decode(encoded, target.size).dense(target.size)
    return encoded, target - sent
