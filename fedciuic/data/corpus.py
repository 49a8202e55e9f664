"""A region's data as training sees it: examples split by record, grouped by privacy unit.

Examples are padded, never packed: a row's gradient belongs to one record and one person
(what DP-SGD clips).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import datasets
import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from fedciuic.config import NodeConfig, PrivacyUnit, RunConfig
from fedciuic.data.scrubbing import node_scrubber
from fedciuic.data.sources import discover, root_of
from fedciuic.data.tokenized import (
    BUCKET,
    FEATURES,
    IGNORE,
    INPUT_IDS,
    LABELS,
    RECORD,
    USER,
    Summary,
    Tokenized,
    data_fingerprint,
    dropped_for_length,
    dropped_for_size,
    tokenized,
)
from fedciuic.errors import DataError

#: How many reasons a refusal quotes (``fedciuic data check`` lists them all).
QUOTED = 3


@dataclass(frozen=True)
class Batch:
    """Padded examples: ids, labels (``-100``: no loss) and the attention mask."""

    input_ids: torch.Tensor  # [B, T]
    labels: torch.Tensor  # [B, T]
    attention_mask: torch.Tensor  # [B, T]

    def to(self, device: torch.device | str) -> Batch:
        return Batch(
            self.input_ids.to(device), self.labels.to(device), self.attention_mask.to(device)
        )

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def first(self, count: int) -> Batch:
        return self.rows(0, count)

    def rows(self, start: int, stop: int) -> Batch:
        return Batch(
            self.input_ids[start:stop], self.labels[start:stop], self.attention_mask[start:stop]
        )

    @classmethod
    def of_ids(cls, input_ids: torch.Tensor) -> Batch:
        """Unpadded rows with every token trained on (benchmarks and tests)."""
        return cls(input_ids, input_ids, torch.ones_like(input_ids))


class Units:
    """Examples grouped by privacy unit: which examples (positions) each unit owns."""

    def __init__(self, owners: np.ndarray) -> None:
        _, inverse, counts = np.unique(owners, return_inverse=True, return_counts=True)
        self.count = int(counts.shape[0])
        self.order = np.argsort(inverse, kind="stable")
        self.offsets = np.concatenate([[0], np.cumsum(counts)])
        self.largest = int(counts.max()) if self.count else 0

    def examples(self, unit: int) -> np.ndarray:
        return self.order[self.offsets[unit] : self.offsets[unit + 1]]


@dataclass(frozen=True)
class ExampleSet:
    """Some rows of the memory-mapped examples, with the privacy unit each belongs to."""

    table: datasets.Dataset
    rows: np.ndarray  # [n] row numbers in ``table``
    units: np.ndarray  # [n] the unit (record or user digest) of each row
    pad_id: int

    def __len__(self) -> int:
        return int(self.rows.shape[0])

    @classmethod
    def of_rows(
        cls, rows: torch.Tensor, *, units: Sequence[int] | None = None, pad_id: int = 0
    ) -> ExampleSet:
        """Rows of tokens in memory (benchmarks, tests), all trained on; ``units``: their owners."""
        ids = rows.tolist()
        n = len(ids)
        owners = list(range(n)) if units is None else [int(u) for u in units]
        table = datasets.Dataset.from_dict(
            {INPUT_IDS: ids, LABELS: ids, RECORD: list(range(n)), USER: owners, BUCKET: [0.5] * n},
            features=FEATURES,
        )
        return cls(table, np.arange(n), np.asarray(owners, dtype=np.int64), pad_id)

    @cached_property
    def grouped(self) -> Units:
        """The set grouped by unit (computed once: DP-SGD samples units every round)."""
        return Units(self.units)

    @property
    def num_units(self) -> int:
        return self.grouped.count

    def batch(self, positions: Sequence[int] | np.ndarray) -> Batch:
        """The examples at ``positions`` (indices into this set), right-padded."""
        picked = self.table[[int(self.rows[p]) for p in positions]]
        return self._padded(picked[INPUT_IDS], picked[LABELS])

    def batches(self, size: int) -> list[tuple[np.ndarray, Batch]]:
        """The whole set in batches of ``size`` with their positions (evaluation), shortest
        first (as ``group_by_length`` does) so that each pads to lengths like its own."""
        if not len(self):
            return []
        picked = self.table[[int(r) for r in self.rows]]  # read once
        ids, labels = picked[INPUT_IDS], picked[LABELS]
        order = np.argsort(np.asarray([len(x) for x in ids], dtype=np.int64), kind="stable")
        return [
            (part, self._padded([ids[p] for p in part], [labels[p] for p in part]))
            for part in np.split(order, range(size, len(self), size))
        ]

    def _padded(self, ids: Sequence[Sequence[int]], labels: Sequence[Sequence[int]]) -> Batch:
        shape = (len(ids), max(len(x) for x in ids))
        input_ids = torch.full(shape, self.pad_id, dtype=torch.long)
        label_ids = torch.full(shape, IGNORE, dtype=torch.long)
        mask = torch.zeros(shape, dtype=torch.long)
        for i, (row_ids, row_labels) in enumerate(zip(ids, labels, strict=True)):
            n = len(row_ids)
            input_ids[i, :n] = torch.as_tensor(row_ids, dtype=torch.long)
            label_ids[i, :n] = torch.as_tensor(row_labels, dtype=torch.long)
            mask[i, :n] = 1
        return Batch(input_ids, label_ids, mask)


@dataclass(frozen=True)
class RegionData:
    """A region's examples, split into train and held-out eval by a hash of each record."""

    region: str
    root: Path
    files: tuple[str, ...]
    fingerprint: str
    unit: PrivacyUnit  # what the train set is grouped by: record or user
    train: ExampleSet
    eval: ExampleSet
    summary: Summary
    cache: Path  # the tokenised examples in the region's state-path
    tokenised_now: bool  # False: read from the cache

    @property
    def deidentified(self) -> tuple[str, ...]:
        """The entity types scrubbed from the texts the examples were made of."""
        deid = self.summary.deid
        return tuple(deid.identity["entities"]) if deid is not None else ()


