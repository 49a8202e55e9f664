"""Sealing as a stage of the round, present or absent, with both ends in one place.

As with Flower's ``DifferentialPrivacyServerSideFixedClipping``, each end is handed one
object, chosen once from ``seal``, and never asks whether sealing is on: sealed, signatures
are checked and updates travel sealed; clear (a lab run), nothing is signed or checked.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeAlias

import numpy as np

from fedciuic.audit import Event, digest
from fedciuic.crypto import (
    AggregatorKeys,
    EnvelopeRejected,
    Keypair,
    MalformedPayload,
    PublicBundle,
    RegionKeys,
    read_update_payload,
    sign_global,
    sign_run_end,
)
from fedciuic.policy import UNSEALED
from fedciuic.wire import (
    DECLINED,
    JURISDICTION,
    KEY_ID,
    POLICY_HASH,
    SEALED,
    TRAINED,
    UPDATE,
    Instruction,
    MalformedReply,
    Reply,
    RunEndNotice,
    parse_info,
)

Note = Callable[..., None]


# -- the aggregator's end -----------------------------------------------------------------


@dataclass(frozen=True)
class Provenance:
    """Where an update comes from and under what terms (its envelope, or clear reply)."""

    region: str
    jurisdiction: str
    policy_hash: str
    suite: str


@dataclass(frozen=True)
class Received:
    """A trained reply's content; ``metrics`` and ``arrays`` untrusted until parsed."""

    arrays: Mapping[str, np.ndarray]
    metrics: object
    info: dict[str, str]
    header: Provenance


@dataclass(frozen=True)
class SealedReplies:
    """The aggregator's end, sealed: replies signed by their regions, updates sealed to
    the aggregator's key."""

    keys: AggregatorKeys

    @property
    def signer(self) -> str:
        """The key id that signs instructions (hex; "" when nothing is signed)."""
        return self.keys.keypair.bundle.key_id.hex()

    def sign_global(self, run_id: int, task: Instruction, digest: bytes | None = None) -> bytes:
        """The signature over an instruction; ``digest``: its adapter's, when known."""
        keypair, adapter = self.keys.keypair, task.adapter
        return sign_global(
            keypair, run_id, task.server_round, adapter, task.terms, task.witness, digest
        )

    def sign_run_end(self, run_id: int, notice: RunEndNotice) -> bytes:
        return sign_run_end(
            self.keys.keypair, run_id, notice.terms, notice.witness, notice.receipts_digest
        )

    def sender(self, reply: Reply, run_id: int, server_round: int) -> str | None:
        """The region a (non-failed) reply is recorded under, or None when nothing
        names it: raises when a signature names another region."""
        if reply.status == DECLINED and not reply.signature:
            # A region that could not load its keys declines unsigned: recorded under
            # its node (or what the node authenticated as before), its claim noted.
            return None
        sender = self.keys.reply_sender(
            reply.info.get(KEY_ID, ""),
            reply.signature,
            run_id=run_id,
            server_round=server_round,
            fields=reply.signed,
        )
        if sender.party != reply.region:
            raise EnvelopeRejected(
                f"reply names region {reply.region!r} but is signed by {sender.party!r}"
            )
        return sender.party

    def receive(self, reply: Reply, run_id: int, server_round: int, sender: str | None) -> Received:
        """A trained or sealed reply's content, or raises for the wrong kind."""
        if reply.status == TRAINED:
            raise EnvelopeRejected("unsealed update refused")
        if reply.status != SEALED or reply.envelope is None:
            raise MalformedReply(f"status {reply.status!r} in a training reply")
        opened = self.keys.open_update(reply.envelope, run_id=run_id, server_round=server_round)
        if opened.sender.party != sender:
            raise EnvelopeRejected(
                f"envelope sealed by {opened.sender.party!r} in a reply signed by {sender!r}"
            )
        header = Provenance(
            opened.sender.party, opened.sender.jurisdiction, opened.policy_hash, opened.suite
        )
        return Received(opened.arrays, opened.metrics, parse_info(opened.info, TRAINED), header)

    def run_start(self) -> dict[str, Any]:
        """What ``run_start`` records about the keys."""
        return {
            "key_id": self.signer,
            "region_key_ids": {b.party: kid.hex() for kid, b in self.keys.regions.items()},
        }

    def bundles(self) -> dict[str, PublicBundle]:
        """Each region's public bundle (for secure aggregation)."""
        return {b.party: b for b in self.keys.regions.values()}


