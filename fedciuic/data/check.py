"""``fedciuic data check``: what a region's data folder holds, read as a region reads it.

Tokenised into a temporary folder (the region's cache is left alone); :func:`scan_data` is
the launcher's bounded version: every row checked, a sample tokenised, nothing written.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path
from typing import TYPE_CHECKING

import datasets
from transformers import PreTrainedTokenizerBase

from fedciuic.config import DEFAULT_MAX_RECORD_BYTES, Fields, TruncationSide
from fedciuic.data.scrubbing import Scrubbed
from fedciuic.data.sources import discover, root_of
from fedciuic.data.tokenized import (
    IGNORE,
    INPUT_IDS,
    LABELS,
    Scanned,
    Summary,
    dropped_for_length,
    scan_examples,
    tokenized,
)
from fedciuic.deid import CONTEXT_NAME, NAME_SOURCES, entity_label

if TYPE_CHECKING:
    from fedciuic.deid import Scrubber

#: How the masked part (no loss) of the shown example is marked.
MASK_OPEN, MASK_CLOSE = "⟦", "⟧"
#: Records :func:`scan_data` renders and tokenises (every row is read and checked).
SCAN_SAMPLE = 256


@dataclass(frozen=True)
class DataCheck:
    root: Path
    summary: Summary
    example: str | None  # one training example, its masked part marked
    seq_len: int
    tokenizer: str  # what counted the tokens
    truncation_side: TruncationSide = "right"
    #: A few of what de-identification found, every identifier masked.
    deid_examples: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.summary.bad_rows and self.summary.examples > 0

    def lines(self, user_id_field: str) -> list[str]:
        s = self.summary
        kinds = ", ".join(f"{name} ({kind})" for name, kind in s.files.items())
        shapes = ", ".join(f"{shape} {n}" for shape, n in sorted(s.shapes.items()))
        if s.records and not s.without_user:
            users = f"{s.users} (every record has {user_id_field})"
        elif s.users:
            users = (
                f"{s.users}, but {s.without_user} record(s) have no {user_id_field} (e.g. "
                f'{", ".join(s.without_user_where[:3])}): privacy-unit "user" would refuse them'
            )
        else:
            users = f'none (no {user_id_field} field): privacy-unit "user" is not possible'
        out = [
            f"data-path: {self.root}",
            f"files: {len(s.files)}: {kinds}",
            f"records: {s.records} ({shapes or 'none'}); bad rows: {s.bad_rows}",
            oversized_line(s),
            f"users: {users}",
            f"examples: {s.examples} at seq-len {self.seq_len}; {s.truncated} record(s) cut "
            f"at seq-len, {s.dropped} dropped (nothing left to train on within seq-len)",
            f"tokens: {s.tokens:,}, {s.trained_tokens:,} of them trained on ({self.tokenizer})",
        ]
        if (dropped := dropped_for_length(s, self.seq_len, self.truncation_side)) is not None:
            out.append(f"  {dropped}")
        if self.example is not None:
            out += ["", f"one training example ({MASK_OPEN}masked: no loss{MASK_CLOSE}):"]
            out += [self.example, ""]
        out += deid_lines(s.deid, self.deid_examples)
        if s.bad_rows:
            out += [f"bad rows ({s.bad_rows}):", *s.bad_reasons]
        if s.oversized:
            out += [
                f"records over max-record-bytes ({sum(s.oversized.values())}, dropped unread):",
                *s.oversized_where,
            ]
        return out


def oversized_line(summary: Summary) -> str:
    files = ", ".join(f"{name} {n}" for name, n in summary.oversized.items())
    return (
        f"over max-record-bytes ({summary.max_record_bytes:,} bytes): "
        f"{sum(summary.oversized.values())} record(s) dropped unread"
        + (f" ({files})" if files else "")
    )


def _counted(counts: dict[str, int]) -> str:
    return ", ".join(f"{entity_label(e)} {n}" for e, n in sorted(counts.items())) or "none"


def deid_lines(deid: Scrubbed | None, examples: tuple[str, ...]) -> list[str]:
    """What de-identification would replace before training, and a few masked examples."""
    if deid is None:
        return ["de-identification: off (nothing would be scrubbed)", ""]
    identity = deid.identity
    found = sum(deid.counts.values())
    out = [
        f"de-identification ({identity['replacement']}, {len(identity['entities'])} entity "
        f"type(s), pipeline {identity['config_hash'][:12]}): {found} identifier(s) would be "
        f"replaced in {deid.records} record(s)",
        f"  by entity type: {_counted(deid.counts)}",
        *(f"  {file}: {_counted(counts)}" for file, counts in deid.files.items()),
    ]
    scrubbed = set(identity["entities"])
    if CONTEXT_NAME in scrubbed and not scrubbed & set(NAME_SOURCES):
        out.append(
            "  names: by their context only (no deid-dictionary, no deid-ner-model): a "
            "policy that requires names (the shipped CN and EU ones) declines this region"
        )
    if examples:
        out += ["  examples (identifiers masked):", *(f"    {e}" for e in examples)]
    return [*out, ""]


def check_data(
    data_path: str | Path,
    tokenizer: PreTrainedTokenizerBase,
    *,
    seq_len: int,
    fields: Fields,
    tokenizer_name: str,
    truncation_side: TruncationSide = "right",
    scrubber: Scrubber | None = None,
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
) -> DataCheck:
    """Read, de-identify and tokenise ``data_path`` as a region would, listing every bad row."""
    root = root_of(data_path)
    sources = discover(root)
    with tempfile.TemporaryDirectory(prefix="fedciuic-data-check-") as scratch:
        data = tokenized(
            sources,
            tokenizer,
            seq_len=seq_len,
            fields=fields,
            state_dir=Path(scratch),
            keep_reasons=None,
            truncation_side=truncation_side,
            scrubber=scrubber,
            max_record_bytes=max_record_bytes,
        )
        example = _example(data.examples, tokenizer)
        found = tuple(scrubber.findings.examples or ()) if scrubber is not None else ()
        return DataCheck(
            root, data.summary, example, seq_len, tokenizer_name, truncation_side, found
        )


def scan_data(
    data_path: str | Path,
    tokenizer: PreTrainedTokenizerBase,
    *,
    seq_len: int,
    fields: Fields,
    sample: int = SCAN_SAMPLE,
    truncation_side: TruncationSide = "right",
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
) -> tuple[Path, Scanned]:
    """The resolved folder and what :func:`scan_examples` finds in it."""
    root = root_of(data_path)
    return root, scan_examples(
        discover(root),
        tokenizer,
        seq_len=seq_len,
        fields=fields,
        sample=sample,
        truncation_side=truncation_side,
        max_record_bytes=max_record_bytes,
    )


def _example(examples: datasets.Dataset, tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The first example with a masked prompt (else the first), decoded run by run."""
    if not examples.num_rows:
        return None
    first = (examples[i] for i in range(min(examples.num_rows, 200)))
    row = next((r for r in first if IGNORE in r[LABELS][1:]), None) or examples[0]
    runs = groupby(zip(row[INPUT_IDS], row[LABELS], strict=True), key=lambda t: t[1] == IGNORE)
    return "".join(
        _shown(str(tokenizer.decode([t for t, _ in run])), masked) for masked, run in runs
    )


def _shown(text: str, masked: bool) -> str:
    return f"{MASK_OPEN}{text}{MASK_CLOSE}" if masked else text
