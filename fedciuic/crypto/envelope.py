"""Sealed, signed envelopes: only the recipient can open them, and it knows who sealed them.

Layout (big-endian integers; ``docs/envelope.md`` is the reference)::

    header   magic "FCEV" | version 1 | suite | signature suite | sender key id (16)
             | recipient key id (16) | run id (u64) | round (u32)
             | region length (u8) | region (ASCII) | policy hash length (u8) | policy hash
    kem      X-Wing ciphertext (1120)
    payload  length (u64) | AEAD ciphertext
    sig      length (u16) | sender's signature over SHA-256 of everything before it

Suite 1 (default), X-Wing + AES-256-GCM: a fresh X-Wing secret per envelope,
HKDF-SHA256 to a 32-byte key and a 12-byte nonce, the header as associated data.
Suite 2, X-Wing + Fernet: compatibility only (no associated data, AES-128-CBC +
HMAC, base64: about a third larger).

Every integrity failure (any bit changed anywhere, a truncated envelope, an unknown
signer, a wrong key) is one opaque :class:`InvalidEnvelope`, as in Fernet. Envelopes
that are authentic but not acceptable here (another run, round or recipient, a
replay, too large) raise :class:`EnvelopeRejected` with the reason, for the audit log.
"""

from __future__ import annotations

import base64
import hashlib
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from cryptography.exceptions import InvalidTag
from cryptography.fernet import Fernet, InvalidToken
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from fedciuic.crypto.keys import NAME_PATTERN, Keypair, PublicBundle
from fedciuic.crypto.xwing import CIPHERTEXT_SIZE
from fedciuic.errors import FedciuicError

MAGIC = b"FCEV"
VERSION = 1
Suite = Literal["xwing-aes256gcm", "xwing-fernet"]
SUITES: dict[str, int] = {"xwing-aes256gcm": 1, "xwing-fernet": 2}
SIG_SUITES: dict[str, int] = {"ed25519": 1, "ed25519+mldsa65": 2}
SIGNED_LABEL = b"fedciuic-envelope-signature/1\x00"
DEFAULT_MAX_SIZE = 1 << 30
POLICY_HASH_SIZE = 32  # SHA-256; or no policy hash at all
_FIXED = struct.Struct(">4sBBB16s16sQI")  # magic .. round


class InvalidEnvelope(FedciuicError):
    """The envelope is not authentic or not intact (deliberately says no more)."""

    def __init__(self) -> None:
        super().__init__("invalid envelope")


class EnvelopeRejected(FedciuicError):
    """An authentic envelope that is not acceptable here; the message says why."""


@dataclass(frozen=True)
class Header:
    suite: Suite
    signature: str
    sender: bytes
    recipient: bytes
    run_id: int
    round: int
    region: str
    policy_hash: bytes

    def encode(self) -> bytes:
        region = self.region.encode("ascii")
        if len(region) > 255 or len(self.policy_hash) > 255:
            raise ValueError("region and policy hash are at most 255 bytes")
        return (
            _FIXED.pack(
                MAGIC,
                VERSION,
                SUITES[self.suite],
                SIG_SUITES[self.signature],
                self.sender,
                self.recipient,
                self.run_id,
                self.round,
            )
            + bytes([len(region)])
            + region
            + bytes([len(self.policy_hash)])
            + self.policy_hash
        )


@dataclass(frozen=True)
class Opened:
    header: Header
    sender: PublicBundle
    payload: bytes


def _keys(secret: bytes, suite: Suite) -> bytes:
    info = b"fedciuic-envelope/1 " + suite.encode()
    size = 44 if suite == "xwing-aes256gcm" else 32
    return HKDF(algorithm=hashes.SHA256(), length=size, salt=None, info=info).derive(secret)


def _to_sign(prefix: bytes | memoryview) -> bytes:
    return SIGNED_LABEL + hashlib.sha256(prefix).digest()


def seal(
    payload: bytes,
    *,
    sender: Keypair,
    recipient: PublicBundle,
    run_id: int,
    server_round: int,
    region: str,
    policy_hash: bytes = b"",
    suite: Suite = "xwing-aes256gcm",
) -> bytearray:
    """Encrypt ``payload`` to ``recipient`` under a fresh X-Wing secret and sign it.

    The envelope is written into one buffer: AES-GCM encrypts straight into it and
    the signature hashes it in place, so the payload is copied once, by the cipher.
    """
    header = Header(
        suite=suite,
        signature=sender.bundle.signature,
        sender=sender.bundle.key_id,
        recipient=recipient.key_id,
        run_id=run_id,
        round=server_round,
        region=region,
        policy_hash=policy_hash,
    ).encode()
    secret, kem_ct = recipient.xwing.encapsulate()
    keys = _keys(secret, suite)
    token = b""
    if suite == "xwing-aes256gcm":
        body_len = len(payload) + 16
    else:
        token = Fernet(base64.urlsafe_b64encode(keys)).encrypt(payload)
        body_len = len(token)
    sig_size = sender.bundle.signature_size()
    body_at = len(header) + CIPHERTEXT_SIZE + 8
    end = body_at + body_len
    buf = bytearray(end + 2 + sig_size)
    view = memoryview(buf)
    view[: len(header)] = header
    view[len(header) : len(header) + CIPHERTEXT_SIZE] = kem_ct
    struct.pack_into(">Q", buf, body_at - 8, body_len)
    if suite == "xwing-aes256gcm":
        AESGCM(keys[:32]).encrypt_into(keys[32:], payload, header, view[body_at:end])
    else:
        view[body_at:end] = token
    signature = sender.sign(_to_sign(view[:end]))
    struct.pack_into(">H", buf, end, len(signature))
    view[end + 2 :] = signature
    return buf


