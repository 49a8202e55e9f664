"""A file's records, read without ever holding one larger than ``max-record-bytes``.

A huge record (a log dump pasted into a chat) read whole could take the region past its
memory: one over the limit is scanned past in pieces, and only its size and place kept.
"""

from __future__ import annotations

import codecs
import io
import re
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

#: Bytes read at a time while scanning (and past a record over the limit).
READ_BYTES = 1 << 20


@dataclass(frozen=True)
class RawRecord:
    """One record as the file holds it: its bytes, or (over the limit) only their count."""

    line: int  # the line of the file it starts on, from 1
    size: int  # its bytes, without the line break that ends it
    data: bytes | None


class Malformed(ValueError):
    """The file's structure is broken (not one record): ``line`` is where."""

    def __init__(self, line: int, message: str) -> None:
        super().__init__(message)
        self.line = line


def skip_bom(handle: io.BufferedReader) -> None:
    """Step past a UTF-8 byte order mark at the start of ``handle``."""
    if handle.read(len(codecs.BOM_UTF8)) != codecs.BOM_UTF8:
        handle.seek(0)


def _line_break(raw: bytes) -> int:
    """The length of the line break ``raw`` ends in: 2 (``\\r\\n``), 1 (``\\n``) or 0."""
    if raw.endswith(b"\r\n"):
        return 2
    return 1 if raw.endswith(b"\n") else 0


def _tail(tail: bytes, piece: bytes) -> bytes:
    """The last two bytes read, ``piece`` read after ``tail``."""
    return piece[-2:] if len(piece) >= 2 else (tail + piece)[-2:]


def lines(handle: io.BufferedReader, limit: int) -> Iterator[RawRecord]:
    """Each line of ``handle``; a line over ``limit`` bytes is scanned past, not kept."""
    lineno = 0
    while raw := handle.readline(limit + 2):  # the line and its "\r\n", if it fits
        lineno += 1
        if raw.endswith(b"\n") or len(raw) < limit + 2:  # whole (the last may have no \n)
            size = len(raw) - _line_break(raw)
            yield RawRecord(lineno, size, raw[:size] if size <= limit else None)
            continue
        size, tail = len(raw), raw[-2:]
        while piece := handle.readline(READ_BYTES):
            size, tail = size + len(piece), _tail(tail, piece)
            if piece.endswith(b"\n"):
                break
        yield RawRecord(lineno, size - _line_break(tail), None)


def csv_records(handle: io.BufferedReader, limit: int) -> Iterator[RawRecord]:
    """Each CSV record (lines joined inside quotes); one over ``limit`` bytes is read past."""
    lineno = 0
    while True:
        first = lineno + 1
        parts: list[bytes] = []
        size = quotes = 0
        tail = b""
        over = False
        while piece := handle.readline(READ_BYTES):
            parts.append(piece)
            size, tail = size + len(piece), _tail(tail, piece)
            quotes += piece.count(b'"')
            ended = piece.endswith(b"\n")
            lineno += ended
            if ended and quotes % 2 == 0:
                break
            if size > limit + 2:  # over, whatever line break ends it
                parts.clear()
                more, lines, tail = _skip_csv(handle, quotes % 2 == 1, tail)
                size, lineno, over = size + more, lineno + lines, True
                break
        if not size:
            return
        if not tail.endswith(b"\n"):
            lineno += 1  # the last line, without a line break
        length = size - _line_break(tail)
        if over or length > limit:
            yield RawRecord(first, length, None)
        else:
            yield RawRecord(first, length, b"".join(parts)[:length])


#: The rest of a quoted field up to its closing quote ("" is a quote inside it), and of a
#: line outside quotes up to a quote or its end.
_QUOTED = re.compile(rb'[^"]*+(?:""[^"]*+)*+')
_UNQUOTED = re.compile(rb'[^"\n]*+')


def _skip_csv(handle: io.BufferedReader, inside: bool, tail: bytes) -> tuple[int, int, bytes]:
    """Read past the rest of a CSV record (``inside``: in a quoted field): its bytes, line
    breaks and last two bytes."""
    size = lines = 0
    skip = 0  # a quote's second half, the next chunk's first byte
    while chunk := handle.read(READ_BYTES):
        pos, end = skip, len(chunk)
        skip = 0
        while pos < end:
            if inside:
                pos = _QUOTED.match(chunk, pos).end()  # type: ignore[union-attr]
                if pos == end:
                    break
                if pos == end - 1 and handle.peek(1)[:1] == b'"':  # "" across chunks
                    pos, skip = end, 1
                else:  # its closing quote
                    pos, inside = pos + 1, False
                continue
            pos = _UNQUOTED.match(chunk, pos).end()  # type: ignore[union-attr]
            if pos == end:
                break
            if chunk[pos] == ord('"'):
                pos, inside = pos + 1, True
                continue
            pos += 1  # the line break that ends the record
            handle.seek(pos - end, io.SEEK_CUR)
            tail = _tail(tail, chunk[max(pos - 2, 0) : pos])
            return size + pos, lines + chunk.count(b"\n", 0, pos), tail
        size, lines, tail = size + end, lines + chunk.count(b"\n"), _tail(tail, chunk)
    return size, lines, tail


#: Outside strings, structure; inside one, all up to its closing quote (possessive: no backtrack).
_STRUCTURE = re.compile(rb'["\[\]{},]')
_STRING_BODY = re.compile(rb'[^"\\]*+(?:\\.[^"\\]*+)*+', re.DOTALL)
_NOT_SPACE = re.compile(rb"[^ \t\r\n]")


