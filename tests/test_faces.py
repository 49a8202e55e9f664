"""The library's packages have faces and no circles: every import from another package
goes through that package's ``__init__`` (which lists what others use), every name a
face lists resolves, and no two packages import each other, directly or round about
(imports inside functions counted)."""

from __future__ import annotations

import ast
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from fedciuic.faces import listed

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ROOT / "fedciuic"
PACKAGES = sorted(p.name for p in LIBRARY.iterdir() if (p / "__init__.py").is_file())
#: Where the library is used from: the library itself and the two Flower apps.
SOURCES = [f for folder in ("fedciuic", "server", "clients") for f in (ROOT / folder).rglob("*.py")]


def _unit(path: Path) -> str:
    """The package (or top-level module, or app) a file belongs to."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return parts[1] if parts[0] == "fedciuic" and len(parts) > 1 else parts[0]


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every module ``path`` imports from the library (line, dotted name), anywhere."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
    return [(line, name) for line, name in found if name.split(".")[0] == "fedciuic"]


def test_every_import_from_another_package_goes_through_its_face():
    bypass = [
        f"{path.relative_to(ROOT)}:{line}: {module}"
        for path in SOURCES
        for line, module in _imports(path)
        if len(parts := module.split(".")) > 2 and parts[1] in PACKAGES and parts[1] != _unit(path)
    ]
    assert not bypass, "import these through the package's __init__:\n" + "\n".join(bypass)


@pytest.mark.parametrize("package", PACKAGES)
def test_every_name_a_face_lists_is_its_modules_own(package):
    """Each name is written once, as ``name as name`` (the re-export mypy and ruff read),
    and is the very object its module defines."""
    face = importlib.import_module(f"fedciuic.{package}")
    tree = ast.parse((LIBRARY / package / "__init__.py").read_text(encoding="utf-8"))
    mine = f"fedciuic.{package}."
    shown = [
        alias
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(mine)
        for alias in node.names
    ]
    assert [a.name for a in shown if a.asname != a.name] == []
    where = listed(f"fedciuic.{package}")
    for name, module in where.items():
        assert getattr(face, name) is getattr(
            importlib.import_module(f"fedciuic.{package}.{module}"), name
        )


def test_no_two_packages_import_each_other_even_round_about():
    uses: dict[str, set[str]] = {}
    for path in SOURCES:
        if path.relative_to(ROOT).parts[0] != "fedciuic":
            continue
        mine = _unit(path)
        for _, module in _imports(path):
            parts = module.split(".")
            other = parts[1] if len(parts) > 1 else mine
            if other != mine and (other in PACKAGES or (LIBRARY / f"{other}.py").is_file()):
                uses.setdefault(mine, set()).add(other)

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for nxt in uses.get(start, ()):
            if nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})):
                return True
        return False

    circles = sorted(a for a in uses if reaches(a, a, {a}))
    assert not circles, f"packages in an import circle: {circles} ({uses})"


def test_no_module_imports_itself_round_about():
    """File level: each import of a face's name leads to the module that defines it;
    no chain of imports (inside functions counted) comes back to where it started."""
    modules = {
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
        for p in LIBRARY.rglob("*.py")
    }
    faces = {name: listed(name) for name, path in modules.items() if path.name == "__init__.py"}
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        if path.name == "__init__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module in modules:
                where = faces.get(node.module, {})
                for alias in node.names:
                    target = f"{node.module}.{where.get(alias.name, alias.name)}"
                    edges.setdefault(name, set()).add(target if target in modules else node.module)

    def back(start: str) -> bool:
        seen, todo = set(), list(edges.get(start, ()))
        while todo:
            here = todo.pop()
            if here == start:
                return True
            if here not in seen:
                seen.add(here)
                todo += edges.get(here, ())
        return False

    circles = sorted(m for m in edges if back(m))
    assert not circles, f"modules in an import circle: {circles}"


#: Verbs a module is called by (``worker.main``, ``channel.encode``), never imported bare
#: next to another module's, and type variables.
MODULE_VERBS = {"main", "serve", "log", "encode", "render", "T"}


def test_each_public_name_is_defined_in_one_module():
    """A class, constant or function is defined once: two definitions under one name are
    two meanings a reader (and an import) can confuse."""
    where: dict[str, list[str]] = {}
    for path in sorted(LIBRARY.rglob("*.py")):
        if path.name == "__init__.py":
            continue
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                names = [node.name]
            elif isinstance(node, ast.Assign):
                names = [t.id for t in node.targets if isinstance(t, ast.Name)]
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names = [node.target.id]
            else:
                continue
            for name in names:
                if not name.startswith("_") and name not in MODULE_VERBS:
                    where.setdefault(name, []).append(str(path.relative_to(ROOT)))
    twice = {name: paths for name, paths in where.items() if len(paths) > 1}
    assert not twice, f"defined in more than one module (rename one): {twice}"


#: Issue 33's bound: a class past it owns more than one thing and is to be split.
MAX_CLASS_LINES = 350


def test_no_class_is_longer_than_the_bound():
    long = [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({length} lines)"
        for path in SOURCES
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.ClassDef)
        and (length := (node.end_lineno or node.lineno) - node.lineno + 1) > MAX_CLASS_LINES
    ]
    assert not long, long


#: What a light face must not import: the model libraries (seconds each, and the relay
#: and every `fedciuic` command would pay for them).
HEAVY = ("torch", "transformers", "peft", "opacus", "datasets", "presidio_analyzer")


def _eager(package: str) -> bool:
    source = (LIBRARY / package / "__init__.py").read_text(encoding="utf-8")
    return "__getattr__ = face(" not in source


def _heavy_after(module: str) -> list[str]:
    """The model libraries a fresh interpreter holds once it has imported ``module``."""
    loaded = f"[m for m in {HEAVY!r} if m in sys.modules]"
    probe = f"import {module}, json, sys; print(json.dumps({loaded}))"
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, check=True
    )
    return list(json.loads(done.stdout))


@pytest.mark.parametrize("package", [p for p in PACKAGES if _eager(p)])
def test_a_face_that_imports_at_once_imports_no_model_library(package):
    """A light package's face imports its names at once; one whose modules reach torch
    (the aggregator's round, a run's summary) loads them on first use instead."""
    assert _heavy_after(f"fedciuic.{package}") == []


def test_the_command_line_imports_no_model_library():
    """Every `fedciuic` command (start.sh runs several) starts without torch."""
    assert _heavy_after("fedciuic.ops.cli") == []
