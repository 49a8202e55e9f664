"""The layout of fedciuic's Flower messages, written and read in one place.

Aggregator to region: ``arrays`` (the global adapter) and ``config``
(``server-round``, ``base-fingerprint``, the aggregator's ``model-signature`` and
``aggregator-key-id``). Region to aggregator, after training: with sealing on,
``arrays`` holds one uint8 array ``envelope`` and ``info`` only the region name,
status ``sealed`` and key id; everything else (the compressed update, metrics,
data fingerprint) is inside the envelope. With sealing off, ``arrays`` holds the
compressed ``update``, with ``metrics`` and ``info`` in the clear. Evaluation
replies carry ``metrics`` and ``info``. A region that declines sends no arrays,
only its reason.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fedciuic.crypto.keys import NAME_PATTERN, Keypair
from fedciuic.crypto.sealing import reply_message
from fedciuic.errors import FedciuicError
from fedciuic.model.train import EvalStats
from fedciuic.policy.rules import LoadedPolicy
from fedciuic.rounds.region import TrainOutcome

ARRAYS, CONFIG, METRICS, INFO = "arrays", "config", "metrics", "info"
TRAINED, EVALUATED, DECLINED, SEALED = "trained", "evaluated", "declined", "sealed"
WITNESSED = "witnessed"  # a region's answer to the run-end notice
ENVELOPE, UPDATE = "envelope", "update"
JURISDICTION, POLICY_HASH, SUITE = "jurisdiction", "policy-hash", "suite"
#: Fields a region may add to any reply: its key id and signature over the reply (with
#: sealing), and the head of its audit log's latest signed checkpoint (witnessing); the
#: aggregator's instructions carry the head of its own log the same way.
KEY_ID, SIGNATURE, AUDIT_COUNT, AUDIT_HEAD = "key-id", "signature", "audit-count", "audit-head"


def pack_arrays(arrays: Mapping[str, np.ndarray]) -> ArrayRecord:
    return ArrayRecord({name: Array(np.ascontiguousarray(a)) for name, a in arrays.items()})


def unpack_arrays(record: ArrayRecord) -> dict[str, np.ndarray]:
    return {name: array.numpy() for name, array in record.items()}


def instruction(
    arrays: ArrayRecord,
    *,
    server_round: int,
    base_fingerprint: str,
    config: ConfigRecord,
    signature: bytes = b"",
    signer: str = "",
    federation_run: int = 0,
    witness: tuple[int, str] | None = None,
) -> RecordDict:
    """What the aggregator sends: the global adapter, signed, and the round's settings.
    ``federation_run`` is the run id that started the federation: a resumed run keeps
    it, so that regions account and cache by it (nothing is released twice).
    ``witness`` is the head of the aggregator's latest signed audit checkpoint, which
    the signature also covers and each region records (docs/audit.md)."""
    merged = ConfigRecord(dict(config))
    merged["server-round"] = server_round
    merged["federation-run"] = federation_run
    merged["base-fingerprint"] = base_fingerprint
    merged["model-signature"] = signature
    merged["aggregator-key-id"] = signer
    if witness is not None:
        merged[AUDIT_COUNT], merged[AUDIT_HEAD] = witness
    return RecordDict({ARRAYS: arrays, CONFIG: merged})


class MalformedInstruction(FedciuicError):
    """An instruction that is not what this protocol says (the region declines)."""


@dataclass(frozen=True)
class Instruction:
    adapter: dict[str, np.ndarray]
    server_round: int
    base_fingerprint: str
    signature: bytes = b""
    signer: str = ""
    federation_run: int = 0  # 0: this run started the federation
    witness: tuple[int, str] | None = None


def _typed(config: Mapping[str, object], key: str, kind: type, default: object) -> Any:
    value = config.get(key, default)
    if type(value) is not kind:
        raise MalformedInstruction(
            f"malformed instruction: {key}: {kind.__name__} expected, got {type(value).__name__}"
        )
    return value


def _head(config: Mapping[str, object], what: str) -> tuple[int, str]:
    """The aggregator's audit head that an instruction or notice carries."""
    count, head = _typed(config, AUDIT_COUNT, int, None), _typed(config, AUDIT_HEAD, str, None)
    if not 0 <= count < 2**63 or not re.fullmatch(r"[0-9a-f]{64}", head):
        raise MalformedInstruction(f"malformed {what}: audit-count/audit-head")
    return count, head


