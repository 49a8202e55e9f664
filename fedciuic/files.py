"""What a path in a folder that others fill (a region's data-path, a model-path) is, when
it is not a file that can be read.

Only regular files are opened there: a FIFO may block forever, a socket or device is no
data, and a broken link fails deep inside a library. Callers ask first and refuse in one line.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

DIRECTORY = "a directory"
#: What a path is, by the mode its links lead to, when it is neither a file nor a folder.
_KINDS = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def broken_link(path: Path) -> str | None:
    """Why symlink ``path`` leads nowhere (a loop, a missing target); None if it leads somewhere."""
    if not path.is_symlink():
        return None
    try:
        path.stat()
    except OSError as err:
        if err.errno == errno.ELOOP:
            return "a symlink loop"
        return f"a dangling symlink (to {os.readlink(path)}: {err.strerror})"
    return None


def not_regular(path: Path) -> str | None:
    """What ``path`` is, its links followed, when it is not a regular file; None when it is."""
    if broken := broken_link(path):
        return broken
    try:
        mode = path.stat().st_mode
    except OSError as err:
        return f"unreadable ({err.strerror})"
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return DIRECTORY
    return next((what for test, what in _KINDS if test(mode)), "not a regular file")
