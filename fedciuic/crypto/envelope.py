"""Sealed, signed envelopes: only the recipient can open them, and it knows who sealed them.

Layout: ``docs/envelope.md``. Suite 1 (default), X-Wing + AES-256-GCM, seals chunks, each
under a nonce of its index and a final flag with the header as associated data, so order
and truncation are authenticated; the signature covers the header, the KEM ciphertext and
each chunk's SHA-256, binding the exact ciphertext (GCM alone does not, for the recipient
who holds its key). Chunks are encrypted and hashed while in cache, on a small thread pool
(AES-GCM and ``hashlib`` release the GIL). Suite 2, X-Wing + Fernet, is for compatibility
only. Version 1 envelopes still open; :func:`seal` writes version 2.

Every integrity failure (any bit changed, truncation, an unknown signer, a wrong key) is
one opaque :class:`InvalidEnvelope`, as in Fernet; an authentic envelope not acceptable
here (another run, round or recipient, a replay, too large) raises
:class:`EnvelopeRejected` with the reason, for the audit log.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import struct
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal, TypeVar

from cryptography.exceptions import InvalidTag
from cryptography.fernet import Fernet, InvalidToken
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from fedciuic.crypto.keys import NAME_PATTERN, Keypair, PublicBundle
from fedciuic.crypto.xwing import CIPHERTEXT_SIZE
from fedciuic.errors import FedciuicError

ENVELOPE_MAGIC = b"FCEV"
VERSION = 2
READABLE_VERSIONS = (1, 2)
Suite = Literal["xwing-aes256gcm", "xwing-fernet"]
SUITES: dict[Suite, int] = {"xwing-aes256gcm": 1, "xwing-fernet": 2}
SIG_SUITES: dict[str, int] = {"ed25519": 1, "ed25519+mldsa65": 2}
_SUITE_NAMES = {v: k for k, v in SUITES.items()}
_SIG_NAMES = {v: k for k, v in SIG_SUITES.items()}
SIGNED_LABEL = b"fedciuic-envelope-signature/1\x00"  # version 1
SIGNED_LABEL_V2 = b"fedciuic-envelope-signature/2\x00"
DEFAULT_MAX_SIZE = 1 << 30
POLICY_HASH_SIZE = 32  # SHA-256; or no policy hash at all
TAG_SIZE = 16  # AES-GCM
NONCE_PREFIX_SIZE = 7  # + chunk index (u32) + final flag (u8) = the 12-byte GCM nonce
#: Plaintext bytes per AEAD chunk, as a power of two, and the range an opener accepts.
CHUNK_EXPONENT = 18  # 256 KiB: a chunk and its ciphertext stay in L2 between AES and SHA-256
MIN_CHUNK_EXPONENT, MAX_CHUNK_EXPONENT = 16, 24
MAX_CHUNKS = 1 << 32  # the chunk index is a u32
_FIXED = struct.Struct(">4sBBB16s16sQI")  # magic .. round
_SIZES = struct.Struct(">BQ")  # version 2: chunk exponent, length
_NONCE_TAIL = struct.Struct(">IB")  # chunk index, final flag


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
    version: int = VERSION
    #: Version 2: plaintext bytes per chunk as a power of two (suite 1), 0 for suite 2.
    chunk_exponent: int = 0
    #: Version 2: the plaintext length (suite 1) or the Fernet token's length (suite 2).
    length: int = 0

    def encode(self) -> bytes:
        region = self.region.encode("ascii")
        if len(region) > 255 or len(self.policy_hash) > 255:
            raise ValueError("region and policy hash are at most 255 bytes")
        codes = (ENVELOPE_MAGIC, self.version, SUITES[self.suite], SIG_SUITES[self.signature])
        head = _FIXED.pack(*codes, self.sender, self.recipient, self.run_id, self.round)
        head += bytes([len(region)]) + region + bytes([len(self.policy_hash)]) + self.policy_hash
        return head if self.version == 1 else head + _SIZES.pack(self.chunk_exponent, self.length)

    def chunks(self) -> int:
        """Version 2, suite 1: how many AEAD chunks (at least one, for an empty payload)."""
        return max(1, -(-self.length >> self.chunk_exponent))

    def body_size(self) -> int:
        """Version 2: the bytes between the KEM ciphertext and the signature."""
        if self.suite == "xwing-aes256gcm":
            return self.length + TAG_SIZE * self.chunks()
        return self.length


@dataclass(frozen=True)
class Opened:
    header: Header
    sender: PublicBundle
    #: The plaintext; a ``bytearray`` for AES-GCM envelopes of version 2 (the chunks are
    #: decrypted straight into it), ``bytes`` otherwise.
    payload: bytes | bytearray


# -- the worker pool ------------------------------------------------------------------------

_T = TypeVar("_T")
_pool: tuple[int, ThreadPoolExecutor] | None = None
_pool_lock = threading.Lock()


def workers() -> int:
    """Threads that seal or open one envelope's chunks: ``FEDCIUIC_SEAL_THREADS`` when
    set, else the usable cores, at most 8."""
    setting = os.environ.get("FEDCIUIC_SEAL_THREADS", "")
    if setting.isdigit() and int(setting) >= 1:
        return int(setting)
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(8, cores))


def _map(task: Callable[[int], _T], count: int) -> list[_T]:
    """``[task(i) for i in range(count)]``, on the pool when there is more than one chunk;
    made again in a forked child, whose copy of the parent's pool has no threads."""
    global _pool
    threads = workers()
    if count == 1 or threads == 1:
        return [task(i) for i in range(count)]
    with _pool_lock:
        if _pool is None or _pool[0] != os.getpid() or _pool[1]._max_workers != threads:
            if _pool is not None and _pool[0] == os.getpid():
                _pool[1].shutdown(wait=False)
            _pool = (os.getpid(), ThreadPoolExecutor(threads, thread_name_prefix="fedciuic-seal"))
        pool = _pool[1]
    return list(pool.map(task, range(count)))


