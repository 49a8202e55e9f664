"""The secure sum's messages, typed and validated (pydantic) before either end uses them,
and what each signature covers.

A region signs each message with its identity key over the session id (every field of
the session), the phase and the content, so a relay or aggregator cannot replay one from
another round, move it to another phase, or attribute it to another region.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping, Sequence
from enum import StrEnum
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from fedciuic.crypto import NAME_PATTERN, PUBLIC_KEY_SIZE
from fedciuic.errors import FedciuicError
from fedciuic.secagg.ddp import DistributedDp, normed_scale, scale_for
from fedciuic.secagg.masking import MAX_BITS, MIN_BITS, SKETCH_BYTES, Ring
from fedciuic.secagg.rotation import block

#: Domain separation of every signed secure-sum message, versioned with this layout.
DOMAIN = "fedciuic-secagg/2"

Name = Annotated[str, Field(pattern=NAME_PATTERN)]


class Phase(StrEnum):
    """The secure sum's phases, in order: each region takes part in each at most once."""

    ADVERT = "advert"  # ephemeral key, signed
    SHARES = "shares"  # seed shares and pair seeds, sealed to each peer
    MASKED = "masked"  # the masked vector
    CONSENT = "consent"  # signature on the survivors
    REVEAL = "reveal"  # shares that unmask the survivors' sum


class SecAggError(FedciuicError):
    """A refused secure-sum message or request: the reason names phase, region and fault."""

    public_reason = True


class Message(BaseModel):
    model_config = ConfigDict(
        frozen=True, extra="forbid", strict=True, ser_json_bytes="base64", val_json_bytes="base64"
    )


class Session(Message):
    """What one secure sum is over: proposed by the aggregator, checked by each region."""

    run_id: int = Field(ge=0)
    server_round: int = Field(ge=0)
    regions: tuple[Name, ...]
    threshold: int
    bits: int = Field(ge=MIN_BITS, le=MAX_BITS)
    size: int = Field(ge=1)
    #: Each region's clip, the fixed point's scale (ring units per unit), and the
    #: distributed noise multiplier (0: none): the same for every region.
    clip: float = Field(gt=0, allow_inf_nan=False)
    scale: float = Field(gt=0, allow_inf_nan=False)
    noise: float = Field(ge=0, allow_inf_nan=False)
    #: The regions' sent norms added up, which the scale follows (0: the clip). Any value
    #: is safe: one scale for all gives the aggregator a function of the sum only.
    bound: float = Field(default=0.0, ge=0, allow_inf_nan=False)

    @field_validator("regions")
    @classmethod
    def _distinct(cls, regions: tuple[str, ...]) -> tuple[str, ...]:
        twice = sorted({r for r in regions if regions.count(r) > 1})
        if twice:
            raise ValueError(f"{', '.join(twice)} listed more than once")
        if list(regions) != sorted(regions):
            raise ValueError("not in sorted order")
        if len(regions) < 2:
            raise ValueError("a secure sum needs at least 2 regions")
        return regions

    @model_validator(mode="after")
    def _check(self) -> Session:
        # More than half: two survivor sets cannot both gather a threshold of signatures.
        if not len(self.regions) // 2 < self.threshold <= len(self.regions):
            raise ValueError(
                f"threshold {self.threshold} is not more than half of the "
                f"{len(self.regions)} regions (and at most all of them)"
            )
        if self.bound and self.noise:
            raise ValueError("a sum with distributed noise is scaled by its clip, not by norms")
        return self

    @classmethod
    def propose(
        cls,
        *,
        run_id: int,
        server_round: int,
        regions: tuple[str, ...],
        threshold: int,
        bits: int,
        size: int,
        clip: float,
        noise: float,
        bound: float = 0.0,
    ) -> Session:
        """The session at the finest scale its sum fits the ring at, by the regions' norms
        (``bound``) or the clip (:class:`~fedciuic.secagg.masking.RingTooSmall`: none)."""
        if bound:
            scale = normed_scale(bound=bound, regions=len(regions), size=size, ring=Ring(bits))
        else:
            scale = scale_for(
                regions=len(regions),
                threshold=threshold,
                clip=clip,
                noise=noise,
                dim=size,
                block=block(size),
                ring=Ring(bits),
            )
        return cls(
            run_id=run_id,
            server_round=server_round,
            regions=regions,
            threshold=threshold,
            bits=bits,
            size=size,
            clip=clip,
            scale=scale,
            noise=noise,
            bound=bound,
        )

    def terms(self) -> dict[str, Any]:
        """What :meth:`propose` takes: every field but the scale it derives from them."""
        return self.model_dump(exclude={"scale"})

    def distributed(self) -> DistributedDp:
        """The fixed point and noise every region of the session applies."""
        return DistributedDp(
            self.clip, self.scale, self.noise, self.threshold, self.size, block(self.size)
        )

    def index(self, region: str) -> int:
        """The region's position, from 1 (Shamir's holder; who adds and who subtracts)."""
        return self.regions.index(region) + 1

    def derives(self, region: str, peer: str) -> bool:
        """Whether ``region`` derives (and seals) its pair seed with ``peer``, else ``peer``
        does: each derives for the half of the others that follow it round the circle."""
        n, i, j = len(self.regions), self.index(region), self.index(peer)
        ahead = (j - i) % n
        return ahead < n - ahead or (ahead == n - ahead and i < j)

    def sid(self) -> bytes:
        """The session id every signature in this secure sum covers."""
        return hashlib.sha256(signable(DOMAIN, self.model_dump())).digest()


