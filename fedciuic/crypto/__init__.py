"""Everything cryptographic between the parties: X-Wing (``xwing``), the sealed
envelope (``envelope``), key files (``keys``), each party's end of sealing updates and
signing what the aggregator sends (``parties``), and the deployment's TLS and SuperNode
keys (``tls``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedciuic.faces import face

if TYPE_CHECKING:
    from fedciuic.crypto.envelope import EnvelopeRejected, InvalidEnvelope, Suite
    from fedciuic.crypto.keys import (
        NAME_PATTERN,
        KeyFileError,
        Keypair,
        PublicBundle,
        bundle_path,
        load_bundle,
        load_bundles,
        load_keypair,
        write_keys,
    )
    from fedciuic.crypto.parties import (
        AGGREGATOR,
        NONCE_BYTES,
        AggregatorKeys,
        MalformedPayload,
        RegionKeys,
        TaskKind,
        Terms,
        aggregator_keys,
        config_digest,
        model_digest,
        read_update_payload,
        region_keys,
        reply_message,
        sign_global,
        sign_run_end,
        update_payload,
    )
    from fedciuic.crypto.tls import ServerTls, generate_server_tls, generate_supernode_key
    from fedciuic.crypto.xwing import (
        CIPHERTEXT_SIZE,
        PUBLIC_KEY_SIZE,
        XWingPrivateKey,
        XWingPublicKey,
    )

#: What other packages use, and the module each lives in: imported on first use.
_WHERE = {
    "CIPHERTEXT_SIZE": "xwing",
    "PUBLIC_KEY_SIZE": "xwing",
    "XWingPrivateKey": "xwing",
    "XWingPublicKey": "xwing",
    "AGGREGATOR": "parties",
    "AggregatorKeys": "parties",
    "EnvelopeRejected": "envelope",
    "InvalidEnvelope": "envelope",
    "Suite": "envelope",
    "KeyFileError": "keys",
    "Keypair": "keys",
    "MalformedPayload": "parties",
    "NAME_PATTERN": "keys",
    "NONCE_BYTES": "parties",
    "PublicBundle": "keys",
    "RegionKeys": "parties",
    "ServerTls": "tls",
    "TaskKind": "parties",
    "Terms": "parties",
    "aggregator_keys": "parties",
    "bundle_path": "keys",
    "config_digest": "parties",
    "generate_server_tls": "tls",
    "generate_supernode_key": "tls",
    "load_bundle": "keys",
    "load_bundles": "keys",
    "load_keypair": "keys",
    "model_digest": "parties",
    "read_update_payload": "parties",
    "region_keys": "parties",
    "reply_message": "parties",
    "sign_global": "parties",
    "sign_run_end": "parties",
    "update_payload": "parties",
    "write_keys": "keys",
}
__all__ = [
    "AGGREGATOR",
    "CIPHERTEXT_SIZE",
    "NAME_PATTERN",
    "NONCE_BYTES",
    "PUBLIC_KEY_SIZE",
    "AggregatorKeys",
    "EnvelopeRejected",
    "InvalidEnvelope",
    "KeyFileError",
    "Keypair",
    "MalformedPayload",
    "PublicBundle",
    "RegionKeys",
    "ServerTls",
    "Suite",
    "TaskKind",
    "Terms",
    "XWingPrivateKey",
    "XWingPublicKey",
    "aggregator_keys",
    "bundle_path",
    "config_digest",
    "generate_server_tls",
    "generate_supernode_key",
    "load_bundle",
    "load_bundles",
    "load_keypair",
    "model_digest",
    "read_update_payload",
    "region_keys",
    "reply_message",
    "sign_global",
    "sign_run_end",
    "update_payload",
    "write_keys",
]
__getattr__ = face(__name__, _WHERE)
