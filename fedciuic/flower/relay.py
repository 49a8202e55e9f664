"""A deployed region's ClientApp is a relay: the message to the region's agent, the
agent's answer back, unchanged.

The aggregator ships the ClientApp, so a region trusts none of it: it reads one node-config
key (:data:`AGENT`, the agent's socket), holds no key, imports no torch, and refuses a node
config that names the region's data, state or keys. The agent checks everything; a hostile
relay can only fail to deliver.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import cast

from flwr.app import ConfigRecord, Context, Error, Message, MessageType, MetricRecord, RecordDict
from flwr.app.typing import ConfigRecordValues

from fedciuic.agent import HELLO, ChannelError, Frame, Scalar, ask
from fedciuic.crypto import TaskKind
from fedciuic.flower.protocol import pack_arrays, unpack_arrays
from fedciuic.wire import ARRAYS

#: The one node-config key a deployed region's SuperNode carries: the agent's socket.
AGENT = "agent"
#: A secure sum's phases travel as Flower queries of their own action.
SECAGG_MESSAGE = f"{MessageType.QUERY}.{TaskKind.SECAGG}"
#: The aggregator asking a node which region it serves (the agent's unsigned ``hello``).
HELLO_MESSAGE = f"{MessageType.QUERY}.{HELLO}"
#: What each Flower message type asks the agent (the kinds of task it verifies).
MESSAGE_KINDS = {
    MessageType.TRAIN: TaskKind.TRAIN,
    MessageType.EVALUATE: TaskKind.EVALUATE,
    MessageType.QUERY: TaskKind.RUN_END,
    SECAGG_MESSAGE: TaskKind.SECAGG,
}
#: The Flower error code of a message the relay could not deliver.
UNDELIVERED = 1
_DEFAULT_WAIT = 600.0
#: Node-config keys that hand the ClientApp what only the region's agent may hold.
_REGION_KEYS = ("region", "data-path", "state-path", "key-file", "policy", "trainer")


class RelayError(Exception):
    """The relay cannot reach its agent, or its node config is not a relay's."""


def agent_socket(node_config: dict[str, object]) -> Path:
    """The agent's socket from the node config, and nothing else from it."""
    held = [k for k in _REGION_KEYS if k in node_config]
    if held:
        raise RelayError(
            f"node config: {', '.join(held)}: a deployed region's ClientApp holds no data, "
            "state or keys (it is code the aggregator ships); start the region's agent "
            f"(fedciuic agent --config agent.toml) and give the SuperNode --node-config "
            f"\"{AGENT}='/path/to/agent.sock'\""
        )
    value = node_config.get(AGENT)
    if not isinstance(value, str) or not value:
        raise RelayError(
            f"node config: {AGENT}: missing; start the SuperNode with --node-config "
            f"\"{AGENT}='/path/to/agent.sock'\" (the region's agent socket)"
        )
    return Path(value)


def _wait(context: Context) -> float:
    """How long to wait for the agent: the run's round-timeout (the agent enforces it)."""
    value = context.run_config.get("round-timeout", _DEFAULT_WAIT)
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return max(float(value), 1.0)
    return _DEFAULT_WAIT


def request(message: Message, run_id: int) -> Frame:
    """The message as the agent reads it: kind, run id, config records, arrays."""
    content = message.content
    records = content.array_records.values()
    arrays = {k: v for r in records for k, v in unpack_arrays(r).items()} if records else None
    message_type = message.metadata.message_type
    kind = HELLO if message_type == HELLO_MESSAGE else MESSAGE_KINDS.get(message_type, message_type)
    return Frame(
        meta={"kind": str(kind), "flower-run": run_id},
        config={
            name: cast(dict[str, Scalar], dict(record))
            for name, record in content.config_records.items()
        },
        arrays=arrays,
    )


def reply_content(answer: Frame) -> RecordDict:
    """The agent's answer as Flower message content, record for record."""
    content = RecordDict()
    for name, values in answer.config.items():
        content[name] = ConfigRecord(cast(dict[str, ConfigRecordValues], dict(values)))
    for name, numbers in answer.metrics.items():
        content[name] = MetricRecord(dict(numbers))
    if answer.arrays is not None:
        content[ARRAYS] = pack_arrays(answer.arrays)
    return content


def forward(message: Message, context: Context) -> Message:
    """The agent's answer to ``message``, or a Flower error saying why there is none."""
    try:
        socket_path = agent_socket(dict(context.node_config))
        answer = ask(socket_path, request(message, context.run_id), timeout=_wait(context))
    except (RelayError, ChannelError) as err:
        return Message(Error(UNDELIVERED, f"relay: {err}"), reply_to=message)
    if answer.error:
        return Message(Error(UNDELIVERED, f"agent: {answer.error}"), reply_to=message)
    return Message(reply_content(answer), reply_to=message)
