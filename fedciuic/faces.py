"""Package faces: each package's ``__init__`` imports what other packages use of it, one
line per name (``from fedciuic.pkg.module import name as name``, the re-export form
mypy and ruff read), and nothing else. A light package imports them at once; a heavy
one (torch, Opacus, Presidio behind it) writes the same lines under ``TYPE_CHECKING``
and imports each name on first use (PEP 562) through :func:`face`, so that the relay
imports no torch and a cluster worker reaches rank 0 before the model libraries.
``tests/test_faces.py`` holds every import from another package to its face."""

from __future__ import annotations

import ast
import functools
from collections.abc import Callable
from importlib import import_module
from importlib.util import find_spec
from pathlib import Path
from typing import Any


@functools.cache
def listed(package: str) -> dict[str, str]:
    """Each name the face of ``package`` shows, and its module within the package: read
    from the face's own import lines, where alone they are written."""
    spec = find_spec(package)
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(package)
    where = {}
    for node in ast.walk(ast.parse(Path(spec.origin).read_text(encoding="utf-8"))):
        if not isinstance(node, ast.ImportFrom):
            continue
        module = node.module or ""
        if module.startswith(f"{package}."):
            for alias in node.names:
                where[alias.asname or alias.name] = module.removeprefix(f"{package}.")
    return where


def face(package: str) -> Callable[[str], Any]:
    """The module ``__getattr__`` of a heavy ``package``: each name it lists is imported
    from its module when first used."""

    def __getattr__(name: str) -> Any:
        module = listed(package).get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(import_module(f"{package}.{module}"), name)

    return __getattr__
