"""README.md's "## Layout" block says what the tree holds, and the tree agrees.

The block is read as written: a line at no indent names a path of the repository (a
file, or a folder ending in ``/``); a line at two spaces names a package (``model/``)
or a top-level module (``config.py``) of ``fedciuic/``; deeper lines go on describing
the entry above them. The modules a package's description names (``adapter.py``) are
its modules. Every package, top-level module and package module of ``fedciuic/`` must be
named there, and every ``.py``, ``.md`` and ``.sh`` file and every ``folder/`` the block
names must exist (looked for beside its entry first, then from the repository's root).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ROOT / "fedciuic"
README = ROOT / "README.md"

#: A path-like word: letters, digits, ``_ . / -``, not glued to another such word.
WORD = re.compile(r"(?<![\w./-])[\w./-]*[\w/]")
#: What the block names that must exist: files with these suffixes, and folders.
CHECKED_SUFFIXES = (".py", ".md", ".sh")


@dataclass
class Entry:
    name: str  # as written: "fedciuic/", "  model/" -> "model/", "clients/app.py"
    line: int  # in README.md
    nested: bool  # at two spaces: a package or top-level module of fedciuic/
    text: list[str] = field(default_factory=list)  # its description, every line of it

    @property
    def folder(self) -> Path:
        """Where the names in its description are looked for first."""
        base = LIBRARY / self.name if self.nested else ROOT / self.name
        return base if self.name.endswith("/") else base.parent

    @property
    def named(self) -> list[str]:
        """The files and folders its description names (``x.py``, ``docs/a.md``, ``x/``)."""
        return [
            word
            for word in WORD.findall(" ".join(self.text))
            if word.endswith("/") or word.endswith(CHECKED_SUFFIXES)
        ]

    @property
    def modules(self) -> set[str]:
        """The modules a package's description names: bare ``x.py`` words."""
        return {word for word in self.named if word.endswith(".py") and "/" not in word}


def _block() -> tuple[int, list[str]]:
    """The first line's number and the lines of the code block under "## Layout"."""
    lines = README.read_text(encoding="utf-8").splitlines()
    start = lines.index("## Layout")
    opening = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("```"))
    closing = next(i for i in range(opening + 1, len(lines)) if lines[i].startswith("```"))
    assert all(not lines[i].startswith("## ") for i in range(start + 1, opening)), (
        'README.md: no code block in the "## Layout" section'
    )
    return opening + 2, lines[opening + 1 : closing]


def entries() -> list[Entry]:
    first, lines = _block()
    found: list[Entry] = []
    for number, line in enumerate(lines, start=first):
        indent = len(line) - len(line.lstrip(" "))
        if not line.strip():
            continue
        if indent in (0, 2):
            name, _, text = line.strip().partition(" ")
            found.append(Entry(name, number, nested=indent == 2, text=[text]))
        else:
            assert found, f"README.md:{number}: a description with no entry above it"
            found[-1].text.append(line.strip())
    return found


def _library() -> dict[str, Entry]:
    """The two-space entries, by name; each must sit under the "fedciuic/" entry."""
    parent = ""
    library: dict[str, Entry] = {}
    for entry in entries():
        if not entry.nested:
            parent = entry.name
        else:
            assert parent == "fedciuic/", (
                f"README.md:{entry.line}: {entry.name!r} is indented under {parent!r}, "
                "but only fedciuic/'s packages and modules are"
            )
            library[entry.name] = entry
    return library


PACKAGES = sorted(p.name for p in LIBRARY.iterdir() if (p / "__init__.py").is_file())
MODULES = sorted(p.name for p in LIBRARY.glob("*.py") if p.name != "__init__.py")


def test_the_block_is_read_as_entries():
    names = [entry.name for entry in entries()]
    assert "fedciuic/" in names and len(_library()) > len(PACKAGES), (
        f"README.md's Layout block read as {names}: is it still a code block of "
        "'path  description' lines?"
    )


def test_every_package_of_the_library_is_in_the_layout():
    missing = [f"{p}/" for p in PACKAGES if f"{p}/" not in _library()]
    assert not missing, f"README.md's Layout names no entry for these packages: {missing}"


def test_every_top_level_module_of_the_library_is_in_the_layout():
    missing = [m for m in MODULES if m not in _library()]
    assert not missing, "README.md's Layout names no entry for: " + ", ".join(
        f"fedciuic/{m}" for m in missing
    )


@pytest.mark.parametrize("package", PACKAGES)
def test_every_module_of_a_package_is_named_in_its_description(package):
    entry = _library().get(f"{package}/")
    assert entry is not None, f"README.md's Layout has no {package}/ entry"
    modules = {p.name for p in (LIBRARY / package).glob("*.py") if p.name != "__init__.py"}
    missing = sorted(modules - entry.modules)
    assert not missing, (
        f"README.md:{entry.line}: the {package}/ entry does not name {missing} "
        f"(fedciuic/{package}/ holds them)"
    )


def test_every_entry_is_in_the_tree():
    gone = [
        f"README.md:{entry.line}: {entry.name}"
        for entry in entries()
        if not ((LIBRARY if entry.nested else ROOT) / entry.name).exists()
    ]
    assert not gone, "README.md's Layout names entries the tree does not hold:\n" + "\n".join(gone)


def test_every_file_and_folder_a_description_names_is_in_the_tree():
    gone = [
        f"README.md:{entry.line}: {word} (in the {entry.name} entry)"
        for entry in entries()
        for word in entry.named
        if not ((entry.folder / word).exists() or (ROOT / word).exists())
    ]
    assert not gone, "README.md's Layout names what the tree does not hold:\n" + "\n".join(gone)
