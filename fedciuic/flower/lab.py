"""Lab mode: a simulated region's round in the ClientApp's own process.

``fedciuic simulate`` runs every party in one operator's process tree, so the ClientApp
may hold the region's data and keys; a deployment runs each round in the region's agent.
"""

from __future__ import annotations

from flwr.app import Context, Message, MessageType

from fedciuic.config import NodeConfig
from fedciuic.crypto import TaskKind
from fedciuic.errors import FedciuicError
from fedciuic.flower import protocol
from fedciuic.flower.relay import HELLO_MESSAGE, MESSAGE_KINDS
from fedciuic.region import (
    handle_instruction,
    read_configs,
    region_name,
    unreadable,
    witness_run_end,
)
from fedciuic.wire import RunEndNotice


def handle(msg: Message, context: Context) -> Message:
    """The region's reply to one message, packed for Flower."""
    if msg.metadata.message_type == HELLO_MESSAGE:  # which region (as an agent says it)
        region = region_name(context.run_config, context.node_config)
        return Message(protocol.hello_answer(region), reply_to=msg)
    kind = TaskKind(MESSAGE_KINDS[msg.metadata.message_type])
    try:
        task = (
            protocol.read_run_end(msg)
            if msg.metadata.message_type == MessageType.QUERY
            else protocol.read_instruction(msg)
        )
        run, node = read_configs(task, context.node_config)
    except FedciuicError as err:
        unread = unreadable(
            context.run_config, context.node_config, err, run_end=kind == TaskKind.RUN_END
        )
        return Message(protocol.region_reply(unread), reply_to=msg)
    if isinstance(task, RunEndNotice):
        reply = witness_run_end(run, node, task, flower_run=context.run_id)
    else:
        reply = handle_instruction(
            run,
            node,
            task,
            asked=kind,
            flower_run=context.run_id,
            simulated=NodeConfig.is_simulated(context.node_config),
        )
    return Message(protocol.region_reply(reply), reply_to=msg)
