"""The base model's identity: every party must fine-tune the very same base.

A checkpoint by the SHA-256 of its config, weight and tokenizer files; a preset by what
builds it: name, config, seed, and the torch version whose random init it uses.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from fedciuic.digests import DigestCache, cache_dir

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


def checkpoint_files(path: Path) -> list[Path]:
    return sorted(
        p
        for p in path.iterdir()
        if p.is_file()
        and (p.name in CONFIG_FILES or p.suffix in WEIGHT_SUFFIXES)
        and not p.name.startswith("adapter_")
    )


def checkpoint_fingerprint(path: Path, *, cache: Path | None = None) -> str:
    """SHA-256 over each defining file's name and digest, in name order."""
    store = DigestCache(cache or cache_dir() / "file-digests.json")
    digest = hashlib.sha256(b"fedciuic-checkpoint-v1\n")
    for file in checkpoint_files(path):
        digest.update(f"{file.name}:{store.digest(file)}\n".encode())
    store.save()
    return digest.hexdigest()


def preset_fingerprint(
    name: str, config: Mapping[str, Any], seed: int, tokenizer: PreTrainedTokenizerBase
) -> str:
    """What builds a preset's weights, and its tokenizer (trained locally: it may differ)."""
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