class FromRegion(Message):
    """A message a region sends the aggregator, under its name."""

    region: Name


class Advert(FromRegion):
    """A region's ephemeral X-Wing key for this session, derived from its key seed."""

    key: bytes = Field(min_length=PUBLIC_KEY_SIZE, max_length=PUBLIC_KEY_SIZE)
    signature: bytes


class SealedItem(Message):
    """The sender's seed shares sealed to the recipient's identity key, and (from the one
    that derives it) their pair seed sealed to the recipient's ephemeral key."""

    sender: Name
    to: Name
    shares: bytes
    pair: bytes | None = None
    signature: bytes


class Shares(FromRegion):
    items: tuple[SealedItem, ...]


class Masked(FromRegion):
    vector: bytes
    #: The masked wrap check (:func:`~fedciuic.secagg.masking.sketch`).
    sketch: bytes = Field(min_length=SKETCH_BYTES, max_length=SKETCH_BYTES)
    signature: bytes


class Consent(FromRegion):
    """A region's signature on the survivors: those whose masked vectors are summed."""

    survivors: tuple[Name, ...]
    signature: bytes


class Reveal(FromRegion):
    """Shares of survivors' self seeds and dropped regions' key seeds, never both for one."""

    self_shares: dict[Name, int]
    key_shares: dict[Name, int]
    signature: bytes


_M = TypeVar("_M", bound=Message)


def signable(*parts: Any) -> bytes:
    """A signable encoding of what a signature covers."""
    return json.dumps(parts, sort_keys=True, separators=(",", ":"), default=_bytes).encode()


def _bytes(value: object) -> str:
    if isinstance(value, bytes | bytearray):
        return bytes(value).hex()
    raise TypeError(f"{type(value).__name__} is not signable")


def to_sign(session: Session, phase: Phase, region: str, content: Mapping[str, Any]) -> bytes:
    """What a region signs in ``phase`` of ``session``."""
    return signable(DOMAIN, session.sid(), phase.value, region, dict(content))


# What each phase's signature covers besides the session, phase and region.


def consent_content(survivors: Sequence[str]) -> dict[str, object]:
    return {"survivors": list(survivors)}


def sealed_content(item: SealedItem) -> dict[str, object]:
    return {"to": item.to, "shares": item.shares, "pair": item.pair}


def masked_content(vector: bytes, sketch: bytes) -> dict[str, object]:
    """The masked vector's SHA-256 (not megabytes of hex in the signed text), and sketch."""
    return {"vector": hashlib.sha256(vector).digest(), "sketch": sketch}


def reveal_content(reveal: Reveal) -> dict[str, object]:
    return {"self": reveal.self_shares, "key": reveal.key_shares}


def parse(model: type[_M], data: object, phase: Phase) -> _M:
    """An untrusted message typed, or :class:`SecAggError` naming the first bad field."""
    try:
        if isinstance(data, bytes | str):
            return model.model_validate_json(data)
        return model.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or model.__name__
        raise SecAggError(
            f"secure sum, {phase.value}: malformed {model.__name__} ({where}: {first['msg']})"
        ) from None


class Request(Message):
    """What the aggregator asks a region in one phase: the session and the phase's input."""

    phase: Phase
    session: Session
    adverts: tuple[Advert, ...] = ()  # shares: the regions that joined
    shared: tuple[Name, ...] = ()  # masked: the regions that shared
    items: tuple[SealedItem, ...] = ()  # masked: what they sealed to this region
    survivors: tuple[Name, ...] = ()  # consent, reveal
    consents: tuple[Consent, ...] = ()  # reveal


#: An answer on the wire: its JSON's length (u32, little-endian), the JSON, and a masked
#: vector's raw bytes (base64 would be a third larger).
_HEAD = struct.Struct("<I")


def pack_answer(message: FromRegion) -> bytes:
    """A region's message as it travels."""
    blob = message.vector if isinstance(message, Masked) else b""
    head = message.model_copy(update={"vector": b""}) if blob else message
    text = head.model_dump_json().encode()
    return _HEAD.pack(len(text)) + text + blob


def unpack_answer(data: bytes, phase: Phase) -> bytes | Masked:
    """:func:`pack_answer`'s inverse: the JSON (parsed where taken), or a whole masked message."""
    if len(data) < _HEAD.size or _HEAD.unpack_from(data)[0] > len(data) - _HEAD.size:
        raise SecAggError(f"secure sum, {phase.value}: a truncated answer")
    (size,) = _HEAD.unpack_from(data)
    text, blob = data[_HEAD.size : _HEAD.size + size], data[_HEAD.size + size :]
    if phase != Phase.MASKED:
        if blob:
            raise SecAggError(f"secure sum, {phase.value}: bytes past the answer")
        return text
    return parse(Masked, text, phase).model_copy(update={"vector": blob})
