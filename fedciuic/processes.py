"""Processes a launcher starts, found and stopped as trees, and the few helpers the
deployment's scripts need: light to import (psutil and the stdlib), as each script step pays for it.

A Ray worker whose raylet exits first is re-parented to init, out of every tree, so each
launched process carries :data:`OWNER_ENV`, which Ray passes on to its workers.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import psutil

#: What ``flwr run`` prints once the SuperLink has accepted the run.
STARTED_RUN = re.compile(r"Successfully started run (\d+)")

#: Marks every process a launcher started (and all they start): ``<owner>:<folder>``.
OWNER_ENV = "FEDCIUIC_LAUNCH"


def running(proc: psutil.Process) -> bool:
    """Alive and not a zombie (an exited child its parent has not reaped yet)."""
    try:
        return bool(proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


def owner_tag(label: str, folder: Path) -> str:
    """The ``FEDCIUIC_LAUNCH`` value of a launcher: who started it, and where."""
    return f"{label}:{folder}"


def owner_folder(tag: str) -> Path | None:
    """The folder in a ``FEDCIUIC_LAUNCH`` value (the tests look for what a run left)."""
    _, sep, folder = tag.partition(":")
    return Path(folder) if sep and folder else None


def owned_processes(owner: str) -> list[psutil.Process]:
    """Live processes whose environment has ``FEDCIUIC_LAUNCH=owner``; not this process or
    its ancestors (stop.sh runs under the start.sh it stops), nor other users'."""
    found = []
    me = psutil.Process()
    spared = {me.pid, *(p.pid for p in me.parents())}
    for proc in psutil.process_iter():
        try:
            if proc.pid not in spared and proc.environ().get(OWNER_ENV) == owner and running(proc):
                found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


def stop_process_trees(
    pids: Sequence[int], grace: float = 10.0, owner: str | None = None
) -> list[psutil.Process]:
    """SIGTERM each process, its descendants and every process ``owner`` marks; SIGKILL what
    is left after ``grace`` seconds and each process group; return what could not be stopped.
    Descendants are listed before any signal, as Flower detaches some helpers into sessions."""
    targets: dict[int, psutil.Process] = {}
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(pid)
            for proc in (root, *root.children(recursive=True)):
                targets[proc.pid] = proc
    for proc in owned_processes(owner) if owner else []:
        targets.setdefault(proc.pid, proc)
    for proc in targets.values():
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(running(p) for p in targets.values()):
        time.sleep(0.2)
    for proc in targets.values():
        if running(proc):
            with contextlib.suppress(psutil.Error):
                proc.kill()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
    if not owner:
        return []
    # A Ray worker that outlived its raylet, or one started meanwhile: kill until none is left.
    deadline = time.monotonic() + grace
    while left := owned_processes(owner):
        if time.monotonic() > deadline:
            return left
        for proc in left:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(left, timeout=1)
    return []


def healthy(url: str, cafile: str | None = None) -> bool:
    """Whether a SuperLink answers 200 on its ``/health`` URL (trusting ``cafile``)."""
    context = ssl.create_default_context(cafile=cafile) if cafile else None
    try:
        with urllib.request.urlopen(url, timeout=1, context=context) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def toml_value(value: Any) -> str:
    """A scalar as a TOML value for --run-config (a JSON string is a TOML basic string)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, int | float) else json.dumps(str(value))


def toml_pairs(values: Mapping[str, Any]) -> str:
    return " ".join(f"{k}={toml_value(v)}" for k, v in values.items())
