"""Package faces: each package's ``__init__`` imports what other packages use of it, one
line per name (``from fedciuic.pkg.module import name as name``), and nothing else. A light
package imports them at once; a heavy one (torch, Opacus, Presidio) writes them under
``TYPE_CHECKING`` and imports each on first use through :func:`face` (PEP 562), so that the
relay imports no torch. ``tests/test_faces.py`` holds every cross-package import to its face."""

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
    """Each name the face of ``package`` shows, and its module, read from the face's imports."""
    spec = find_spec(package)
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(package)
    prefix = f"{package}."
    return {
        alias.asname or alias.name: node.module.removeprefix(prefix)
        for node in ast.walk(ast.parse(Path(spec.origin).read_text(encoding="utf-8")))
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(prefix)
        for alias in node.names
    }


def face(package: str) -> Callable[[str], Any]:
    """The module ``__getattr__`` of a heavy ``package``: each listed name imported on first use."""

    def __getattr__(name: str) -> Any:
        module = listed(package).get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(import_module(f"{package}.{module}"), name)

    return __getattr__
