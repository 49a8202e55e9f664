"""A region's secure sums on disk, one file per session, so that an agent that restarts
mid-sum goes on from its last phase and never answers a phase twice: the file is flushed
before the phase's message leaves. The joined update is a file of its own until masked;
after the reveal only that fact is kept. The folder is 0700, files 0600: seeds are as
secret as keys.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fedciuic.secagg.masking import Ring
from fedciuic.secagg.messages import Name, Phase, SecAggError, Session

#: The folder under a region's state-path.
SECAGG_DIR = "secagg"
_FORMAT = "fedciuic-secagg-state/1"


class StoredSum(BaseModel):
    """One session as the region left it after its last phase."""

    model_config = ConfigDict(
        frozen=True, extra="forbid", ser_json_bytes="hex", val_json_bytes="hex"
    )

    format: str = Field(pattern=f"^{_FORMAT}$", default=_FORMAT)
    session: Session
    done: Phase
    self_seed: bytes = b""
    key_seed: bytes = b""
    keys: dict[Name, bytes] = {}
    held: dict[Name, tuple[int, int]] = {}
    shared: tuple[Name, ...] = ()
    survivors: tuple[Name, ...] = ()


class SessionStore:
    """The files of one region's secure sums."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def path(self, session: Session) -> Path:
        return self.folder / f"{session.run_id}-{session.server_round}-{session.sid().hex()}.json"

    def joined(self, run_id: int, server_round: int) -> bool:
        """Whether this region joined any session of this run's round."""
        return any(self.folder.glob(f"{run_id}-{server_round}-*.json"))

    def rounds_joined(self, run_id: int) -> int:
        """How many rounds of this run this region joined a secure sum in."""
        return len({p.name.split("-")[1] for p in self.folder.glob(f"{run_id}-*-*.json")})

    def save(self, state: StoredSum) -> None:
        """Replace the session's file, flushed to disk before this returns."""
        self._write(self.path(state.session), state.model_dump_json().encode())

    def save_update(self, session: Session, encoded: np.ndarray) -> None:
        """The encoded update a region joined with, kept beside the session's file until masked."""
        self._write(self._update_path(session), Ring(session.bits).pack(encoded))

    def load_update(self, session: Session) -> np.ndarray | None:
        path = self._update_path(session)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            return Ring(session.bits).unpack(data, session.size)
        except ValueError as err:
            raise SecAggError(
                f"{path}: damaged ({err}); this region takes no further part in that secure sum"
            ) from None

    def drop_update(self, session: Session) -> None:
        self._update_path(session).unlink(missing_ok=True)

    def _update_path(self, session: Session) -> Path:
        return self.path(session).with_suffix(".update")

    def _write(self, target: Path, data: bytes) -> None:
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = target.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)

    def load(self, session: Session) -> StoredSum | None:
        """The session's state, or None when this region never joined it."""
        path = self.path(session)
        try:
            text = path.read_text()
        except FileNotFoundError:
            return None
        except OSError as err:
            raise SecAggError(f"{path}: unreadable ({err.strerror})") from None
        try:
            state = StoredSum.model_validate_json(text)
        except ValidationError as err:
            first = err.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "file"
            raise SecAggError(
                f"{path}: damaged ({where}: {first['msg']}); this region takes no further "
                "part in that secure sum"
            ) from None
        if state.session != session:
            raise SecAggError(f"{path}: holds another session; this region takes no part in it")
        return state
