"""Where a region's records come from: the files under its own ``data-path``, read locally.

A region's data never leaves its host; this module is the only place that opens it.
Every entry is resolved and checked to lie inside ``data-path`` before it is read, so
a symlink cannot smuggle another region's data (or anything else) in, and every data
file is checked to be a regular file (:func:`regular`): a FIFO would hang the region's
round, a device or a broken link would fail deep inside a reader.

JSON Lines and text files are read here line by line (each problem names its line, and
a bad row can be skipped); JSON arrays, CSV and Parquet files and folders written by
``Dataset.save_to_disk`` are read through Hugging Face ``datasets``, offline.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets

from fedciuic.data.records import json_kind
from fedciuic.errors import DataError
from fedciuic.files import broken_link, not_regular

# Local files only, never the Hub. ``datasets`` reads HF_HUB_OFFLINE once, when first
# imported (transformers may import it before this module does), so setting the
# variable here would come too late: set the flag where loading reads it.
datasets.config.HF_HUB_OFFLINE = True
datasets.config.HF_DATASETS_OFFLINE = True
datasets.disable_progress_bars()
datasets.logging.set_verbosity(logging.CRITICAL)

#: File types a region may hold, by suffix; each file is read by its kind.
KINDS: dict[str, str] = {
    ".jsonl": "jsonl",
    ".json": "json",
    ".csv": "csv",
    ".parquet": "parquet",
    ".txt": "text",
}
#: A folder written by ``Dataset.save_to_disk`` (it holds these two files).
SAVED = "saved"
SAVED_MARKERS = ("state.json", "dataset_info.json")
DATASET_DICT_MARKER = "dataset_dict.json"
#: The ``datasets`` builder that reads each kind it reads.
_BUILDERS = {"json": "json", "csv": "csv", "parquet": "parquet"}
#: Kinds read as a table: every row has every column (null where it has no value).
TABLE_KINDS = (*_BUILDERS, SAVED)


class NoDataFiles(DataError):
    """A region's data-path holds no file of a kind it reads: the region has no data
    (as if its folder were missing), rather than data that is broken."""


@dataclass(frozen=True)
class Source:
    """One file (or saved dataset folder) of a region's data."""

    path: Path  # resolved, inside data-path
    name: str  # relative to data-path: what messages and the fingerprint say
    kind: str

    def files(self) -> list[Path]:
        """The files whose bytes define this source (a saved folder's every file)."""
        if self.kind != SAVED:
            return [self.path]
        return sorted(p for p in self.path.rglob("*") if p.is_file())

    def where(self, index: int) -> str:
        """``FILE:LINE`` (or ``FILE:row N`` where lines mean nothing) of row ``index``,
        for kinds whose rows are numbered by :func:`read_rows` itself."""
        if self.kind == "csv":
            return f"{self.name}:{index + 2}"  # line 1 is the header
        return f"{self.name}:row {index + 1}"


@dataclass(frozen=True)
class Row:
    """A row as read: its values, or why it could not be read at all."""

    where: str  # FILE:LINE or FILE:row N
    values: Mapping[str, Any] | None
    error: str | None = None  # "field: message" or a message about the whole row


def root_of(data_path: str | Path) -> Path:
    """The region's data folder, resolved, or a :class:`DataError` saying what is wrong."""
    root = Path(data_path).expanduser()
    if not root.is_dir():
        what = "does not exist" if not root.exists() else "is not a directory"
        raise DataError(
            f"data-path {root} {what}; create it with the region's data files "
            f"({', '.join(KINDS)} or a save_to_disk folder; `fedciuic demo-data DIR` makes "
            "demo data) and pass it as data-path"
        )
    return root.resolve()


def discover(data_path: str | Path) -> list[Source]:
    """The region's data sources (sorted), refusing anything that resolves outside it.

    Hidden entries are not data (the region keeps its state in ``.fedciuic/``), nor are
    files of other types (a README); a saved dataset folder is one source.
    """
    root = root_of(data_path)
    found: list[Source] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        here = Path(dirpath)
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        filenames = sorted(f for f in filenames if not f.startswith("."))
        for name in dirnames + filenames:
            _refuse(here / name, broken_link(here / name))
            _check_inside(here / name, root)
        if DATASET_DICT_MARKER in filenames:
            raise DataError(
                f"{here.relative_to(root)}: a DatasetDict folder (several splits); save one "
                "split there instead: dataset['train'].save_to_disk(PATH)"
            )
        if all(marker in filenames for marker in SAVED_MARKERS):
            for name in filenames:  # what load_from_disk opens
                regular(here / name)
            found.append(Source(here, str(here.relative_to(root)), SAVED))
            dirnames[:] = []
            continue
        data_files = [f for f in filenames if Path(f).suffix in KINDS]
        for name in data_files:
            regular(here / name)
        found.extend(
            Source(here / f, str((here / f).relative_to(root)), KINDS[Path(f).suffix])
            for f in data_files
        )
    if not found:
        raise NoDataFiles(
            f"data-path {root} holds no data files ({', '.join(KINDS)} or a save_to_disk "
            "folder); add the region's records there"
        )
    return sorted(found, key=lambda s: s.name)


