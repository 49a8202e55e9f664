"""X-Wing against the draft's vectors; envelopes; key files."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from fedciuic.crypto.envelope import (
    EnvelopeRejected,
    Expectation,
    InvalidEnvelope,
    open_envelope,
    seal,
)
from fedciuic.crypto.keys import (
    KeyFileError,
    Keypair,
    load_bundle,
    load_bundles,
    load_keypair,
    write_keys,
)
from fedciuic.crypto.xwing import XWingPrivateKey, XWingPublicKey, combiner

# The test vectors of draft-connolly-cfrg-xwing-kem (a copy of shared/vectors/).
VECTORS = json.loads((Path(__file__).parent.parent / "vectors" / "xwing-draft.json").read_text())


@pytest.mark.parametrize("vector", VECTORS, ids=lambda v: v["sk"][:8])
def test_xwing_draft_vectors(vector):
    sk = XWingPrivateKey(bytes.fromhex(vector["sk"]))
    ct = bytes.fromhex(vector["ct"])
    assert sk.public_key().raw.hex() == vector["pk"]  # key generation from the seed
    assert sk.decapsulate(ct).hex() == vector["ss"]  # decapsulation and the combiner
    # Encapsulation: the X25519 half is derandomised from eseed[32:64] as the draft
    # says; cryptography offers no derandomised ML-KEM encapsulation, so the ML-KEM
    # half is checked through decapsulation above.
    ephemeral = X25519PrivateKey.from_private_bytes(bytes.fromhex(vector["eseed"])[32:])
    assert ephemeral.public_key().public_bytes_raw() == ct[1088:]


def test_xwing_round_trip_and_implicit_rejection():
    sk = XWingPrivateKey.generate()
    secret, ct = sk.public_key().encapsulate()
    assert sk.decapsulate(ct) == secret and len(secret) == 32
    assert XWingPrivateKey.generate().decapsulate(ct) != secret


def test_combiner_is_sha3_of_the_draft_inputs():
    import hashlib

    args = (b"m" * 32, b"x" * 32, b"c" * 32, b"p" * 32)
    assert combiner(*args) == hashlib.sha3_256(b"".join(args) + b"\\.//^\\").digest()


def sealed(parties, payload=b"delta bytes", region="eu", suite="xwing-aes256gcm", **kw):
    return seal(
        payload,
        sender=parties[region],
        recipient=parties["aggregator"].bundle,
        run_id=kw.get("run_id", 11),
        server_round=kw.get("server_round", 2),
        region=region,
        policy_hash=kw.get("policy_hash", b"\x01" * 32),
        suite=suite,
    )


def opened(parties, envelope, senders=None):
    senders = senders or {
        p.bundle.key_id: p.bundle for n, p in parties.items() if n != "aggregator"
    }
    return open_envelope(envelope, recipient=parties["aggregator"], senders=senders)


@pytest.mark.parametrize("suite", ["xwing-aes256gcm", "xwing-fernet"])
@pytest.mark.parametrize("region", ["eu", "cn"])  # Ed25519 and hybrid Ed25519 + ML-DSA-65
def test_seal_and_open_round_trip(parties, suite, region):
    out = opened(parties, sealed(parties, b"x" * 5000, region=region, suite=suite))
    assert out.payload == b"x" * 5000
    h = out.header
    assert (h.run_id, h.round, h.region, h.suite) == (11, 2, region, suite)
    assert h.policy_hash == b"\x01" * 32 and out.sender.party == region


@pytest.mark.parametrize("suite", ["xwing-aes256gcm", "xwing-fernet"])
def test_every_single_bit_flip_is_one_opaque_error(parties, suite):
    envelope = sealed(parties, b"0123456789abcdef", suite=suite)
    for bit in range(len(envelope) * 8):
        damaged = bytearray(envelope)
        damaged[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(InvalidEnvelope) as info:
            opened(parties, bytes(damaged))
        assert str(info.value) == "invalid envelope"


def test_truncated_envelopes_are_invalid(parties):
    envelope = sealed(parties)
    for size in (0, 3, 40, 1200, len(envelope) // 2, len(envelope) - 1):
        with pytest.raises(InvalidEnvelope):
            opened(parties, envelope[:size])
    with pytest.raises(InvalidEnvelope):
        opened(parties, envelope + b"\x00")


def test_signed_by_an_unknown_key_is_invalid(parties):
    stranger = Keypair.generate("eu", "EU")  # claims to be eu, with other keys
    envelope = seal(
        b"x",
        sender=stranger,
        recipient=parties["aggregator"].bundle,
        run_id=11,
        server_round=2,
        region="eu",
    )
    with pytest.raises(InvalidEnvelope):
        opened(parties, envelope)


def test_envelope_for_another_recipient_is_rejected(parties):
    other = Keypair.generate("aggregator", "US")
    envelope = seal(
        b"x", sender=parties["eu"], recipient=other.bundle, run_id=11, server_round=2, region="eu"
    )
    with pytest.raises(EnvelopeRejected, match="not this aggregator's"):
        opened(parties, envelope)


def test_envelope_over_the_size_limit_is_rejected(parties):
    envelope = sealed(parties, b"x" * 10_000)
    with pytest.raises(EnvelopeRejected, match="exceeds the 5000-byte limit"):
        open_envelope(envelope, recipient=parties["aggregator"], senders={}, max_size=5000)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"run_id": 12}, "envelope is for run 12, this is run 11"),
        ({"server_round": 3}, "envelope is for round 3, this is round 2"),
    ],
)
def test_envelope_for_another_run_or_round_is_rejected(parties, kw, message):
    out = opened(parties, sealed(parties, **kw))
    with pytest.raises(EnvelopeRejected, match=message):
        Expectation(run_id=11, seen=set()).check(out, server_round=2)


def test_a_replayed_envelope_is_rejected(parties):
    guard = Expectation(run_id=11, seen=set())
    envelope = sealed(parties)
    guard.check(opened(parties, envelope), server_round=2)
    with pytest.raises(EnvelopeRejected, match="replay: a second envelope from eu in round 2"):
        guard.check(opened(parties, envelope), server_round=2)
    with pytest.raises(EnvelopeRejected, match="replay"):  # a fresh one counts too
        guard.check(opened(parties, sealed(parties, b"other")), server_round=2)


def test_region_name_must_match_the_signer(parties):
    envelope = seal(
        b"x",
        sender=parties["eu"],
        recipient=parties["aggregator"].bundle,
        run_id=11,
        server_round=2,
        region="cn",
    )
    with pytest.raises(EnvelopeRejected, match="names region 'cn' but is signed by 'eu'"):
        Expectation(run_id=11, seen=set()).check(opened(parties, envelope), server_round=2)


def test_fernet_suite_is_about_a_third_larger(parties):
    payload = os.urandom(300_000)
    gcm = len(sealed(parties, payload))
    fernet = len(sealed(parties, payload, suite="xwing-fernet"))
    assert 1.3 < fernet / gcm < 1.4


# -- key files -----------------------------------------------------------------------


def test_private_key_file_is_mode_0600_and_round_trips(tmp_path):
    keypair = Keypair.generate("eu", "EU", "ed25519+mldsa65")
    private, public = write_keys(keypair, tmp_path)
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    loaded = load_keypair(private)
    assert loaded.bundle.key_id == keypair.bundle.key_id == load_bundle(public).key_id
    message = b"signed"
    assert load_bundle(public).verify(message, loaded.sign(message))


def test_keys_are_never_overwritten(tmp_path):
    write_keys(Keypair.generate("eu", "EU"), tmp_path)
    with pytest.raises(KeyFileError, match="already exists; keys are never overwritten"):
        write_keys(Keypair.generate("eu", "EU"), tmp_path)


def test_private_key_readable_by_others_is_refused(tmp_path):
    private, _ = write_keys(Keypair.generate("eu", "EU"), tmp_path)
    private.chmod(0o640)
    with pytest.raises(KeyFileError, match=r"accessible by others \(mode 640\); run `chmod 600"):
        load_keypair(private)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: "{not json", "not a readable private key file"),
        (lambda d: json.dumps({**d, "xwing_seed": "!!"}), "xwing_seed: not valid base64"),
        (lambda d: json.dumps({**d, "xwing_seed": "AAAA"}), "xwing_seed: 3 bytes, expected 32"),
        (
            lambda d: json.dumps({k: v for k, v in d.items() if k != "ed25519_seed"}),
            "ed25519_seed: Field required",
        ),
        (lambda d: json.dumps({**d, "extra": 1}), "extra: Extra inputs are not permitted"),
        (lambda d: json.dumps({**d, "key_id": "0" * 32}), "key_id: does not match"),
    ],
)
def test_malformed_private_key_file_is_named(tmp_path, edit, message):
    private, _ = write_keys(Keypair.generate("eu", "EU"), tmp_path)
    private.write_text(edit(json.loads(private.read_text())))
    with pytest.raises(KeyFileError, match=message) as info:
        load_keypair(private)
    assert str(private) in str(info.value)


def test_bundle_whose_key_id_does_not_match_is_refused(tmp_path):
    _, public = write_keys(Keypair.generate("eu", "EU"), tmp_path)
    data = json.loads(public.read_text())
    other = Keypair.generate("eu", "EU").bundle.to_file()
    data["ed25519_public"] = other.ed25519_public
    public.write_text(json.dumps(data))
    with pytest.raises(KeyFileError, match=r"key_id: .* does not match the keys in the file"):
        load_bundle(public)


def test_missing_bundle_says_how_to_make_one(tmp_path):
    with pytest.raises(KeyFileError, match="no public bundle here; create one with"):
        load_bundle(tmp_path / "aggregator.pub.json")
    with pytest.raises(KeyFileError, match="no such folder of public bundles"):
        load_bundles(tmp_path / "nope")


def test_xwing_public_key_of_wrong_size_is_refused():
    with pytest.raises(ValueError, match="1216 bytes"):
        XWingPublicKey(b"\x00" * 10)