def read_instruction(message: Message) -> Instruction:
    """The aggregator's instruction as typed values (it is untrusted until its
    signature is checked): :class:`MalformedInstruction` says what is wrong."""
    content = message.content
    if CONFIG not in content.config_records or ARRAYS not in content.array_records:
        raise MalformedInstruction("malformed instruction: no config or arrays record")
    config = dict(content.config_records[CONFIG])
    server_round = _typed(config, "server-round", int, None)
    federation_run = _typed(config, "federation-run", int, 0)
    if not 0 <= server_round < 2**32 or not 0 <= federation_run < 2**64:
        raise MalformedInstruction("malformed instruction: server-round or federation-run")
    witness = None
    if AUDIT_COUNT in config or AUDIT_HEAD in config:
        witness = _head(config, "instruction")
    return Instruction(
        adapter=unpack_arrays(content.array_records[ARRAYS]),
        server_round=server_round,
        base_fingerprint=_typed(config, "base-fingerprint", str, None),
        signature=_typed(config, "model-signature", bytes, b""),
        signer=_typed(config, "aggregator-key-id", str, ""),
        federation_run=federation_run,
        witness=witness,
    )


@dataclass(frozen=True)
class RunEndNotice:
    """After ``run_end``: the head of the aggregator's log, signed, for each region to
    record (and answer with its own): the end of a run is witnessed like a round."""

    federation_run: int
    witness: tuple[int, str]
    signature: bytes = b""
    signer: str = ""


def run_end_notice(notice: RunEndNotice) -> RecordDict:
    count, head = notice.witness
    return RecordDict(
        {
            CONFIG: ConfigRecord(
                {
                    "federation-run": notice.federation_run,
                    AUDIT_COUNT: count,
                    AUDIT_HEAD: head,
                    "model-signature": notice.signature,
                    "aggregator-key-id": notice.signer,
                }
            )
        }
    )


def read_run_end(message: Message) -> RunEndNotice:
    if CONFIG not in message.content.config_records:
        raise MalformedInstruction("malformed run-end notice: no config record")
    config = dict(message.content.config_records[CONFIG])
    return RunEndNotice(
        federation_run=_typed(config, "federation-run", int, 0),
        witness=_head(config, "run-end notice"),
        signature=_typed(config, "model-signature", bytes, b""),
        signer=_typed(config, "aggregator-key-id", str, ""),
    )


def witnessed_reply(region: str) -> RecordDict:
    return RecordDict(
        {
            METRICS: MetricRecord({}),
            INFO: ConfigRecord({"region": region, "status": WITNESSED, "reason": ""}),
        }
    )


def train_metrics(outcome: TrainOutcome) -> dict[str, int | float | list[int] | list[float]]:
    metrics: dict[str, int | float | list[int] | list[float]] = {
        "num-examples": outcome.stats.num_examples,
        "train-loss": outcome.stats.loss,
        "steps": outcome.stats.steps,
        "update-bytes": len(outcome.update),
    }
    if outcome.privacy is not None:
        p = outcome.privacy
        metrics.update(
            {
                "epsilon": p.epsilon,
                "epsilon-budget": p.epsilon_budget,
                "delta": p.delta,
                "noise-multiplier": p.noise_multiplier,
                "sample-rate": p.sample_rate,
                "secure-mode": int(p.secure_mode),
                "max-grad-norm": p.max_grad_norm,
            }
        )
    return metrics


def train_info(outcome: TrainOutcome, policy: LoadedPolicy | None = None) -> dict[str, str]:
    """Who trained on what, under which policy (its hash also travels in a sealed header)."""
    return {
        "region": outcome.region,
        "status": TRAINED,
        "reason": "",
        "data-fingerprint": outcome.data_fingerprint,
        JURISDICTION: policy.policy.jurisdiction if policy else "",
        POLICY_HASH: policy.hash if policy else "",
    }


def clear_reply(
    arrays: Mapping[str, np.ndarray], metrics: Mapping[str, Any], info: Mapping[str, str]
) -> RecordDict:
    """An update in the clear (``seal = false`` only)."""
    return RecordDict(
        {
            ARRAYS: pack_arrays(arrays),
            METRICS: MetricRecord(dict(metrics)),
            INFO: ConfigRecord(dict(info)),
        }
    )


def train_reply(outcome: TrainOutcome, policy: LoadedPolicy | None = None) -> RecordDict:
    return clear_reply(
        update_arrays(outcome.update), train_metrics(outcome), train_info(outcome, policy)
    )


def update_arrays(update: bytes) -> dict[str, np.ndarray]:
    """The compressed update as the one array a reply (or sealed payload) carries."""
    return {UPDATE: np.frombuffer(update, dtype=np.uint8)}