def regular(path: Path) -> None:
    """Refuse ``path`` unless it is a regular file: checked wherever a data file is
    listed or opened, before anything opens it."""
    _refuse(path, not_regular(path))


def _refuse(path: Path, what: str | None) -> None:
    if what is not None:
        raise DataError(
            f"{path}: {what}, not a regular file; a region reads only regular files in its "
            "data-path: put the data file itself there, or remove this entry"
        )


def _check_inside(entry: Path, root: Path) -> None:
    if entry.is_symlink() and not entry.resolve().is_relative_to(root):
        raise DataError(
            f"{entry}: links outside data-path {root} (to {entry.resolve()}); a region "
            "reads only its own folder: copy the data in instead"
        )


def read_rows(source: Source, *, cache_dir: Path, text_field: str) -> Iterator[Row]:
    """Each row of ``source`` with where it is; unreadable rows come with their reason.
    A text file's content is the ``text_field`` of its one record."""
    if source.kind != SAVED:
        regular(source.path)
    if source.kind == "jsonl":
        yield from _jsonl_rows(source)
    elif source.kind == "text":
        yield from _text_rows(source, text_field)
    else:
        yield from _datasets_rows(source, cache_dir)


def _jsonl_rows(source: Source) -> Iterator[Row]:
    with _opened(source) as handle:
        for lineno, raw in enumerate(handle, start=1):
            where = f"{source.name}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                yield Row(where, None, _not_utf8(err, f"column {err.start + 1}"))
                continue
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as err:
                yield Row(where, None, f"invalid JSON ({_json_problem(err)})")
                continue
            if not isinstance(value, dict):
                yield Row(where, None, f"expected a JSON object, got {json_kind(value)}")
                continue
            yield Row(where, value)


def _text_rows(source: Source, text_field: str) -> Iterator[Row]:
    """A text file is one ``text`` record (an empty one is no record)."""
    with _opened(source) as handle:
        data = handle.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        yield Row(f"{source.name}:{line}", None, _not_utf8(err, f"byte {err.start}"))
        return
    if text.strip():
        yield Row(f"{source.name}:1", {text_field: text})


def _datasets_rows(source: Source, cache_dir: Path) -> Iterator[Row]:
    try:
        if source.kind == SAVED:
            loaded = datasets.load_from_disk(str(source.path))
            if not isinstance(loaded, datasets.Dataset):
                raise DataError(f"{source.name}: not one Dataset; save one split there")
            table: Any = loaded
        else:
            table = datasets.load_dataset(
                _BUILDERS[source.kind],
                data_files=str(source.path),
                split="train",
                streaming=True,
                cache_dir=str(cache_dir),
            )
        for index, values in enumerate(table):
            yield Row(source.where(index), values)
    except DataError:
        raise
    except UnicodeDecodeError as err:
        line, column = _bad_byte(source.path)
        raise DataError(f"{source.name}:{line}: {_not_utf8(err, f'column {column}')}") from None
    except Exception as err:
        reason = " ".join(str(err).split()) or type(err).__name__
        raise DataError(
            f"{source.name}: cannot be read as {source.kind} ({reason[:300]}); check the "
            "file (`fedciuic data check` lists what it reads)"
        ) from None


def _opened(source: Source) -> Any:
    try:
        return open(source.path, "rb")
    except OSError as err:
        raise DataError(
            f"{source.name}: cannot read ({err.strerror}); check its permissions"
        ) from None


def _json_problem(err: json.JSONDecodeError) -> str:
    """The decoder's message and where: some of its messages end in "at" already
    ("Unterminated string starting at")."""
    at = "" if err.msg.endswith(" at") else " at"
    return f"{err.msg}{at} column {err.colno}"


def _not_utf8(err: UnicodeDecodeError, at: str) -> str:
    return f"not UTF-8 text ({err.reason} at {at}); save the file as UTF-8"


def _bad_byte(path: Path) -> tuple[int, int]:
    """The line and column (in bytes) of the first byte that is not UTF-8 (for formats
    read by a library, whose error says neither)."""
    with open(path, "rb") as handle:
        for lineno, raw in enumerate(handle, start=1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as err:
                return lineno, err.start + 1
    return 1, 1
