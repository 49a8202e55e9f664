"""ClientApp: in a deployment, a relay to the region's own agent; in simulation (lab
mode, one operator owns every process), the region's round in this process.

Deployed, this app is code the aggregator ships in its FAB, so it does nothing a region
must trust: :func:`fedciuic.flower.relay.forward` hands each message to the region's
agent (``fedciuic agent``, started by the region from its own install) and returns the
agent's sealed, signed answer unchanged. Simulated (Flower gave the node a
``partition-id``), :mod:`fedciuic.flower.lab` runs the region's round here.
"""

from __future__ import annotations

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from fedciuic.agent import HELLO
from fedciuic.config import NodeConfig
from fedciuic.crypto import TaskKind
from fedciuic.flower import forward

app = ClientApp()


def _handle(msg: Message, context: Context) -> Message:
    if NodeConfig.is_simulated(context.node_config):
        from fedciuic.flower import lab  # the region's round: torch, data, keys

        return lab.handle(msg, context)
    return forward(msg, context)


@app.train()
def train(msg: Message, context: Context) -> Message:
    return _handle(msg, context)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    return _handle(msg, context)


@app.query()
def query(msg: Message, context: Context) -> Message:
    """The aggregator's run-end notice: the region records its final audit head."""
    return _handle(msg, context)


@app.query(HELLO)
def hello(msg: Message, context: Context) -> Message:
    """Which region this node serves (nothing secret): the aggregator signs each
    instruction for the region it goes to."""
    return _handle(msg, context)


@app.query(TaskKind.SECAGG)
def secure_sum(msg: Message, context: Context) -> Message:
    """One phase of a secure sum (docs/secure-aggregation.md)."""
    return _handle(msg, context)
