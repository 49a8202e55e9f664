"""The relay's own OS user: Flower's ClientApp runs where it cannot read the region.

A deployed region's ClientApp is code the aggregator ships, so the start scripts run it
as an unprivileged user of its own, in no group of the region's; the agent refuses to
serve while that user can read the region's files. That user must still pass (``o+x``)
every folder to Python, its home and the agent's socket: the first that it cannot is
named at init and at start, not met as a relay that dies.

The SuperNode and the relay carry the kernel's parent-death signal, so a start script
killed with SIGKILL takes them with it. The relay supervises Flower's SuperExec in a
process group of its own: its ClientApps end with the region too, even one blocked on
a SuperNode that is gone (one that leaves the group on purpose is the aggregator's code,
run as a user that reads nothing of the region's).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import pwd
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from fedciuic.errors import FedciuicError

_PR_SET_PDEATHSIG = 1
#: The relay's user when ``fedciuic init`` runs as root and names none.
RELAY_USER = "fedciuic-relay"
#: What the relay imports: Flower, NumPy and fedciuic's channel (never torch).
RELAY_IMPORTS = "import flwr.supernode, numpy, fedciuic.flower.relay"


class SeparationError(FedciuicError):
    """The relay cannot run as its own user (who, where, and the fix)."""


def default_relay_user() -> str:
    """:data:`RELAY_USER` for root, who can start processes as it; else "" (no separation)."""
    return RELAY_USER if os.geteuid() == 0 else ""


def interpreter_paths() -> list[Path]:
    """What the relay's Python reads: itself, its standard library, Flower and fedciuic."""
    import flwr

    import fedciuic

    return [
        Path(sys.executable),
        Path(sys.executable).resolve(),
        Path(os.__file__).resolve().parent,
        Path(flwr.__file__).resolve().parent,
        Path(fedciuic.__file__).resolve().parent,
    ]


def closed_to_others(paths: Iterable[Path], *, read: bool = True) -> Path | None:
    """The first folder on the way to any of ``paths`` (or, with ``read``, the path itself)
    that a user in none of its groups may not pass or read; None when all are open."""
    for path in paths:
        for step in [*reversed(path.parents), path]:
            try:
                mode = step.stat().st_mode
            except OSError:
                return step
            needed = stat.S_IXOTH | (stat.S_IROTH if read and step == path else 0)
            if mode & needed != needed:
                return step
    return None


def first_closed(path: Path) -> Path | None:
    """The first existing folder on the way to ``path`` others may not pass, or None
    (whoever makes the missing ones makes them passable)."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    return closed_to_others([existing], read=False)


def relay_folders(home: Path, socket: Path) -> dict[str, Path]:
    """What the relay's user must pass, by what it leads to (whoever makes the last opens it)."""
    return {f"its home {home}": home.parent, f"the agent's socket {socket}": socket.parent.parent}


def reach_problem(user: str, folders: dict[str, Path], source: str = "relay-user") -> str | None:
    """Why ``user`` (named in ``source``) could not reach one of ``folders``, or None."""
    for what, folder in folders.items():
        closed = first_closed(folder)
        if closed is not None:
            return (
                f"{source} {user}: cannot reach {what}: {closed} is closed to other users; "
                f"chmod o+x {closed} (let others pass through it), or keep the deployment in "
                "a folder others may pass through"
            )
    return None


def reachability_problem(user: str) -> str | None:
    """Why ``user`` could not run the relay from this install, or None."""
    closed = closed_to_others(interpreter_paths())
    if closed is None:
        return None
    return (
        f"--relay-user {user}: that user cannot run this Python ({sys.executable}): {closed} "
        "is closed to other users; open the folders on the way for passage (e.g. chmod o+x "
        f"{closed}), or install fedciuic in a virtual environment other users can read (e.g. "
        'under /opt), or pass --relay-user "" to run the relay as yourself (no OS '
        "separation: a hostile ClientApp could read the region's files)"
    )


def ensure_user(name: str, home: Path) -> pwd.struct_passwd:
    """Root only: the relay's user (a no-login system user, made if missing) and its 0700 home."""
    if os.geteuid() != 0:
        raise SeparationError(
            f"relay-user {name}: starting the relay as another user needs root; run the "
            'start script as root, or set relay-user = "" in agent.toml (no OS separation)'
        )
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        done = subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
            capture_output=True,
            text=True,
            check=False,
        )
        try:  # made by us, or by another region's script meanwhile
            entry = pwd.getpwnam(name)
        except KeyError:
            raise SeparationError(
                f"relay-user {name}: useradd failed ({done.stderr.strip()}); create the user "
                "yourself"
            ) from None
    if entry.pw_uid == 0:
        raise SeparationError(f"relay-user {name}: uid 0 is root; name an unprivileged user")
    home.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chown(home, entry.pw_uid, entry.pw_gid)
    home.chmod(0o700)
    return entry


