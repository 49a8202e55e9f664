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

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fedciuic.audit.log import AuditError, checkpoint_head
from fedciuic.crypto.keys import Keypair
from fedciuic.errors import FedciuicError
from fedciuic.rounds.wire import (
    AUDIT_COUNT,
    AUDIT_HEAD,
    DECLINED,
    ENVELOPE,
    EVALUATED,
    KEY_ID,
    SEALED,
    WITNESSED,
    Instruction,
    MalformedReply,
    Reply,
    RunEndNotice,
    failed,
    parse_reply,
    sign_info,
)

ARRAYS, CONFIG, METRICS, INFO = "arrays", "config", "metrics", "info"  # the records a message holds

if TYPE_CHECKING:  # torch: not for a ClientApp that hands its rounds to a trainer
    from fedciuic.model.train import EvalStats
    from fedciuic.rounds.region_round import RegionReply


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


def _typed(config: Mapping[str, object], key: str, kind: type, default: object) -> Any:
    value = config.get(key, default)
    if type(value) is not kind:
        raise MalformedInstruction(
            f"malformed instruction: {key}: {kind.__name__} expected, got {type(value).__name__}"
        )
    return value


def _head(config: Mapping[str, object], what: str) -> tuple[int, str]:
    """The aggregator's audit head that an instruction or notice carries."""
    try:
        return checkpoint_head(config.get(AUDIT_COUNT), config.get(AUDIT_HEAD))
    except AuditError as err:
        raise MalformedInstruction(f"malformed {what}: {AUDIT_COUNT}/{AUDIT_HEAD}: {err}") from None


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


def sealed_reply(region: str, envelope: bytes | bytearray, key_id: str) -> RecordDict:
    """A sealed update: the envelope, and in the clear only who sent it."""
    return RecordDict(
        {
            ARRAYS: ArrayRecord({ENVELOPE: Array(np.frombuffer(envelope, dtype=np.uint8))}),
            METRICS: MetricRecord({}),
            INFO: ConfigRecord({"region": region, "status": SEALED, "reason": "", KEY_ID: key_id}),
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


def sign_reply(
    content: RecordDict, keypair: Keypair, *, run_id: int, server_round: int
) -> RecordDict:
    """Add the region's key id and signature to a reply, so that the aggregator records
    it under the region its key names, never under the name it claims."""
    metrics: Mapping[str, object] = content.metric_records.get(METRICS, {})
    sign_info(
        content.config_records[INFO], metrics, keypair, run_id=run_id, server_round=server_round
    )
    return content


def add_witness(content: RecordDict, count: int, head: str) -> RecordDict:
    """Carry the head of the sender's latest signed audit checkpoint."""
    info = content.config_records[INFO]
    info[AUDIT_COUNT], info[AUDIT_HEAD] = count, head
    return content


def region_reply(reply: RegionReply) -> RecordDict:
    """A region's outcome as its Flower reply carries it, with the head of its audit
    log; unsigned (:func:`sign_reply` signs it where the region's key is)."""
    from fedciuic.rounds import region_round as rr
    from fedciuic.rounds.sealing import Clear, Sealed

    content: RecordDict
    match reply.outcome:
        case rr.Declined(region, reason):
            content = decline_reply(region, reason)
        case rr.Evaluated(region, stats):
            content = evaluate_reply(region, stats)
        case Sealed(region, envelope, key_id):
            content = sealed_reply(region, envelope, key_id)
        case Clear(arrays, metrics, info):
            content = clear_reply(arrays, metrics, info)
        case rr.Witnessed(region):
            content = witnessed_reply(region)
    if reply.witness is not None:
        content = add_witness(content, *reply.witness)
    return content


def read_reply(message: Message, node_id: int | None = None) -> Reply:
    """Unpack a Flower reply into the plain :class:`Reply` (``rounds.wire`` validates
    its fields); a Flower error (the region's process failed) is a ``failed`` reply.
    ``node_id``: the node the answered message went to, when known. An error the
    SuperLink writes itself (the node stopped sending heartbeats) names the SuperLink
    as its source, not the node."""
    node_id = message.metadata.src_node_id if node_id is None else node_id
    if message.has_error():
        return failed(node_id, "", message.error.reason or "unknown error")
    content = message.content
    if set(content.config_records) != {INFO} or set(content.metric_records) - {METRICS}:
        raise MalformedReply(
            f"malformed reply: records {sorted(content.config_records)}, "
            f"{sorted(content.metric_records)}; expected info and metrics"
        )
    records = content.array_records
    if set(records) - {ARRAYS}:
        raise MalformedReply(f"malformed reply: array records {sorted(records)}")
    return parse_reply(
        node_id,
        dict(content.config_records[INFO]),
        dict(content.metric_records.get(METRICS) or {}),
        unpack_arrays(records[ARRAYS]) if ARRAYS in records else None,
    )
