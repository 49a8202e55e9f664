"""ClientApp: one region. Reads its Context and Message, calls the region's round
(``fedciuic.rounds.region_round``: checks, policy, training, sealing, the audit
trail, every decline with its reasons) and packs the outcome into the reply: the
head of the region's latest signed audit checkpoint and, with sealing, its signature.
"""

from __future__ import annotations

from flwr.app import Context, Message, RecordDict
from flwr.clientapp import ClientApp

from fedciuic.config import NodeConfig
from fedciuic.errors import FedciuicError
from fedciuic.flower import protocol
from fedciuic.rounds import region_round as rr
from fedciuic.rounds.sealing import Clear, Sealed

app = ClientApp()


def _content(outcome: rr.Outcome) -> RecordDict:
    match outcome:
        case rr.Declined(region, reason):
            return protocol.decline_reply(region, reason)
        case rr.Evaluated(region, stats):
            return protocol.evaluate_reply(region, stats)
        case Sealed(region, envelope, key_id):
            return protocol.sealed_reply(region, envelope, key_id)
        case Clear(arrays, metrics, info):
            return protocol.clear_reply(arrays, metrics, info)
        case rr.Witnessed(region):
            return protocol.witnessed_reply(region)


def _reply(msg: Message, reply: rr.RegionReply) -> Message:
    """The outcome as a Flower reply, carrying the region's audit head, signed."""
    content = _content(reply.outcome)
    if reply.witness is not None:
        content = protocol.add_witness(content, *reply.witness)
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
    return _reply(msg, rr.witness_run_end(run, node, notice, flower_run=context.run_id))


@app.train()
def train(msg: Message, context: Context) -> Message:
    return _round(msg, context, training=True)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    return _round(msg, context, training=False)
