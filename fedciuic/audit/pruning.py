"""Replacing an audit log's file under its writers, for a prune (``AuditLog.prune``).

The kept records go to a side file renamed over the log, so a crash leaves the whole log or
the pruned one, never half of either; writers waiting on the old file's lock reopen it.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from pathlib import Path

#: The side file (``<log>.pruning-<ns>``) a prune renames over the log; one left by a process
#: killed mid-prune is swept at the next open.
PRUNING_SUFFIX = ".pruning-"


def replaced(path: Path, held: int) -> bool:
    """Whether ``path`` now names another file than the open ``held`` (a prune replaced it);
    a log moved aside (the path gone) is written on where it is."""
    try:
        on_disk = os.stat(path)
    except OSError:
        return False
    mine = os.fstat(held)
    return (on_disk.st_dev, on_disk.st_ino) != (mine.st_dev, mine.st_ino)


def replace_with(path: Path, kept: bytes, mode: int) -> None:
    """Make ``kept`` the file at ``path``, the folder fsync'ed so the rename lasts; on
    ``OSError`` the side file is removed and the error raised (the caller holds the lock)."""
    side = path.with_name(f"{path.name}{PRUNING_SUFFIX}{time.time_ns()}")
    try:
        fd = os.open(side, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as out:
            os.fchmod(out.fileno(), mode)
            out.write(kept)
            out.flush()
            os.fsync(out.fileno())
        os.replace(side, path)
        folder = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)
    except OSError:
        side.unlink(missing_ok=True)
        raise


def remove_side_files(path: Path) -> None:
    """Remove what prunes of ``path`` killed before their rename left: under the log's lock
    none is under way, so each is a copy of records the log still holds."""
    stem = path.name + PRUNING_SUFFIX
    try:
        names = os.listdir(path.parent)
    except OSError:
        return
    for name in names:
        if name.startswith(stem) and re.fullmatch("[0-9]+", name[len(stem) :]):
            with contextlib.suppress(OSError):  # another owner's: changes nothing here
                os.unlink(path.parent / name)
