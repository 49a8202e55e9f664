"""ClientApp: one region. Reads its Context, calls fedciuic, packs the reply.

Expected problems (bad data path, unknown region, mismatched base model) become a
decline with the reason; the aggregator records it and goes on with the others.
"""

from __future__ import annotations

from logging import WARNING

from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.supercore import log

from fedciuic.config import NodeConfig, RunConfig
from fedciuic.errors import FedciuicError
from fedciuic.flower import protocol
from fedciuic.region import Region, open_region

app = ClientApp()


def _region(context: Context) -> Region:
    run = RunConfig.from_user_config(context.run_config, source="run config")
    return open_region(run, NodeConfig.resolve(context.node_config, run))


def _name(context: Context) -> str:
    """The region's name for a decline, even when its config is broken."""
    node = context.node_config
    try:
        run = RunConfig.from_user_config(context.run_config, source="run config")
        return NodeConfig.resolve(node, run).region
    except FedciuicError:
        return str(node.get("region") or f"partition-{node.get('partition-id', '?')}")


def _decline(msg: Message, context: Context, err: FedciuicError) -> Message:
    log(WARNING, "fedciuic: region declines: %s", err)
    return Message(protocol.decline_reply(_name(context), str(err)), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    try:
        region = _region(context)
        task = protocol.read_instruction(msg)
        outcome = region.train_round(
            task.adapter,
            server_round=task.server_round,
            base_fingerprint=task.base_fingerprint,
            run_id=context.run_id,
        )
    except FedciuicError as err:
        return _decline(msg, context, err)
    return Message(protocol.train_reply(outcome), reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    try:
        region = _region(context)
        task = protocol.read_instruction(msg)
        stats = region.evaluate(task.adapter, base_fingerprint=task.base_fingerprint)
    except FedciuicError as err:
        return _decline(msg, context, err)
    return Message(protocol.evaluate_reply(region.name, stats), reply_to=msg)
