"""The aggregator's checkpoint after every round, and resuming a run from it.

A checkpoint is a folder ``round-NNNN/`` with the global adapter and the server
optimiser's state (two safetensors files) and ``state.json`` (the federation's run
id, the round, the base-model fingerprint, both files' SHA-256, the optimiser's name
and hyperparameters, the audit log's position, the run's records so far, and an
opaque ``extra`` dict the aggregator fills), written and fsync'ed in full before
``LATEST`` is atomically pointed at it. Only then are folders beyond the newest
``keep`` deleted (never the one ``LATEST`` names): a process killed at any moment
leaves a loadable ``LATEST``.

``fedciuic-checkpoint/1`` folders (no optimiser state, no ``extra``) still load,
with ``optimizer = None``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load_file, save_file

from fedciuic.errors import FedciuicError
from fedciuic.rounds.metrics import Rounds, dump_rounds, parse_rounds
from fedciuic.server_optim import OptimizerState

FORMAT = "fedciuic-checkpoint/2"
FORMATS = ("fedciuic-checkpoint/1", FORMAT)  # what load_checkpoint reads
LATEST = "LATEST"
#: A run's checkpoints, inside its output folder (run-<id>/checkpoint/).
CHECKPOINT_DIR = "checkpoint"
ADAPTER = "adapter.safetensors"
OPTIMIZER = "optimizer.safetensors"
STATE = "state.json"
_ROUND = re.compile(r"round-(\d{4,})")


class CheckpointError(FedciuicError):
    """A checkpoint is missing, damaged, or belongs to another model."""


@dataclass(frozen=True)
class Checkpoint:
    federation_run: int  # the run id of the run that started the federation
    round: int  # the last round completed
    base_fingerprint: str
    adapter: dict[str, np.ndarray]
    audit_seq: int  # records in the aggregator's audit log when the checkpoint was taken
    audit_head: str
    rounds: Rounds  # metrics.json "rounds" so far
    optimizer: OptimizerState | None = None  # None: a /1 checkpoint (none had state)
    extra: dict[str, Any] = field(default_factory=dict)  # the aggregator's, JSON, as-is


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def save_checkpoint(directory: Path, checkpoint: Checkpoint, keep: int = 1) -> Path:
    """Write ``round-NNNN/`` in full, then point ``LATEST`` at it; then only the newest
    ``keep`` rounds up to this one stay."""
    folder = directory / f"round-{checkpoint.round:04d}"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    save_file({k: np.ascontiguousarray(v) for k, v in checkpoint.adapter.items()}, folder / ADAPTER)
    state: dict[str, Any] = {
        "format": FORMAT,
        "federation_run": checkpoint.federation_run,
        "round": checkpoint.round,
        "base_fingerprint": checkpoint.base_fingerprint,
        "adapter_sha256": _digest(folder / ADAPTER),
        "audit": {"seq": checkpoint.audit_seq, "head": checkpoint.audit_head},
        "rounds": dump_rounds(checkpoint.rounds),
        "extra": checkpoint.extra,
    }
    written = [folder / ADAPTER]
    if checkpoint.optimizer is not None:
        arrays = {k: np.ascontiguousarray(v) for k, v in checkpoint.optimizer.arrays.items()}
        save_file(arrays, folder / OPTIMIZER)
        state["optimizer"] = {
            **checkpoint.optimizer.meta(),
            "sha256": _digest(folder / OPTIMIZER),
        }
        written.append(folder / OPTIMIZER)
    (folder / STATE).write_text(json.dumps(state, sort_keys=True), encoding="utf-8")
    for path in (*written, folder / STATE, folder):
        _fsync(path)
    pointer = directory / (LATEST + ".tmp")
    pointer.write_text(folder.name + "\n", encoding="utf-8")
    _fsync(pointer)
    os.replace(pointer, directory / LATEST)
    _fsync(directory)
    kept = [r for r in kept_rounds(directory) if r <= checkpoint.round][-keep:]
    for old in directory.glob("round-*"):
        number = _round_of(old)
        if old != folder and (number is None or number not in kept):
            shutil.rmtree(old, ignore_errors=True)
    return folder


def _round_of(path: Path) -> int | None:
    match = _ROUND.fullmatch(path.name)
    return int(match.group(1)) if match else None


def kept_rounds(directory: Path) -> list[int]:
    """The round numbers of the ``round-NNNN`` folders under ``directory``, ascending."""
    if not directory.is_dir():
        return []
    found = (_round_of(p) for p in directory.iterdir() if p.is_dir())
    return sorted(n for n in found if n is not None)


def _kept(directory: Path) -> str:
    rounds = kept_rounds(directory)
    names = ", ".join(f"round-{n:04d}" for n in rounds) or "none"
    return f"kept rounds in {directory}: {names}"


def checkpoint_folder(path: Path) -> Path:
    """The ``round-NNNN`` folder that ``path`` names: a run folder (its ``checkpoint/``
    ``LATEST``), a ``checkpoint/`` folder (its ``LATEST``), or a round folder itself."""
    fix = "point resume-from at a run folder written by fedciuic (runs/run-<id>)"
    if (path / STATE).is_file() or _round_of(path) is not None:
        if not path.is_dir():
            raise CheckpointError(f"{path}: no such checkpoint; {_kept(path.parent)}")
        return path
    directory = path / "checkpoint" if (path / "checkpoint").is_dir() else path
    try:
        name = (directory / LATEST).read_text(encoding="utf-8").strip()
    except FileNotFoundError as err:
        raise CheckpointError(f"{err.filename}: no checkpoint here; {fix}") from None
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{directory}: unreadable checkpoint ({err}); {fix}") from None
    if _round_of(Path(name)) is None or Path(name).name != name:
        raise CheckpointError(f"{directory / LATEST}: names {name[:80]!r}, not a round folder")
    return directory / name


def load_checkpoint(path: Path) -> Checkpoint:
    """The checkpoint ``path`` names (see :func:`checkpoint_folder`), checked whole."""
    folder = checkpoint_folder(path)
    try:
        state = json.loads((folder / STATE).read_text(encoding="utf-8"))
    except FileNotFoundError as err:
        raise CheckpointError(
            f"{err.filename}: no checkpoint here (a round folder without state.json); "
            f"{_kept(folder.parent)}"
        ) from None
    except (OSError, ValueError) as err:
        raise CheckpointError(
            f"{folder}: unreadable checkpoint ({err}); {_kept(folder.parent)}"
        ) from None
    try:
        if not isinstance(state, dict) or state.get("format") not in FORMATS:
            fmt = state.get("format") if isinstance(state, dict) else None
            raise ValueError(f"format {fmt!r}, expected one of {', '.join(FORMATS)}")
        if _digest(folder / ADAPTER) != state["adapter_sha256"]:
            raise ValueError("the adapter does not match its recorded SHA-256")
        adapter = load_file(folder / ADAPTER)
        optimizer = None
        if "optimizer" in state:
            meta = state["optimizer"]
            if _digest(folder / OPTIMIZER) != meta["sha256"]:
                raise ValueError("the optimizer state does not match its recorded SHA-256")
            optimizer = OptimizerState(
                name=str(meta["name"]),
                hyperparameters={k: float(v) for k, v in meta["hyperparameters"].items()},
                steps=int(meta["steps"]),
                layout=str(meta["layout"]),
                size=int(meta["size"]),
                arrays=dict(load_file(folder / OPTIMIZER)),
            )
        extra = state.get("extra", {})
        if not isinstance(extra, dict):
            raise ValueError(f"extra is a {type(extra).__name__}, not an object")
        return Checkpoint(
            federation_run=int(state["federation_run"]),
            round=int(state["round"]),
            base_fingerprint=str(state["base_fingerprint"]),
            adapter=dict(adapter),
            audit_seq=int(state["audit"]["seq"]),
            audit_head=str(state["audit"]["head"]),
            rounds=parse_rounds(state["rounds"]),
            optimizer=optimizer,
            extra=extra,
        )
    except (KeyError, TypeError, ValueError, OSError, AttributeError) as err:
        raise CheckpointError(
            f"{folder}: damaged checkpoint ({err}); {_kept(folder.parent)}: resume from "
            "another one or another run folder, or start over"
        ) from None
