"""What a region's two secret seeds give, and how seeds travel between regions.

Per secure sum a region draws a *self seed* ``b`` (its self mask) and a *key seed* ``k``,
which gives its ephemeral X-Wing key and the pair seeds it owns. A pair seed travels
sealed to the other region's ephemeral key, so either region's ``k`` recovers it. Shares
of ``b`` and ``k`` travel sealed to each holder's identity key, never shared: recovering
a region's ``k`` opens the pair seeds sent to it, never the shares it holds of others'.
Sealing is X-Wing then AES-256-GCM under the fresh secret (one message per key: a fixed
nonce), with the session, both regions and the purpose as associated data.
"""

from __future__ import annotations

import hashlib

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from fedciuic.crypto import CIPHERTEXT_SIZE, XWingPrivateKey, XWingPublicKey
from fedciuic.secagg.messages import DOMAIN, SecAggError, signable
from fedciuic.secagg.shamir import PRIME, SEED_BYTES

#: A Shamir share's value on the wire: 521 bits in big-endian bytes.
SHARE_BYTES = (PRIME.bit_length() + 7) // 8
_TAG, _NONCE = 16, b"\0" * 12
#: SealedItem sizes: a share pair (of ``b`` and of ``k``) and one pair seed.
SEALED_SHARES = CIPHERTEXT_SIZE + 2 * SHARE_BYTES + _TAG
SEALED_PAIR = CIPHERTEXT_SIZE + SEED_BYTES + _TAG
#: What each sealed item is for (in its associated data).
SHARES, PAIR = "shares", "pair"


def _derive(key_seed: bytes, sid: bytes, *label: str) -> bytes:
    return hashlib.shake_256(signable(DOMAIN, "derive", sid, key_seed, *label)).digest(SEED_BYTES)


def ephemeral(key_seed: bytes, sid: bytes) -> XWingPrivateKey:
    """The region's ephemeral X-Wing key in session ``sid``."""
    return XWingPrivateKey(_derive(key_seed, sid, "ephemeral"))


def pair_seed(key_seed: bytes, sid: bytes, owner: str, other: str) -> bytes:
    """The pair seed ``owner`` (the lower-numbered of the two) shares with ``other``."""
    return _derive(key_seed, sid, "pair", owner, other)


def _aad(sid: bytes, purpose: str, sender: str, to: str) -> bytes:
    return signable(DOMAIN, "sealed", sid, purpose, sender, to)


def seal_to(
    key: XWingPublicKey, plaintext: bytes, *, sid: bytes, purpose: str, sender: str, to: str
) -> bytes:
    """``plaintext`` sealed for ``key``'s holder, bound to session, purpose and regions."""
    secret, ciphertext = key.encapsulate()
    return ciphertext + AESGCM(secret).encrypt(_NONCE, plaintext, _aad(sid, purpose, sender, to))


def open_with(
    key: XWingPrivateKey,
    sealed: bytes,
    *,
    size: int,
    sid: bytes,
    purpose: str,
    sender: str,
    to: str,
) -> bytes:
    """What :func:`seal_to` sealed (``size`` bytes); :class:`SecAggError` for anything else."""
    if len(sealed) != CIPHERTEXT_SIZE + size + _TAG:
        raise SecAggError(
            f"secure sum: the {purpose} sealed by {sender} for {to} has the wrong size"
        )
    secret = key.decapsulate(sealed[:CIPHERTEXT_SIZE])
    try:
        return AESGCM(secret).decrypt(
            _NONCE, sealed[CIPHERTEXT_SIZE:], _aad(sid, purpose, sender, to)
        )
    except InvalidTag:
        raise SecAggError(
            f"secure sum: the {purpose} sealed by {sender} for {to} does not open "
            "(altered, or sealed for another session or key)"
        ) from None


def share_value(data: bytes) -> int:
    return int.from_bytes(data, "big")


def share_bytes(value: int) -> bytes:
    return value.to_bytes(SHARE_BYTES, "big")
