"""The aggregator's checkpoint after every round, and resuming a run from it.

A checkpoint is a folder ``round-NNNN/`` with the global adapter (safetensors) and
``state.json`` (the federation's run id, the round, the base-model fingerprint, the
adapter's SHA-256, the audit log's position, the run's records so far), written and
fsync'ed in full before ``LATEST`` is atomically pointed at it. A process killed at
any moment leaves the previous checkpoint intact. FedAvg over deltas keeps no other
state on the aggregator: no server optimizer, no momentum.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from fedciuic.errors import FedciuicError
from fedciuic.rounds.metrics import Rounds, dump_rounds, parse_rounds

FORMAT = "fedciuic-checkpoint/1"
LATEST = "LATEST"
ADAPTER = "adapter.safetensors"
STATE = "state.json"


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


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def save_checkpoint(directory: Path, checkpoint: Checkpoint) -> Path:
    """Write ``round-NNNN/`` in full, then point ``LATEST`` at it; older rounds go."""
    folder = directory / f"round-{checkpoint.round:04d}"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    save_file({k: np.ascontiguousarray(v) for k, v in checkpoint.adapter.items()}, folder / ADAPTER)
    state = {
        "format": FORMAT,
        "federation_run": checkpoint.federation_run,
        "round": checkpoint.round,
        "base_fingerprint": checkpoint.base_fingerprint,
        "adapter_sha256": _digest(folder / ADAPTER),
        "audit": {"seq": checkpoint.audit_seq, "head": checkpoint.audit_head},
        "rounds": dump_rounds(checkpoint.rounds),
    }
    (folder / STATE).write_text(json.dumps(state, sort_keys=True), encoding="utf-8")
    for path in (folder / ADAPTER, folder / STATE, folder):
        _fsync(path)
    pointer = directory / (LATEST + ".tmp")
    pointer.write_text(folder.name + "\n", encoding="utf-8")
    _fsync(pointer)
    os.replace(pointer, directory / LATEST)
    _fsync(directory)
    for old in directory.glob("round-*"):
        if old != folder:
            shutil.rmtree(old, ignore_errors=True)
    return folder


def load_checkpoint(path: Path) -> Checkpoint:
    """The latest checkpoint under ``path`` (a run folder or its ``checkpoint/``)."""
    directory = path / "checkpoint" if (path / "checkpoint").is_dir() else path
    fix = "point resume-from at a run folder written by fedciuic (runs/run-<id>)"
    try:
        folder = directory / (directory / LATEST).read_text(encoding="utf-8").strip()
        state = json.loads((folder / STATE).read_text(encoding="utf-8"))
    except FileNotFoundError as err:
        raise CheckpointError(f"{err.filename}: no checkpoint here; {fix}") from None
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{directory}: unreadable checkpoint ({err}); {fix}") from None
    try:
        if state["format"] != FORMAT:
            raise ValueError(f"format {state['format']!r}")
        if _digest(folder / ADAPTER) != state["adapter_sha256"]:
            raise ValueError("the adapter does not match its recorded SHA-256")
        adapter = load_file(folder / ADAPTER)
        return Checkpoint(
            federation_run=int(state["federation_run"]),
            round=int(state["round"]),
            base_fingerprint=str(state["base_fingerprint"]),
            adapter=dict(adapter),
            audit_seq=int(state["audit"]["seq"]),
            audit_head=str(state["audit"]["head"]),
            rounds=parse_rounds(state["rounds"]),
        )
    except (KeyError, TypeError, ValueError, OSError) as err:
        raise CheckpointError(
            f"{folder}: damaged checkpoint ({err}); resume from another run folder or start over"
        ) from None
