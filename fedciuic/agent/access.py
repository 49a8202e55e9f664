"""Who can read the region's files: the agent refuses to serve while its relay can.

Worked out from owners, groups and mode bits, walking down only through folders the
relay's user may enter. A path with a POSIX ACL is reported too (its mode bits do not
say who may read it); a relay running as root is refused.
"""

from __future__ import annotations

import grp
import os
import pwd
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from fedciuic.errors import FedciuicError

_ACL = "system.posix_acl_access"
#: How many exposed paths a refusal names (the first found).
SHOWN = 5


class AccessError(FedciuicError):
    """The relay's user can read what only the region may, or does not exist."""


@dataclass(frozen=True)
class Account:
    """An OS user as the kernel checks it: its uid and every group it is in."""

    name: str
    uid: int
    gids: frozenset[int]

    @classmethod
    def named(cls, name: str) -> Account:
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            raise AccessError(
                f"agent config:relay-user: no OS user {name!r}; create it (as root: "
                f"useradd --system --no-create-home --shell /usr/sbin/nologin {name}) or "
                'set relay-user = "" to run the relay as the agent\'s own user'
            ) from None
        gids = {entry.pw_gid, *(g.gr_gid for g in grp.getgrall() if name in g.gr_mem)}
        return cls(name, entry.pw_uid, frozenset(gids))

    def may(self, info: os.stat_result, bit: int) -> bool:
        """Whether this user has permission ``bit`` (4 read, 1 search) on the file."""
        if self.uid == 0:
            return True
        if info.st_uid == self.uid:
            return bool(info.st_mode >> 6 & bit)
        if info.st_gid in self.gids:
            return bool(info.st_mode >> 3 & bit)
        return bool(info.st_mode & bit)


def _has_acl(path: Path) -> bool:
    try:
        return _ACL in os.listxattr(path, follow_symlinks=False)
    except OSError:  # no xattrs on this file system: no ACLs either
        return False


def _reachable(path: Path, who: Account) -> bool:
    """Whether ``who`` may search every folder on the way to ``path``."""
    for folder in reversed(path.parents):
        try:
            info = folder.stat()
        except OSError:
            return False
        if not who.may(info, 1) and not _has_acl(folder):
            return False
    return True


def _walk(path: Path, who: Account) -> Iterator[Path]:
    """The paths at or under ``path`` that ``who`` could read or list (or with an ACL)."""
    try:
        info = path.lstat()
    except OSError:
        return
    if stat.S_ISLNK(info.st_mode):
        return  # a link is followed where it points, which is checked on its own
    acl = _has_acl(path)
    if acl or who.may(info, 4):
        yield path
    if stat.S_ISDIR(info.st_mode) and (acl or who.may(info, 1)):
        try:
            children = sorted(path.iterdir())
        except OSError:
            return
        for child in children:
            yield from _walk(child, who)


def exposed(paths: Iterable[Path], who: Account) -> list[Path]:
    """Every path among ``paths`` (and under them) that ``who`` could read."""
    found: list[Path] = []
    for path in paths:
        resolved = path.expanduser().resolve()
        if _reachable(resolved, who):
            found.extend(p for p in _walk(resolved, who) if p not in found)
    return found


def check_private(paths: Iterable[Path], who: Account) -> None:
    """Refuse (one line naming the paths and the fix) when ``who`` can read any."""
    if who.uid == 0:
        raise AccessError(
            f"agent config:relay-user: {who.name!r} is root, who can read every file; run "
            "the relay as an unprivileged user"
        )
    if who.uid == os.getuid():
        raise AccessError(
            f"agent config:relay-user: {who.name!r} is the agent's own user; run the relay "
            'as a user of its own, or set relay-user = ""'
        )
    found = exposed(paths, who)
    if found:
        shown = ", ".join(str(p) for p in found[:SHOWN])
        more = f" (+{len(found) - SHOWN} more)" if len(found) > SHOWN else ""
        raise AccessError(
            f"the relay's user {who.name!r} can read {shown}{more}; make the region's "
            "data, state and key folders its own and private (chmod -R go-rwx FOLDER) "
            "before the agent serves"
        )