def sealed_reply(region: str, envelope: bytes | bytearray, key_id: str) -> RecordDict:
    """A sealed update: the envelope, and in the clear only who sent it."""
    return RecordDict(
        {
            ARRAYS: ArrayRecord({ENVELOPE: Array(np.frombuffer(envelope, dtype=np.uint8))}),
            METRICS: MetricRecord({}),
            INFO: ConfigRecord(
                {"region": region, "status": SEALED, "reason": "", "key-id": key_id}
            ),
        }
    )


def evaluate_reply(region: str, stats: EvalStats) -> RecordDict:
    return RecordDict(
        {
            METRICS: MetricRecord(
                {
                    "num-examples": stats.num_examples,
                    "eval-loss": stats.loss,
                    "perplexity": stats.perplexity,
                }
            ),
            INFO: ConfigRecord({"region": region, "status": EVALUATED, "reason": ""}),
        }
    )


def decline_reply(region: str, reason: str) -> RecordDict:
    """A normal outcome, not an error: the region says why it sends nothing."""
    return RecordDict(
        {
            METRICS: MetricRecord({"num-examples": 0}),
            INFO: ConfigRecord({"region": region, "status": DECLINED, "reason": reason}),
        }
    )


class MalformedReply(FedciuicError):
    """A reply that is not what this protocol says; the message names the field."""


