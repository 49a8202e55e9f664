"""docs/architecture.md's import table is the design, and the code keeps to it.

The table's rows are ``| floor | unit | may import |``, one per unit, bottom floor first:
a unit is a package of ``fedciuic/`` (``model/``), a top-level module (``config.py``) or
one of the two apps (``server/app.py``). Floor 0 holds the foundations, which every other
unit may import besides what its row lists. Every import of ``fedciuic`` in the library
and the apps (anywhere in a file, inside functions too, as in ``tests/test_faces.py``)
must be one its unit's row allows, and a row may allow only rows above it, so the floors
stay floors (no import goes up, and none goes round).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ROOT / "fedciuic"
DOC = ROOT / "docs" / "architecture.md"
APPS = ("server", "clients")
#: A row of the table: its floor, its unit and what it may import.
ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*`([^`]+)`\s*\|(.*)\|\s*$")
NAME = re.compile(r"`([^`]+)`")


def unit_of_name(name: str) -> str:
    """The unit a name in the table stands for: ``model/`` -> model, ``config.py`` ->
    config, ``server/app.py`` -> server."""
    return name.removesuffix("/").removesuffix(".py").split("/")[0]


def unit_of_path(path: Path) -> str:
    """The unit a source file belongs to (its package, top-level module or app)."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts == ("fedciuic", "__init__"):
        return "fedciuic"  # the library's own face: in no row, so it may import nothing
    return parts[1] if parts[0] == "fedciuic" else parts[0]


@dataclass(frozen=True)
class Row:
    floor: int
    unit: str
    name: str  # as written in the table
    may: tuple[str, ...]  # the units it may import, besides the foundations
    line: int


def table() -> list[Row]:
    rows = []
    for number, line in enumerate(DOC.read_text(encoding="utf-8").splitlines(), start=1):
        if match := ROW.match(line):
            floor, name, may = match.groups()
            allowed = tuple(unit_of_name(n) for n in NAME.findall(may))
            rows.append(Row(int(floor), unit_of_name(name), name, allowed, number))
    return rows


def units() -> set[str]:
    """Every unit the code has: packages, top-level modules, the apps."""
    packages = {p.name for p in LIBRARY.iterdir() if (p / "__init__.py").is_file()}
    modules = {p.stem for p in LIBRARY.glob("*.py") if p.name != "__init__.py"}
    return packages | modules | set(APPS)


def sources() -> list[Path]:
    return sorted(f for folder in ("fedciuic", *APPS) for f in (ROOT / folder).rglob("*.py"))


def imports(path: Path) -> list[tuple[int, str]]:
    """Every unit ``path`` imports from the library (line, unit), anywhere in the file."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
    return [
        (line, parts[1])
        for line, module in found
        if len(parts := module.split(".")) > 1 and parts[0] == "fedciuic"
    ]


def test_the_table_is_read():
    rows = table()
    assert len(rows) > 10 and any(r.floor == 0 for r in rows), (
        f"{DOC.relative_to(ROOT)}: no import table read (rows '| floor | `unit` | may "
        f"import |' expected); read {rows}"
    )


def test_the_table_lists_every_package_module_and_app_once():
    listed = [row.unit for row in table()]
    twice = sorted({u for u in listed if listed.count(u) > 1})
    missing = sorted(units() - set(listed))
    unknown = sorted(set(listed) - units())
    assert not (twice or missing or unknown), (
        f"{DOC.relative_to(ROOT)}'s import table: rows for units the code does not have: "
        f"{unknown}; no row for: {missing}; more than one row for: {twice}"
    )


def test_each_row_allows_only_rows_above_it():
    above: set[str] = set()
    wrong = []
    floor = 0
    for row in table():
        if row.floor < floor:
            wrong.append(
                f"line {row.line}: {row.name} is on floor {row.floor}, below the row above"
            )
        floor = row.floor
        later = [u for u in row.may if u not in above]
        if later:
            wrong.append(f"line {row.line}: {row.name} may import {later}, not above it")
        if row.floor == 0 and row.may:
            wrong.append(f"line {row.line}: {row.name} is a foundation and imports nothing")
        above.add(row.unit)
    assert not wrong, f"{DOC.relative_to(ROOT)}'s floors:\n" + "\n".join(wrong)


def test_every_import_between_units_is_one_the_table_allows():
    rows = {row.unit: row for row in table()}
    foundations = {u for u, row in rows.items() if row.floor == 0}
    disallowed = []
    for path in sources():
        unit = unit_of_path(path)
        row = rows.get(unit)
        may = set(row.may) if row else set()
        allowed = may | (foundations if row and row.floor > 0 else set())
        for line, other in imports(path):
            if other != unit and other not in allowed:
                disallowed.append(
                    f"{path.relative_to(ROOT)}:{line}: {unit} imports {other}, which "
                    f"{DOC.relative_to(ROOT)} does not let it (its row allows "
                    f"{(sorted(may) or 'nothing') if row else 'nothing: it has no row'}"
                    f"{' and floor 0' if row and row.floor > 0 else ''})"
                )
    assert not disallowed, "imports the architecture does not allow:\n" + "\n".join(disallowed)


def test_nothing_below_the_adapters_floor_imports_flower():
    """The two sides of a round and everything under them are plain Python: Flower is
    imported only from the floor of ``flower/`` up."""
    rows = {row.unit: row for row in table()}
    adapters = rows["flower"].floor
    flower = []
    for path in sources():
        row = rows.get(unit_of_path(path))
        if row is None or row.floor >= adapters:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            flower += [
                f"{path.relative_to(ROOT)}:{node.lineno}: {name} (floor {row.floor})"
                for name in names
                if name.split(".")[0] == "flwr"
            ]
    assert not flower, (
        f"Flower imported below floor {adapters} (docs/architecture.md):\n" + "\n".join(flower)
    )
