"""The files ``fedciuic init`` writes, rendered from the templates in ``templates/``.

A template is the file as written, with ``@@{name}`` where a value goes (``@@`` is
not bash syntax, so ``$x`` stays bash's own), ``@@@@`` for a literal ``@@`` and
``@@#`` starting a line of notes for its editors. A placeholder without a value, or a
value without a placeholder, raises: nothing renders silently. Files named ``_*`` are
fragments of other templates, inserted with :func:`fragment`.
"""

from __future__ import annotations

import re
import string
from functools import cache
from importlib import resources

_NOTE = re.compile(r"^@@#.*\n", re.MULTILINE)


class _Template(string.Template):
    delimiter = "@@"


@cache
def _load(name: str) -> _Template:
    text = (resources.files("fedciuic.ops") / "templates" / name).read_text(encoding="utf-8")
    template = _Template(_NOTE.sub("", text))
    if not template.is_valid():
        raise ValueError(f"template {name}: an @@ that is not @@{{name}}, @@name or @@@@")
    return template


def render(name: str, **values: str | int) -> str:
    """Template ``name`` with ``values``; KeyError if one is missing or unused."""
    template = _load(name)
    wanted = set(template.get_identifiers())
    missing, unused = wanted - values.keys(), values.keys() - wanted
    problems = [
        f"{what}: {', '.join(sorted(names))}"
        for what, names in (("no value for", missing), ("no placeholder for", unused))
        if names
    ]
    if problems:
        raise KeyError(f"template {name}: " + "; ".join(problems))
    return template.substitute(values)


def fragment(name: str, **values: str | int) -> str:
    """:func:`render` without the final line break: for a placeholder on a line of its own."""
    return render(name, **values).removesuffix("\n")
