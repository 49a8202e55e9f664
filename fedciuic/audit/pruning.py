"""Replacing an audit log's file under its writers, for a prune (``AuditLog.prune``).

The kept records are written to a side file renamed over the log, so a crash leaves the
whole log or the pruned one, never half of either. Writers in other processes waiting on
the old file's lock find the path replaced (``replaced``) and reopen it; a prune killed
before its rename leaves a side file the next writer removes (``remove_side_files``).
This module only moves bytes: which records to keep, and recording the prune, are ``log``'s.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from pathlib import Path

#: The side file a prune writes the kept records to before renaming it over the log:
#: ``<log>.pruning-<ns>``. One left by a process killed mid-prune is swept at the next open.
PRUNING_SUFFIX = ".pruning-"


def replaced(path: Path, held: int) -> bool:
    """Whether ``path`` now names another file than the open file ``held`` (a prune
    replaced it). A log moved aside (the path gone) is written on where it is."""
    try:
        on_disk = os.stat(path)
    except OSError:
        return False
    mine = os.fstat(held)
    return (on_disk.st_dev, on_disk.st_ino) != (mine.st_dev, mine.st_ino)


def replace_with(path: Path, kept: bytes, mode: int) -> None:
    """Make ``kept`` the file at ``path`` (permissions ``mode``), the folder fsync'ed so
    that the rename lasts; the caller holds the log's lock. On ``OSError`` the side file
    is removed and the error raised, for the caller to say what it means for the log."""
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
    """Remove the side files of a prune of ``path`` killed before its rename: under the
    log's lock no prune is under way, so each is a copy of records the log still holds.
    Other files (``<log>.torn-<ns>``, a name only starting like one) are left alone."""
    stem = path.name + PRUNING_SUFFIX
    try:
        names = os.listdir(path.parent)
    except OSError:
        return
    for name in names:
        if name.startswith(stem) and re.fullmatch("[0-9]+", name[len(stem) :]):
            # One that cannot be removed (another owner's) changes nothing here.
            with contextlib.suppress(OSError):
                os.unlink(path.parent / name)
