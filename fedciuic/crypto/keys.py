"""Party keys: an X-Wing decapsulation key and a signing key, with a public bundle.

A party's private key file (JSON, mode 0600) holds 32-byte seeds: X-Wing, Ed25519 and,
for hybrid signatures, ML-DSA-65. Its public bundle (JSON) holds its name, jurisdiction,
public keys and key id, ``SHA-256("fedciuic-key-id/1" || 0x00 || xwing_pk || ed25519_pk
|| mldsa65_pk)[:16]``. With ``ed25519+mldsa65`` both signatures must verify. See
``docs/envelope.md`` for the file formats.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import stat
from pathlib import Path
from typing import Literal, TypeVar

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.mldsa import MLDSA65PrivateKey, MLDSA65PublicKey
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fedciuic.crypto.xwing import SEED_SIZE, XWingPrivateKey, XWingPublicKey
from fedciuic.errors import FedciuicError

SignatureSuite = Literal["ed25519", "ed25519+mldsa65"]
PRIVATE_FORMAT = "fedciuic-private-key/1"
BUNDLE_FORMAT = "fedciuic-public-bundle/1"
KEY_ID_SIZE = 16
ED25519_SIG_SIZE = 64
MLDSA65_SIG_SIZE = 3309
SIGNING_CONTEXT = b"fedciuic/1"
NAME_PATTERN = r"^[a-z][a-z0-9_-]{0,31}$"


class KeyFileError(FedciuicError):
    """A key file or bundle is missing, malformed, exposed or inconsistent."""


def key_id(xwing_pk: bytes, ed25519_pk: bytes, mldsa65_pk: bytes = b"") -> bytes:
    """The 16-byte id of a set of public keys."""
    digest = hashlib.sha256(b"fedciuic-key-id/1\x00" + xwing_pk + ed25519_pk + mldsa65_pk)
    return digest.digest()[:KEY_ID_SIZE]


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(data: BaseModel, field: str, size: int, path: Path) -> bytes:
    """``data.field`` decoded, and exactly ``size`` bytes."""
    try:
        raw = base64.b64decode(getattr(data, field), validate=True)
    except (binascii.Error, ValueError):
        raise KeyFileError(f"{path}:{field}: not valid base64") from None
    if len(raw) != size:
        raise KeyFileError(f"{path}:{field}: {len(raw)} bytes, expected {size}")
    return raw


class _File(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    format: str
    party: str = Field(pattern=NAME_PATTERN)
    jurisdiction: str = Field(min_length=1, max_length=64)
    signature: SignatureSuite


_F = TypeVar("_F", bound=_File)


class BundleFile(_File):
    xwing_public: str
    ed25519_public: str
    mldsa65_public: str | None = None
    key_id: str = Field(pattern=r"^[0-9a-f]{32}$")


class PrivateFile(_File):
    xwing_seed: str
    ed25519_seed: str
    mldsa65_seed: str | None = None
    key_id: str = Field(pattern=r"^[0-9a-f]{32}$")


class PublicBundle:
    """A party's public keys: who it is, where it is, how to encrypt to it and verify it."""

    def __init__(
        self,
        *,
        party: str,
        jurisdiction: str,
        signature: SignatureSuite,
        xwing: XWingPublicKey,
        ed25519: bytes,
        mldsa65: bytes | None,
    ) -> None:
        self.party = party
        self.jurisdiction = jurisdiction
        self.signature = signature
        self.xwing = xwing
        self.ed25519 = Ed25519PublicKey.from_public_bytes(ed25519)
        self.mldsa65 = MLDSA65PublicKey.from_public_bytes(mldsa65) if mldsa65 else None
        self.key_id = key_id(xwing.raw, ed25519, mldsa65 or b"")

    def to_file(self) -> BundleFile:
        return BundleFile(
            format=BUNDLE_FORMAT,
            party=self.party,
            jurisdiction=self.jurisdiction,
            signature=self.signature,
            xwing_public=_b64(self.xwing.raw),
            ed25519_public=_b64(self.ed25519.public_bytes_raw()),
            mldsa65_public=_b64(self.mldsa65.public_bytes_raw()) if self.mldsa65 else None,
            key_id=self.key_id.hex(),
        )

    def signature_size(self) -> int:
        return ED25519_SIG_SIZE + (MLDSA65_SIG_SIZE if self.mldsa65 else 0)

    def verify(self, message: bytes, signature: bytes) -> bool:
        """True when ``signature`` is this party's (every part of a hybrid) over ``message``."""
        if len(signature) != self.signature_size():
            return False
        try:
            self.ed25519.verify(signature[:ED25519_SIG_SIZE], message)
            if self.mldsa65 is not None:
                self.mldsa65.verify(signature[ED25519_SIG_SIZE:], message, SIGNING_CONTEXT)
        except InvalidSignature:
            return False
        return True


