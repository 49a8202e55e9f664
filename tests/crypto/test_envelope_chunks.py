"""Envelope version 2: chunked AES-GCM, the signature over the chunks' digests, sizes
checked before anything large is allocated, and version 1 still opening.

Hostile envelopes are built here from docs/envelope.md with the test's own encoder:
re-signed by the real sender where the point is that the AEAD layer alone refuses them
(chunk order, truncation, extension), left unsigned where the signature must.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import struct
import sys
import tracemalloc

import numpy as np
import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from fedciuic.crypto.envelope import (
    SIGNED_LABEL,
    SIGNED_LABEL_V2,
    EnvelopeRejected,
    Header,
    InvalidEnvelope,
    open_envelope,
    parse_header,
    seal,
)
from fedciuic.crypto.keys import Keypair
from fedciuic.crypto.xwing import CIPHERTEXT_SIZE

EXP = 16  # the smallest chunk an opener accepts: 64 KiB, so tests stay small
CHUNK = 1 << EXP
TAG = 16


def seal_as(parties, payload, region="eu", recipient="aggregator", **kw):
    return seal(
        payload,
        sender=parties[region],
        recipient=parties[recipient].bundle,
        run_id=11,
        server_round=2,
        region=region,
        policy_hash=b"\x01" * 32,
        chunk_exponent=kw.pop("chunk_exponent", EXP),
        **kw,
    )


def open_as(parties, envelope, **kw):
    senders = {p.bundle.key_id: p.bundle for n, p in parties.items() if n != "aggregator"}
    return open_envelope(envelope, recipient=parties["aggregator"], senders=senders, **kw)


class Parts:
    """An envelope cut at the documented boundaries, to rebuild hostile variants."""

    def __init__(self, parties, envelope, region="eu"):
        self.keypair = parties[region]
        self.header, end = parse_header(envelope)
        self.encoded = bytes(envelope[:end])
        self.kem = bytes(envelope[end : end + CIPHERTEXT_SIZE])
        sig_at = len(envelope) - self.keypair.bundle.signature_size()
        body = bytes(envelope[end + CIPHERTEXT_SIZE : sig_at])
        self.signature = bytes(envelope[sig_at:])
        step = CHUNK + TAG
        self.chunks = [body[i : i + step] for i in range(0, len(body), step)]

    def with_length(self, length: int) -> Parts:
        fields = {**self.header.__dict__, "length": length}
        self.encoded = Header(**fields).encode()
        return self

    def build(self, resign: bool = True) -> bytes:
        prefix = self.encoded + self.kem
        digests = b"".join(hashlib.sha256(c).digest() for c in self.chunks)
        signature = self.signature
        if resign:
            message = SIGNED_LABEL_V2 + hashlib.sha256(prefix + digests).digest()
            signature = self.keypair.sign(message)
        return prefix + b"".join(self.chunks) + signature


SIZES = [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK, 3 * CHUNK + 5]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("region", ["eu", "cn"])
def test_round_trip_at_chunk_boundaries(parties, size, region):
    payload = os.urandom(size)
    envelope = seal_as(parties, payload, region=region)
    header, _ = parse_header(envelope)
    chunks = max(1, -(-size // CHUNK))
    assert (header.version, header.chunk_exponent, header.length) == (2, EXP, size)
    sig = parties[region].bundle.signature_size()
    assert len(envelope) == len(header.encode()) + CIPHERTEXT_SIZE + size + TAG * chunks + sig
    out = open_as(parties, envelope)
    assert out.payload == payload and out.sender.party == region


@pytest.mark.parametrize("threads", ["1", "3"])
def test_any_buffer_seals_and_any_thread_count_opens(parties, monkeypatch, threads):
    payload = np.arange(5 * CHUNK // 4, dtype=np.float32)  # 5 chunks, not bytes
    envelope = seal_as(parties, payload)
    monkeypatch.setenv("FEDCIUIC_SEAL_THREADS", threads)
    as_array = np.frombuffer(envelope, dtype=np.uint8)  # what Flower carries
    assert open_as(parties, as_array).payload == payload.tobytes()


def test_default_chunk_size_round_trips(parties):
    payload = os.urandom(600_000)
    envelope = seal(
        payload, sender=parties["eu"], recipient=parties["aggregator"].bundle, run_id=1,
        server_round=1, region="eu",
    )  # fmt: skip
    assert parse_header(envelope)[0].chunk_exponent == 18
    assert open_as(parties, envelope).payload == payload


@pytest.mark.parametrize("where", ["first", "middle", "last", "last tag"])
def test_a_changed_chunk_is_invalid(parties, where):
    envelope = bytearray(seal_as(parties, os.urandom(3 * CHUNK + 100)))
    body_at = len(Parts(parties, envelope).encoded) + CIPHERTEXT_SIZE
    sig_at = len(envelope) - 64
    at = {
        "first": body_at,
        "middle": body_at + CHUNK + TAG + 7,
        "last": sig_at - TAG - 1,
        "last tag": sig_at - 1,
    }[where]
    envelope[at] ^= 0x80
    with pytest.raises(InvalidEnvelope, match=r"^invalid envelope$"):
        open_as(parties, envelope)
    parts = Parts(parties, envelope)  # the sender re-signs: GCM alone refuses it
    with pytest.raises(InvalidEnvelope):
        open_as(parties, parts.build())


def test_reordered_chunks_are_invalid_even_when_re_signed(parties):
    parts = Parts(parties, seal_as(parties, os.urandom(3 * CHUNK)))
    parts.chunks[0], parts.chunks[1] = parts.chunks[1], parts.chunks[0]
    with pytest.raises(InvalidEnvelope):
        open_as(parties, parts.build(resign=False))
    with pytest.raises(InvalidEnvelope):  # the nonce holds the chunk index
        open_as(parties, parts.build())


def test_a_dropped_final_chunk_is_invalid_even_when_re_signed(parties):
    parts = Parts(parties, seal_as(parties, os.urandom(2 * CHUNK + 10)))
    parts.chunks.pop()
    with pytest.raises(InvalidEnvelope):  # the header still says 2 * CHUNK + 10
        open_as(parties, parts.build())
    parts.with_length(2 * CHUNK)  # a consistent length, re-signed
    with pytest.raises(InvalidEnvelope):  # chunk 1 was not sealed as the final one
        open_as(parties, parts.build())


def test_an_extended_envelope_is_invalid_even_when_re_signed(parties):
    envelope = seal_as(parties, os.urandom(2 * CHUNK))
    with pytest.raises(InvalidEnvelope):
        open_as(parties, envelope + b"\x00")
    parts = Parts(parties, envelope).with_length(3 * CHUNK)
    parts.chunks.append(parts.chunks[-1])  # a well-formed chunk from elsewhere
    with pytest.raises(InvalidEnvelope):
        open_as(parties, parts.build())


def test_a_truncated_envelope_is_invalid(parties):
    envelope = seal_as(parties, os.urandom(2 * CHUNK))
    for size in (0, 5, 60, 90, 1000, len(envelope) - 64, len(envelope) - 1):
        with pytest.raises(InvalidEnvelope):
            open_as(parties, envelope[:size])


def test_a_bad_signature_is_invalid(parties):
    envelope = bytearray(seal_as(parties, os.urandom(CHUNK + 1), region="cn"))
    for at in (len(envelope) - 1, len(envelope) - 3309 - 1):  # ML-DSA, then Ed25519
        damaged = bytearray(envelope)
        damaged[at] ^= 1
        with pytest.raises(InvalidEnvelope):
            open_as(parties, damaged)


def test_the_recipient_is_checked_after_the_signature(parties):
    other = {**parties, "other": Keypair.generate("aggregator", "US")}
    envelope = seal_as(other, os.urandom(2 * CHUNK), recipient="other")
    with pytest.raises(EnvelopeRejected, match="not this aggregator's"):
        open_as(parties, envelope)
    damaged = bytearray(envelope)
    damaged[-1] ^= 1
    with pytest.raises(InvalidEnvelope):  # unauthenticated: no reason to give
        open_as(parties, damaged)


def absurd(parties, resign: bool, **fields) -> bytes:
    """A small envelope whose header declares other sizes (re-signed or not)."""
    parts = Parts(parties, seal_as(parties, os.urandom(100)))
    parts.encoded = Header(**{**parts.header.__dict__, **fields}).encode()
    return parts.build(resign)


@pytest.mark.parametrize(
    "fields",
    [
        {"length": 2**64 - 1},
        {"length": 1 << 40},
        {"length": 1 << 30},
        {"length": 101},
        {"length": 99},
        {"chunk_exponent": 0},
        {"chunk_exponent": 15},
        {"chunk_exponent": 25},
        {"chunk_exponent": 255},
    ],
)
@pytest.mark.parametrize("resign", [False, True])
def test_absurd_declared_sizes_fail_before_any_large_allocation(parties, fields, resign):
    envelope = absurd(parties, resign, **fields)
    tracemalloc.start()
    try:
        with pytest.raises(InvalidEnvelope):
            open_as(parties, envelope)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 10


@pytest.mark.parametrize(
    "header",
    [
        b"FCEV\x03",  # unknown version
        b"FCEV\x02\x03",  # unknown suite
        b"FCEV\x02\x01\x07",  # unknown signature suite
        b"FCEX\x02\x01\x01",  # magic
    ],
)
def test_a_malformed_header_is_invalid(parties, header):
    envelope = bytearray(seal_as(parties, b"x"))
    envelope[: len(header)] = header
    with pytest.raises(InvalidEnvelope):
        open_as(parties, envelope)


def test_the_envelope_is_over_the_limit_before_anything_else(parties):
    with pytest.raises(EnvelopeRejected, match="exceeds the 100-byte limit"):
        open_as(parties, b"\xff" * 101, max_size=100)


def test_sealing_and_opening_copy_nothing_large(parties):
    """Seal allocates the envelope once; open allocates the plaintext once."""
    payload = os.urandom(32 * CHUNK)  # 2 MiB
    tracemalloc.start()
    try:
        envelope = seal_as(parties, payload)
        seal_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        out = open_as(parties, envelope)
        open_peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    assert out.payload == payload
    assert seal_peak < len(envelope) + (256 << 10)
    assert open_peak < len(payload) + (256 << 10)


def v1_envelope(parties, payload: bytes, region="eu") -> bytes:
    """Version 1 exactly as docs/envelope.md describes it (what older regions send)."""
    sender, recipient = parties[region], parties["aggregator"].bundle
    region_b = region.encode()
    header = (
        struct.pack(
            ">4sBBB16s16sQI",
            b"FCEV",
            1,
            1,
            1 if sender.bundle.signature == "ed25519" else 2,
            sender.bundle.key_id,
            recipient.key_id,
            11,
            2,
        )
        + bytes([len(region_b)])
        + region_b
        + b"\x00"
    )
    secret, kem = recipient.xwing.encapsulate()
    info = b"fedciuic-envelope/1 xwing-aes256gcm"
    okm = HKDF(algorithm=hashes.SHA256(), length=44, salt=None, info=info).derive(secret)
    body = AESGCM(okm[:32]).encrypt(okm[32:], payload, header)
    prefix: bytes = header + kem + struct.pack(">Q", len(body)) + body
    signature: bytes = sender.sign(SIGNED_LABEL + hashlib.sha256(prefix).digest())
    return prefix + struct.pack(">H", len(signature)) + signature


@pytest.mark.parametrize("region", ["eu", "cn"])
def test_version_1_envelopes_still_open(parties, region):
    payload = os.urandom(3 * CHUNK)
    out = open_as(parties, v1_envelope(parties, payload, region))
    assert out.payload == payload and out.header.version == 1
    assert (out.header.run_id, out.header.round, out.header.region) == (11, 2, region)
    damaged = bytearray(v1_envelope(parties, payload, region))
    damaged[200] ^= 1
    with pytest.raises(InvalidEnvelope):
        open_as(parties, damaged)


def _seal_in_child(parties, queue) -> None:  # pragma: no cover - runs in the child
    envelope = seal_as(parties, os.urandom(4 * CHUNK))
    queue.put(open_as(parties, envelope).payload[:0] == b"")


@pytest.mark.skipif(sys.platform != "linux", reason="fork")
def test_a_forked_child_seals_with_its_own_threads(parties):
    seal_as(parties, os.urandom(4 * CHUNK))  # the parent's pool exists now
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_seal_in_child, args=(parties, queue))
    child.start()
    child.join(30)
    alive = child.is_alive()
    if alive:
        child.kill()
    assert not alive and child.exitcode == 0 and queue.get(timeout=5)
