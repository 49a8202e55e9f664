"""Package faces: each package's ``__init__`` lists what other packages use of it and
imports each name from its module on first use (PEP 562), so that importing one name
does not import the whole package (the relay imports no torch; a cluster worker reaches
rank 0 before it imports the model libraries). ``tests/test_faces.py`` holds every
import from another package to its face."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from importlib import import_module
from typing import Any


def face(package: str, where: Mapping[str, str]) -> Callable[[str], Any]:
    """The module ``__getattr__`` of ``package``: ``where`` maps each name it shows to
    the module (within the package) that defines it."""

    def __getattr__(name: str) -> Any:
        if name in where:
            return getattr(import_module(f"{package}.{where[name]}"), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
