"""Where a region's records come from: the files under its own ``data-path``, read locally.

The only place that opens a region's data. Every entry must lie inside ``data-path`` (no
symlink smuggles other data in) and be a regular file (a FIFO would hang the round); a
record over ``max-record-bytes`` is never read whole (:mod:`fedciuic.data.bounded`).
"""

from __future__ import annotations

import csv
import io
import json
import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from itertools import zip_longest
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa
import pyarrow.parquet as pq

from fedciuic.data.bounded import (
    Malformed,
    RawRecord,
    csv_records,
    json_array,
    lines,
    row_bytes,
    skip_bom,
)
from fedciuic.data.records import json_kind
from fedciuic.errors import DataError
from fedciuic.files import broken_link, not_regular

# Local files only, never the Hub: set where loading reads it (``datasets`` reads the
# environment once, perhaps before this module is imported).
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
#: Kinds read as a table: every row has every column (null where it has no value).
TABLE_KINDS = ("csv", "parquet", SAVED)


class NoDataFiles(DataError):
    """The data-path holds no file a region reads: no data (as if missing), not broken data."""


@dataclass(frozen=True)
class Source:
    """One file (or saved dataset folder) of a region's data."""

    path: Path  # resolved, inside data-path
    name: str  # relative to data-path: what messages and the fingerprint say
    kind: str

    def files(self) -> list[Path]:
        if self.kind != SAVED:
            return [self.path]
        return sorted(p for p in self.path.rglob("*") if p.is_file())

    def where(self, index: int) -> str:
        """``FILE:row N`` of row ``index``, for kinds whose rows have no line."""
        return f"{self.name}:row {index + 1}"


@dataclass(frozen=True)
class Row:
    """A row as read: its values, or why it could not be read at all."""

    where: str  # FILE:LINE or FILE:row N
    values: Mapping[str, Any] | None
    error: str | None = None  # "field: message" or a message about the whole row
    #: Its size in bytes when it is over max-record-bytes (then it was not read).
    oversized: int | None = None


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
    """The region's data sources (sorted), refusing anything that resolves outside it;
    hidden entries (the region's state in ``.fedciuic/``) are not data."""
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
    """Refuse ``path`` unless it is a regular file, before anything opens it."""
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


def read_rows(source: Source, *, text_field: str, max_bytes: int) -> Iterator[Row]:
    """Each row of ``source``: its values, why it is unreadable, or (over the limit) its size."""
    if source.kind != SAVED:
        regular(source.path)
    if source.kind in ("jsonl", "json"):
        yield from _json_rows(source, text_field, max_bytes)
    elif source.kind == "csv":
        yield from _csv_rows(source, max_bytes)
    elif source.kind == "text":
        yield from _text_rows(source, text_field, max_bytes)
    else:
        yield from _table_rows(source, max_bytes)


def _json_lines(source: Source, handle: io.BufferedReader, max_bytes: int) -> Iterator[Row]:
    for piece in lines(handle, max_bytes):
        where = f"{source.name}:{piece.line}"
        if piece.data is None:
            yield Row(where, None, oversized=piece.size)
            continue
        try:
            line = piece.data.decode("utf-8")
        except UnicodeDecodeError as err:
            yield Row(where, None, _not_utf8(err, f"column {err.start + 1}"))
            continue
        if line.strip():
            yield _json_row(where, line)


def _json_row(where: str, text: str, *, line: int | None = None, text_field: str = "") -> Row:
    """An object's row, or (given ``text_field``) a string's text record starting at ``line``."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        return Row(where, None, f"invalid JSON ({_json_problem(err, line)})")
    if isinstance(value, dict):
        return Row(where, value)
    if isinstance(value, str) and text_field:
        return Row(where, {text_field: value})
    expected = "a JSON object" + (" or string" if text_field else "")
    return Row(where, None, f"expected {expected}, got {json_kind(value)}")


def _json_rows(source: Source, text_field: str, max_bytes: int) -> Iterator[Row]:
    """A JSON array's elements; JSON Lines (or a .json file that is no array) line by line."""
    with _opened(source) as handle:
        skip_bom(handle)
        if source.kind == "jsonl" or _first_byte(handle) != b"[":
            yield from _json_lines(source, handle, max_bytes)
            return
        try:
            for index, piece in enumerate(json_array(handle, max_bytes)):
                where = source.where(index)
                if piece.data is None:
                    yield Row(where, None, oversized=piece.size)
                    continue
                try:
                    text = piece.data.decode("utf-8")
                except UnicodeDecodeError as err:
                    line = piece.line + piece.data.count(b"\n", 0, err.start)
                    yield Row(where, None, _not_utf8(err, f"line {line}"))
                    continue
                yield _json_row(where, text, line=piece.line, text_field=text_field)
        except Malformed as err:
            raise DataError(
                f"{source.name}:{err.line}: not one JSON array ({err}); fix the file, or "
                "write one object per line (JSON Lines, .jsonl)"
            ) from None