def region_fingerprint(data_path: str | Path) -> str:
    """The digest a region's ledger and reports name its data by (its files' bytes)."""
    return data_fingerprint(discover(data_path))


def load_region_data(
    run: RunConfig, node: NodeConfig, tokenizer: PreTrainedTokenizerBase
) -> RegionData:
    """Read, check and tokenise (once) a region's records, then split and group them; the
    split hashes each record's content (stable across runs, duplicates on one side)."""
    root = root_of(node.data_path)
    sources = discover(root)
    data = tokenized(
        sources,
        tokenizer,
        seq_len=run.training.seq_len,
        fields=run.fields,
        state_dir=node.state_dir,
        truncation_side=run.data.truncation_side,
        scrubber=node_scrubber(run.deid, node),
        max_record_bytes=node.record_limit(run),
    )
    summary = data.summary
    # Padding is masked out of attention and loss: any id the model knows will do.
    pad_id = next((i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id) if i is not None), 0)
    if (refusal := bad_rows_refusal(run, node.region, root, summary)) is not None:
        raise DataError(refusal)
    units = _units(run, node.region, root, data)
    held_out = _held_out(data.examples.data.column(BUCKET).to_numpy(), run.data.eval_fraction)
    all_rows = np.arange(data.examples.num_rows)
    train_rows, eval_rows = all_rows[~held_out], all_rows[held_out][: run.data.max_eval_examples]
    if not len(train_rows) or not len(eval_rows):
        which = "training" if not len(train_rows) else "held-out evaluation"
        raise DataError(
            f"region {node.region}: data-path {root} gives {data.examples.num_rows} example(s) "
            f"from {summary.records} record(s), and none for {which} (eval-fraction "
            f"{run.data.eval_fraction:g}); "
            + (
                dropped_for_length(summary, run.training.seq_len, run.data.truncation_side)
                or dropped_for_size(summary)
                or "add records"
            )
        )
    return RegionData(
        region=node.region,
        root=root,
        files=tuple(s.name for s in sources),
        fingerprint=summary.data_fingerprint,
        unit=run.privacy.privacy_unit,
        train=ExampleSet(data.examples, train_rows, units[train_rows], pad_id),
        eval=ExampleSet(data.examples, eval_rows, units[eval_rows], pad_id),
        summary=summary,
        cache=data.folder,
        tokenised_now=data.built,
    )


def _held_out(buckets: np.ndarray, fraction: float) -> np.ndarray:
    """Records whose bucket is below ``fraction``, yet both sides non-empty where records differ."""
    held = buckets < fraction
    if buckets.size and buckets.min() < buckets.max():  # the records differ
        if not held.any():
            held = buckets == buckets.min()
        elif held.all():
            held = buckets < buckets.max()
    return np.asarray(held)


def bad_rows_refusal(run: RunConfig, region: str, root: Path, summary: Summary) -> str | None:
    """Why the region refuses its data for its bad rows (None: it does not)."""
    if not summary.bad_rows or run.data.bad_rows == "skip":
        return None
    return (
        f"region {region}: {summary.bad_rows} bad row(s) in data-path {root}: "
        + "; ".join(summary.bad_reasons[:QUOTED])
        + f'; fix them (`fedciuic data check {root}` lists them) or set bad-rows = "skip"'
    )


def users_refusal(run: RunConfig, region: str, root: Path, summary: Summary) -> str | None:
    """Why the region refuses its data for records that name no user (None: it does not)."""
    if run.privacy.privacy_unit == "record" or not summary.without_user:
        return None
    return (
        f"region {region}: {summary.without_user} record(s) in {root} name no user, e.g. "
        + ", ".join(summary.without_user_where[:QUOTED])
        + f': field {run.fields.user_id_field} missing; privacy-unit = "user" needs it in every '
        "record: add it, set user-id-field to your field's name, or set "
        'privacy-unit = "record"'
    )


def _units(run: RunConfig, region: str, root: Path, data: Tokenized) -> np.ndarray:
    """Each example's privacy unit: its record, or the user the record names."""
    if run.privacy.privacy_unit == "record":
        return np.asarray(data.examples.data.column(RECORD).to_numpy())
    if (refusal := users_refusal(run, region, root, data.summary)) is not None:
        raise DataError(refusal)
    return np.asarray(data.examples.data.column(USER).to_numpy())
