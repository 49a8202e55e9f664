"""The region agent: the region's own process, the only one that holds its data, keys,
ledger, policy and audit log (docs/cluster.md). Flower's ClientApp, which the
aggregator ships, relays to it over :mod:`fedciuic.agent.channel`.

``fedciuic agent --config agent.toml`` serves (:func:`~fedciuic.agent.service.serve`);
:class:`~fedciuic.agent.config.AgentConfig` is its file;
:mod:`fedciuic.agent.access` checks that the relay's OS user cannot read the region's
files. Importing this package imports none of them: the relay imports only the channel.
"""
