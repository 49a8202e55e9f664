"""Tokenise a region's records once into a memory-mapped Arrow file in its state-path.

Keyed by all that decides its content (:func:`cache_key`), so a later round or run reads
it back; records stream in batches, so a corpus larger than memory fits.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import datasets
import numpy as np
from datasets.arrow_writer import ArrowWriter
from pydantic import BaseModel, ConfigDict, ValidationError
from transformers import PreTrainedTokenizerBase

if TYPE_CHECKING:
    from fedciuic.deid import Scrubber

from fedciuic.config import DEFAULT_MAX_RECORD_BYTES, Fields, TruncationSide
from fedciuic.data.records import (
    INSTRUCTION,
    OUTPUT,
    SHAPES,
    WHOLE_RECORD,
    BadRecord,
    Record,
    Renderer,
    parse_record,
)
from fedciuic.data.scrubbing import Scrubbed, scrub_record
from fedciuic.data.sources import TABLE_KINDS, Row, Source, read_rows
from fedciuic.digests import DigestCache, cache_dir
from fedciuic.errors import DataError

#: Bumped when what a cached file holds changes.
CACHE_FORMAT = 4
IGNORE = -100  # the label of a token that carries no loss (PyTorch's ignore_index)
EXAMPLES_FILE = "examples.arrow"
CACHE_SUMMARY = "summary.json"
#: Cached tokenisations a region keeps (the newest); older ones are removed.
KEEP = 3
#: Reasons kept per problem kind (the counts are always complete).
MAX_REASONS = 20
_BATCH = 512
#: Columns a problem of a table's columns lists.
_SHOWN_COLUMNS = 20

INPUT_IDS, LABELS, RECORD, USER, BUCKET = "input_ids", "labels", "record", "user", "bucket"
FEATURES = datasets.Features(
    {
        INPUT_IDS: datasets.Sequence(datasets.Value("int32")),
        LABELS: datasets.Sequence(datasets.Value("int32")),
        RECORD: datasets.Value("int64"),  # source index << 40 | row index
        USER: datasets.Value("int64"),  # a digest of the user id; null: no user id
        BUCKET: datasets.Value("float64"),  # in [0, 1): held out when below eval-fraction
    }
)
_ROW_BITS = 40


class Summary(BaseModel):
    """What tokenising found: counts, shapes, and the first reasons rows were refused."""

    model_config = ConfigDict(extra="forbid")

    key: str
    format: int = CACHE_FORMAT
    data_fingerprint: str
    files: dict[str, str]  # name -> kind
    records: int = 0
    shapes: dict[str, int] = {}
    examples: int = 0
    tokens: int = 0
    trained_tokens: int = 0  # tokens with a label
    truncated: int = 0  # non-text records cut at seq-len
    dropped: int = 0  # records left with no trained token within seq-len
    #: Of the dropped records: the shortest prompt, the seq-len that keeps a trained token
    #: of every one, and the one that keeps them whole (None: none dropped).
    dropped_shortest_prompt: int | None = None
    dropped_keep_seq_len: int | None = None
    dropped_whole_seq_len: int | None = None
    bad_rows: int = 0
    bad_reasons: list[str] = []  # "FILE:LINE: field: message", the first MAX_REASONS
    users: int = 0  # distinct user ids
    without_user: int = 0  # records that name no user
    without_user_where: list[str] = []  # the first MAX_REASONS of them
    #: Records over this many bytes were dropped unread: counts per file, "FILE:LINE (N bytes)".
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES
    oversized: dict[str, int] = {}
    oversized_where: list[str] = []
    #: What de-identification replaced before tokenising (None: it was off).
    deid: Scrubbed | None = None


@dataclass
class _Missing:  # a problem of a table's columns, which every one of its rows has
    reason: int | None  # its line in bad_reasons (None: past the reasons kept)
    message: str
    rows: int = 1


@dataclass
class _Counts:
    summary: Summary
    keep_reasons: int | None = MAX_REASONS
    user_keys: set[int] = field(default_factory=set)
    missing: dict[tuple[str, str], _Missing] = field(default_factory=dict)
    #: Of the records dropped for length (see Summary.dropped_*).
    shortest_prompt: int | None = None
    keep: int = 0
    whole: int = 0

    def bad(self, where: str, reason: str) -> int | None:
        self.summary.bad_rows += 1
        if self.keep_reasons is None or len(self.summary.bad_reasons) < self.keep_reasons:
            self.summary.bad_reasons.append(f"{where}: {reason}")
            return len(self.summary.bad_reasons) - 1
        return None

    def oversized(self, source: Source, row: Row) -> None:
        summary = self.summary
        summary.oversized[source.name] = summary.oversized.get(source.name, 0) + 1
        if len(summary.oversized_where) < MAX_REASONS:
            summary.oversized_where.append(f"{row.where} ({row.oversized:,} bytes)")

    def columns(self, source: Source, field: str, message: str) -> None:
        """A missing column refuses every row of a table: name the file once, with a count."""
        key = (source.name, field)
        if key in self.missing:
            self.summary.bad_rows += 1
            self.missing[key].rows += 1
        else:
            self.missing[key] = _Missing(self.bad(source.name, ""), message)

    def dropped(self, prompt: int | None, longest: int) -> None:
        self.summary.dropped += 1
        self.whole = max(self.whole, longest)
        if prompt is None:
            return
        self.keep = max(self.keep, prompt + 1)
        if self.shortest_prompt is None or prompt < self.shortest_prompt:
            self.shortest_prompt = prompt

    def finish(self) -> None:
        summary = self.summary
        for (name, column), gap in self.missing.items():
            if gap.reason is not None:
                summary.bad_reasons[gap.reason] = (
                    f"{name}: {column}: in all {gap.rows:,} row(s): {gap.message}"
                )
        if summary.dropped:
            summary.dropped_shortest_prompt = self.shortest_prompt
            summary.dropped_keep_seq_len = max(self.keep, 2) if self.keep else None
            summary.dropped_whole_seq_len = self.whole
        summary.users = len(self.user_keys)


def data_fingerprint(sources: list[Source]) -> str:
    """SHA-256 over each source's name, kind and bytes (digests cached by file stat)."""
    store = DigestCache(cache_dir() / "file-digests.json")
    digest = hashlib.sha256(b"fedciuic-data-v2\n")
    for source in sources:
        digest.update(f"{source.name}\0{source.kind}\n".encode())
        for path in source.files():
            try:
                value = store.digest(path)
            except OSError as err:
                raise DataError(
                    f"{path}: cannot read ({err.strerror}); check its permissions"
                ) from None
            digest.update(f"{path.relative_to(source.path.parent)}:{value}\n".encode())
    store.save()
    return digest.hexdigest()


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """What decides how text becomes ids: the vocabulary, merges, special tokens, template."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    described = {
        "backend": backend.to_str() if backend is not None else None,
        "vocab": None if backend is not None else sorted(tokenizer.get_vocab().items()),
        "special": {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())},
        "chat_template": getattr(tokenizer, "chat_template", None),
        "class": type(tokenizer).__name__,
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()


def cache_key(
    fingerprint: str,
    tokenizer: PreTrainedTokenizerBase,
    seq_len: int,
    fields: Fields,
    truncation_side: TruncationSide = "right",
    scrubber: Scrubber | None = None,
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
) -> str:
    """What decides a cache entry's content (the deid config hash covers all of its settings)."""
    described = {
        "format": CACHE_FORMAT,
        "max_record_bytes": max_record_bytes,
        "deid": scrubber.identity["config_hash"] if scrubber is not None else None,
        "data": fingerprint,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "seq_len": seq_len,
        "truncation_side": truncation_side,
        "fields": fields.model_dump(),
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:32]


