"""Authenticated values in a region's store.

torch's ``TCPStore`` checks no one: whatever reaches MASTER_PORT can read and write its
keys. So every value fedciuic passes through it carries an HMAC-SHA256 over the key and
the value, under a secret only the region's ranks hold (fresh for each start of workers
the region spawns; the operator's under torchrun, docs/cluster.md).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from collections.abc import Mapping
from pathlib import Path

from torch._C._distributed_c10d import TCPStore

from fedciuic.cluster.dist import ClusterError

#: The cluster secret in hex (a region sets it for the workers it starts), or the path
#: of a private file (mode 0600) that holds it.
SECRET_ENV = "FEDCIUIC_CLUSTER_SECRET"
SECRET_FILE_ENV = "FEDCIUIC_CLUSTER_SECRET_FILE"
#: Bytes of a secret the region makes; the least it accepts from an operator.
SECRET_BYTES = 32
MIN_SECRET_BYTES = 16
#: Marks an authenticated value (and its format's version): ``PREFIX + tag + ":" + value``.
PREFIX = "fedciuic-hmac-sha256/1:"


class StoreAuthError(ClusterError):
    """A value in the region's store is not authenticated by the cluster secret."""


def new_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


def _decode(text: str, source: str) -> bytes:
    try:
        secret = bytes.fromhex(text.strip())
    except ValueError:
        secret = b""
    if len(secret) < MIN_SECRET_BYTES:
        raise ClusterError(
            f"{source}: the cluster secret must be at least {MIN_SECRET_BYTES} random bytes "
            f"in hex; make one with: python -c 'import secrets; "
            f"print(secrets.token_hex({SECRET_BYTES}))'"
        )
    return secret


def secret_from_env(env: Mapping[str, str] | None = None) -> bytes:
    """The cluster secret given to this rank (:data:`SECRET_ENV`, else the file
    :data:`SECRET_FILE_ENV` names): the file must be this user's and private (mode 0600),
    as a secret others can read authenticates nothing."""
    env = os.environ if env is None else env
    if env.get(SECRET_ENV):
        return _decode(env[SECRET_ENV], f"environment:{SECRET_ENV}")
    named = env.get(SECRET_FILE_ENV)
    if not named:
        raise ClusterError(
            f"environment: neither {SECRET_ENV} nor {SECRET_FILE_ENV} is set; every rank of "
            "a region trained by processes it did not start itself needs the region's "
            f"cluster secret: set {SECRET_FILE_ENV} to a private file (mode 0600) holding "
            "it in hex, the same on every rank (docs/cluster.md)"
        )
    path = Path(named)
    source = f"environment:{SECRET_FILE_ENV}: {path}"
    try:
        info, text = path.stat(), path.read_text()
    except (OSError, UnicodeError) as err:
        raise ClusterError(f"{source}: cannot read the cluster secret ({err})") from None
    if info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) & 0o077:
        raise ClusterError(
            f"{source}: the cluster secret's file is mode {stat.S_IMODE(info.st_mode):04o}, "
            f"owner uid {info.st_uid}; make it this user's (uid {os.getuid()}) and private "
            f"(chmod 600 {path})"
        )
    return _decode(text, source)


def _tag(secret: bytes, key: str, value: bytes) -> str:
    """The MAC covers the key, so a value cannot be moved to another key (a command
    replayed under the next number, one rank's check-in as another's)."""
    return hmac.new(secret, key.encode() + b"\0" + value, hashlib.sha256).hexdigest()


class SealedStore:
    """A region's store through which only authenticated values pass (``raw``: the
    ``TCPStore`` itself, for torch's process-group set-up and to see which keys are set)."""

    def __init__(self, raw: TCPStore, secret: bytes, *, what: str) -> None:
        self.raw, self._secret, self.what = raw, secret, what

    def set(self, key: str, value: str) -> None:
        self.raw.set(key, f"{PREFIX}{_tag(self._secret, key, value.encode())}:{value}")

    def get(self, key: str) -> str:
        """The value at ``key`` once its MAC checks; :class:`StoreAuthError` otherwise."""
        stored, prefix = bytes(self.raw.get(key)), PREFIX.encode()
        tag, sep, data = stored.removeprefix(prefix).partition(b":")
        if not stored.startswith(prefix) or not sep:
            reason = "its value carries no MAC"
        elif not hmac.compare_digest(tag, _tag(self._secret, key, data).encode()):
            reason = "its MAC does not match this region's cluster secret"
        else:
            return data.decode()
        raise StoreAuthError(
            f"{self.what}: refused the store key {key!r}: {reason}; it was not written by "
            "a rank of this region (a stray client on MASTER_PORT, or a rank with another "
            f"secret). Give every rank the same secret ({SECRET_ENV} or {SECRET_FILE_ENV}) "
            "and let only the region's hosts reach MASTER_PORT (docs/cluster.md)"
        )
