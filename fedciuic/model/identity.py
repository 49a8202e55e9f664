"""The base model's identity: every party must fine-tune the very same base.

A checkpoint directory is identified by the SHA-256 of its config, weight and
tokenizer files (``config.json``, ``*.safetensors``, ``*.bin``, the index,
``tokenizer.json``, the chat template), each file's
digest cached by path, size, modification time and inode, so that a checkpoint that
has not changed costs a ``stat`` per file instead of a pass over its weights. A preset
is identified by what builds it: its name, config, seed and the torch version whose
random init it uses (its weights are a function of those).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

#: Files whose bytes define a checkpoint's base model and how it reads text.
WEIGHT_SUFFIXES = (".safetensors", ".bin")
CONFIG_FILES = (
    "config.json",
    "model.safetensors.index.json",
    "pytorch_model.bin.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
)
_CHUNK = 16 * 2**20


def cache_dir() -> Path:
    """``$FEDCIUIC_CACHE``, else ``~/.cache/fedciuic``."""
    configured = os.environ.get("FEDCIUIC_CACHE")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "fedciuic"


def checkpoint_files(path: Path) -> list[Path]:
    """The files that define the base model in a checkpoint directory, sorted."""
    return sorted(
        p
        for p in path.iterdir()
        if p.is_file()
        and (p.name in CONFIG_FILES or p.suffix in WEIGHT_SUFFIXES)
        and not p.name.startswith("adapter_")
    )


def checkpoint_fingerprint(path: Path, *, cache: Path | None = None) -> str:
    """SHA-256 over each defining file's name and digest, in name order."""
    store = _DigestCache(cache or cache_dir() / "file-digests.json")
    digest = hashlib.sha256(b"fedciuic-checkpoint-v1\n")
    for file in checkpoint_files(path):
        digest.update(f"{file.name}:{store.digest(file)}\n".encode())
    store.save()
    return digest.hexdigest()


def preset_fingerprint(
    name: str, config: Mapping[str, Any], seed: int, tokenizer: PreTrainedTokenizerBase
) -> str:
    """What builds a preset's weights (name, config, seed, torch's version) and the
    tokenizer it reads text with (trained locally, so it could differ by machine)."""
    vocab = json.dumps(tokenizer.get_vocab(), sort_keys=True)
    described = {
        "preset": name,
        "config": dict(config),
        "seed": seed,
        "torch": torch.__version__,
        "tokenizer": hashlib.sha256(vocab.encode()).hexdigest(),
        "chat_template": getattr(tokenizer, "chat_template", None),
    }
    text = json.dumps(described, sort_keys=True, default=str)
    return hashlib.sha256(b"fedciuic-preset-v1\n" + text.encode()).hexdigest()


def file_digest(file: Path) -> str:
    digest = hashlib.sha256()
    with file.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


class _DigestCache:
    """Digests of files by (path, size, mtime, inode). A cache only: an unreadable or
    stale entry is recomputed, never trusted."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.entries: dict[str, dict[str, Any]] = {}
        self.changed = False
        try:
            loaded = json.loads(path.read_text(encoding="utf-8"))
            if isinstance(loaded, dict):
                self.entries = {k: v for k, v in loaded.items() if isinstance(v, dict)}
        except (OSError, ValueError):
            pass

    def digest(self, file: Path) -> str:
        stat = file.stat()
        key = str(file.resolve())
        stamp = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "inode": stat.st_ino}
        entry = self.entries.get(key, {})
        if all(entry.get(k) == v for k, v in stamp.items()) and isinstance(
            entry.get("sha256"), str
        ):
            return str(entry["sha256"])
        value = file_digest(file)
        self.entries[key] = {**stamp, "sha256": value}
        self.changed = True
        return value

    def save(self) -> None:
        """Atomically; a cache that cannot be written is only slower next time."""
        if not self.changed:
            return
        tmp = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".digests.")
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                json.dump(self.entries, handle, sort_keys=True)
            os.replace(tmp, self.path)
        except OSError:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