@dataclass(frozen=True)
class Tokenized:
    """A region's cached examples (memory-mapped) and what tokenising found."""

    examples: datasets.Dataset
    summary: Summary
    folder: Path
    built: bool  # tokenised now (False: read from the cache)


def tokenized(
    sources: list[Source],
    tokenizer: PreTrainedTokenizerBase,
    *,
    seq_len: int,
    fields: Fields,
    state_dir: Path,
    keep_reasons: int | None = MAX_REASONS,
    truncation_side: TruncationSide = "right",
    scrubber: Scrubber | None = None,
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
) -> Tokenized:
    """The region's examples from ``state_dir/data-cache/KEY``, tokenised there if missing
    (de-identified first by ``scrubber``: the cache never holds an identifier it finds)."""
    fingerprint = data_fingerprint(sources)
    key = cache_key(
        fingerprint, tokenizer, seq_len, fields, truncation_side, scrubber, max_record_bytes
    )
    root = state_dir / "data-cache"
    folder = root / key
    if (cached := _load(folder, key)) is not None:
        return Tokenized(cached[0], cached[1], folder, built=False)
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=root, prefix=".building-"))
    try:
        write_examples(
            sources,
            tokenizer,
            seq_len=seq_len,
            fields=fields,
            folder=staging,
            summary=_summary(sources, max_record_bytes, key, fingerprint),
            keep_reasons=keep_reasons,
            truncation_side=truncation_side,
            scrubber=scrubber,
        )
        # Another process of this region may have finished the same key meanwhile: its
        # complete entry stays (readers may have it mapped); a broken one is replaced.
        if _load(folder, key) is None:
            shutil.rmtree(folder, ignore_errors=True)
            with contextlib.suppress(OSError):  # lost a race to a complete entry
                os.replace(staging, folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    _prune(root, keep=folder)
    if (loaded := _load(folder, key)) is None:
        raise DataError(f"{folder}: the tokenised data just written cannot be read back")
    return Tokenized(loaded[0], loaded[1], folder, built=True)


def _summary(sources: list[Source], max_bytes: int, key: str = "", data: str = "") -> Summary:
    files = {s.name: s.kind for s in sources}
    return Summary(key=key, data_fingerprint=data, files=files, max_record_bytes=max_bytes)


def _load(folder: Path, key: str) -> tuple[datasets.Dataset, Summary] | None:
    """A complete cache entry for ``key``, or None (anything else is rebuilt, never trusted)."""
    try:
        summary = Summary.model_validate_json((folder / CACHE_SUMMARY).read_text(encoding="utf-8"))
        if summary.key != key or summary.format != CACHE_FORMAT:
            return None
        examples = datasets.Dataset.from_file(str(folder / EXAMPLES_FILE))
    except (OSError, ValueError, ValidationError):
        return None
    if examples.num_rows != summary.examples or examples.features != FEATURES:
        return None
    return examples, summary


def _prune(root: Path, *, keep: Path) -> None:
    entries = sorted(
        (p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")),
        key=lambda p: p.stat().st_mtime,
        reverse=True,
    )
    for old in [e for e in entries if e != keep][KEEP - 1 :]:
        shutil.rmtree(old, ignore_errors=True)


def write_examples(
    sources: list[Source],
    tokenizer: PreTrainedTokenizerBase,
    *,
    seq_len: int,
    fields: Fields,
    folder: Path,
    summary: Summary,
    keep_reasons: int | None = MAX_REASONS,
    truncation_side: TruncationSide = "right",
    scrubber: Scrubber | None = None,
) -> None:
    """Tokenise every valid record into ``folder``; ``keep_reasons`` None keeps every reason."""
    counts = _Counts(summary, keep_reasons)
    renderer = Renderer(tokenizer)
    if scrubber is not None:
        scrubber.findings.clear()
    writer = ArrowWriter(features=FEATURES, path=str(folder / EXAMPLES_FILE))
    try:
        for batch in _batches(sources, fields, counts, scrubber):
            _write_batch(writer, batch, renderer, counts, seq_len, truncation_side)
        writer.finalize()
    finally:
        writer.close()
    counts.finish()
    if scrubber is not None:
        summary.deid = Scrubbed.of(scrubber)
    (folder / CACHE_SUMMARY).write_text(summary.model_dump_json(indent=1), encoding="utf-8")


@dataclass(frozen=True)
class _Item:
    where: str
    record_key: int
    record: Record


def _batches(
    sources: list[Source], fields: Fields, counts: _Counts, scrubber: Scrubber | None = None
) -> Iterator[list[_Item]]:
    batch: list[_Item] = []
    limit = counts.summary.max_record_bytes
    for index, source in enumerate(sources):
        for row_index, row in enumerate(
            read_rows(source, text_field=fields.text_field, max_bytes=limit)
        ):
            if (item := _parse(source, row, fields, counts)) is None:
                continue
            if scrubber is not None:  # before anything is rendered, counted or hashed
                item = scrub_record(item, scrubber, row.where, source.name)
            batch.append(_Item(row.where, index << _ROW_BITS | row_index, item))
            if len(batch) == _BATCH:
                yield batch
                batch = []
    if batch:
        yield batch


def _parse(source: Source, row: Row, fields: Fields, counts: _Counts) -> Record | None:
    if row.oversized is not None:
        counts.oversized(source, row)
        return None
    if row.error is not None or row.values is None:
        counts.bad(row.where, row.error or "unreadable")
        return None
    try:
        return parse_record(row.values, fields)
    except BadRecord as err:
        if (problem := _of_columns(source, row.values, err, fields)) is not None:
            counts.columns(source, err.field, problem)
        else:
            counts.bad(row.where, str(err))
        return None


def _of_columns(
    source: Source, values: Mapping[str, Any], err: BadRecord, fields: Fields
) -> str | None:
    """What is wrong with a table's columns, if that is why ``err`` refused a row of it
    (a table's rows share its columns; each JSON line has its own)."""
    if source.kind not in TABLE_KINDS:
        return None
    known = {
        fields.text_field,
        fields.prompt_field,
        fields.response_field,
        fields.messages_field,
        INSTRUCTION,
        OUTPUT,
    }
    if err.field == WHOLE_RECORD:
        if known & set(values):
            return None
        return str(err).removeprefix(f"{WHOLE_RECORD}: ")
    if err.field in values or err.field not in known:  # a value of the row, or within one
        return None
    names = sorted(values)
    has = ", ".join(names[:_SHOWN_COLUMNS]) + (", ..." if len(names) > _SHOWN_COLUMNS else "")
    return (
        f"missing: the file has no such column (its columns: {has or 'none'}); add it, or name "
        "yours with the run config's text-field, prompt-field, response-field or "
        "messages-field"
    )


def dropped_for_length(summary: Summary, seq_len: int, side: TruncationSide) -> str | None:
    if not summary.dropped:
        return None
    keep = (
        f"the shortest prompt is {summary.dropped_shortest_prompt} tokens; seq-len "
        f"{summary.dropped_keep_seq_len} keeps a part of every response, "
        f"{summary.dropped_whole_seq_len} keeps them whole"
        if summary.dropped_shortest_prompt is not None
        else f"seq-len {summary.dropped_whole_seq_len} keeps them whole"
    )
    remedy = (
        'raise seq-len, or set truncation-side = "left" to cut prompts from the start so '
        "that the responses fit (docs/data.md)"
        if side == "right"
        else "raise seq-len"
    )
    return (
        f"{summary.dropped} record(s) dropped for length: no token of their response fits "
        f"in seq-len {seq_len} ({keep}); {remedy}"
    )


def dropped_for_size(summary: Summary, quoted: int = 3) -> str | None:
    if not summary.oversized:
        return None
    files = ", ".join(f"{name} {n}" for name, n in summary.oversized.items())
    return (
        f"{sum(summary.oversized.values())} record(s) over max-record-bytes "
        f"({summary.max_record_bytes:,} bytes) dropped unread ({files}), e.g. "
        + ", ".join(summary.oversized_where[:quoted])
    )


def oversized_details(summary: Summary) -> dict[str, Any] | None:
    """What a region's audit log records of the records dropped for their size."""
    if not summary.oversized:
        return None
    return {
        "max_record_bytes": summary.max_record_bytes,
        "records": sum(summary.oversized.values()),
        "files": dict(summary.oversized),
    }


def user_key(user: str) -> int:
    """A user id as a signed 64-bit digest (the cache never holds the id itself)."""
    return int.from_bytes(hashlib.sha256(user.encode()).digest()[:8], "big", signed=True)


def bucket_of(record: Record) -> float:
    """Where the record falls in [0, 1): a function of its content only."""
    return int.from_bytes(record.digest()[:8], "big") / 2.0**64


def _windows(
    length: int, first_trained: int | None, seq_len: int, side: TruncationSide, *, chunked: bool
) -> list[tuple[int, int]]:
    """How an example longer than seq-len is cut (docs/data.md): a chunked record's seq-len
    pieces, else one window; side "left" cuts the prompt's start, keeping at most
    seq-len // 2 of its tokens before a response that overflows."""
    if chunked:
        return [(start, min(start + seq_len, length)) for start in range(0, length, seq_len)]
    if length <= seq_len or side == "right" or first_trained is None:
        return [(0, min(length, seq_len))]
    context = min(first_trained, seq_len // 2)
    start = min(length - seq_len, first_trained - context)
    return [(start, start + seq_len)]


def _count_record(counts: _Counts, item: _Item) -> int | None:
    """Count a valid record; its user key, if it names one."""
    summary = counts.summary
    summary.records += 1
    summary.shapes[item.record.shape] = summary.shapes.get(item.record.shape, 0) + 1
    user = None if item.record.user is None else user_key(item.record.user)
    if user is None:
        summary.without_user += 1
        if len(summary.without_user_where) < MAX_REASONS:
            summary.without_user_where.append(item.where)
    else:
        counts.user_keys.add(user)
    return user


def _write_batch(
    writer: ArrowWriter | None,  # None: a scan's, which keeps only the counts
    batch: list[_Item],
    renderer: Renderer,
    counts: _Counts,
    seq_len: int,
    side: TruncationSide,
) -> None:
    rendered, kept = [], []
    for item in batch:
        try:
            rendered.append(renderer.render(item.record))
            kept.append(item)
        except BadRecord as err:
            counts.bad(item.where, str(err))
    if not kept:
        return
    texts = [text for shown in rendered for row in shown.rows for text, _ in row]
    encoded = iter(renderer.tokenizer(texts, add_special_tokens=False)["input_ids"])
    out: dict[str, list[object]] = {name: [] for name in FEATURES}
    summary = counts.summary
    for item, shown in zip(kept, rendered, strict=True):
        user = _count_record(counts, item)
        bucket = bucket_of(item.record)
        wrote = 0
        truncated = False
        prompt: int | None = None  # the shortest prompt of the record's examples
        longest = 0
        for row in shown.rows:
            ids: list[int] = []
            trained: list[bool] = []
            for _, on in row:
                piece = next(encoded)
                ids += piece
                trained += [on] * len(piece)
            ids_array = np.asarray(ids, dtype=np.int32)
            on_array = np.asarray(trained, dtype=bool)
            labels = np.where(on_array, ids_array, IGNORE).astype(np.int32)
            first = int(on_array.argmax()) if on_array.any() else None
            if first is not None and (prompt is None or first < prompt):
                prompt = first
            longest = max(longest, len(ids))
            truncated |= not shown.chunked and len(ids) > seq_len
            for begin, end in _windows(len(ids), first, seq_len, side, chunked=shown.chunked):
                piece_labels = labels[begin:end]
                if end - begin < 2 or not bool((piece_labels[1:] != IGNORE).any()):
                    continue  # nothing to predict in it
                out[INPUT_IDS].append(ids_array[begin:end])
                out[LABELS].append(piece_labels)
                out[RECORD].append(item.record_key)
                out[USER].append(user)
                out[BUCKET].append(bucket)
                summary.tokens += end - begin
                summary.trained_tokens += int((piece_labels[1:] != IGNORE).sum())
                wrote += 1
        summary.truncated += int(truncated)
        summary.examples += wrote
        if not wrote:
            counts.dropped(prompt, longest)
    if out[INPUT_IDS] and writer is not None:
        writer.write_batch(out)


@dataclass(frozen=True)
class Scanned:
    """What a scan of a region's data found (nothing written)."""

    summary: Summary  # examples, tokens, cuts and drops: of the sampled records only
    sampled: int  # records rendered and tokenised
    unreadable: list[str]  # sources that could not be read (their rows before it counted)
    render_error: str | None  # the model's chat template failed: sampling stopped


def scan_examples(
    sources: list[Source],
    tokenizer: PreTrainedTokenizerBase,
    *,
    seq_len: int,
    fields: Fields,
    sample: int,
    keep_reasons: int | None = MAX_REASONS,
    truncation_side: TruncationSide = "right",
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
) -> Scanned:
    """Check every row as :func:`tokenized` does, but tokenise only the first ``sample``
    valid records and write nothing: a launcher's check in seconds."""
    summary = _summary(sources, max_record_bytes)
    counts = _Counts(summary, keep_reasons)
    renderer = Renderer(tokenizer)
    sampled = 0
    unreadable: list[str] = []
    render_error: str | None = None
    for source in sources:
        try:
            for batch in _batches([source], fields, counts):
                room = 0 if render_error is not None else max(sample - sampled, 0)
                rest = batch[room:]
                if room:
                    bad, reasons = summary.bad_rows, len(summary.bad_reasons)
                    try:
                        _write_batch(None, batch[:room], renderer, counts, seq_len, truncation_side)
                        sampled += len(batch[:room])
                    except DataError as err:  # the model's, not the rows': stop rendering
                        # (before any of the batch is counted; rows the template refused
                        # on the way count as records)
                        summary.bad_rows = bad
                        del summary.bad_reasons[reasons:]
                        render_error = str(err)
                        rest = batch
                for item in rest:
                    _count_record(counts, item)
        except DataError as err:
            unreadable.append(str(err))
    counts.finish()
    return Scanned(summary, sampled, unreadable, render_error)


__all__ = ["SHAPES", "Scanned", "Summary", "Tokenized", "scan_examples", "tokenized"]
