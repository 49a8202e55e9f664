"""In-region data: read only the files under a region's own ``data-path``, tokenise locally.

A region's data never leaves its ClientApp; this module is the only place that opens
it. Every file is resolved and checked to lie inside ``data-path`` before it is
opened, so a symlink cannot smuggle another region's data (or anything else) in.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from fedciuic.errors import DataError

#: File types a region may hold: JSON Lines (one ``{"text": ...}`` per line) and plain text.
#: Files and folders whose names start with a dot are not data and are skipped.
SUFFIXES = (".jsonl", ".txt")


@dataclass(frozen=True)
class RegionData:
    """A region's tokenised data: fixed-length blocks, split into train and held-out eval."""

    region: str
    root: Path
    files: tuple[str, ...]
    fingerprint: str
    train: torch.Tensor  # [n_train, seq_len] token ids
    eval: torch.Tensor  # [n_eval, seq_len] token ids


def list_data_files(data_path: str | Path) -> list[Path]:
    """List the region's data files (sorted), refusing anything that resolves outside it."""
    root = Path(data_path).expanduser()
    if not root.is_dir():
        what = "does not exist" if not root.exists() else "is not a directory"
        raise DataError(
            f"data-path {root} {what}; create it with the region's .jsonl/.txt files "
            "(or run `fedciuic demo-data DIR`) and pass it as data-path"
        )
    real_root = root.resolve()
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(real_root, followlinks=False):
        # Hidden entries are not data: the region keeps its state (ledger) in .fedciuic/.
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        filenames = [f for f in filenames if not f.startswith(".")]
        for name in sorted(dirnames) + sorted(filenames):
            entry = Path(dirpath) / name
            if entry.is_symlink() and not entry.resolve().is_relative_to(real_root):
                raise DataError(
                    f"{entry}: links outside data-path {real_root} (to {entry.resolve()}); "
                    "a region reads only its own folder: copy the data in instead"
                )
        found.extend(Path(dirpath) / n for n in filenames if Path(n).suffix in SUFFIXES)
        dirnames.sort()
    if not found:
        raise DataError(
            f"data-path {real_root} holds no {' or '.join(SUFFIXES)} files; add the "
            "region's text there"
        )
    return sorted(found)


def read_documents(path: Path) -> list[str]:
    """Read one file's documents: each JSON Lines record's ``text``, or a whole text file."""
    try:
        with open(path, encoding="utf-8") as handle:
            content = handle.read()
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    except OSError as err:
        raise DataError(f"{path}: cannot read ({err.strerror}); check its permissions") from None
    if path.suffix == ".txt":
        return [content] if content.strip() else []
    docs = []
    for lineno, line in enumerate(content.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{lineno}: invalid JSON ({err.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise DataError(f'{path}:{lineno}: expected an object like {{"text": "..."}}')
        docs.append(record["text"])
    return docs


def load_region_data(
    region: str,
    data_path: str | Path,
    tokenizer: PreTrainedTokenizerBase,
    *,
    seq_len: int,
    eval_fraction: float,
    max_eval_examples: int,
) -> RegionData:
    """Tokenise a region's files into ``seq_len`` blocks and hold out every k-th block.

    The split depends only on the data (block order), so it is the same in every
    round and every run, and evaluation never sees training blocks.
    """
    files = list_data_files(data_path)
    digest = hashlib.sha256()
    ids: list[int] = []
    eos = tokenizer.eos_token_id
    root = Path(data_path).expanduser().resolve()
    for path in files:
        docs = read_documents(path)
        digest.update(f"{path.relative_to(root)}\n".encode())
        for doc in docs:
            digest.update(hashlib.sha256(doc.encode()).digest())
            ids.extend(tokenizer(doc, add_special_tokens=False)["input_ids"])
            if eos is not None:
                ids.append(int(eos))
    n_blocks = len(ids) // seq_len
    if n_blocks < 2:
        raise DataError(
            f"region {region}: data-path {root} has {len(ids)} tokens, fewer than the "
            f"{2 * seq_len} needed for one training and one evaluation block of seq-len "
            f"{seq_len}; add text or lower seq-len"
        )
    blocks = torch.tensor(ids[: n_blocks * seq_len], dtype=torch.long).view(n_blocks, seq_len)
    every = max(2, round(1 / eval_fraction))
    is_eval = (torch.arange(n_blocks) % every) == every - 1
    if not bool(is_eval.any()):
        is_eval[-1] = True
    return RegionData(
        region=region,
        root=root,
        files=tuple(str(p.relative_to(root)) for p in files),
        fingerprint=digest.hexdigest(),
        train=blocks[~is_eval],
        eval=blocks[is_eval][:max_eval_examples],
    )
