"""Sealing updates and signing the global model, between fedciuic's parties (no Flower).

A region seals its update (the adapter delta as safetensors, metrics in its metadata) to
the aggregator, which accepts it only from a known region's key, for this run and round,
once. The aggregator signs the global adapter it sends down; a region checks that
signature before it trains or evaluates.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from fedciuic.crypto.envelope import (
    Expectation,
    InvalidEnvelope,
    Suite,
    open_envelope,
    seal,
)
from fedciuic.crypto.keys import (
    KeyFileError,
    Keypair,
    PublicBundle,
    bundle_path,
    load_bundle,
    load_bundles,
    load_keypair,
    private_key_path,
    write_keys,
)
from fedciuic.errors import FedciuicError

AGGREGATOR = "aggregator"
#: Version 5: the terms name the recipient region.
GLOBAL_LABEL = b"fedciuic-global-model/5\x00"
RUN_END_LABEL = b"fedciuic-run-end/5\x00"
#: Bytes of an instruction's nonce: each signed instruction is unique, so a region can
#: refuse one it has already been handed (a replay).
NONCE_BYTES = 16


class TaskKind(StrEnum):
    """What an instruction asks a region to do; signed with it, so that a relay cannot
    turn an evaluation into a training round."""

    TRAIN = "train"
    EVALUATE = "evaluate"
    RUN_END = "run-end"
    #: One phase of a secure sum (docs/secure-aggregation.md): the request it carries is
    #: the instruction's one array, under the aggregator's signature.
    SECAGG = "secagg"


_KIND_CODES = {TaskKind.TRAIN: 1, TaskKind.EVALUATE: 2, TaskKind.RUN_END: 3, TaskKind.SECAGG: 4}


@dataclass(frozen=True)
class Terms:
    """What an instruction asks besides the adapter, under the aggregator's signature.
    ``federation_run`` is what the region accounts under (a resumed run keeps the first
    run's id); ``checkpoint``, the SHA-256 of the state a resumed run continued from. The
    recipient is signed because nonces are each agent's own: unsigned, an instruction
    meant for one region could be handed to another."""

    kind: TaskKind
    config_digest: bytes
    nonce: bytes
    federation_run: int = 0
    base_fingerprint: str = ""
    checkpoint: bytes = b""
    recipient: str = ""  # "": addressed to no region, acted on by none

    def encode(self) -> bytes:
        """Kind (u8) | config digest (32) | nonce (16) | federation run (u64) | base
        fingerprint length (u16) and UTF-8 bytes | checkpoint length (u8) and bytes |
        recipient length (u8) and UTF-8 bytes."""
        base = self.base_fingerprint.encode()
        recipient = self.recipient.encode()
        if (
            len(self.config_digest) != 32
            or len(self.nonce) != NONCE_BYTES
            or len(base) > 4096
            or len(self.checkpoint) not in (0, 32)
            or len(recipient) > 255
        ):
            raise ValueError(
                "terms: a 32-byte config digest, a 16-byte nonce, a base fingerprint of "
                "at most 4096 bytes, a checkpoint identity of 0 or 32 bytes and a recipient "
                "of at most 255 bytes expected"
            )
        head = struct.pack(">B", _KIND_CODES[self.kind]) + self.config_digest + self.nonce
        tail = struct.pack(">B", len(self.checkpoint)) + self.checkpoint
        to = struct.pack(">B", len(recipient)) + recipient
        return head + struct.pack(">QH", self.federation_run, len(base)) + base + tail + to


def config_digest(run_config: str) -> bytes:
    """The SHA-256 of a run config's canonical JSON, as an instruction carries it."""
    return hashlib.sha256(run_config.encode()).digest()


def model_digest(arrays: Mapping[str, np.ndarray]) -> bytes:
    """SHA-256 over names, dtypes, shapes and bytes of ``arrays`` in name order."""
    digest = hashlib.sha256()
    for name in sorted(arrays):
        value = np.ascontiguousarray(arrays[name])
        digest.update(f"{name}\x00{value.dtype.str}\x00{value.shape}\x00".encode())
        digest.update(value.tobytes())
    return digest.digest()


def _witness_tail(witness: tuple[int, str] | None) -> bytes:
    """Witness flag (u8), then if 1 the signer's audit checkpoint count (u64) and head (32)."""
    if witness is None:
        return b"\x00"
    return b"\x01" + struct.pack(">Q", witness[0]) + bytes.fromhex(witness[1])


def _global_message(
    run_id: int, server_round: int, digest: bytes, terms: Terms, witness: tuple[int, str] | None
) -> bytes:
    """Label | run id (u64) | round (u32) | model digest (32) | terms | witness."""
    head = GLOBAL_LABEL + struct.pack(">QI", run_id, server_round) + digest
    return head + terms.encode() + _witness_tail(witness)


def sign_global(
    keypair: Keypair,
    run_id: int,
    server_round: int,
    arrays: Mapping[str, np.ndarray],
    terms: Terms,
    witness: tuple[int, str] | None = None,
    digest: bytes | None = None,
) -> bytes:
    """The aggregator's signature over the global adapter, its terms and the head of its
    audit log's latest signed checkpoint; ``digest``, when the caller has it (one
    adapter signed for each region is hashed once)."""
    digest = model_digest(arrays) if digest is None else digest
    return keypair.sign(_global_message(run_id, server_round, digest, terms, witness))


def _run_end_message(run_id: int, terms: Terms, witness: tuple[int, str], receipts: bytes) -> bytes:
    """Label | run id (u64) | terms | receipts digest (32) | the aggregator's audit
    checkpoint count and head."""
    if len(receipts) != 32:
        raise ValueError("run end: a 32-byte receipts digest expected")
    head = RUN_END_LABEL + struct.pack(">Q", run_id) + terms.encode() + receipts
    return head + _witness_tail(witness)


def sign_run_end(
    keypair: Keypair, run_id: int, terms: Terms, witness: tuple[int, str], receipts: bytes
) -> bytes:
    """The aggregator's signature over its log's head once ``run_end`` is in it and over what
    it received from each region (``receipts``): a region learns which releases never arrived."""
    return keypair.sign(_run_end_message(run_id, terms, witness, receipts))


REPLY_LABEL = b"fedciuic-reply/1\x00"


def reply_message(run_id: int, server_round: int, fields: Mapping[str, object]) -> bytes:
    """What a region signs for a reply: run, round and the canonical JSON of its fields."""
    body = json.dumps(fields, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return REPLY_LABEL + struct.pack(">QI", run_id, server_round) + body.encode()


def update_payload(
    arrays: Mapping[str, np.ndarray], metrics: dict[str, Any], info: dict[str, str]
) -> bytes:
    """The plaintext of a sealed update: safetensors, metrics and info in its metadata."""
    metadata = {"metrics": json.dumps(metrics), "info": json.dumps(info)}
    return bytes(st_save({k: np.ascontiguousarray(v) for k, v in arrays.items()}, metadata))


class NotSignedError(FedciuicError):
    """An instruction or notice the aggregator did not sign as it stands: another run,
    round or kind of task, other terms, another key, or altered on the way."""


class Misaddressed(NotSignedError):
    """An instruction or notice the aggregator signed for another region."""


class MalformedPayload(FedciuicError):
    """An opened envelope whose plaintext is not a fedciuic update."""


def read_update_payload(
    payload: bytes | bytearray,
) -> tuple[dict[str, np.ndarray], object, object]:
    """Inverse of :func:`update_payload`, the metrics and info still untrusted;
    :class:`MalformedPayload` unless safetensors with both in its metadata."""
    try:
        payload = bytes(payload)  # safetensors reads only bytes (a no-op for bytes)
        (size,) = struct.unpack_from("<Q", payload)
        metadata = json.loads(payload[8 : 8 + size])["__metadata__"]
        metrics = json.loads(metadata["metrics"])
        info = json.loads(metadata["info"])
        arrays = st_load(payload)
    except Exception as err:
        reason = f"{type(err).__name__}: {str(err)[:200]}"
        raise MalformedPayload(f"sealed payload is not a fedciuic update ({reason})") from None
    return arrays, metrics, info


@dataclass(frozen=True)
class RegionKeys:
    """What a region needs to seal: its own keys and the aggregator's bundle."""

    keypair: Keypair
    aggregator: PublicBundle
    suite: Suite

    def check_global(
        self,
        signature: bytes,
        key_id: str,
        run_id: int,
        server_round: int,
        arrays: Mapping[str, np.ndarray],
        terms: Terms,
        witness: tuple[int, str] | None = None,
    ) -> None:
        """Refuse a global adapter the aggregator did not sign as it stands."""
        message = _global_message(run_id, server_round, model_digest(arrays), terms, witness)
        what = f"the {terms.kind} instruction of round {server_round}"
        self._check(what, terms, message, signature, key_id, f" for run {run_id}; refusing it")

    def _check(
        self, what: str, terms: Terms, message: bytes, signature: bytes, key_id: str, tail: str
    ) -> None:
        """Refuse what the aggregator did not sign as it stands, or signed for another region."""
        me, theirs = self.keypair.bundle.party, self.aggregator.key_id.hex()
        if key_id != theirs or not self.aggregator.verify(message, signature):
            raise NotSignedError(
                f"region {me}: {what} is not signed by the aggregator key {theirs}{tail}"
            )
        if terms.recipient != me:
            raise Misaddressed(
                f"region {me}: {what} is addressed to "
                f"{repr(terms.recipient) if terms.recipient else 'no region'}, not to this "
                "region; refusing it (the relay handed it to the wrong region)"
            )

    def check_run_end(
        self,
        signature: bytes,
        key_id: str,
        run_id: int,
        terms: Terms,
        witness: tuple[int, str],
        receipts: bytes,
    ) -> None:
        """Refuse a run-end notice the aggregator did not sign."""
        message = _run_end_message(run_id, terms, witness, receipts)
        self._check(f"the run-end notice of run {run_id}", terms, message, signature, key_id, "")

    def seal_update(
        self, payload: bytes, *, run_id: int, server_round: int, policy_hash: str = ""
    ) -> bytearray:
        """Seal to the aggregator; the header names the policy the region applied."""
        return seal(
            payload,
            sender=self.keypair,
            recipient=self.aggregator,
            run_id=run_id,
            server_round=server_round,
            region=self.keypair.bundle.party,
            suite=self.suite,
            policy_hash=bytes.fromhex(policy_hash),
        )


def region_keys(
    region: str, *, key_file: str, aggregator_bundle: str, keys_dir: str, suite: Suite
) -> RegionKeys:
    """Load a region's keys from its agent config, or from the run's keys-dir in
    simulation (lab mode: one operator holds every party's keys)."""
    if key_file or aggregator_bundle:
        private, bundle = Path(key_file), Path(aggregator_bundle)
        if not key_file or not aggregator_bundle:
            raise KeyFileError(
                "agent config: set both key-file and aggregator-bundle (sealing needs the "
                "region's private key and the aggregator's public bundle)"
            )
    elif keys_dir:
        private = private_key_path(Path(keys_dir), region)
        bundle = bundle_path(Path(keys_dir), AGGREGATOR)
    else:
        raise KeyFileError(
            f"region {region}: no keys to seal with; name them in the region's agent.toml "
            '(key-file = "/keys/REGION.key.json", aggregator-bundle = '
            '"/keys/aggregator.pub.json")'
        )
    keypair = load_keypair(private)
    if keypair.bundle.party != region:
        raise KeyFileError(
            f"{private}:party: {keypair.bundle.party!r}, but this is region {region!r}"
        )
    return RegionKeys(keypair, load_bundle(bundle), suite)


@dataclass(frozen=True)
class OpenedUpdate:
    """A region's update once opened: its content and the authenticated header facts."""

    arrays: dict[str, np.ndarray]
    metrics: object  # untrusted until validated
    info: object
    sender: PublicBundle
    suite: str
    policy_hash: str  # hex; "" when the region sealed without a policy


@dataclass
class AggregatorKeys:
    """The aggregator's private key, the regions it accepts updates from, and replays seen."""

    keypair: Keypair
    regions: dict[bytes, PublicBundle]
    max_size: int
    seen: set[tuple[int, int, bytes]] = field(default_factory=set)

    def reply_sender(
        self,
        key_id: str,
        signature: bytes,
        *,
        run_id: int,
        server_round: int,
        fields: Mapping[str, object],
    ) -> PublicBundle:
        """The region whose key signed this reply; :class:`InvalidEnvelope` otherwise."""
        try:
            sender = self.regions[bytes.fromhex(key_id)]
            message = reply_message(run_id, server_round, fields)
        except (KeyError, ValueError, TypeError):
            raise InvalidEnvelope() from None
        if not sender.verify(message, signature):
            raise InvalidEnvelope()
        return sender

    def open_update(
        self, envelope: bytes | bytearray, *, run_id: int, server_round: int
    ) -> OpenedUpdate:
        """Verify, bind and decrypt one update; raises with the reason to record."""
        opened = open_envelope(
            envelope, recipient=self.keypair, senders=self.regions, max_size=self.max_size
        )
        Expectation(run_id, self.seen).check(opened, server_round)
        header = opened.header
        return OpenedUpdate(
            *read_update_payload(opened.payload),
            opened.sender,
            header.suite,
            header.policy_hash.hex(),
        )


def generate_federation_keys(
    directory: Path, regions: tuple[str, ...], aggregator_jurisdiction: str = "EU"
) -> Path:
    """Keys for a local federation in one folder (simulation and loopback demos only:
    in a deployment each party generates its own and shares only its bundle)."""
    from fedciuic.jurisdictions import simulated_jurisdiction

    write_keys(Keypair.generate(AGGREGATOR, aggregator_jurisdiction), directory)
    for region in regions:
        write_keys(Keypair.generate(region, simulated_jurisdiction(region)), directory)
    return directory


def aggregator_keys(keys_dir: str, max_size: int) -> AggregatorKeys:
    """The aggregator's keys from ``keys_dir``: ``aggregator.key.json``, the regions' bundles."""
    if not keys_dir:
        raise KeyFileError(
            "run config:keys-dir: empty; sealing needs a folder with aggregator.key.json and "
            "each region's REGION.pub.json (`fedciuic keys generate --party aggregator ...`)"
        )
    folder = Path(keys_dir)
    keypair = load_keypair(private_key_path(folder, AGGREGATOR))
    regions = {kid: b for kid, b in load_bundles(folder).items() if kid != keypair.bundle.key_id}
    if not regions:
        raise KeyFileError(f"{folder}: no region bundles (REGION.pub.json); add each region's")
    return AggregatorKeys(keypair, regions, max_size)