_OPTIONAL_INFO = frozenset({KEY_ID, SIGNATURE, AUDIT_COUNT, AUDIT_HEAD})
_BASE_INFO = frozenset({"region", "status", "reason"})
#: The exact info keys of each status (besides the optional ones above).
INFO_KEYS: dict[str, frozenset[str]] = {
    TRAINED: _BASE_INFO | {"data-fingerprint", JURISDICTION, POLICY_HASH},
    SEALED: _BASE_INFO,
    EVALUATED: _BASE_INFO,
    DECLINED: _BASE_INFO,
    WITNESSED: _BASE_INFO,
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
    """What a DP region declares it spent and applied; all or none of them."""

    epsilon: float = Field(ge=0)
    epsilon_budget: float = Field(gt=0)
    delta: float = Field(ge=0, lt=1)
    noise_multiplier: float = Field(ge=0)
    sample_rate: float = Field(gt=0, le=1)
    secure_mode: int = Field(ge=0, le=1)
    max_grad_norm: float = Field(gt=0)


class TrainMetrics(_Strict):
    num_examples: int = Field(ge=1, le=_MAX_COUNT)
    train_loss: float = Field(ge=0)
    steps: int = Field(ge=0, le=_MAX_COUNT)
    update_bytes: int = Field(ge=0, le=_MAX_COUNT)
    privacy: PrivacyFigures | None = None

    def record(self) -> dict[str, float | int]:
        """The figures as metrics.json stores them (privacy keys with underscores)."""
        privacy = self.privacy.model_dump() if self.privacy else {}
        return {k: v for k, v in privacy.items() if k != "max_grad_norm"}


class EvalMetrics(_Strict):
    num_examples: int = Field(ge=1, le=_MAX_COUNT)
    eval_loss: float = Field(ge=0)
    perplexity: float = Field(ge=0)


class DeclineMetrics(_Strict):
    num_examples: int = Field(ge=0, le=0)


_PRIVACY_KEYS = frozenset(f.alias or k for k, f in PrivacyFigures.model_fields.items())


def _problem(err: ValidationError, what: str) -> MalformedReply:
    first = err.errors()[0]
    where = ".".join(str(part) for part in first["loc"]) or what
    more = f" (+{err.error_count() - 1} more)" if err.error_count() > 1 else ""
    return MalformedReply(f"malformed {what}: {where}: {first['msg']}{more}")


def parse_train_metrics(metrics: object) -> TrainMetrics:
    """A trained reply's metrics (clear, or from inside its envelope), validated."""
    if not isinstance(metrics, Mapping):
        raise MalformedReply(f"malformed metrics: an object expected, got {type(metrics).__name__}")
    flat = dict(metrics)
    privacy = {k: flat.pop(k) for k in list(flat) if k in _PRIVACY_KEYS}
    try:
        return TrainMetrics.model_validate(
            {**flat, "privacy": PrivacyFigures.model_validate(privacy) if privacy else None}
        )
    except ValidationError as err:
        raise _problem(err, "metrics") from None


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
    if not re.fullmatch(NAME_PATTERN, clear["region"]):
        raise MalformedReply(
            f"malformed info: region {clear['region'][:40]!r} is not a region name"
        )
    return {str(k): str(v) for k, v in clear.items()}


@dataclass(frozen=True)
class Witness:
    """The head of a party's latest signed audit checkpoint, as another party saw it."""

    count: int
    head: str


def _witness(info: Mapping[str, object]) -> Witness | None:
    count, head = info.get(AUDIT_COUNT), info.get(AUDIT_HEAD)
    if count is None and head is None:
        return None
    if (
        type(count) is not int
        or not 0 <= count <= _MAX_COUNT
        or not isinstance(head, str)
        or not re.fullmatch(r"[0-9a-f]{64}", head)
    ):
        raise MalformedReply("malformed info: audit-count/audit-head: a count and a SHA-256 hex")
    return Witness(count, head)


@dataclass(frozen=True)
class Reply:
    """A region's reply as the aggregator sees it, parsed but not yet authenticated:
    ``region`` is the name it *claims*."""

    node_id: int
    region: str
    status: str  # trained | sealed | evaluated | declined | failed
    reason: str = ""
    metrics: dict[str, int | float] = field(default_factory=dict)
    info: dict[str, str] = field(default_factory=dict)
    arrays: dict[str, np.ndarray] | None = None
    envelope: bytes | None = None
    signature: bytes = b""
    witness: Witness | None = None
    signed: dict[str, object] = field(default_factory=dict)  # what the signature covers


def signed_fields(info: Mapping[str, object], metrics: Mapping[str, object]) -> dict[str, object]:
    """What a region's reply signature covers: everything it sends in the clear."""
    return {
        "info": {k: v for k, v in info.items() if k != SIGNATURE},
        "metrics": dict(metrics),
    }


def sign_reply(
    content: RecordDict, keypair: Keypair, *, run_id: int, server_round: int
) -> RecordDict:
    """Add the region's key id and signature to a reply, so that the aggregator records
    it under the region its key names, never under the name it claims."""
    info = content.config_records[INFO]
    info[KEY_ID] = keypair.bundle.key_id.hex()
    metrics: Mapping[str, object] = content.metric_records.get(METRICS, {})
    info[SIGNATURE] = keypair.sign(
        reply_message(run_id, server_round, signed_fields(info, metrics))
    )
    return content


def add_witness(content: RecordDict, count: int, head: str) -> RecordDict:
    """Carry the head of the sender's latest signed audit checkpoint."""
    info = content.config_records[INFO]
    info[AUDIT_COUNT], info[AUDIT_HEAD] = count, head
    return content


FAILED = "failed"


def failed(node_id: int, region: str, reason: str) -> Reply:
    return Reply(node_id, region, FAILED, reason=reason)


def read_reply(message: Message) -> Reply:
    """Parse a reply into typed values; :class:`MalformedReply` says what is wrong.
    A Flower error (the region's process failed) is a ``failed`` reply."""
    node_id = message.metadata.src_node_id
    if message.has_error():
        return failed(node_id, "", message.error.reason or "unknown error")
    content = message.content
    if set(content.config_records) != {INFO} or set(content.metric_records) - {METRICS}:
        raise MalformedReply(
            f"malformed reply: records {sorted(content.config_records)}, "
            f"{sorted(content.metric_records)}; expected info and metrics"
        )
    raw_info = dict(content.config_records[INFO])
    status = raw_info.get("status")
    info = parse_info(raw_info, str(status))
    status = info["status"]
    signature = raw_info.get(SIGNATURE, b"")
    if not isinstance(signature, bytes) or len(signature) > 16384:
        raise MalformedReply("malformed info: signature: bytes expected")
    metrics: dict[str, int | float] = {}
    for key, value in (content.metric_records.get(METRICS) or {}).items():
        if type(value) not in (int, float):
            raise MalformedReply(f"malformed metrics: {key}: a number expected")
        metrics[key] = value  # type: ignore[assignment]
    records = content.array_records
    if set(records) - {ARRAYS}:
        raise MalformedReply(f"malformed reply: array records {sorted(records)}")
    arrays = unpack_arrays(records[ARRAYS]) if ARRAYS in records else None
    envelope = None
    if status == SEALED:
        if arrays is None or set(arrays) != {ENVELOPE}:
            raise MalformedReply("malformed reply: a sealed reply carries one array, envelope")
        sealed = arrays[ENVELOPE]
        if sealed.dtype != np.uint8 or sealed.ndim != 1:
            raise MalformedReply("malformed reply: envelope: uint8[n] expected")
        envelope, arrays = sealed.tobytes(), None
    elif status != TRAINED and arrays is not None:
        raise MalformedReply(f"malformed reply: a {status} reply carries no arrays")
    return Reply(
        node_id,
        info["region"],
        info["status"],
        info["reason"],
        metrics,
        info,
        arrays,
        envelope,
        signature,
        _witness(raw_info),
        signed_fields(raw_info, metrics),
    )