def parse_header(data: bytes | bytearray) -> tuple[Header, int]:
    """The header and where it ends; :class:`InvalidEnvelope` if it is not one."""
    try:
        magic, version, suite, sig, sender, recipient, run_id, rnd = _FIXED.unpack_from(data)
        pos = _FIXED.size
        region_len = data[pos]
        region = bytes(data[pos + 1 : pos + 1 + region_len]).decode("ascii")
        pos += 1 + region_len
        policy_len = data[pos]
        policy = bytes(data[pos + 1 : pos + 1 + policy_len])
        pos += 1 + policy_len
        if (
            magic != MAGIC
            or version != VERSION
            or policy_len not in (0, POLICY_HASH_SIZE)
            or len(policy) != policy_len
            or not re.fullmatch(NAME_PATTERN, region)
        ):
            raise ValueError
        suite_name = {v: k for k, v in SUITES.items()}[suite]
        sig_name = {v: k for k, v in SIG_SUITES.items()}[sig]
    except (struct.error, IndexError, KeyError, ValueError, UnicodeDecodeError):
        raise InvalidEnvelope() from None
    header = Header(suite_name, sig_name, sender, recipient, run_id, rnd, region, policy)  # type: ignore[arg-type]
    return header, pos


def open_envelope(
    data: bytes | bytearray,
    *,
    recipient: Keypair,
    senders: Mapping[bytes, PublicBundle],
    max_size: int = DEFAULT_MAX_SIZE,
) -> Opened:
    """Verify the signature, then decrypt. Binding checks are the caller's (see
    :class:`Expectation`); the header is authentic once this returns."""
    if len(data) > max_size:
        raise EnvelopeRejected(f"envelope of {len(data)} bytes exceeds the {max_size}-byte limit")
    view = memoryview(data)
    header, header_end = parse_header(data)
    pos = header_end
    try:
        kem_ct = view[pos : pos + CIPHERTEXT_SIZE]
        pos += CIPHERTEXT_SIZE
        (body_len,) = struct.unpack_from(">Q", data, pos)
        pos += 8
        body = view[pos : pos + body_len]
        pos += body_len
        (sig_len,) = struct.unpack_from(">H", data, pos)
        signature = bytes(view[pos + 2 :])
        sender = senders[header.sender]
    except (struct.error, KeyError, OverflowError):
        raise InvalidEnvelope() from None
    if (
        len(kem_ct) != CIPHERTEXT_SIZE
        or len(body) != body_len
        or len(signature) != sig_len
        or SIG_SUITES[sender.signature] != SIG_SUITES[header.signature]
        or not sender.verify(_to_sign(view[:pos]), signature)
    ):
        raise InvalidEnvelope()
    if header.recipient != recipient.bundle.key_id:
        raise EnvelopeRejected(
            f"envelope is for key {header.recipient.hex()}, not this aggregator's "
            f"{recipient.bundle.key_id.hex()}"
        )
    try:
        # A malformed KEM share (an X25519 low-order point, say) fails inside
        # decapsulation: one opaque answer for it too.
        keys = _keys(recipient.xwing.decapsulate(bytes(kem_ct)), header.suite)
        if header.suite == "xwing-aes256gcm":
            payload = AESGCM(keys[:32]).decrypt(keys[32:], body, view[:header_end])
        else:
            payload = Fernet(base64.urlsafe_b64encode(keys)).decrypt(bytes(body))
    except (InvalidTag, InvalidToken, ValueError):
        raise InvalidEnvelope() from None
    return Opened(header, sender, payload)


@dataclass
class Expectation:
    """What the aggregator accepts in one round, and the envelopes it has already seen."""

    run_id: int
    seen: set[tuple[int, int, bytes]]

    def check(self, opened: Opened, server_round: int) -> None:
        h = opened.header
        if h.run_id != self.run_id:
            raise EnvelopeRejected(f"envelope is for run {h.run_id}, this is run {self.run_id}")
        if h.round != server_round:
            raise EnvelopeRejected(f"envelope is for round {h.round}, this is round {server_round}")
        if h.region != opened.sender.party:
            raise EnvelopeRejected(
                f"envelope names region {h.region!r} but is signed by {opened.sender.party!r}"
            )
        key = (h.run_id, h.round, h.sender)
        if key in self.seen:
            raise EnvelopeRejected(f"replay: a second envelope from {h.region} in round {h.round}")
        self.seen.add(key)


__all__ = [
    "EnvelopeRejected",
    "Expectation",
    "Header",
    "InvalidEnvelope",
    "Opened",
    "open_envelope",
    "seal",
]
