"""Deterministic demo corpora per region, made from documentation that ships with CPython.

Nothing is downloaded. Each region gets the docstrings of a different family of
standard-library modules, so the regions really differ (non-IID by topic and
vocabulary): ``eu`` text and internet formats, ``cn`` numbers and data structures,
``us`` operating system and concurrency, and so on.
"""

from __future__ import annotations

import importlib
import inspect
import json
import pkgutil
import warnings
from pathlib import Path
from types import ModuleType

from fedciuic.errors import ConfigError

#: Module families per region; each region's corpus is the docstrings of its family.
FAMILIES: dict[str, tuple[str, ...]] = {
    "eu": (
        "email",
        "http",
        "urllib",
        "html",
        "json",
        "xml",
        "mailbox",
        "smtplib",
        "imaplib",
        "poplib",
        "ftplib",
        "base64",
        "quopri",
        "mimetypes",
        "codecs",
        "gettext",
        "locale",
        "csv",
        "configparser",
    ),
    "cn": (
        "decimal",
        "fractions",
        "statistics",
        "random",
        "math",
        "cmath",
        "numbers",
        "array",
        "heapq",
        "bisect",
        "itertools",
        "functools",
        "operator",
        "collections",
        "struct",
        "hashlib",
        "hmac",
        "secrets",
        "zlib",
        "datetime",
        "calendar",
        "enum",
        "dataclasses",
        "copy",
        "pprint",
    ),
    "us": (
        "os",
        "shutil",
        "pathlib",
        "subprocess",
        "threading",
        "multiprocessing",
        "asyncio",
        "concurrent",
        "socket",
        "selectors",
        "signal",
        "logging",
        "tempfile",
        "glob",
        "fnmatch",
        "io",
        "sched",
        "queue",
        "argparse",
    ),
    "sg": ("unittest", "doctest", "pdb", "trace", "timeit", "cProfile", "inspect", "dis"),
    "in": ("sqlite3", "dbm", "shelve", "pickle", "zipfile", "tarfile", "gzip", "bz2", "lzma"),
}

#: Upper bound on a region's corpus, to keep the demo quick on one CPU core.
MAX_CHARS = 200_000


def module_docs(names: tuple[str, ...], max_chars: int = MAX_CHARS) -> list[str]:
    """Docstrings of the named modules, their public submodules and members, in a fixed order."""
    docs: list[str] = []
    total = 0
    for module in _modules(names):
        members = [module] + [
            obj
            for attr, obj in sorted(vars(module).items())
            if not attr.startswith("_") and getattr(obj, "__module__", None) == module.__name__
        ]
        for obj in members:
            doc = inspect.getdoc(obj)
            if not doc or len(doc) < 40:
                continue
            docs.append(doc)
            total += len(doc)
            if total >= max_chars:
                return docs
    return docs


def _modules(names: tuple[str, ...]) -> list[ModuleType]:
    found = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in names:
            try:
                module = importlib.import_module(name)
            except ImportError:
                continue  # e.g. a CPython built without this optional module
            found.append(module)
            subs = sorted(
                info.name
                for info in pkgutil.iter_modules(getattr(module, "__path__", []), f"{name}.")
                if not info.name.rsplit(".", 1)[-1].startswith("_")
                and "test" not in info.name
                and "__main__" not in info.name
            )
            for sub in subs:
                try:
                    found.append(importlib.import_module(sub))
                except Exception:
                    continue
    return found


def write_demo_corpora(root: Path, regions: tuple[str, ...]) -> dict[str, Path]:
    """Write ``root/<region>/docs.jsonl`` for each region and return the folders."""
    unknown = [r for r in regions if r not in FAMILIES]
    if unknown:
        raise ConfigError(
            [f"demo data:regions: no demo corpus for {unknown}; known: {', '.join(FAMILIES)}"]
        )
    folders = {}
    for region in regions:
        folder = root / region
        folder.mkdir(parents=True, exist_ok=True)
        lines = [json.dumps({"text": d}, ensure_ascii=False) for d in module_docs(FAMILIES[region])]
        (folder / "docs.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
        folders[region] = folder
    return folders
