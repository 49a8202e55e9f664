"""Digests of files, cached by their stat, and fedciuic's cache folder.

The cache makes an unchanged checkpoint or data file cost a ``stat``, not a pass over its bytes.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

_CHUNK = 16 * 2**20


def cache_dir() -> Path:
    """``$FEDCIUIC_CACHE``, else ``~/.cache/fedciuic``."""
    configured = os.environ.get("FEDCIUIC_CACHE")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "fedciuic"


def file_digest(file: Path) -> str:
    digest = hashlib.sha256()
    with file.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


class DigestCache:
    """Digests of files by (path, size, mtime, inode); a bad or stale entry is recomputed."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.entries: dict[str, dict[str, Any]] = {}
        self.changed = False
        try:
            loaded = json.loads(path.read_text(encoding="utf-8"))
            if isinstance(loaded, dict):
                self.entries = {k: v for k, v in loaded.items() if isinstance(v, dict)}
        except (OSError, ValueError):
            pass

    def digest(self, file: Path) -> str:
        stat = file.stat()
        key = str(file.resolve())
        stamp = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "inode": stat.st_ino}
        entry = self.entries.get(key, {})
        if all(entry.get(k) == v for k, v in stamp.items()) and isinstance(
            entry.get("sha256"), str
        ):
            return str(entry["sha256"])
        value = file_digest(file)
        self.entries[key] = {**stamp, "sha256": value}
        self.changed = True
        return value

    def save(self) -> None:
        """Atomically; a cache that cannot be written is only slower next time."""
        if not self.changed:
            return
        tmp = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".digests.")
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                json.dump(self.entries, handle, sort_keys=True)
            os.replace(tmp, self.path)
        except OSError:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)


def code_digest(package: Path | None = None) -> str:
    """SHA-256 over the package's ``*.py`` and template files and their paths: which code
    made an update, signed into every reply."""
    root = package or Path(__file__).resolve().parent
    digest = hashlib.sha256(b"fedciuic-code/1\x00")
    for file in sorted(root.rglob("*")):
        name = file.relative_to(root)
        if not file.is_file() or "__pycache__" in name.parts:
            continue
        if file.suffix == ".py" or "templates" in name.parts:
            digest.update(name.as_posix().encode() + b"\x00")
            digest.update(hashlib.sha256(file.read_bytes()).digest())
    return digest.hexdigest()


@functools.cache
def installed_code() -> str:
    return code_digest()
