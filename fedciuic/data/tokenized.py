"""Tokenise a region's records once into a memory-mapped Arrow file in its state-path.

One row per training example: its token ids, its labels (``-100`` where no loss is
taken), the record and person it comes from, and the record's split bucket. The file
is keyed by everything that decides its content (the data's digest, the tokenizer, its
chat template, seq-len, the field names), so a later round or run reads it back
instead of tokenising again. Records are read and written in batches: a corpus larger
than memory streams through.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import datasets
import numpy as np
from datasets.arrow_writer import ArrowWriter
from pydantic import BaseModel, ConfigDict, ValidationError
from transformers import PreTrainedTokenizerBase

from fedciuic.data.records import SHAPES, BadRecord, Fields, Record, Renderer, parse_record
from fedciuic.data.sources import Row, Source, read_rows
from fedciuic.digests import DigestCache, cache_dir
from fedciuic.errors import DataError

#: Bumped when what a cached file holds changes.
FORMAT = 1
IGNORE = -100  # the label of a token that carries no loss (PyTorch's ignore_index)
EXAMPLES_FILE = "examples.arrow"
SUMMARY_FILE = "summary.json"
#: Cached tokenisations a region keeps (the newest); older ones are removed.
KEEP = 3
#: Reasons kept per problem kind (the counts are always complete).
MAX_REASONS = 20
_BATCH = 512

# Column names of the cached examples.
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
    format: int = FORMAT
    data_fingerprint: str
    files: dict[str, str]  # name -> kind
    records: int = 0
    shapes: dict[str, int] = {}
    examples: int = 0
    tokens: int = 0
    trained_tokens: int = 0  # tokens with a label
    truncated: int = 0  # non-text records cut at seq-len
    dropped: int = 0  # records left with no trained token within seq-len
    bad_rows: int = 0
    bad_reasons: list[str] = []  # "FILE:LINE: field: message", the first MAX_REASONS
    users: int = 0  # distinct user ids
    without_user: int = 0  # records that name no user
    without_user_where: list[str] = []  # the first MAX_REASONS of them


@dataclass
class _Counts:
    summary: Summary
    keep_reasons: int | None = MAX_REASONS
    user_keys: set[int] = field(default_factory=set)

    def bad(self, where: str, reason: str) -> None:
        self.summary.bad_rows += 1
        if self.keep_reasons is None or len(self.summary.bad_reasons) < self.keep_reasons:
            self.summary.bad_reasons.append(f"{where}: {reason}")


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
    fingerprint: str, tokenizer: PreTrainedTokenizerBase, seq_len: int, fields: Fields
) -> str:
    described = {
        "format": FORMAT,
        "data": fingerprint,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "seq_len": seq_len,
        "fields": asdict(fields),
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
) -> Tokenized:
    """The region's examples: read from ``state_dir/data-cache/KEY``, or tokenised into it."""
    fingerprint = data_fingerprint(sources)
    key = cache_key(fingerprint, tokenizer, seq_len, fields)
    root = state_dir / "data-cache"
    folder = root / key
    cached = _load(folder, key)
    if cached is not None:
        return Tokenized(cached[0], cached[1], folder, built=False)
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=root, prefix=".building-"))
    try:
        summary = Summary(
            key=key, data_fingerprint=fingerprint, files={s.name: s.kind for s in sources}
        )
        write_examples(
            sources,
            tokenizer,
            seq_len=seq_len,
            fields=fields,
            folder=staging,
            summary=summary,
            scratch=root / ".datasets",
            keep_reasons=keep_reasons,
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
    loaded = _load(folder, key)
    if loaded is None:
        raise DataError(f"{folder}: the tokenised data just written cannot be read back")
    return Tokenized(loaded[0], loaded[1], folder, built=True)


def _load(folder: Path, key: str) -> tuple[datasets.Dataset, Summary] | None:
    """A complete cache entry for ``key``, or None (anything else is rebuilt, never trusted)."""
    try:
        summary = Summary.model_validate_json((folder / SUMMARY_FILE).read_text(encoding="utf-8"))
        if summary.key != key or summary.format != FORMAT:
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
    scratch: Path,
    keep_reasons: int | None = MAX_REASONS,
) -> None:
    """Tokenise every valid record of ``sources`` into ``folder`` (examples + summary);
    the first ``keep_reasons`` bad rows' reasons are kept (None: all of them)."""
    counts = _Counts(summary, keep_reasons)
    renderer = Renderer(tokenizer)
    writer = ArrowWriter(features=FEATURES, path=str(folder / EXAMPLES_FILE))
    try:
        for batch in _batches(sources, fields, counts, scratch):
            _write_batch(writer, batch, renderer, tokenizer, seq_len, counts)
        writer.finalize()
    finally:
        writer.close()
    summary.users = len(counts.user_keys)
    (folder / SUMMARY_FILE).write_text(summary.model_dump_json(indent=1), encoding="utf-8")


