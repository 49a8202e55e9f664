"""X-Wing: the hybrid KEM of draft-connolly-cfrg-xwing-kem (ML-KEM-768 + X25519).

Exactly as the draft specifies: the decapsulation key is a 32-byte seed, expanded with
SHAKE-256 to 96 bytes (the ML-KEM-768 seed d || z, then the X25519 secret); the
encapsulation key is ``pk_M || pk_X`` (1184 + 32 bytes), the ciphertext ``ct_M || ct_X``
(1088 + 32 bytes), the shared secret ``SHA3-256(ss_M || ss_X || ct_X || pk_X || XWingLabel)``.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from functools import cached_property

from cryptography.hazmat.primitives.asymmetric.mlkem import MLKEM768PrivateKey, MLKEM768PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

#: The draft's label, the six ASCII bytes ``\\.//^\\``.
XWING_LABEL = b"\\.//^\\"
SEED_SIZE = 32
MLKEM_PK_SIZE, MLKEM_CT_SIZE, X25519_SIZE = 1184, 1088, 32
PUBLIC_KEY_SIZE = MLKEM_PK_SIZE + X25519_SIZE  # 1216
CIPHERTEXT_SIZE = MLKEM_CT_SIZE + X25519_SIZE  # 1120


def combiner(ss_m: bytes, ss_x: bytes, ct_x: bytes, pk_x: bytes) -> bytes:
    """The X-Wing combiner: ``SHA3-256(ss_M || ss_X || ct_X || pk_X || XWingLabel)``."""
    return hashlib.sha3_256(ss_m + ss_x + ct_x + pk_x + XWING_LABEL).digest()


@dataclass(frozen=True)
class XWingPrivateKey:
    """An X-Wing decapsulation key, held as its 32-byte seed."""

    seed: bytes

    def __post_init__(self) -> None:
        if len(self.seed) != SEED_SIZE:
            raise ValueError(f"an X-Wing seed is {SEED_SIZE} bytes, got {len(self.seed)}")

    @classmethod
    def generate(cls) -> XWingPrivateKey:
        return cls(os.urandom(SEED_SIZE))

    @cached_property
    def _expanded(self) -> tuple[MLKEM768PrivateKey, X25519PrivateKey, bytes]:
        """The expanded keys and ``pk_X``, made once per key: ML-KEM key generation from
        the seed would otherwise be most of a decapsulation's cost."""
        expanded = hashlib.shake_256(self.seed).digest(96)
        sk_m = MLKEM768PrivateKey.from_seed_bytes(expanded[:64])
        sk_x = X25519PrivateKey.from_private_bytes(expanded[64:96])
        return sk_m, sk_x, sk_x.public_key().public_bytes_raw()

    def public_key(self) -> XWingPublicKey:
        sk_m, _, pk_x = self._expanded
        return XWingPublicKey(sk_m.public_key().public_bytes_raw() + pk_x)

    def decapsulate(self, ciphertext: bytes) -> bytes:
        """The shared secret for ``ciphertext``. ML-KEM's implicit rejection means a
        wrong ciphertext yields a wrong secret rather than an error."""
        if len(ciphertext) != CIPHERTEXT_SIZE:
            raise ValueError(f"an X-Wing ciphertext is {CIPHERTEXT_SIZE} bytes")
        sk_m, sk_x, pk_x = self._expanded
        ct_m, ct_x = ciphertext[:MLKEM_CT_SIZE], ciphertext[MLKEM_CT_SIZE:]
        ss_x = sk_x.exchange(X25519PublicKey.from_public_bytes(ct_x))
        return combiner(sk_m.decapsulate(ct_m), ss_x, ct_x, pk_x)


@dataclass(frozen=True)
class XWingPublicKey:
    """An X-Wing encapsulation key: ``pk_M || pk_X``."""

    raw: bytes

    def __post_init__(self) -> None:
        if len(self.raw) != PUBLIC_KEY_SIZE:
            raise ValueError(
                f"an X-Wing public key is {PUBLIC_KEY_SIZE} bytes, got {len(self.raw)}"
            )

    @cached_property
    def _parsed(self) -> tuple[MLKEM768PublicKey, X25519PublicKey]:
        """The two public keys, parsed (and ML-KEM's checked) once per key."""
        return (
            MLKEM768PublicKey.from_public_bytes(self.raw[:MLKEM_PK_SIZE]),
            X25519PublicKey.from_public_bytes(self.raw[MLKEM_PK_SIZE:]),
        )

    def encapsulate(self) -> tuple[bytes, bytes]:
        """A fresh ``(shared_secret, ciphertext)``."""
        pk_m, pk_x = self._parsed
        ephemeral = X25519PrivateKey.generate()
        ss_m, ct_m = pk_m.encapsulate()
        ct_x = ephemeral.public_key().public_bytes_raw()
        ss_x = ephemeral.exchange(pk_x)
        return combiner(ss_m, ss_x, ct_x, self.raw[MLKEM_PK_SIZE:]), ct_m + ct_x