# -- keys and the signed message ----------------------------------------------------------


def _keys(secret: bytes, suite: Suite, version: int) -> bytes:
    info = f"fedciuic-envelope/{version} {suite}".encode()
    nonce = 12 if version == 1 else NONCE_PREFIX_SIZE
    size = 32 if suite == "xwing-fernet" else 32 + nonce
    return HKDF(algorithm=hashes.SHA256(), length=size, salt=None, info=info).derive(secret)


def signed_message(
    header: memoryview | bytes, kem: memoryview | bytes, digests: list[bytes]
) -> bytes:
    """Version 2: what the sender signs, given the SHA-256 of each body chunk in order."""
    return SIGNED_LABEL_V2 + hashlib.sha256(b"".join([header, kem, *digests])).digest()


def _chunk(header: Header, prefix: bytes, body_at: int, index: int) -> tuple[slice, slice, bytes]:
    """Version 2, suite 1: chunk ``index``'s plaintext and ciphertext slices, and its nonce."""
    start = index << header.chunk_exponent
    stop = min(start + (1 << header.chunk_exponent), header.length)
    at = body_at + index * ((1 << header.chunk_exponent) + TAG_SIZE)
    nonce = prefix + _NONCE_TAIL.pack(index, index == header.chunks() - 1)
    return slice(start, stop), slice(at, at + stop - start + TAG_SIZE), nonce


# -- sealing ------------------------------------------------------------------------------


