"""The aggregator's checkpoint after every round, and resuming a run from it.

A checkpoint is a folder ``round-NNNN/`` (adapter, server optimiser state, and
``state.json`` with their SHA-256), fsync'ed in full before ``LATEST`` is atomically
pointed at it and older folders are deleted: a process killed at any moment leaves a
loadable ``LATEST``. ``state.sig`` signs the SHA-256 of ``state.json`` (the checkpoint's
identity, which a resumed run signs into every instruction), so whoever can write the
disk but not the key cannot swap or roll back the model unnoticed. A run with keys
resumes only from a checkpoint its key signed.
"""

from __future__ import annotations

import base64
import binascii
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

from fedciuic.aggregator.server_optim import OptimizerState
from fedciuic.config import ADAPTER_MODES, DEFAULT_ADAPTER_MODE, AdapterMode
from fedciuic.crypto import Keypair, PublicBundle
from fedciuic.errors import FedciuicError
from fedciuic.record import Rounds, dump_rounds, parse_rounds

CHECKPOINT_FORMAT = "fedciuic-checkpoint/3"
#: What load_checkpoint reads; only CHECKPOINT_FORMAT is signed.
FORMATS = ("fedciuic-checkpoint/1", "fedciuic-checkpoint/2", CHECKPOINT_FORMAT)
LATEST = "LATEST"
#: A run's checkpoints, inside its output folder (run-<id>/checkpoint/).
CHECKPOINT_DIR = "checkpoint"
ADAPTER = "adapter.safetensors"
OPTIMIZER = "optimizer.safetensors"
STATE = "state.json"
SIGNATURE = "state.sig"
_SIGNED_LABEL = b"fedciuic-checkpoint/3\x00"
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
    #: The run's adapter-mode (older checkpoints were all ``lora``): a resume under
    #: another is refused.
    adapter_mode: AdapterMode = DEFAULT_ADAPTER_MODE
    #: Set when loaded: the SHA-256 of its state.json, and its signer's key id ("": none).
    identity: str = ""
    signer: str = ""


def _signed_message(state: bytes) -> bytes:
    return _SIGNED_LABEL + hashlib.sha256(state).digest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def save_checkpoint(
    directory: Path, checkpoint: Checkpoint, keep: int = 1, keypair: Keypair | None = None
) -> Path:
    """Write ``round-NNNN/`` in full, point ``LATEST`` at it, keep the newest ``keep``."""
    folder = directory / f"round-{checkpoint.round:04d}"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    save_file({k: np.ascontiguousarray(v) for k, v in checkpoint.adapter.items()}, folder / ADAPTER)
    state: dict[str, Any] = {
        "format": CHECKPOINT_FORMAT,
        "federation_run": checkpoint.federation_run,
        "round": checkpoint.round,
        "base_fingerprint": checkpoint.base_fingerprint,
        "adapter_mode": checkpoint.adapter_mode,
        "adapter_sha256": _digest(folder / ADAPTER),
        "audit": {"seq": checkpoint.audit_seq, "head": checkpoint.audit_head},
        "rounds": dump_rounds(checkpoint.rounds),
        "extra": checkpoint.extra,
    }
    written = [folder / ADAPTER]
    if checkpoint.optimizer is not None:
        arrays = {k: np.ascontiguousarray(v) for k, v in checkpoint.optimizer.arrays.items()}
        save_file(arrays, folder / OPTIMIZER)
        state["optimizer"] = {**checkpoint.optimizer.meta(), "sha256": _digest(folder / OPTIMIZER)}
        written.append(folder / OPTIMIZER)
    if keypair is not None:
        state["signer"] = keypair.bundle.key_id.hex()
    body = json.dumps(state, sort_keys=True).encode()
    (folder / STATE).write_bytes(body)
    written.append(folder / STATE)
    if keypair is not None:
        (folder / SIGNATURE).write_text(
            base64.b64encode(keypair.sign(_signed_message(body))).decode() + "\n"
        )
        written.append(folder / SIGNATURE)
    for path in (*written, folder):
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
    """The ``round-NNNN`` folder that ``path`` (a run, ``checkpoint/`` or round folder) names."""
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


def _check_signature(folder: Path, body: bytes, state: Any, signer: PublicBundle) -> None:
    """That ``signer`` (the aggregator's key) signed this state.json as it stands."""
    fmt = state.get("format") if isinstance(state, dict) else None
    if fmt != CHECKPOINT_FORMAT or not state.get("signer"):
        raise CheckpointError(
            f"{folder}: an unsigned checkpoint ({fmt}); a run with keys resumes only from "
            f"one its aggregator's key signed ({CHECKPOINT_FORMAT}): start over, or resume from a "
            "checkpoint this fedciuic wrote"
        )
    try:
        signature = base64.b64decode((folder / SIGNATURE).read_bytes().strip(), validate=True)
    except (OSError, binascii.Error, ValueError) as err:
        why = err.strerror if isinstance(err, OSError) else "not base64"
        raise CheckpointError(
            f"{folder / SIGNATURE}: the checkpoint's signature cannot be read ({why}); "
            f"without it nothing shows who wrote the checkpoint: {_kept(folder.parent)}"
        ) from None
    if state.get("signer") != signer.key_id.hex() or not signer.verify(
        _signed_message(body), signature
    ):
        raise CheckpointError(
            f"{folder}: not signed by this aggregator's key ({signer.key_id.hex()[:16]}): "
            "its files were changed after it was written, or another key wrote it; resume "
            f"from another checkpoint or start over ({_kept(folder.parent)})"
        )


def load_checkpoint(path: Path, signer: PublicBundle | None = None) -> Checkpoint:
    """The checkpoint ``path`` names, checked whole; with ``signer``, only one it signed."""
    folder = checkpoint_folder(path)
    try:
        body = (folder / STATE).read_bytes()
        state = json.loads(body.decode("utf-8"))
    except FileNotFoundError as err:
        raise CheckpointError(
            f"{err.filename}: no checkpoint here (a round folder without state.json); "
            f"{_kept(folder.parent)}"
        ) from None
    except (OSError, ValueError) as err:
        raise CheckpointError(
            f"{folder}: unreadable checkpoint ({err}); {_kept(folder.parent)}"
        ) from None
    if signer is not None:
        _check_signature(folder, body, state, signer)
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
        mode = state.get("adapter_mode", DEFAULT_ADAPTER_MODE)
        if mode not in ADAPTER_MODES:
            raise ValueError(f"adapter_mode {str(mode)[:40]!r} is not one of {ADAPTER_MODES}")
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
            adapter_mode=mode,
            identity=hashlib.sha256(body).hexdigest(),
            signer=str(state.get("signer", "")) if signer is not None else "",
        )
    except (KeyError, TypeError, ValueError, OSError, AttributeError) as err:
        raise CheckpointError(
            f"{folder}: damaged checkpoint ({err}); {_kept(folder.parent)}: resume from "
            "another one or another run folder, or start over"
        ) from None
