"""The region agent: the region's own process, the only one that holds its data, keys,
ledger, policy and audit log (docs/cluster.md). Flower's ClientApp, which the
aggregator ships, relays to it over :mod:`fedciuic.agent.channel`.

``fedciuic agent --config agent.toml`` serves (:func:`~fedciuic.agent.service.serve`);
:class:`~fedciuic.agent.config.AgentConfig` is its file;
:mod:`fedciuic.agent.access` checks that the relay's OS user cannot read the region's
files. Importing this package imports none of them: the relay imports only the channel.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedciuic.faces import face

if TYPE_CHECKING:
    from fedciuic.agent.channel import (
        HELLO,
        HELLO_RECORD,
        HELLO_REGION,
        ChannelError,
        Frame,
        Scalar,
        ask,
    )
    from fedciuic.agent.config import AgentConfig
    from fedciuic.agent.service import AgentError, hello, serve

#: What other packages use, and the module each lives in: imported on first use.
_WHERE = {
    "HELLO": "channel",
    "HELLO_RECORD": "channel",
    "HELLO_REGION": "channel",
    "AgentConfig": "config",
    "AgentError": "service",
    "ChannelError": "channel",
    "Frame": "channel",
    "Scalar": "channel",
    "ask": "channel",
    "hello": "service",
    "serve": "service",
}
__all__ = [
    "HELLO",
    "HELLO_RECORD",
    "HELLO_REGION",
    "AgentConfig",
    "AgentError",
    "ChannelError",
    "Frame",
    "Scalar",
    "ask",
    "hello",
    "serve",
]
__getattr__ = face(__name__, _WHERE)