class _Element:
    """The element being read: its pieces while it is within the limit."""

    def __init__(self, line: int, limit: int) -> None:
        self.line = line
        self.limit = limit
        self.parts: list[bytes] | None = []
        self.size = 0
        self.spaces = 0  # trailing whitespace so far (not the element's)

    def add(self, data: bytes) -> None:
        if not data:
            return
        self.size += len(data)
        stripped = len(data.rstrip(b" \t\r\n"))
        self.spaces = self.spaces + len(data) if not stripped else len(data) - stripped
        if self.parts is not None:
            self.parts.append(data)
            if self.size - self.spaces > self.limit:
                self.parts = None

    def record(self) -> RawRecord:
        size = self.size - self.spaces
        data = None if self.parts is None else b"".join(self.parts)[:size]
        return RawRecord(self.line, size, data)


class _Lines:
    """The line of a place in the chunk being scanned (places asked for in order)."""

    def __init__(self) -> None:
        self.line = 1
        self.chunk = b""
        self.counted = 0  # the chunk's newlines before this are in ``line``

    def read(self, chunk: bytes) -> None:
        self.at(None)
        self.chunk, self.counted = chunk, 0

    def at(self, place: int | None) -> int:
        end = len(self.chunk) if place is None else place
        self.line += self.chunk.count(b"\n", self.counted, end)
        self.counted = end
        return self.line


def json_array(handle: io.BufferedReader, limit: int) -> Iterator[RawRecord]:
    """Each element of the JSON array in ``handle``, unparsed; one over ``limit`` is read past."""
    lines = _Lines()
    state = "open"  # open: before "["; value: before an element; in: in one; done: after "]"
    first = True  # no element yet (so "]" may close an empty array)
    depth = 0
    in_string = escaped = False
    element: _Element | None = None
    while chunk := handle.read(READ_BYTES):
        lines.read(chunk)
        pos, size = 0, len(chunk)
        begin = 0  # where the element's bytes start in this chunk
        while pos < size:
            if state in ("open", "value", "done"):
                if (found := _NOT_SPACE.search(chunk, pos)) is None:
                    break
                at, char = found.start(), chunk[found.start() : found.start() + 1]
                if state == "open":
                    if char != b"[":
                        raise Malformed(lines.at(at), "expected a JSON array ([...])")
                    state, pos = "value", at + 1
                elif state == "done":
                    raise Malformed(lines.at(at), "more after the array's closing ]")
                elif char == b"]" and first:
                    state, pos = "done", at + 1
                elif char in (b",", b"]"):
                    raise Malformed(lines.at(at), f"expected a value before {char.decode()}")
                else:
                    state, pos, begin = "in", at, at
                    element = _Element(lines.at(at), limit)
                continue
            if escaped:
                pos, escaped = pos + 1, False
                continue
            if in_string:
                end = _STRING_BODY.match(chunk, pos).end()  # type: ignore[union-attr]
                if end == size:
                    break
                if chunk[end] == ord('"'):
                    pos, in_string = end + 1, False
                else:  # a backslash, the chunk's last byte: what it escapes comes next
                    pos, escaped = size, True
                continue
            if (found := _STRUCTURE.search(chunk, pos)) is None:
                break
            at, char = found.start(), chunk[found.start() : found.start() + 1]
            pos = at + 1
            if char == b'"':
                in_string = True
            elif char in (b"[", b"{"):
                depth += 1
            elif depth:
                depth -= char != b","
            elif char == b"}":
                raise Malformed(lines.at(at), "a } that closes nothing")
            else:  # "," or "]" of the array: the element ends
                assert element is not None
                element.add(chunk[begin:at])
                yield element.record()
                element, first = None, False
                state = "value" if char == b"," else "done"
        if element is not None:
            element.add(chunk[begin:])
    if state != "done":
        raise Malformed(lines.at(None), "the array does not end (no closing ])")


def _value_bytes(array: pa.Array) -> np.ndarray:
    """The bytes of each value of ``array`` (a nested one's values summed)."""
    kind = array.type
    if pa.types.is_dictionary(kind):
        array = array.dictionary_decode()
        kind = array.type
    if pa.types.is_map(kind):  # a list of key-item structs
        array = array.cast(pa.list_(pa.struct([kind.key_field, kind.item_field])))
        kind = array.type
    if (
        pa.types.is_string(kind)
        or pa.types.is_large_string(kind)
        or pa.types.is_binary(kind)
        or pa.types.is_large_binary(kind)
    ):
        lengths = pc.binary_length(array).fill_null(0)
        return np.asarray(lengths.to_numpy(zero_copy_only=False), dtype=np.int64)
    if pa.types.is_struct(kind):
        return _summed(array.flatten(), len(array))  # the struct's offset and nulls applied
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        values = pc.list_flatten(array)
        parents = pc.list_parent_indices(array).to_numpy(zero_copy_only=False)
        summed = np.bincount(parents, weights=_value_bytes(values), minlength=len(array))
        return np.asarray(summed, dtype=np.int64)
    width = kind.bit_width // 8 if hasattr(kind, "bit_width") else 0
    return np.full(len(array), width, dtype=np.int64)


def row_bytes(batch: pa.RecordBatch) -> np.ndarray:
    """The bytes of each row's values, from the arrays' offsets (no value becomes an object)."""
    return _summed(batch.columns, batch.num_rows)


def _summed(arrays: list[pa.Array], rows: int) -> np.ndarray:
    total = np.zeros(rows, dtype=np.int64)
    for array in arrays:
        total += _value_bytes(array)
    return total