class Keypair:
    """A party's private keys together with its public bundle."""

    def __init__(
        self,
        *,
        party: str,
        jurisdiction: str,
        signature: SignatureSuite,
        xwing_seed: bytes,
        ed25519_seed: bytes,
        mldsa65_seed: bytes | None,
    ) -> None:
        self.xwing = XWingPrivateKey(xwing_seed)
        self._ed25519_seed = ed25519_seed
        self._mldsa65_seed = mldsa65_seed
        self.ed25519 = Ed25519PrivateKey.from_private_bytes(ed25519_seed)
        self.mldsa65 = MLDSA65PrivateKey.from_seed_bytes(mldsa65_seed) if mldsa65_seed else None
        self.bundle = PublicBundle(
            party=party,
            jurisdiction=jurisdiction,
            signature=signature,
            xwing=self.xwing.public_key(),
            ed25519=self.ed25519.public_key().public_bytes_raw(),
            mldsa65=self.mldsa65.public_key().public_bytes_raw() if self.mldsa65 else None,
        )

    @classmethod
    def generate(
        cls, party: str, jurisdiction: str, signature: SignatureSuite = "ed25519"
    ) -> Keypair:
        return cls(
            party=party,
            jurisdiction=jurisdiction,
            signature=signature,
            xwing_seed=os.urandom(SEED_SIZE),
            ed25519_seed=os.urandom(32),
            mldsa65_seed=os.urandom(32) if signature == "ed25519+mldsa65" else None,
        )

    def sign(self, message: bytes) -> bytes:
        sig = self.ed25519.sign(message)
        if self.mldsa65 is not None:
            sig += self.mldsa65.sign(message, SIGNING_CONTEXT)
        return sig

    def to_file(self) -> PrivateFile:
        return PrivateFile(
            format=PRIVATE_FORMAT,
            party=self.bundle.party,
            jurisdiction=self.bundle.jurisdiction,
            signature=self.bundle.signature,
            xwing_seed=_b64(self.xwing.seed),
            ed25519_seed=_b64(self._ed25519_seed),
            mldsa65_seed=_b64(self._mldsa65_seed) if self._mldsa65_seed else None,
            key_id=self.bundle.key_id.hex(),
        )


def private_key_path(directory: Path, party: str) -> Path:
    return directory / f"{party}.key.json"


def bundle_path(directory: Path, party: str) -> Path:
    return directory / f"{party}.pub.json"


