"""What the benchmark scripts share: a table row and its verdict, best-of timing and
/proc readings (and a local federation's process tree).

Each script in ``run_all.BENCHMARKS`` defines ``rows(result) -> list[Row]`` (its lines
of the README table, from the JSON it wrote with ``--json``) and may define
``plot(result, out) -> list[Path]``; ``run_all.py`` only collects them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

if TYPE_CHECKING:
    from fedciuic.flower.launch import LocalFederation

#: (figure, measured, target, verdict)
Row = list[str]


def verdict(met: bool) -> str:
    return "met" if met else "**not met**"


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of ``repeats`` calls: on a shared machine noise only adds time."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def proc_bytes(path: str, *fields: str) -> tuple[int, ...]:
    """The ``Field: N kB`` lines of a /proc file (status, smaps_rollup) in bytes, in
    the order asked; zeros once the process is gone."""
    found = dict.fromkeys(fields, 0)
    try:
        with open(path, encoding="ascii") as handle:
            for line in handle:
                name, _, rest = line.partition(":")
                if name in found:
                    found[name] = int(rest.split()[0]) * 1024
    except (OSError, ValueError):
        pass
    return tuple(found[field] for field in fields)


def process_tree(federation: LocalFederation) -> set[int]:
    """Every process a local federation started, with all their descendants, and every
    process it owns wherever it was re-parented (Ray's daemons and actors)."""
    pids: set[int] = set()
    for pid in federation.pids():
        try:
            root = psutil.Process(pid)
            pids.update(p.pid for p in (root, *root.children(recursive=True)))
        except psutil.Error:
            continue
    pids.update(p.pid for p in federation.owned())
    return pids


def save_figure(fig: Any, path: Path) -> Path:
    """Lay out, write (PNG, 110 dpi, as every plot in results/) and close ``fig``."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
