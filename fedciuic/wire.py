"""What a region's reply says, as plain typed values: the field names both sides use, strict
models of untrusted metrics, and :class:`Reply` (parsed, not yet authenticated). No Flower
here: ``fedciuic.flower.protocol`` packs these into Flower messages."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, TypeGuard

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from fedciuic.audit import AuditError, checkpoint_head
from fedciuic.config import PRIVACY_UNITS, PrivacyUnit
from fedciuic.crypto import (
    NAME_PATTERN,
    NONCE_BYTES,
    Keypair,
    TaskKind,
    Terms,
    config_digest,
    reply_message,
)
from fedciuic.deid import parse_entities
from fedciuic.errors import FedciuicError

TRAINED, EVALUATED, DECLINED, SEALED = "trained", "evaluated", "declined", "sealed"
WITNESSED = "witnessed"  # a region's answer to the run-end notice
#: A region's answer in one phase of a secure sum: the phase's message as the reply's one
#: array, its SHA-256 under the reply's signature.
SECURE = "secure"
SECAGG_REQUEST, SECAGG_ANSWER, SECAGG_DIGEST = "secagg-request", "secagg-answer", "secagg-digest"
FAILED = "failed"  # no usable reply: the region's process failed, or it never answered
REJECTED = "rejected"  # the aggregator's verdict on a reply it refused
NO_REPLY = "no reply within round-timeout"
#: Seconds between two pulls of replies, each a cheap call to the SuperLink (Flower's own: 3 s).
PULL_INTERVAL = 0.2
ENVELOPE, UPDATE = "envelope", "update"
#: The records a message holds (Flower's RecordDict keys; the agent's channel uses the same).
ARRAYS, CONFIG, METRICS, INFO = "arrays", "config", "metrics", "info"
JURISDICTION, POLICY_HASH = "jurisdiction", "policy-hash"
#: A trained reply's info: its privacy unit ("" without DP), adapter-mode (refused unless
#: the run's), and the entity types it scrubbed (comma-separated, "" when off).
PRIVACY_UNIT, ADAPTER_MODE, DEID_ENTITIES = "privacy-unit", "adapter-mode", "deid-entities"
#: A secure round's trained reply: its update's norm, rounded up, to scale the secure sum by.
UPDATE_NORM = "update-norm"
#: Fields a region may add to any reply: its key id and signature, and its audit log's
#: latest signed checkpoint head, as instructions carry the aggregator's.
KEY_ID, SIGNATURE, AUDIT_COUNT, AUDIT_HEAD = "key-id", "signature", "audit-count", "audit-head"
#: Which code made a reply, under its signature: the fedciuic version and code digest.
AGENT_VERSION, AGENT_CODE = "agent-version", "agent-code"


@dataclass(frozen=True)
class Instruction:
    """What the aggregator sends a region each round (untrusted until its signature is
    checked): the global adapter, the task, the run config and a single-use nonce."""

    adapter: dict[str, np.ndarray]
    server_round: int
    base_fingerprint: str
    kind: TaskKind = TaskKind.TRAIN
    run_config: str = "{}"
    nonce: bytes = bytes(NONCE_BYTES)
    signature: bytes = b""
    signer: str = ""
    federation_run: int = 0  # 0: this run started the federation
    witness: tuple[int, str] | None = None
    checkpoint: str = ""  # hex SHA-256 of the checkpoint a resumed run continued from
    recipient: str = ""  # the region it is for (signed): any other refuses it

    @cached_property
    def terms(self) -> Terms:
        """What its signature binds (cached: the config's digest is computed once)."""
        return Terms(
            self.kind,
            config_digest(self.run_config),
            self.nonce,
            self.federation_run,
            self.base_fingerprint,
            bytes.fromhex(self.checkpoint),
            self.recipient,
        )

    def run_settings(self) -> dict[str, Any]:
        return run_settings(self.run_config)


@dataclass(frozen=True)
class RunEndNotice:
    """The aggregator's signed log head after ``run_end``, for each region to record and
    answer, and ``receipts`` (``{region: [[round, digest], ...]}``) of what it received."""

    federation_run: int
    witness: tuple[int, str]
    run_config: str = "{}"
    nonce: bytes = bytes(NONCE_BYTES)
    signature: bytes = b""
    signer: str = ""
    receipts: str = "{}"
    recipient: str = ""

    @property
    def receipts_digest(self) -> bytes:
        return hashlib.sha256(self.receipts.encode()).digest()

    def received(self, region: str) -> set[tuple[int, str]]:
        """The (round, digest) of each update the aggregator received from ``region``."""
        try:
            value = json.loads(self.receipts, parse_constant=_no_constant)
            entries = value.get(region, []) if isinstance(value, dict) else None
            if not isinstance(entries, list):
                raise ValueError("an object of lists expected")
            return {(int(r), str(d)) for r, d in entries}
        except (ValueError, TypeError) as err:
            raise MalformedInstruction(
                f"malformed run-end notice: {RECEIPTS}: {str(err)[:80]}"
            ) from None

    @property
    def kind(self) -> TaskKind:
        return TaskKind.RUN_END

    @cached_property
    def terms(self) -> Terms:
        return Terms(
            self.kind,
            config_digest(self.run_config),
            self.nonce,
            self.federation_run,
            recipient=self.recipient,
        )

    def run_settings(self) -> dict[str, Any]:
        return run_settings(self.run_config)


#: Instruction and notice fields (the config record the aggregator sends).
SERVER_ROUND, FEDERATION_RUN = "server-round", "federation-run"
BASE_FINGERPRINT = "base-fingerprint"
SIGNATURE_FIELD, SIGNER = "model-signature", "aggregator-key-id"
TASK, RUN_CONFIG, NONCE, RECEIPTS = "task", "run-config", "nonce", "receipts"
RECIPIENT = "recipient"
RESUMED_FROM = "resumed-from-checkpoint"
_IDENTITY = re.compile(r"[0-9a-f]{64}")
#: The longest run config (canonical JSON) and receipts (about 100 per region and round).
MAX_RUN_CONFIG = 1 << 16
MAX_RECEIPTS = 1 << 24


class MalformedInstruction(FedciuicError):
    """An instruction that is not what this protocol says (the region declines)."""

    public_reason = True


def run_settings(text: str) -> dict[str, Any]:
    """A run config's canonical JSON as a mapping (a JSON object of scalars)."""
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except ValueError as err:
        raise MalformedInstruction(f"malformed instruction: {RUN_CONFIG}: {err}") from None
    if not isinstance(value, dict) or not all(
        isinstance(v, str | int | float | bool) for v in value.values()
    ):
        raise MalformedInstruction(
            f"malformed instruction: {RUN_CONFIG}: a JSON object of scalars expected"
        )
    return value


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not a number")


def _typed(config: Mapping[str, object], key: str, kind: type, default: object) -> Any:
    value = config.get(key, default)
    if type(value) is not kind:
        raise MalformedInstruction(
            f"malformed instruction: {key}: {kind.__name__} expected, got {type(value).__name__}"
        )
    return value


def _head(config: Mapping[str, object], what: str) -> tuple[int, str]:
    try:
        return checkpoint_head(config.get(AUDIT_COUNT), config.get(AUDIT_HEAD))
    except AuditError as err:
        raise MalformedInstruction(f"malformed {what}: {AUDIT_COUNT}/{AUDIT_HEAD}: {err}") from None


def _terms(config: Mapping[str, object], what: str) -> tuple[TaskKind, str, bytes]:
    try:
        kind = TaskKind(_typed(config, TASK, str, None))
    except ValueError:
        raise MalformedInstruction(
            f"malformed {what}: {TASK}: one of {', '.join(TaskKind)} expected"
        ) from None
    run_config = _typed(config, RUN_CONFIG, str, None)
    nonce = _typed(config, NONCE, bytes, None)
    if len(run_config) > MAX_RUN_CONFIG or len(nonce) != NONCE_BYTES:
        raise MalformedInstruction(
            f"malformed {what}: {RUN_CONFIG} (at most {MAX_RUN_CONFIG} characters) or "
            f"{NONCE} ({NONCE_BYTES} bytes)"
        )
    return kind, run_config, nonce


def is_region_name(value: object) -> TypeGuard[str]:
    """Whether an untrusted value is a party's name."""
    return isinstance(value, str) and re.fullmatch(NAME_PATTERN, value) is not None


def _recipient(config: Mapping[str, object], what: str) -> str:
    recipient = _typed(config, RECIPIENT, str, None)
    if not is_region_name(recipient):
        raise MalformedInstruction(f"malformed {what}: {RECIPIENT}: a region name expected")
    return str(recipient)


def parse_instruction(
    config: Mapping[str, object], adapter: Mapping[str, np.ndarray]
) -> Instruction:
    """An instruction's fields as typed values, untrusted until its signature is checked."""
    server_round = _typed(config, SERVER_ROUND, int, None)
    federation_run = _typed(config, FEDERATION_RUN, int, 0)
    if not 0 <= server_round < 2**32 or not 0 <= federation_run < 2**64:
        raise MalformedInstruction(f"malformed instruction: {SERVER_ROUND} or {FEDERATION_RUN}")
    kind, run_config, nonce = _terms(config, "instruction")
    if kind == TaskKind.RUN_END:
        raise MalformedInstruction(f"malformed instruction: {TASK}: {kind} carries no adapter")
    witness = None
    if AUDIT_COUNT in config or AUDIT_HEAD in config:
        witness = _head(config, "instruction")
    checkpoint = _typed(config, RESUMED_FROM, str, "")
    if checkpoint and not _IDENTITY.fullmatch(checkpoint):
        raise MalformedInstruction(
            f"malformed instruction: {RESUMED_FROM}: a checkpoint identity (64 hex digits)"
        )
    return Instruction(
        adapter=dict(adapter),
        server_round=server_round,
        base_fingerprint=_typed(config, BASE_FINGERPRINT, str, None),
        kind=kind,
        run_config=run_config,
        nonce=nonce,
        signature=_typed(config, SIGNATURE_FIELD, bytes, b""),
        signer=_typed(config, SIGNER, str, ""),
        federation_run=federation_run,
        witness=witness,
        checkpoint=checkpoint,
        recipient=_recipient(config, "instruction"),
    )


def parse_run_end(config: Mapping[str, object]) -> RunEndNotice:
    """A run-end notice's fields as typed values (untrusted until its signature is checked)."""
    kind, run_config, nonce = _terms(config, "run-end notice")
    if kind != TaskKind.RUN_END:
        raise MalformedInstruction(f"malformed run-end notice: {TASK}: {kind}")
    federation_run = _typed(config, FEDERATION_RUN, int, 0)
    if not 0 <= federation_run < 2**64:
        raise MalformedInstruction(f"malformed run-end notice: {FEDERATION_RUN}")
    receipts = _typed(config, RECEIPTS, str, None)
    if len(receipts) > MAX_RECEIPTS:
        raise MalformedInstruction(
            f"malformed run-end notice: {RECEIPTS}: over {MAX_RECEIPTS} characters"
        )
    return RunEndNotice(
        federation_run=federation_run,
        witness=_head(config, "run-end notice"),
        run_config=run_config,
        nonce=nonce,
        signature=_typed(config, SIGNATURE_FIELD, bytes, b""),
        signer=_typed(config, SIGNER, str, ""),
        receipts=receipts,
        recipient=_recipient(config, "run-end notice"),
    )


def instruction_fields(task: Instruction | RunEndNotice) -> dict[str, str | int | bytes]:
    """The inverse of :func:`parse_instruction` / :func:`parse_run_end`."""
    fields: dict[str, str | int | bytes] = {
        FEDERATION_RUN: task.federation_run,
        TASK: str(task.kind),
        RUN_CONFIG: task.run_config,
        NONCE: task.nonce,
        SIGNATURE_FIELD: task.signature,
        SIGNER: task.signer,
        RECIPIENT: task.recipient,
    }
    if isinstance(task, Instruction):
        fields[SERVER_ROUND] = task.server_round
        fields[BASE_FINGERPRINT] = task.base_fingerprint
        if task.checkpoint:
            fields[RESUMED_FROM] = task.checkpoint
    else:
        fields[RECEIPTS] = task.receipts
    if task.witness is not None:
        fields[AUDIT_COUNT], fields[AUDIT_HEAD] = task.witness
    return fields


class MalformedReply(FedciuicError):
    """A reply that is not what this protocol says; the message names the field."""


_OPTIONAL_INFO = frozenset({KEY_ID, SIGNATURE, AUDIT_COUNT, AUDIT_HEAD, AGENT_VERSION, AGENT_CODE})
_BASE_INFO = frozenset({"region", "status", "reason"})
#: The exact info keys of each status (besides the optional ones above).
INFO_KEYS: dict[str, frozenset[str]] = {
    TRAINED: _BASE_INFO
    | {"data-fingerprint", JURISDICTION, POLICY_HASH, PRIVACY_UNIT, ADAPTER_MODE, DEID_ENTITIES},
    SEALED: _BASE_INFO,
    EVALUATED: _BASE_INFO,
    DECLINED: _BASE_INFO,
    WITNESSED: _BASE_INFO,
    SECURE: _BASE_INFO | {SECAGG_DIGEST},
}
_MAX_COUNT = 2**53  # any count above this is not a count


class _Strict(BaseModel):
    """Untrusted numbers: exact types (a bool is no int, a float no int), finite, in range."""

    model_config = ConfigDict(
        strict=True,
        extra="forbid",
        allow_inf_nan=False,
        frozen=True,
        populate_by_name=True,
        alias_generator=lambda name: name.replace("_", "-"),
    )


class PrivacyFigures(_Strict):
    """What a DP region declares it spent and applied; all or none of them. ``unit``
    comes from the reply's info (:data:`PRIVACY_UNIT`), the others from its metrics."""

    unit: PrivacyUnit
    epsilon: float = Field(ge=0)
    epsilon_budget: float = Field(gt=0)
    delta: float = Field(ge=0, lt=1)
    noise_multiplier: float = Field(ge=0)
    sample_rate: float = Field(gt=0, le=1)
    secure_mode: int = Field(ge=0, le=1)
    max_grad_norm: float = Field(gt=0)


class TrainMetrics(_Strict):
    num_examples: int = Field(ge=1, le=_MAX_COUNT)
    #: None when every DP-SGD step of the round drew an empty Poisson batch (noise only).
    train_loss: float | None = Field(default=None, ge=0)
    steps: int = Field(ge=0, le=_MAX_COUNT)
    update_bytes: int = Field(ge=0, le=_MAX_COUNT)
    update_norm: float | None = Field(default=None, ge=0)
    privacy: PrivacyFigures | None = None

    def declared(self) -> dict[str, Any]:
        """Its privacy as the policies check it and the audit log records it (None: no DP)."""
        keys = ("epsilon", "delta", "max_grad_norm", "secure_mode", "unit")
        if self.privacy is None:
            return dict.fromkeys(keys)
        declared = {key: getattr(self.privacy, key) for key in keys}
        declared["secure_mode"] = bool(declared["secure_mode"])
        return declared

    def record(self) -> dict[str, float | int | str]:
        """The figures as metrics.json stores them (privacy keys with underscores)."""
        privacy = self.privacy.model_dump() if self.privacy else {}
        return {k: v for k, v in privacy.items() if k != "max_grad_norm"}


class EvalMetrics(_Strict):
    num_examples: int = Field(ge=1, le=_MAX_COUNT)
    eval_loss: float = Field(ge=0)
    perplexity: float = Field(ge=0)
    #: Seconds of one local DP-SGD step on the region's hardware (absent without DP).
    step_seconds: float | None = Field(default=None, gt=0, le=86_400)


_PRIVACY_KEYS = frozenset(
    f.alias or k for k, f in PrivacyFigures.model_fields.items() if k != "unit"
)
_UNIT: TypeAdapter[PrivacyUnit] = TypeAdapter(PrivacyUnit)


def _problem(err: ValidationError, what: str) -> MalformedReply:
    first = err.errors()[0]
    where = ".".join(str(part) for part in first["loc"]) or what
    more = f" (+{err.error_count() - 1} more)" if err.error_count() > 1 else ""
    return MalformedReply(f"malformed {what}: {where}: {first['msg']}{more}")


def parse_train_metrics(metrics: object, unit: str) -> TrainMetrics:
    """A trained reply's metrics and declared privacy unit: DP figures come with a unit, and
    a unit only with DP figures."""
    if not isinstance(metrics, Mapping):
        raise MalformedReply(f"malformed metrics: an object expected, got {type(metrics).__name__}")
    flat = dict(metrics)
    privacy = {k: flat.pop(k) for k in list(flat) if k in _PRIVACY_KEYS}
    if unit and not privacy:
        raise MalformedReply(
            f"malformed info: {PRIVACY_UNIT}: {unit[:40]!r} declared without DP figures; a "
            'reply without DP declares ""'
        )
    if privacy:
        try:
            privacy["unit"] = _UNIT.validate_python(unit, strict=True)
        except ValidationError:
            raise MalformedReply(
                f"malformed info: {PRIVACY_UNIT}: {unit[:40]!r} is not one of "
                f"{', '.join(PRIVACY_UNITS)}"
            ) from None
    try:
        return TrainMetrics.model_validate(
            {**flat, "privacy": PrivacyFigures.model_validate(privacy) if privacy else None}
        )
    except ValidationError as err:
        raise _problem(err, "metrics") from None


def parse_deid_entities(value: str) -> tuple[str, ...]:
    """A trained reply's declared de-identification (:data:`DEID_ENTITIES`), validated."""
    names = tuple(v for v in value.split(",") if v) if value else ()
    try:
        parsed = parse_entities(names)
    except ValueError as err:
        raise MalformedReply(f"malformed info: {DEID_ENTITIES}: {err}") from None
    if len(parsed) != len(names):
        raise MalformedReply(
            f"malformed info: {DEID_ENTITIES}: {value[:80]!r} repeats or abbreviates entity types"
        )
    return parsed


def parse_eval_metrics(metrics: Mapping[str, object]) -> EvalMetrics:
    try:
        return EvalMetrics.model_validate(dict(metrics))
    except ValidationError as err:
        raise _problem(err, "metrics") from None


def parse_info(info: object, status: str) -> dict[str, str]:
    """A reply's info with exactly the keys its status has; every value a string."""
    if not isinstance(info, Mapping):
        raise MalformedReply(f"malformed info: an object expected, got {type(info).__name__}")
    expected = INFO_KEYS.get(status)
    if expected is None:
        raise MalformedReply(
            f"malformed info: status {str(status)[:32]!r} is not one of {sorted(INFO_KEYS)}"
        )
    keys = set(info)
    if not expected <= keys or keys - expected - _OPTIONAL_INFO:
        raise MalformedReply(
            f"malformed info: keys {sorted(map(str, keys))[:16]}, expected {sorted(expected)}"
        )
    clear = {k: v for k, v in info.items() if k not in (SIGNATURE, AUDIT_COUNT)}
    for key, value in clear.items():
        if not isinstance(value, str) or len(value) > 4096:
            raise MalformedReply(f"malformed info: {key}: a string (at most 4096) expected")
    if not is_region_name(clear["region"]):
        raise MalformedReply(
            f"malformed info: region {clear['region'][:40]!r} is not a region name"
        )
    return {str(k): str(v) for k, v in clear.items()}


@dataclass(frozen=True)
class Records:
    """A reply's content as Flower's records carry it, without Flower."""

    info: dict[str, str | int | bytes]
    metrics: dict[str, int | float] = field(default_factory=dict)
    arrays: dict[str, np.ndarray] | None = None

    def sign(self, keypair: Keypair, *, run_id: int, server_round: int) -> Records:
        info: dict[str, Any] = dict(self.info)
        sign_info(info, self.metrics, keypair, run_id=run_id, server_round=server_round)
        return Records(info, self.metrics, self.arrays)


def declined(region: str, reason: str) -> Records:
    """A normal outcome, not an error: the region says why it sends nothing."""
    return Records({"region": region, "status": DECLINED, "reason": reason}, {"num-examples": 0})


def evaluated(
    region: str,
    num_examples: int,
    loss: float,
    perplexity: float,
    step_seconds: float | None = None,
) -> Records:
    metrics: dict[str, int | float] = {
        "num-examples": num_examples,
        "eval-loss": loss,
        "perplexity": perplexity,
    }
    if step_seconds is not None:
        metrics["step-seconds"] = step_seconds
    return Records({"region": region, "status": EVALUATED, "reason": ""}, metrics)


def witnessed(region: str) -> Records:
    return Records({"region": region, "status": WITNESSED, "reason": ""})


def sealed(region: str, envelope: bytes | bytearray, key_id: str) -> Records:
    """A sealed update: the envelope, and in the clear only who sent it."""
    return Records(
        {"region": region, "status": SEALED, "reason": "", KEY_ID: key_id},
        {},
        {ENVELOPE: np.frombuffer(envelope, dtype=np.uint8)},
    )


def secure_answer(region: str, data: bytes) -> Records:
    """A region's message in one phase of a secure sum."""
    return Records(
        {"region": region, "status": SECURE, "reason": "", SECAGG_DIGEST: digest_of(data)},
        {},
        {SECAGG_ANSWER: np.frombuffer(data, dtype=np.uint8)},
    )


def digest_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def clear(
    arrays: Mapping[str, np.ndarray], metrics: Mapping[str, Any], info: Mapping[str, str]
) -> Records:
    """An update in the clear (``seal = false`` only)."""
    return Records(dict(info), dict(metrics), dict(arrays))


@dataclass(frozen=True)
class Witness:
    """The head of a party's latest signed audit checkpoint, as another party saw it."""

    count: int
    head: str


def _witness(info: Mapping[str, object]) -> Witness | None:
    if AUDIT_COUNT not in info and AUDIT_HEAD not in info:
        return None
    try:
        return Witness(*checkpoint_head(info.get(AUDIT_COUNT), info.get(AUDIT_HEAD)))
    except AuditError as err:
        raise MalformedReply(f"malformed info: {AUDIT_COUNT}/{AUDIT_HEAD}: {err}") from None


@dataclass(frozen=True)
class Reply:
    """A region's reply as the aggregator sees it, parsed but not yet authenticated:
    ``region`` is the name it *claims*."""

    node_id: int
    region: str
    status: str  # trained | sealed | evaluated | declined | witnessed | failed | rejected
    reason: str = ""
    metrics: dict[str, int | float] = field(default_factory=dict)
    info: dict[str, str] = field(default_factory=dict)
    arrays: dict[str, np.ndarray] | None = None
    envelope: bytes | None = None
    signature: bytes = b""
    witness: Witness | None = None
    signed: dict[str, object] = field(default_factory=dict)  # what the signature covers


@dataclass(frozen=True)
class Unread:
    """A reply not parsed yet, read inside the aggregator's per-reply boundary: one that
    cannot be read is rejected alone."""

    node_id: int
    read: Callable[[], Reply]


@dataclass(frozen=True)
class NoReply:
    """A node asked this round that did not answer within ``waited`` s (0: round-timeout)."""

    node_id: int
    waited: float = 0.0


#: What the aggregator's round takes, one per node asked.
Arrival = Reply | Unread | NoReply


def signed_fields(info: Mapping[str, object], metrics: Mapping[str, object]) -> dict[str, object]:
    """What a region's reply signature covers: everything it sends in the clear."""
    return {"info": {k: v for k, v in info.items() if k != SIGNATURE}, "metrics": dict(metrics)}


def sign_info(
    info: MutableMapping[str, Any],
    metrics: Mapping[str, object],
    keypair: Keypair,
    *,
    run_id: int,
    server_round: int,
) -> None:
    """Add the region's key id and signature to ``info``: the aggregator records a reply under
    the region its key names, never the name it claims."""
    info[KEY_ID] = keypair.bundle.key_id.hex()
    info[SIGNATURE] = keypair.sign(
        reply_message(run_id, server_round, signed_fields(info, metrics))
    )


def failed(node_id: int, region: str, reason: str) -> Reply:
    return Reply(node_id, region, FAILED, reason=reason)


def _one_array(arrays: dict[str, np.ndarray] | None, status: str, name: str) -> np.ndarray:
    """The one uint8[n] array a sealed or secure reply carries."""
    array = (arrays or {}).get(name)
    if arrays is None or set(arrays) != {name} or array is None:
        raise MalformedReply(f"malformed reply: a {status} reply carries one array, {name}")
    if array.dtype != np.uint8 or array.ndim != 1:
        raise MalformedReply(f"malformed reply: {name}: uint8[n] expected")
    return array


def parse_reply(
    node_id: int,
    raw_info: Mapping[str, object],
    raw_metrics: Mapping[str, object],
    arrays: Mapping[str, np.ndarray] | None,
) -> Reply:
    """A reply's clear fields and arrays as typed values."""
    info = parse_info(raw_info, str(raw_info.get("status")))
    status = info["status"]
    signature = raw_info.get(SIGNATURE, b"")
    if not isinstance(signature, bytes) or len(signature) > 16384:
        raise MalformedReply("malformed info: signature: bytes expected")
    metrics: dict[str, int | float] = {}
    for key, value in raw_metrics.items():
        if type(value) not in (int, float):
            raise MalformedReply(f"malformed metrics: {key}: a number expected")
        metrics[key] = value  # type: ignore[assignment]
    envelope, clear = None, dict(arrays) if arrays is not None else None
    if status == SEALED:
        envelope, clear = _one_array(clear, status, ENVELOPE).tobytes(), None
    elif status == SECURE:
        if digest_of(_one_array(clear, status, SECAGG_ANSWER).tobytes()) != info[SECAGG_DIGEST]:
            raise MalformedReply(f"malformed reply: {SECAGG_ANSWER} does not match {SECAGG_DIGEST}")
    elif status != TRAINED and clear is not None:
        raise MalformedReply(f"malformed reply: a {status} reply carries no arrays")
    return Reply(
        node_id,
        info["region"],
        info["status"],
        info["reason"],
        metrics,
        info,
        clear,
        envelope,
        signature,
        _witness(raw_info),
        signed_fields(raw_info, metrics),
    )
