"""The region's pseudonym key: 32 random bytes in a file only the region reads. It keys
the pseudonyms (the same identifier gives the same pseudonym in this region, and another
in every other region) and the digest of the region's dictionary."""

from __future__ import annotations

import hashlib
import os
import secrets
from pathlib import Path

from fedciuic.errors import ConfigError

#: The file a region keeps its key in, under its state-path, unless deid-secret names one.
SECRET_FILE = "deid-secret.key"
KEY_BYTES = 32


def region_secret(path: Path) -> bytes:
    """The key in ``path``, made there (mode 0600) the first time."""
    try:
        text = path.read_text(encoding="ascii").strip()
    except FileNotFoundError:
        return _create(path)
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(
            [f"{path}: cannot read the pseudonym key ({err}); check the file"]
        ) from None
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != KEY_BYTES:
        raise ConfigError(
            [
                f"{path}: not a pseudonym key ({2 * KEY_BYTES} hex digits); restore it from "
                "your backup (pseudonyms made with another key differ), or move it away and a "
                "new one is made"
            ]
        )
    return key


def secret_id(key: bytes) -> str:
    """A public name of the key (never the key): pseudonyms made under one id match."""
    return hashlib.sha256(b"fedciuic-deid-key\n" + key).hexdigest()[:16]


def _create(path: Path) -> bytes:
    key = secrets.token_bytes(KEY_BYTES)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write(key.hex() + "\n")
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(staging, path)  # never over a key another process made meanwhile
    except FileExistsError:
        return region_secret(path)
    finally:
        staging.unlink()
    return key