def _first_byte(handle: io.BufferedReader) -> bytes:
    """The first byte of ``handle`` that is not whitespace; the handle stays where it was."""
    start = handle.tell()
    found = b""
    while chunk := handle.read(4096):
        found = chunk.lstrip(b" \t\r\n")[:1]
        if found:
            break
    handle.seek(start)
    return found


def _csv_rows(source: Source, max_bytes: int) -> Iterator[Row]:
    """A CSV file's rows, by its header's names; an empty cell is null (no value)."""
    # csv's own (process-wide) field limit must not refuse what max-record-bytes allows.
    if csv.field_size_limit() < max_bytes:
        csv.field_size_limit(max_bytes)
    header: list[str] | None = None
    with _opened(source) as handle:
        skip_bom(handle)
        for piece in csv_records(handle, max_bytes):
            where, fields, problem = _csv_fields(source, piece)
            if fields is None and problem is None:
                continue  # a blank line
            if header is None:  # the header's problems are the file's
                if fields is not None and len(set(fields)) < len(fields):
                    problem = "a column named twice"
                if fields is None or problem is not None:
                    raise DataError(f"{where}: the header: {problem}; fix the file's first line")
                header = fields
            elif piece.data is None:
                yield Row(where, None, oversized=piece.size)
            elif fields is None or problem is not None:
                yield Row(where, None, problem)
            elif len(fields) > len(header):
                yield Row(where, None, f"{len(fields)} fields, and the header names {len(header)}")
            else:
                cells = zip_longest(header, fields)  # a short row's missing cells are null
                yield Row(where, {name: value or None for name, value in cells if name})


def _csv_fields(source: Source, piece: RawRecord) -> tuple[str, list[str] | None, str | None]:
    """Where a CSV record is (or its byte that is not UTF-8), its fields and its problem."""
    where = f"{source.name}:{piece.line}"
    if piece.data is None:
        return where, None, f"over max-record-bytes ({piece.size:,} bytes)"
    try:
        text = piece.data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = piece.line + piece.data.count(b"\n", 0, err.start)
        column = err.start - piece.data.rfind(b"\n", 0, err.start)
        return f"{source.name}:{line}", None, _not_utf8(err, f"column {column}")
    if not text.strip():
        return where, None, None
    try:
        return where, next(csv.reader((text,))), None
    except csv.Error as err:
        return where, None, f"not CSV ({err}); quote a field that holds a quote or a line break"


def _text_rows(source: Source, text_field: str, max_bytes: int) -> Iterator[Row]:
    """A text file is one ``text`` record (an empty one is no record)."""
    size = source.path.stat().st_size
    if size > max_bytes:
        yield Row(f"{source.name}:1", None, oversized=size)
        return
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


#: Rows of a Parquet file or saved dataset made Python objects at a time.
_TABLE_BATCH = 64


def _table_rows(source: Source, max_bytes: int) -> Iterator[Row]:
    """A Parquet file's or saved dataset's rows: only those within ``max_bytes`` become objects."""
    index = 0
    try:
        for batch in _arrow_batches(source):
            sizes = row_bytes(batch)
            over = sizes > max_bytes
            kept = iter(batch.filter(pa.array(~over)).to_pylist() if not over.all() else ())
            for size, too_long in zip(sizes.tolist(), over.tolist(), strict=True):
                where = source.where(index)
                index += 1
                yield Row(where, None, oversized=size) if too_long else Row(where, next(kept))
    except DataError:
        raise
    except Exception as err:
        reason = " ".join(str(err).split()) or type(err).__name__
        raise DataError(
            f"{source.name}: cannot be read as {source.kind} ({reason[:300]}); check the "
            "file (`fedciuic data check` lists what it reads)"
        ) from None


def _arrow_batches(source: Source) -> Iterator[pa.RecordBatch]:
    if source.kind == "parquet":
        yield from pq.ParquetFile(source.path).iter_batches(batch_size=_TABLE_BATCH)
        return
    loaded = datasets.load_from_disk(str(source.path))  # memory-mapped
    if not isinstance(loaded, datasets.Dataset):
        raise DataError(f"{source.name}: not one Dataset; save one split there")
    for table in loaded.with_format("arrow").iter(batch_size=_TABLE_BATCH):
        yield from table.to_batches()


def _opened(source: Source) -> Any:
    try:
        return open(source.path, "rb")
    except OSError as err:
        raise DataError(
            f"{source.name}: cannot read ({err.strerror}); check its permissions"
        ) from None


def _json_problem(err: json.JSONDecodeError, line: int | None = None) -> str:
    """The decoder's message and where: its line in the file (the text starting at ``line``)
    or, without ``line``, its column."""
    at = "" if err.msg.endswith(" at") else " at"
    if line is None:
        return f"{err.msg}{at} column {err.colno}"
    return f"{err.msg}{at} line {line + err.lineno - 1}"


def _not_utf8(err: UnicodeDecodeError, at: str) -> str:
    return f"not UTF-8 text ({err.reason} at {at}); save the file as UTF-8"