def write_private(path: Path, data: bytes) -> None:
    """Create ``path`` readable by its owner only (0600); never overwrite a key."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise KeyFileError(
            f"{path}: already exists; keys are never overwritten: remove it yourself "
            "or choose another --out"
        ) from None
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
    os.chmod(path, 0o600)  # whatever the umask, be explicit


def write_keys(keypair: Keypair, directory: Path) -> tuple[Path, Path]:
    """Write ``PARTY.key.json`` (mode 0600, never overwritten) and ``PARTY.pub.json``."""
    directory.mkdir(parents=True, exist_ok=True)
    party = keypair.bundle.party
    private, public = private_key_path(directory, party), bundle_path(directory, party)
    write_private(private, keypair.to_file().model_dump_json(indent=2).encode() + b"\n")
    public.write_text(keypair.bundle.to_file().model_dump_json(indent=2) + "\n", encoding="utf-8")
    return private, public


def _load(model: type[_F], path: Path, what: str, expected_format: str) -> _F:
    """The key file or bundle at ``path``, validated; every problem a :class:`KeyFileError`."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise KeyFileError(
            f"{path}: no {what} here; create one with `fedciuic keys generate`"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise KeyFileError(f"{path}: not a readable {what} ({err})") from None
    if not isinstance(data, dict):
        raise KeyFileError(f"{path}: not a {what} (expected a JSON object)")
    try:
        loaded = model.model_validate(data)
    except ValidationError as err:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in err.errors()
        )
        raise KeyFileError(f"{path}: {problems}") from None
    if loaded.format != expected_format:
        raise KeyFileError(f"{path}:format: {loaded.format!r}, expected {expected_format!r}")
    return loaded


def load_bundle(path: Path) -> PublicBundle:
    """Read a public bundle and check that its key id matches its keys."""
    data = _load(BundleFile, path, "public bundle", BUNDLE_FORMAT)
    bundle = PublicBundle(
        party=data.party,
        jurisdiction=data.jurisdiction,
        signature=data.signature,
        xwing=XWingPublicKey(_unb64(data, "xwing_public", 1216, path)),
        ed25519=_unb64(data, "ed25519_public", 32, path),
        mldsa65=_unb64(data, "mldsa65_public", 1952, path) if data.mldsa65_public else None,
    )
    _check_suite(path, data.signature, data.mldsa65_public)
    if bundle.key_id.hex() != data.key_id:
        raise KeyFileError(
            f"{path}:key_id: {data.key_id} does not match the keys in the file "
            f"({bundle.key_id.hex()}); the bundle was altered: ask its owner for a new copy"
        )
    return bundle


def load_keypair(path: Path) -> Keypair:
    """Read a private key file; it must be readable by its owner only."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise KeyFileError(
            f"{path}: no private key here; create one with `fedciuic keys generate`"
        ) from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise KeyFileError(
            f"{path}: private key is accessible by others (mode {stat.S_IMODE(mode):o}); "
            f"run `chmod 600 {path}` and rotate the key if others could read it"
        )
    data = _load(PrivateFile, path, "private key file", PRIVATE_FORMAT)
    _check_suite(path, data.signature, data.mldsa65_seed)
    keypair = Keypair(
        party=data.party,
        jurisdiction=data.jurisdiction,
        signature=data.signature,
        xwing_seed=_unb64(data, "xwing_seed", SEED_SIZE, path),
        ed25519_seed=_unb64(data, "ed25519_seed", 32, path),
        mldsa65_seed=_unb64(data, "mldsa65_seed", 32, path) if data.mldsa65_seed else None,
    )
    if keypair.bundle.key_id.hex() != data.key_id:
        raise KeyFileError(
            f"{path}:key_id: does not match the keys in the file; the file is corrupted: "
            "restore it from a backup or generate new keys"
        )
    return keypair


def _check_suite(path: Path, suite: str, mldsa: str | None) -> None:
    if (suite == "ed25519+mldsa65") != bool(mldsa):
        raise KeyFileError(
            f"{path}:signature: {suite!r} does not match the keys present (ML-DSA-65 key "
            f"{'present' if mldsa else 'missing'})"
        )


def load_bundles(directory: Path) -> dict[bytes, PublicBundle]:
    """All ``*.pub.json`` bundles of a folder, by key id."""
    if not directory.is_dir():
        raise KeyFileError(
            f"{directory}: no such folder of public bundles; put each region's PARTY.pub.json there"
        )
    return {b.key_id: b for b in map(load_bundle, sorted(directory.glob("*.pub.json")))}
