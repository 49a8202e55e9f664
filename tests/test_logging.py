"""Each log line of a run reaches the console once, in Flower's format.

Opacus adds a root handler when it is imported (``logging.basicConfig``) and Flower's
``flwr`` logger propagates to the root, so without :mod:`fedciuic.opacus_logging` a
deployment printed every line twice (``INFO :      round 1`` and
``11/29/2026 02:56:05:INFO:round 1``). Each process starts fresh here, as a deployed one
does: its imports decide which handlers the root holds.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [f for folder in ("fedciuic", "server", "clients") for f in (ROOT / folder).rglob("*.py")]
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
MARK = "fedciuic: round 1: a line logged once"


@pytest.mark.parametrize(
    "module",
    [
        "server.app",  # the aggregator's ServerApp process (secure sums import Opacus)
        # a region's round, in its agent (deployed) or in the lab (simulated): DP-SGD
        # and its ledger import Opacus
        "fedciuic.region.trainer",
    ],
)
def test_a_line_of_the_run_reaches_the_console_once_in_flowers_format(module, capfd):
    code = (
        f"import sys, {module}\n"
        "assert 'opacus' in sys.modules, 'this case tests nothing'\n"
        "from logging import INFO\n"
        "from flwr.common.logger import log\n"
        f"log(INFO, {MARK!r})\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
    err = _ANSI.sub("", capfd.readouterr().err)
    lines = [line for line in err.splitlines() if MARK in line]
    assert len(lines) == 1, f"{module}: the line reached the console {len(lines)} times:\n{err}"
    assert re.fullmatch(rf"INFO\s*:\s+{re.escape(MARK)}", lines[0]), lines[0]


def _imports_opacus(tree: ast.Module) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        if any(name.split(".")[0] == "opacus" for name in names):
            return True
    return False


def _undoes_at_import(tree: ast.Module) -> bool:
    return any(
        isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Call)
        and isinstance(node.value.func, ast.Name)
        and node.value.func.id == "undo_opacus_basic_config"
        for node in tree.body
    )


def test_every_module_that_imports_opacus_undoes_its_root_handler():
    """Whichever of them a process imports first, Opacus' handler is gone after it."""
    forgetful = []
    for path in SOURCES:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        if _imports_opacus(tree) and not _undoes_at_import(tree):
            forgetful.append(str(path.relative_to(ROOT)))
    assert not forgetful, "call undo_opacus_basic_config() after importing Opacus in: " + ", ".join(
        forgetful
    )