def seal(
    payload: bytes | bytearray | memoryview,
    *,
    sender: Keypair,
    recipient: PublicBundle,
    run_id: int,
    server_round: int,
    region: str,
    policy_hash: bytes = b"",
    suite: Suite = "xwing-aes256gcm",
    chunk_exponent: int = CHUNK_EXPONENT,
) -> bytearray:
    """Encrypt ``payload`` (any C-contiguous buffer) to ``recipient`` and sign it. Each
    chunk is encrypted straight into one preallocated buffer and hashed there, so the
    payload is read once and the ciphertext written once."""
    if not MIN_CHUNK_EXPONENT <= chunk_exponent <= MAX_CHUNK_EXPONENT:
        raise ValueError(
            f"chunk_exponent: {chunk_exponent}, not in {MIN_CHUNK_EXPONENT}..{MAX_CHUNK_EXPONENT}"
        )
    plain = memoryview(payload).cast("B")
    secret, kem_ct = recipient.xwing.encapsulate()
    keys = _keys(secret, suite, VERSION)
    aes = suite == "xwing-aes256gcm"
    token = b"" if aes else Fernet(base64.urlsafe_b64encode(keys)).encrypt(bytes(plain))
    header = Header(
        suite=suite,
        signature=sender.bundle.signature,
        sender=sender.bundle.key_id,
        recipient=recipient.key_id,
        run_id=run_id,
        round=server_round,
        region=region,
        policy_hash=policy_hash,
        chunk_exponent=chunk_exponent if aes else 0,
        length=len(plain) if aes else len(token),
    )
    encoded = header.encode()
    body_at = len(encoded) + CIPHERTEXT_SIZE
    end = body_at + header.body_size()
    buf = bytearray(end + sender.bundle.signature_size())
    view = memoryview(buf)
    view[: len(encoded)] = encoded
    view[len(encoded) : body_at] = kem_ct
    if aes:

        def one(index: int) -> bytes:
            text, body, nonce = _chunk(header, keys[32:], body_at, index)
            AESGCM(keys[:32]).encrypt_into(nonce, plain[text], encoded, view[body])
            return hashlib.sha256(view[body]).digest()

        digests = _map(one, header.chunks())
    else:
        view[body_at:end] = token
        digests = [hashlib.sha256(token).digest()]
    view[end:] = sender.sign(signed_message(encoded, kem_ct, digests))
    return buf


# -- opening ------------------------------------------------------------------------------


def parse_header(data: bytes | bytearray | memoryview) -> tuple[Header, int]:
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
        exponent = length = 0
        if version == 2:
            exponent, length = _SIZES.unpack_from(data, pos)
            pos += _SIZES.size
        if (
            magic != ENVELOPE_MAGIC
            or version not in READABLE_VERSIONS
            or policy_len not in (0, POLICY_HASH_SIZE)
            or len(policy) != policy_len
            or not re.fullmatch(NAME_PATTERN, region)
        ):
            raise ValueError
        suite_name = _SUITE_NAMES[suite]
        sig_name = _SIG_NAMES[sig]
        if version == 2 and not (
            MIN_CHUNK_EXPONENT <= exponent <= MAX_CHUNK_EXPONENT
            if suite_name == "xwing-aes256gcm"
            else exponent == 0
        ):
            raise ValueError
    except (struct.error, IndexError, KeyError, ValueError, UnicodeDecodeError):
        raise InvalidEnvelope() from None
    fields = (sender, recipient, run_id, rnd, region, policy, version, exponent, length)
    return Header(suite_name, sig_name, *fields), pos


