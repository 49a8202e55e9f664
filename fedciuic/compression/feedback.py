"""The adapter's flat layout, and error feedback: what compression dropped is kept by
the region (its residual) and added to the next round's delta, so nothing is lost,
only delayed: ``sent + new_residual == delta + old_residual``.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from fedciuic.compression.codecs import Codec
from fedciuic.compression.errors import ResidualError


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