class ClearReplies:
    """A lab run with ``seal = false``: nothing signed, each reply taken at its word."""

    signer = ""

    def sign_global(self, run_id: int, task: Instruction, digest: bytes | None = None) -> bytes:
        return b""

    def sign_run_end(self, run_id: int, notice: RunEndNotice) -> bytes:
        return b""

    def sender(self, reply: Reply, run_id: int, server_round: int) -> str | None:
        return reply.region

    def receive(self, reply: Reply, run_id: int, server_round: int, sender: str | None) -> Received:
        if reply.status == SEALED:
            raise EnvelopeRejected("sealed update, sealing is off")
        if reply.status != TRAINED:
            raise MalformedReply(f"status {reply.status!r} in a training reply")
        info = reply.info  # parse_reply checked its keys for a trained reply
        header = Provenance(sender or reply.region, info[JURISDICTION], info[POLICY_HASH], UNSEALED)
        return Received(reply.arrays or {}, reply.metrics, info, header)

    def run_start(self) -> dict[str, Any]:
        return {"key_id": None, "region_key_ids": {}}

    def bundles(self) -> dict[str, PublicBundle]:
        return {}


#: The aggregator's end of the sealing stage.
ReplySealing: TypeAlias = SealedReplies | ClearReplies


def aggregator_sealing(keys: AggregatorKeys | None) -> ReplySealing:
    """The aggregator's end: sealed when the run has keys (``seal = true``)."""
    return SealedReplies(keys) if keys is not None else ClearReplies()


# -- the region's end -----------------------------------------------------------------------


@dataclass(frozen=True)
class Sealed:
    """A trained update inside an envelope only the aggregator opens."""

    region: str
    envelope: bytes | bytearray
    key_id: str


@dataclass(frozen=True)
class Clear:
    """A trained update in the clear (``seal = false`` only)."""

    arrays: dict[str, np.ndarray]
    metrics: dict[str, Any]
    info: dict[str, str]


@dataclass(frozen=True)
class SealingRegion:
    """The region's end, sealed: checks the aggregator's signatures, seals updates to its key."""

    keys: RegionKeys

    @property
    def keypair(self) -> Keypair:
        """What signs this region's replies and audit log."""
        return self.keys.keypair

    @property
    def destination(self) -> str:
        """Where the aggregator sits, as its key bundle says."""
        return self.keys.aggregator.jurisdiction

    @property
    def own_jurisdiction(self) -> str:
        """Where this region's key says it is."""
        return self.keys.keypair.bundle.jurisdiction

    def check_global(self, task: Instruction, flower_run: int) -> None:
        self.keys.check_global(
            task.signature,
            task.signer,
            flower_run,
            task.server_round,
            task.adapter,
            task.terms,
            task.witness,
        )

    def check_run_end(self, notice: RunEndNotice, flower_run: int) -> None:
        self.keys.check_run_end(
            notice.signature,
            notice.signer,
            flower_run,
            notice.terms,
            notice.witness,
            notice.receipts_digest,
        )

    def joined(self) -> dict[str, Any]:
        """What ``run_joined`` records about the keys."""
        return {
            "key_id": self.keys.keypair.bundle.key_id.hex(),
            "aggregator_key_id": self.keys.aggregator.key_id.hex(),
        }

    def send(
        self,
        region: str,
        payload: bytes,
        *,
        flower_run: int,
        server_round: int,
        policy_hash: str,
        note: Note,
    ) -> Sealed:
        """The update as it leaves the region, noted in the audit log before it does."""
        envelope = self.keys.seal_update(
            payload, run_id=flower_run, server_round=server_round, policy_hash=policy_hash
        )
        note(
            Event.UPDATE_SEALED,
            region=region,
            digest=digest(envelope),
            bytes=len(envelope),
            suite=self.keys.suite,
            destination=self.keys.aggregator.party,
            destination_jurisdiction=self.destination,
            aggregator_key_id=self.keys.aggregator.key_id.hex(),
            policy_hash=policy_hash,
        )
        return Sealed(region, envelope, self.keys.keypair.bundle.key_id.hex())


@dataclass(frozen=True)
class ClearRegion:
    """A lab run with ``seal = false``: nothing checked, the update sent in the clear."""

    destination: str  # where the run config says the aggregator sits
    keypair: None = None
    own_jurisdiction: None = None

    def check_global(self, task: Instruction, flower_run: int) -> None:
        return None

    def check_run_end(self, notice: RunEndNotice, flower_run: int) -> None:
        return None

    def joined(self) -> dict[str, Any]:
        return {"key_id": None, "aggregator_key_id": None}

    def send(
        self,
        region: str,
        payload: bytes,
        *,
        flower_run: int,
        server_round: int,
        policy_hash: str,
        note: Note,
    ) -> Clear:
        arrays, metrics, info = read_update_payload(payload)
        update = arrays[UPDATE].tobytes()
        note(
            Event.UPDATE_SENT_CLEAR,
            region=region,
            digest=digest(update),
            bytes=len(update),
            suite=UNSEALED,
            destination_jurisdiction=self.destination,
            policy_hash=policy_hash,
        )
        if not isinstance(metrics, dict) or not isinstance(info, dict):
            raise MalformedPayload(f"region {region}: the kept update is not one")
        return Clear(arrays, metrics, info)


#: The region's end of the sealing stage.
RegionSealing: TypeAlias = SealingRegion | ClearRegion
