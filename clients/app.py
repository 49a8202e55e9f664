"""ClientApp: one region. Reads its Context and Message, calls the region's round
(``fedciuic.rounds.region_round``: checks, policy, training, sealing, the audit
trail, every decline with its reasons) and packs the outcome into the reply: the
head of the region's latest signed audit checkpoint and, with sealing, its signature.

With node config ``trainer = "service"`` the round runs in the region's long-lived
trainer (``fedciuic trainer``, :mod:`fedciuic.cluster.service`) instead of in this
process, which Flower starts anew for every message: the model stays loaded.
"""

from __future__ import annotations

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from fedciuic.cluster import service
from fedciuic.config import NodeConfig
from fedciuic.errors import FedciuicError
from fedciuic.flower import protocol
from fedciuic.rounds import region_round as rr

app = ClientApp()


def _reply(msg: Message, reply: rr.RegionReply) -> Message:
    """The outcome as a Flower reply, carrying the region's audit head, signed."""
    content = protocol.region_reply(reply)
    if reply.keypair is not None:
        content = protocol.sign_reply(
            content, reply.keypair, run_id=reply.flower_run, server_round=reply.server_round
        )
    return Message(content, reply_to=msg)


def _round(msg: Message, context: Context, *, training: bool) -> Message:
    try:
        run, node = rr.read_configs(context.run_config, context.node_config)
        task = protocol.read_instruction(msg)
    except FedciuicError as err:
        return _reply(msg, rr.unreadable(context.run_config, context.node_config, err))
    simulated = NodeConfig.is_simulated(context.node_config)
    if node.trainer == "service":
        request = service.request_for(
            context.run_config,
            context.node_config,
            node,
            task,
            flower_run=context.run_id,
            training=training,
            simulated=simulated,
        )
        return Message(service.delegate(run, node, request), reply_to=msg)
    return _reply(
        msg,
        rr.handle_instruction(
            run, node, task, training=training, flower_run=context.run_id, simulated=simulated
        ),
    )


@app.query()
def query(msg: Message, context: Context) -> Message:
    """The aggregator's run-end notice: record its final audit head, answer with ours."""
    try:
        run, node = rr.read_configs(context.run_config, context.node_config)
        notice = protocol.read_run_end(msg)
    except FedciuicError as err:
        unread = rr.unreadable(context.run_config, context.node_config, err, run_end=True)
        return _reply(msg, unread)
    if node.trainer == "service":
        request = service.request_for(
            context.run_config, context.node_config, node, notice, flower_run=context.run_id
        )
        return Message(service.delegate(run, node, request), reply_to=msg)
    return _reply(msg, rr.witness_run_end(run, node, notice, flower_run=context.run_id))


@app.train()
def train(msg: Message, context: Context) -> Message:
    return _round(msg, context, training=True)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    return _round(msg, context, training=False)
