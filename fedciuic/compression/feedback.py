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


RESIDUAL_FORMAT = "fedciuic-residual/3"
#: Formats whose one digest covers the whole file: residuals before each had its own
#: digest (2), and before they were tagged with their round (1, one residual, no tag).
_WHOLE_FORMATS = ("fedciuic-residual/2", "fedciuic-residual/1")
_FIX = "delete it to start over (its content is only delayed update, not privacy state)"


def _sha256(part: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(part, np.float32).data.cast("B")).hexdigest()


@dataclass(frozen=True)
class _Stored:
    """A residual file: the residuals after round ``tag`` and before it, each part's digest
    (None: the file's one digest was checked whole when read)."""

    path: Path
    tag: str | None
    parts: list[np.ndarray]
    digests: list[str] | None

    def part(self, index: int) -> tuple[np.ndarray, str]:
        """Part ``index`` and its digest, checked: only the residual a round uses is
        hashed, and a damaged one it does not use is dropped by the next save."""
        part = self.parts[index]
        digest = _sha256(part)
        if self.digests is not None and digest != self.digests[index]:
            raise ResidualError(f"{self.path}: corrupted residual (checksum); {_FIX}")
        if not np.all(np.isfinite(part)):
            raise ResidualError(f"{self.path}: residual has bad values; {_FIX}")
        return part, digest


class ErrorFeedback:
    """A region's residual at ``path``, after round ``round_tag`` and before it, so that a
    round trained again (stopped before its release committed) starts from the same one."""

    def __init__(self, path: Path, codec: Codec, layout: str, n: int, round_tag: str = "") -> None:
        self.path, self.codec, self.layout, self.n = path, codec, layout, n
        self.round_tag = round_tag
        self._before: tuple[np.ndarray, str] | None = None  # what load found, its digest
        self._loaded = False

    def load(self) -> np.ndarray:
        """The residual to add to this round's delta (read-only, a view of the file)."""
        stored = self._read()
        if stored is None:
            index = None
        elif self.round_tag and stored.tag == self.round_tag:
            index = 1 if len(stored.parts) > 1 else None  # the same round: what it started from
        else:
            index = 0
        self._before = None if stored is None or index is None else stored.part(index)
        self._loaded = True
        return np.zeros(self.n, np.float32) if self._before is None else self._before[0]

    def save(self, residual: np.ndarray) -> None:
        """Keep ``residual`` as this round's, and the residual before it (atomic)."""
        if not self._loaded:
            self.load()
        residual = np.ascontiguousarray(residual, np.float32)
        kept = [(residual, _sha256(residual))]
        if self._before is not None:
            kept.append(self._before)  # hashed when it was read
        meta = json.dumps(
            {
                "format": RESIDUAL_FORMAT,
                "codec": self.codec.name,
                "layout": self.layout,
                "tag": self.round_tag,
                "previous": self._before is not None,
                "sha256": [digest for _, digest in kept],
            }
        ).encode()
        tmp = self.path.with_suffix(".tmp")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with tmp.open("wb") as handle:
            handle.write(struct.pack("<I", len(meta)) + meta)
            for part, _ in kept:  # written from the arrays' own memory, not joined first
                handle.write(np.ascontiguousarray(part, np.float32).data.cast("B"))
        tmp.replace(self.path)

    def _read(self) -> _Stored | None:
        """The file's residuals mapped read-only, its header checked (each digest when used)."""
        if not self.path.exists():
            return None
        try:
            with self.path.open("rb") as handle:
                raw = memoryview(mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ))
            (size,) = struct.unpack_from("<I", raw)
            meta = json.loads(raw[4 : 4 + size].tobytes())
            data = raw[4 + size :]
            vector = np.frombuffer(data, np.float32)
        except (struct.error, ValueError, OSError) as err:
            raise ResidualError(f"{self.path}: unreadable residual ({err}); {_FIX}") from None
        if not isinstance(meta, dict):
            raise ResidualError(f"{self.path}: corrupted residual (header); {_FIX}")
        whole = meta.get("format") in _WHOLE_FORMATS
        digests = meta.get("sha256")
        if not (
            (whole and digests == hashlib.sha256(data).hexdigest())
            or (
                meta.get("format") == RESIDUAL_FORMAT
                and isinstance(digests, list)
                and all(isinstance(d, str) for d in digests)
            )
        ):
            raise ResidualError(f"{self.path}: corrupted residual (checksum); {_FIX}")
        if meta.get("codec") != self.codec.name or meta.get("layout") != self.layout:
            raise ResidualError(
                f"{self.path}: residual of codec {meta.get('codec')!r} and adapter layout "
                f"{meta.get('layout')}, this run uses {self.codec.name!r} and {self.layout}; {_FIX}"
            )
        count = 2 if meta.get("previous") is True else 1
        tag = meta.get("tag")
        if vector.size != self.n * count:
            raise ResidualError(
                f"{self.path}: corrupted residual ({vector.size} values where its header "
                f"says {count} of {self.n}); {_FIX}"
            )
        if (not whole and len(digests) != count) or not (tag is None or isinstance(tag, str)):
            raise ResidualError(f"{self.path}: corrupted residual (header); {_FIX}")
        parts = [vector[i * self.n : (i + 1) * self.n] for i in range(count)]
        return _Stored(self.path, tag, parts, None if whole else digests)


def compress_with_feedback(
    delta: np.ndarray,
    residual: np.ndarray,
    codec: Codec,
    rng: np.random.Generator,
    *,
    out: np.ndarray | None = None,
) -> tuple[bytes, np.ndarray]:
    """Encode ``delta + residual``; return the bytes and the new residual (what was
    dropped), in ``out`` if given (``delta`` itself, when the caller's to overwrite)."""
    target = np.add(delta, residual, out=out, dtype=np.float32)
    encoded = codec.encode(target, rng)
    codec.decode(encoded, target.size).subtract_from(target)  # leaves what was dropped
    return encoded, target