def open_envelope(
    data: bytes | bytearray | memoryview,
    *,
    recipient: Keypair,
    senders: Mapping[bytes, PublicBundle],
    max_size: int = DEFAULT_MAX_SIZE,
) -> Opened:
    """Verify the signature and decrypt; no plaintext leaves unless both succeed. Binding
    checks are the caller's (see :class:`Expectation`); the header is authentic once
    this returns. ``data`` may be any C-contiguous buffer (it is not copied)."""
    view = memoryview(data).cast("B")
    if len(view) > max_size:
        raise EnvelopeRejected(f"envelope of {len(view)} bytes exceeds the {max_size}-byte limit")
    header, header_end = parse_header(view)
    if header.version == 1:
        return _open_v1(view, header, header_end, recipient, senders)
    sender = senders.get(header.sender)
    body_at = header_end + CIPHERTEXT_SIZE
    if (
        sender is None
        or sender.signature != header.signature
        or (header.suite == "xwing-aes256gcm" and header.chunks() > MAX_CHUNKS)
        # Every size follows from the header: refuse a mismatch before allocating.
        or len(view) != body_at + header.body_size() + sender.signature_size()
    ):
        raise InvalidEnvelope()
    encoded, kem_ct = view[:header_end], view[header_end:body_at]
    end = body_at + header.body_size()
    ours = header.recipient == recipient.bundle.key_id
    keys = b""
    if ours:
        try:
            # A malformed KEM share (an X25519 low-order point, say) fails inside
            # decapsulation: one opaque answer for it too.
            keys = _keys(recipient.xwing.decapsulate(bytes(kem_ct)), header.suite, 2)
        except ValueError:
            raise InvalidEnvelope() from None
    payload: bytes | bytearray = b""
    if header.suite == "xwing-aes256gcm":
        # One pass: each worker hashes a chunk's ciphertext and decrypts it into place.
        plain = bytearray(header.length if ours else 0)
        out = memoryview(plain)

        def one(index: int) -> tuple[bytes, bool]:
            text, body, nonce = _chunk(header, keys[32:], body_at, index)
            digest = hashlib.sha256(view[body]).digest()
            if ours:
                try:
                    AESGCM(keys[:32]).decrypt_into(nonce, view[body], encoded, out[text])
                except InvalidTag:
                    return digest, False
            return digest, True

        results = _map(one, header.chunks())
        digests, intact = [d for d, _ in results], all(ok for _, ok in results)
        payload = plain
    else:
        token = view[body_at:end]
        digests, intact = [hashlib.sha256(token).digest()], True
    if not sender.verify(signed_message(encoded, kem_ct, digests), bytes(view[end:])):
        raise InvalidEnvelope()
    if not ours:
        raise _not_ours(header, recipient)
    if not intact:
        raise InvalidEnvelope()
    if header.suite == "xwing-fernet":
        try:
            payload = Fernet(base64.urlsafe_b64encode(keys)).decrypt(bytes(view[body_at:end]))
        except InvalidToken:
            raise InvalidEnvelope() from None
    return Opened(header, sender, payload)


def _open_v1(
    view: memoryview,
    header: Header,
    header_end: int,
    recipient: Keypair,
    senders: Mapping[bytes, PublicBundle],
) -> Opened:
    """Version 1: one AEAD call, the signature over SHA-256 of every byte before the
    signature's length."""
    pos = header_end
    try:
        kem_ct = view[pos : pos + CIPHERTEXT_SIZE]
        pos += CIPHERTEXT_SIZE
        (body_len,) = struct.unpack_from(">Q", view, pos)
        pos += 8
        body = view[pos : pos + body_len]
        pos += body_len
        (sig_len,) = struct.unpack_from(">H", view, pos)
        signature = bytes(view[pos + 2 :])
        sender = senders[header.sender]
    except (struct.error, KeyError, OverflowError):
        raise InvalidEnvelope() from None
    if (
        len(kem_ct) != CIPHERTEXT_SIZE
        or len(body) != body_len
        or len(signature) != sig_len
        or sender.signature != header.signature
        or not sender.verify(SIGNED_LABEL + hashlib.sha256(view[:pos]).digest(), signature)
    ):
        raise InvalidEnvelope()
    if header.recipient != recipient.bundle.key_id:
        raise _not_ours(header, recipient)
    try:
        keys = _keys(recipient.xwing.decapsulate(bytes(kem_ct)), header.suite, 1)
        if header.suite == "xwing-aes256gcm":
            payload = AESGCM(keys[:32]).decrypt(keys[32:], body, view[:header_end])
        else:
            payload = Fernet(base64.urlsafe_b64encode(keys)).decrypt(bytes(body))
    except (InvalidTag, InvalidToken, ValueError):
        raise InvalidEnvelope() from None
    return Opened(header, sender, payload)


def _not_ours(header: Header, recipient: Keypair) -> EnvelopeRejected:
    return EnvelopeRejected(
        f"envelope is for key {header.recipient.hex()}, not this aggregator's "
        f"{recipient.bundle.key_id.hex()}"
    )


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
