"""The layout of fedciuic's Flower messages, written and read in one place.

Aggregator to region: ``arrays`` (the global adapter) and ``config``, the signed
:func:`~fedciuic.wire.instruction_fields`. Region to aggregator: ``info`` and ``metrics``,
and ``arrays`` after training: with sealing on one uint8 ``envelope`` holding all else
(``info`` only names the region, status and key id), with sealing off the compressed
``update``. A decline sends no arrays, only its reason.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.app.typing import ConfigRecordValues

from fedciuic.agent import HELLO_RECORD, HELLO_REGION
from fedciuic.wire import (
    ARRAYS,
    CONFIG,
    INFO,
    METRICS,
    Instruction,
    MalformedInstruction,
    MalformedReply,
    Records,
    Reply,
    RunEndNotice,
    failed,
    instruction_fields,
    is_region_name,
    parse_instruction,
    parse_reply,
    parse_run_end,
)

if TYPE_CHECKING:  # torch: never for the relay (a deployed ClientApp)
    from fedciuic.region import RegionReply


def pack_arrays(arrays: Mapping[str, np.ndarray]) -> ArrayRecord:
    return ArrayRecord({name: Array(np.ascontiguousarray(a)) for name, a in arrays.items()})


def unpack_arrays(record: ArrayRecord) -> dict[str, np.ndarray]:
    return {name: array.numpy() for name, array in record.items()}


def _config(values: Mapping[str, str | int | bytes]) -> ConfigRecord:
    return ConfigRecord(dict[str, ConfigRecordValues](values))


def instruction(arrays: ArrayRecord, task: Instruction) -> RecordDict:
    """The global adapter (packed once for every node) and the instruction's fields."""
    return RecordDict({ARRAYS: arrays, CONFIG: _config(instruction_fields(task))})


def read_instruction(message: Message) -> Instruction:
    """The aggregator's instruction, untrusted until its signature is checked."""
    content = message.content
    if CONFIG not in content.config_records or ARRAYS not in content.array_records:
        raise MalformedInstruction("malformed instruction: no config or arrays record")
    return parse_instruction(
        dict(content.config_records[CONFIG]), unpack_arrays(content.array_records[ARRAYS])
    )


def hello_answer(region: str) -> RecordDict:
    """A node's answer to the aggregator's hello: the region it serves."""
    return RecordDict({HELLO_RECORD: _config({HELLO_REGION: region})})


def read_hello(message: Message) -> str | None:
    """The region a node's hello answer names (untrusted), or None when it names none."""
    if message.has_error() or HELLO_RECORD not in message.content.config_records:
        return None
    region = message.content.config_records[HELLO_RECORD].get(HELLO_REGION)
    return region if is_region_name(region) else None


def run_end_notice(notice: RunEndNotice) -> RecordDict:
    return RecordDict({CONFIG: _config(instruction_fields(notice))})


def read_run_end(message: Message) -> RunEndNotice:
    if CONFIG not in message.content.config_records:
        raise MalformedInstruction("malformed run-end notice: no config record")
    return parse_run_end(dict(message.content.config_records[CONFIG]))


def content(records: Records) -> RecordDict:
    """A reply's records as the Flower message content that carries them."""
    packed = RecordDict(
        {METRICS: MetricRecord(dict(records.metrics)), INFO: ConfigRecord(dict(records.info))}
    )
    if records.arrays is not None:
        packed[ARRAYS] = pack_arrays(records.arrays)
    return packed


def region_reply(reply: RegionReply) -> RecordDict:
    """A region's outcome with its audit head and code identity, signed if it can be."""
    from fedciuic.region import region_records

    return content(region_records(reply))


def read_reply(message: Message, node_id: int | None = None) -> Reply:
    """A Flower reply as the plain :class:`Reply` (a Flower error: ``failed``). ``node_id``:
    the node the message went to (an error the SuperLink writes names the SuperLink)."""
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
