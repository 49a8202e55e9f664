"""The adapter's flat layout, and error feedback: what compression dropped is kept by
the region (its residual) and added to the next round's delta, so nothing is lost,
only delayed: ``sent + new_residual == delta + old_residual``.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import struct
from collections.abc import Mapping
from dataclasses import dataclass
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


RESIDUAL_FORMAT = "fedciuic-residual/2"
#: Files written before residuals were tagged with their round: one residual, no tag.
_UNTAGGED_FORMAT = "fedciuic-residual/1"


@dataclass(frozen=True)
class _Stored:
    """A residual file's content: the residual after round ``tag`` and the one before it."""

    tag: str | None
    current: np.ndarray
    previous: np.ndarray | None


class ErrorFeedback:
    """A region's residual, kept at ``path`` between rounds and runs.

    ``round_tag`` names the round it serves. The file keeps the residual after that
    round and the one before it, so that a round trained again (the region stopped
    after compressing and before its release committed) starts from the same residual
    as the first attempt, not from the one that attempt left behind.
    """

    def __init__(self, path: Path, codec: Codec, layout: str, n: int, round_tag: str = "") -> None:
        self.path, self.codec, self.layout, self.n = path, codec, layout, n
        self.round_tag = round_tag
        self._before: np.ndarray | None = None  # what load found before this round
        self._loaded = False

    def load(self) -> np.ndarray:
        """The residual to add to this round's delta (remembered for :meth:`save`; read-only,
        a view of the file's bytes)."""
        stored = self._read()
        if stored is None:
            before = None
        elif self.round_tag and stored.tag == self.round_tag:
            before = stored.previous  # the same round again: the same residual before it
        else:
            before = stored.current
        self._before, self._loaded = before, True
        return np.zeros(self.n, np.float32) if before is None else before

    def save(self, residual: np.ndarray) -> None:
        """Keep ``residual`` as this round's, and the residual before it (atomic)."""
        if not self._loaded:
            self.load()
        arrays = [residual] if self._before is None else [residual, self._before]
        # Hashed and written from the arrays' own memory: a realistic residual pair is
        # 80 MB, and joining it into one bytes object first doubled the time.
        parts = [np.ascontiguousarray(a, np.float32).data.cast("B") for a in arrays]
        digest = hashlib.sha256()
        for part in parts:
            digest.update(part)
        meta = json.dumps(
            {
                "format": RESIDUAL_FORMAT,
                "codec": self.codec.name,
                "layout": self.layout,
                "tag": self.round_tag,
                "previous": self._before is not None,
                "sha256": digest.hexdigest(),
            }
        ).encode()
        tmp = self.path.with_suffix(".tmp")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with tmp.open("wb") as handle:
            handle.write(struct.pack("<I", len(meta)) + meta)
            for part in parts:
                handle.write(part)
        tmp.replace(self.path)

    def _read(self) -> _Stored | None:
        """The file's residuals, checked, as a read-only map of its pages: an 80 MB pair
        is not copied into the process to be hashed and added."""
        if not self.path.exists():
            return None
        fix = "delete it to start over (its content is only delayed update, not privacy state)"
        try:
            with self.path.open("rb") as handle:
                raw = memoryview(mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ))
            (size,) = struct.unpack_from("<I", raw)
            meta = json.loads(raw[4 : 4 + size].tobytes())
            data = raw[4 + size :]
            vector = np.frombuffer(data, np.float32)
        except (struct.error, ValueError, OSError) as err:
            raise ResidualError(f"{self.path}: unreadable residual ({err}); {fix}") from None
        if (
            not isinstance(meta, dict)
            or meta.get("format") not in (RESIDUAL_FORMAT, _UNTAGGED_FORMAT)
            or meta.get("sha256") != hashlib.sha256(data).hexdigest()
        ):
            raise ResidualError(f"{self.path}: corrupted residual (checksum); {fix}")
        if meta.get("codec") != self.codec.name or meta.get("layout") != self.layout:
            raise ResidualError(
                f"{self.path}: residual of codec {meta.get('codec')!r} and adapter layout "
                f"{meta.get('layout')}, this run uses {self.codec.name!r} and {self.layout}; {fix}"
            )
        has_previous = meta.get("previous") is True
        tag = meta.get("tag")
        if (
            vector.size != self.n * (2 if has_previous else 1)
            or not np.all(np.isfinite(vector))
            or not (tag is None or isinstance(tag, str))
        ):
            raise ResidualError(f"{self.path}: residual has the wrong size or bad values; {fix}")
        current, previous = vector[: self.n], vector[self.n :] if has_previous else None
        return _Stored(tag, current, previous)


def compress_with_feedback(
    delta: np.ndarray, residual: np.ndarray, codec: Codec, rng: np.random.Generator
) -> tuple[bytes, np.ndarray]:
    """Encode ``delta + residual``; return the bytes and the new residual (what was dropped)."""
    target = np.add(delta, residual, dtype=np.float32)
    encoded = codec.encode(target, rng)
    target -= codec.decode(encoded, target.size).dense(target.size)  # what was dropped
    return encoded, target