@dataclass(frozen=True)
class _Item:
    where: str
    record_key: int
    record: Record


def _batches(
    sources: list[Source], fields: Fields, counts: _Counts, scratch: Path
) -> Iterator[list[_Item]]:
    batch: list[_Item] = []
    for index, source in enumerate(sources):
        for row_index, row in enumerate(
            read_rows(source, cache_dir=scratch, text_field=fields.text)
        ):
            item = _parse(row, fields, counts)
            if item is None:
                continue
            batch.append(_Item(row.where, index << _ROW_BITS | row_index, item))
            if len(batch) == _BATCH:
                yield batch
                batch = []
    if batch:
        yield batch


def _parse(row: Row, fields: Fields, counts: _Counts) -> Record | None:
    if row.error is not None or row.values is None:
        counts.bad(row.where, row.error or "unreadable")
        return None
    try:
        return parse_record(row.values, fields)
    except BadRecord as err:
        counts.bad(row.where, str(err))
        return None


def user_key(user: str) -> int:
    """A user id as a signed 64-bit digest (the cache never holds the id itself)."""
    return int.from_bytes(hashlib.sha256(user.encode()).digest()[:8], "big", signed=True)


def bucket_of(record: Record) -> float:
    """Where the record falls in [0, 1): a function of its content only."""
    return int.from_bytes(record.digest()[:8], "big") / 2.0**64


def _write_batch(
    writer: ArrowWriter,
    batch: list[_Item],
    renderer: Renderer,
    tokenizer: PreTrainedTokenizerBase,
    seq_len: int,
    counts: _Counts,
) -> None:
    rendered = []
    kept = []
    for item in batch:
        try:
            rendered.append(renderer.render(item.record))
            kept.append(item)
        except BadRecord as err:
            counts.bad(item.where, str(err))
    if not kept:
        return
    texts = [text for shown in rendered for text, _ in shown.pieces]
    encoded = iter(tokenizer(texts, add_special_tokens=False)["input_ids"])
    out: dict[str, list[object]] = {name: [] for name in FEATURES}
    summary = counts.summary
    for item, shown in zip(kept, rendered, strict=True):
        summary.records += 1
        summary.shapes[item.record.shape] = summary.shapes.get(item.record.shape, 0) + 1
        user = None if item.record.user is None else user_key(item.record.user)
        if user is None:
            summary.without_user += 1
            if len(summary.without_user_where) < MAX_REASONS:
                summary.without_user_where.append(item.where)
        else:
            counts.user_keys.add(user)
        ids: list[int] = []
        trained: list[bool] = []
        for _, on in shown.pieces:
            piece = next(encoded)
            ids += piece
            trained += [on] * len(piece)
        ids_array = np.asarray(ids, dtype=np.int32)
        labels = np.where(np.asarray(trained, dtype=bool), ids_array, IGNORE).astype(np.int32)
        pieces = _windows(len(ids), seq_len, chunked=shown.chunked)
        if not shown.chunked and len(ids) > seq_len:
            summary.truncated += 1
        wrote = 0
        bucket = bucket_of(item.record)
        for begin, end in pieces:
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
        summary.examples += wrote
        if not wrote:
            summary.dropped += 1
    if out[INPUT_IDS]:
        writer.write_batch(out)


def _windows(length: int, seq_len: int, *, chunked: bool) -> list[tuple[int, int]]:
    """A chunked record's seq-len pieces, or the first seq-len tokens of any other."""
    if not chunked:
        return [(0, min(length, seq_len))]
    return [(start, min(start + seq_len, length)) for start in range(0, length, seq_len)]


__all__ = ["SHAPES", "Summary", "Tokenized", "tokenized"]
