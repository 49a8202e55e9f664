"""Everything cryptographic between the parties: X-Wing (``xwing``), the sealed
envelope (``envelope``), key files (``keys``), each party's end of sealing updates and
signing what the aggregator sends (``parties``), and the deployment's TLS and SuperNode
keys (``tls``)."""

from __future__ import annotations

from fedciuic.crypto.envelope import EnvelopeRejected, InvalidEnvelope
from fedciuic.crypto.keys import Keypair, PublicBundle
from fedciuic.crypto.parties import AggregatorKeys, RegionKeys, aggregator_keys, region_keys

__all__ = [
    "AggregatorKeys",
    "EnvelopeRejected",
    "InvalidEnvelope",
    "Keypair",
    "PublicBundle",
    "RegionKeys",
    "aggregator_keys",
    "region_keys",
]