def check_runs(name: str) -> None:
    """Run the relay's imports as ``name``: its Python must start and find Flower."""
    entry = pwd.getpwnam(name)
    done = subprocess.run(
        [sys.executable, "-c", RELAY_IMPORTS],
        capture_output=True,
        text=True,
        user=entry.pw_uid,
        group=entry.pw_gid,
        extra_groups=[],
        cwd="/",
        check=False,
    )
    if done.returncode != 0:
        why = reachability_problem(name) or done.stderr.strip().splitlines()[-1:]
        raise SeparationError(f"relay-user {name}: cannot run the relay: {why}")


def run_as(name: str, home: Path, command: Sequence[str], parent: int) -> int:
    """Run ``command`` as ``name`` ("": ourselves) in ``home`` under :func:`supervise`, dying
    with process ``parent`` (the launcher's PID: had it died meanwhile, ours would differ)."""
    env = {**os.environ, "HOME": str(home), "FLWR_HOME": str(home)}
    if name and (problem := reach_problem(name, {f"its home {home}": home.parent})):
        raise SeparationError(problem)
    home.mkdir(mode=0o700, parents=True, exist_ok=True)
    if name:
        entry = ensure_user(name, home)
        check_runs(name)
        os.setgroups([])
        os.setgid(entry.pw_gid)
        os.setuid(entry.pw_uid)
        env["USER"] = env["LOGNAME"] = name
    # Flower's --parent-pid cannot watch a parent of another user (os.kill(pid, 0) is
    # refused, which it takes for an exit): the kernel's parent-death signal can, set
    # after the switch of user (which clears it) and kept across exec.
    _die_with_parent(parent)
    os.chdir(home)
    return supervise(command, env)


def supervise(command: Sequence[str], env: dict[str, str]) -> int:
    """Run ``command`` as the leader of a process group of its own and stay its parent:
    whatever ends this process or ``command`` ends the whole group (SIGTERM, then after
    :data:`GROUP_GRACE` seconds SIGKILL), so the SuperExec's ClientApps cannot outlive it."""
    ended: list[int] = []
    group: list[int] = []  # the child's PID once it runs: its group's ID

    def _stop(signum: int, _frame: object) -> None:
        ended.append(signum)
        for each in group:
            _signal_group(each, signal.SIGTERM)

    for each in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(each, _stop)
    me = os.getpid()
    child = subprocess.Popen(
        list(command), env=env, process_group=0, preexec_fn=lambda: _die_with_parent(me)
    )
    group.append(child.pid)
    if ended:  # a signal before the group existed
        _signal_group(child.pid, signal.SIGTERM)
    status = child.wait()
    _end_group(child.pid)
    if ended:
        return 128 + ended[0]
    return status if status >= 0 else 128 - status


#: Seconds a supervised group has between SIGTERM and SIGKILL.
GROUP_GRACE = 3.0


def _end_group(group: int) -> None:
    """SIGTERM every process left in ``group``; SIGKILL what still runs after the grace."""
    if not _signal_group(group, signal.SIGTERM):
        return
    deadline = time.monotonic() + GROUP_GRACE
    while time.monotonic() < deadline:
        time.sleep(0.05)
        if not _signal_group(group, 0):
            return
    _signal_group(group, signal.SIGKILL)


def _signal_group(group: int, signum: int) -> bool:
    """Send ``signum`` to process group ``group``; False once no process is left in it."""
    try:
        os.killpg(group, signum)
    except (ProcessLookupError, PermissionError):  # (a member that changed user: not ours)
        return False
    return True


def exec_tied(command: Sequence[str], parent: int) -> None:
    """Replace this process with ``command``, which the kernel stops however ``parent`` exits."""
    _die_with_parent(parent)
    os.execvp(command[0], list(command))


def _die_with_parent(parent: int) -> None:
    """SIGTERM this process when its parent exits (Linux); exit at once if ``parent`` is
    no longer its parent: the signal only covers a death after it is set."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:
        raise SystemExit(143)  # as if the signal had come: its parent is gone
