"""A region's dictionary: names its records may hold that no pattern finds, one per line,
read strictly so that a broken file is refused rather than half-used."""

from __future__ import annotations

import codecs
import hashlib
import hmac
import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedciuic.errors import ConfigError

#: A dictionary is names, one per line: anything larger is a mistake.
MAX_DICTIONARY_BYTES = 64 * 2**20
#: Shorter entries would scrub pieces of ordinary words.
MIN_ENTRY_CHARS = 2
MAX_ENTRY_CHARS = 200
COMMENT = "#"
FIX = "one name per line, # for a comment (docs/deidentification.md)"


@dataclass(frozen=True)
class Dictionary:
    """The entries of a region's dictionary file, and its bytes' digest."""

    path: Path
    entries: tuple[str, ...]
    sha256: str

    def keyed_digest(self, key: bytes) -> str:
        """The file's digest under the region's key: what the pipeline's identity holds
        (a plain digest of a short list of names could be confirmed by guessing)."""
        return hmac.new(key, bytes.fromhex(self.sha256), hashlib.sha256).hexdigest()


def load_dictionary(path: Path) -> Dictionary:
    """Read a dictionary file; :class:`ConfigError` names ``FILE:LINE`` and the fix."""
    try:
        size = path.stat().st_size
        if size > MAX_DICTIONARY_BYTES:
            raise ConfigError([f"{path}: {size:,} bytes, over {MAX_DICTIONARY_BYTES:,}; {FIX}"])
        data = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(
            [f"{path}: no such dictionary file; check deid-dictionary (or remove it)"]
        ) from None
    except IsADirectoryError:
        raise ConfigError([f"{path}: is a folder; deid-dictionary names a file"]) from None
    except OSError as err:
        raise ConfigError(
            [f"{path}: cannot read ({err.strerror}); check its permissions"]
        ) from None
    entries: list[str] = []
    # A byte-order mark (as Windows editors save UTF-8) is no part of the first name.
    for number, raw in enumerate(data.removeprefix(codecs.BOM_UTF8).split(b"\n"), start=1):
        try:
            line = raw.decode("utf-8").removesuffix("\r")
        except UnicodeDecodeError as err:
            raise ConfigError(
                [
                    f"{path}:{number}: not UTF-8 (byte {err.start + 1} of the line); save the "
                    "file as UTF-8"
                ]
            ) from None
        entry = line.strip()
        if not entry or entry.startswith(COMMENT):
            continue
        if problem := _problem(entry):
            raise ConfigError([f"{path}:{number}: {problem}; {FIX}"])
        entries.append(entry)
    if not entries:
        raise ConfigError([f"{path}: no entries; {FIX}, or remove deid-dictionary"])
    return Dictionary(path, tuple(entries), hashlib.sha256(data).hexdigest())


#: Letters and digits of spaced scripts, which an entry must not touch (``Zhang Weiqiang``);
#: unspaced scripts have no such boundary (``王伟`` is found in ``王伟是客户``).
_SPACED = r"0-9A-Za-z_\u00c0-\u024f\u0370-\u03ff\u0400-\u04ff"


def dictionary_pattern(entries: tuple[str, ...]) -> re.Pattern[str]:
    """One case-insensitive pattern for every entry, the longest first; a trie, so that
    matching costs the text's length, not that times the entries."""
    trie: dict[str, Any] = {}
    for entry in entries:
        node = trie
        for char in entry.lower():
            node = node.setdefault(char, {})
        node[""] = {}
    return re.compile(rf"(?<![{_SPACED}])(?:{_trie_pattern(trie)})(?![{_SPACED}])", re.IGNORECASE)


def _trie_pattern(node: dict[str, Any]) -> str:
    branches = [
        re.escape(char) + _trie_pattern(child) for char, child in sorted(node.items()) if char
    ]
    if not branches:
        return ""
    body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
    return f"(?:{body})?" if "" in node else body


def _problem(entry: str) -> str:
    if any(unicodedata.category(c) == "Cc" for c in entry):
        return "holds a control character (a tab or a column separator?)"
    if len(entry) < MIN_ENTRY_CHARS:
        return f"entry of {len(entry)} character(s), the least is {MIN_ENTRY_CHARS}"
    if len(entry) > MAX_ENTRY_CHARS:
        return f"entry of {len(entry)} characters, the most is {MAX_ENTRY_CHARS}"
    if not any(c.isalnum() for c in entry):
        return "no letter or digit in the entry"
    return ""
