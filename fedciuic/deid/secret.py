"""The region's pseudonym key: 32 random bytes in a file only the region reads, keying its
pseudonyms, its dictionary's digest and its replies' data commitment (each labelled)."""

from __future__ import annotations

import hashlib
import hmac
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


#: Separates the data commitment from the key's other uses.
COMMITMENT_LABEL = b"fedciuic-data-commitment/1\n"


def data_commitment(key: bytes, fingerprint: str, run_id: int) -> str:
    """What a reply says of the data it trained on: HMAC-SHA256 under the region's key of
    the data's fingerprint and the run. The region (and its audit) can check it; anyone
    without the key learns nothing from it, not even whether two runs read the same data."""
    message = COMMITMENT_LABEL + f"{run_id}\n{fingerprint}".encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()


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
