"""The aggregator's end of the secure sum: it relays what the regions send each other,
checks every message it takes (typed, signed by the region it names, for this session
and phase, once), and learns the survivors' sum and nothing else.

A phase that ends with fewer regions than the threshold withholds the sum
(:class:`SumWithheld`); a message that fails a check is refused alone, on the record.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from fedciuic.crypto import PublicBundle
from fedciuic.errors import FedciuicError
from fedciuic.secagg.masking import SKETCH_BITS, SKETCH_LABEL, Ring, from_ring, sketch, unmask
from fedciuic.secagg.messages import (
    Advert,
    Consent,
    FromRegion,
    Masked,
    Phase,
    Request,
    Reveal,
    SealedItem,
    SecAggError,
    Session,
    Shares,
    consent_content,
    masked_content,
    parse,
    reveal_content,
    sealed_content,
    to_sign,
)
from fedciuic.secagg.rotation import unrotate
from fedciuic.secagg.seeds import PAIR, SEALED_PAIR, SEALED_SHARES, ephemeral, open_with, pair_seed
from fedciuic.secagg.shamir import (
    PRIME,
    SEED_BYTES,
    MalformedShare,
    NotEnoughShares,
    Share,
    combine,
)

#: Standard deviations of the noise a sum's norm may carry before it is out of range.
_SPREAD = 6.0
#: How the aggregator reaches the regions in one phase: each region's request in, the
#: answers that came back out (Flower's relay in a federation, a call in one process).
Ask = Callable[[Phase, Mapping[str, Request]], list[object]]
_M = TypeVar("_M", bound=FromRegion)
_T = TypeVar("_T")


class SumWithheld(FedciuicError):
    """Fewer regions than the threshold at some phase: the sum is not computed."""

    def __init__(self, phase: Phase, got: int, needed: int) -> None:
        self.phase, self.got, self.needed = phase, got, needed
        super().__init__(
            f"secure sum withheld at {phase.value}: {got} region(s), the threshold is {needed}"
        )


@dataclass(frozen=True)
class Refusal:
    """A message the aggregator did not take, and why."""

    phase: Phase
    region: str
    reason: str


@dataclass
class SecureSum:
    """One session's messages as the aggregator has taken them, phase by phase."""

    session: Session
    bundles: Mapping[str, PublicBundle]
    refused: list[Refusal] = field(default_factory=list)
    adverts: dict[str, Advert] = field(default_factory=dict)
    shares: dict[str, Shares] = field(default_factory=dict)
    #: The regions whose masked vectors were taken (U3), each added to ``total`` as it
    #: comes (none is kept on its own), and their sketches to ``hashes``.
    masked: dict[str, bool] = field(default_factory=dict)
    total: np.ndarray | None = None
    hashes: np.ndarray | None = None
    consents: dict[str, Consent] = field(default_factory=dict)
    reveals: dict[str, Reveal] = field(default_factory=dict)

    def run(self, ask: Ask) -> np.ndarray:
        """The five phases through ``ask``; the survivors' sum (ring elements)."""

        def request(phase: Phase, **fields: object) -> Request:
            return Request.model_validate({"phase": phase, "session": self.session, **fields})

        regions = self.session.regions
        adverts = self.take_adverts(ask(Phase.ADVERT, {r: request(Phase.ADVERT) for r in regions}))
        shared = self.take_shares(
            ask(Phase.SHARES, {a.region: request(Phase.SHARES, adverts=adverts) for a in adverts})
        )
        items = {r: self.items_for(r) for r in shared}
        survivors = self.take_masked(
            ask(
                Phase.MASKED,
                {r: request(Phase.MASKED, shared=shared, items=items[r]) for r in shared},
            )
        )
        consents = self.take_consents(
            ask(Phase.CONSENT, {r: request(Phase.CONSENT, survivors=survivors) for r in shared})
        )
        reveal = request(Phase.REVEAL, survivors=survivors, consents=consents)
        return self.take_reveals(ask(Phase.REVEAL, {c.region: reveal for c in consents}))

    # -- phase by phase ------------------------------------------------------------------

    def take_adverts(self, replies: Iterable[object]) -> tuple[Advert, ...]:
        """The adverts taken (U1), which every region that joined is sent."""

        def check(region: str, advert: Advert) -> Advert:
            self._check(Phase.ADVERT, region, {"key": advert.key}, advert.signature)
            return advert

        self._take(Phase.ADVERT, Advert, replies, self.session.regions, self.adverts, check)
        return tuple(self.adverts[r] for r in sorted(self.adverts))

    def take_shares(self, replies: Iterable[object]) -> tuple[str, ...]:
        """The regions whose shares were taken (U2)."""

        def check(region: str, shares: Shares) -> Shares:
            expected = sorted(set(self.adverts) - {region})
            if sorted(item.to for item in shares.items) != expected:
                raise SecAggError(f"items for {[i.to for i in shares.items]}, not for {expected}")
            for item in shares.items:
                self._check_item(region, item)
            return shares

        self._take(Phase.SHARES, Shares, replies, self.adverts, self.shares, check)
        return tuple(sorted(self.shares))

    def items_for(self, region: str) -> tuple[SealedItem, ...]:
        """What the regions that shared sealed to ``region``, for it to mask with."""
        return tuple(i for s in self.shares.values() for i in s.items if i.to == region)

    def take_masked(self, replies: Iterable[object]) -> tuple[str, ...]:
        """The survivors (U3): the regions whose masked vectors were taken."""
        ring, wide = Ring(self.session.bits), Ring(SKETCH_BITS)

        def check(region: str, masked: Masked) -> bool:
            if len(masked.vector) != ring.size(self.session.size):
                raise SecAggError(f"{len(masked.vector)} bytes, not {self.session.size} values")
            content = masked_content(masked.vector, masked.sketch)
            self._check(Phase.MASKED, region, content, masked.signature)
            try:
                values = ring.unpack(masked.vector, self.session.size)
            except ValueError as err:
                raise SecAggError(str(err)) from None
            hashes = np.frombuffer(masked.sketch, "<u8").astype(np.uint64)
            self.total = ring.reduce(values if self.total is None else self.total + values)
            self.hashes = wide.reduce(hashes if self.hashes is None else self.hashes + hashes)
            return True

        self._take(Phase.MASKED, Masked, replies, self.shares, self.masked, check)
        return tuple(sorted(self.masked))

    def take_consents(self, replies: Iterable[object]) -> tuple[Consent, ...]:
        """The consents on the survivors taken, which every survivor is shown."""
        survivors = tuple(sorted(self.masked))

        def check(region: str, consent: Consent) -> Consent:
            if consent.survivors != survivors:
                raise SecAggError("a consent on another survivor set")
            self._check(Phase.CONSENT, region, consent_content(survivors), consent.signature)
            return consent

        self._take(Phase.CONSENT, Consent, replies, self.masked, self.consents, check)
        return tuple(self.consents[r] for r in sorted(self.consents))

    def take_reveals(self, replies: Iterable[object]) -> np.ndarray:
        """The survivors' plain sum (ring elements), from a threshold of reveals."""
        survivors = set(self.masked)
        dropped = set(self.shares) - survivors

        def check(region: str, reveal: Reveal) -> Reveal:
            if set(reveal.self_shares) != survivors or set(reveal.key_shares) != dropped:
                raise SecAggError("shares for other regions than the survivors and the dropped")
            values = [*reveal.self_shares.values(), *reveal.key_shares.values()]
            if any(not 0 <= v < PRIME for v in values):
                raise SecAggError("a share outside the field")
            self._check(Phase.REVEAL, region, reveal_content(reveal), reveal.signature)
            return reveal

        self._take(Phase.REVEAL, Reveal, replies, self.consents, self.reveals, check)
        return self._unmask(survivors, dropped)

    # -- the sum ---------------------------------------------------------------------

    def _unmask(self, survivors: set[str], dropped: set[str]) -> np.ndarray:
        """The plain sum, once its sketch shows it did not wrap."""
        s = self.session
        sid = s.sid()
        self_seeds = {s.index(r): self._recover(r, self_seed=True) for r in survivors}
        pairs: dict[tuple[int, int], bytes] = {}
        for gone in dropped:
            key_seed = self._recover(gone, self_seed=False)
            eph = ephemeral(key_seed, sid)
            for survivor in survivors:
                if s.derives(gone, survivor):
                    seed = pair_seed(key_seed, sid, gone, survivor)
                else:
                    item = next(i for i in self.shares[survivor].items if i.to == gone)
                    assert item.pair is not None  # checked when taken
                    seed = open_with(
                        eph,
                        item.pair,
                        size=SEED_BYTES,
                        sid=sid,
                        purpose=PAIR,
                        sender=survivor,
                        to=gone,
                    )
                pairs[s.index(survivor), s.index(gone)] = seed
        # a threshold (2 or more) of masked vectors came
        assert self.total is not None and self.hashes is not None
        indices = [s.index(r) for r in survivors]

        def unmasked(values: np.ndarray, bits: int, label: bytes = b"") -> np.ndarray:
            return unmask(
                values,
                survivors=indices,
                self_seeds=self_seeds,
                dropped_pairs=pairs,
                ring=Ring(bits),
                label=label,
            )

        total = unmasked(self.total, s.bits)
        hashes = unmasked(self.hashes, SKETCH_BITS, SKETCH_LABEL)
        if not np.array_equal(sketch(total, s.bits, sid), hashes):
            raise SecAggError(
                f"the sum wrapped around its {s.bits}-bit ring (its sketch is not the sum's): "
                "a region's update was past the norm it sent, or its vector is not what it "
                "declared; the sum is withheld (raise secure-ring-bits if it recurs)"
            )
        return total

    def _recover(self, region: str, *, self_seed: bool) -> bytes:
        """``region``'s self seed (or key seed) from the shares the reveals hold."""
        shares = [
            Share(
                self.session.index(holder), (v.self_shares if self_seed else v.key_shares)[region]
            )
            for holder, v in self.reveals.items()
        ]
        try:
            return combine(shares, self.session.threshold)
        except (MalformedShare, NotEnoughShares) as err:
            raise SecAggError(
                f"secure sum: the seed of {region} does not come back: {err}"
            ) from None

    def mean(self, total: np.ndarray) -> np.ndarray:
        """The survivors' mean update, unrotated, once their sum is within what that many
        clipped updates (and their noise) can reach: past it, some vector is not honest."""
        s = self.session
        summed = from_ring(total, scale=1.0, ring=Ring(s.bits))  # ring units
        ddp = s.distributed()
        n = len(self.masked)
        bound = n * ddp.l2 + _SPREAD * math.sqrt(s.size * n * ddp.share_variance)
        norm = float(np.linalg.norm(summed))
        if norm > bound:
            raise SecAggError(
                f"the sum of {n} updates has norm {norm / s.scale:.4g}, over the "
                f"{bound / s.scale:.4g} that {n} updates clipped to {s.clip:g} (and their "
                "noise) can reach: some region's masked vector is not what it declared"
            )
        return unrotate(summed / s.scale / n, s.sid())

    def record(self) -> dict[str, object]:
        """Who took part in each phase, and what was refused, for the audit log."""
        return {
            "joined": sorted(self.adverts),
            "shared": sorted(self.shares),
            "survivors": sorted(self.masked),
            "dropped": sorted(set(self.shares) - set(self.masked)),
            "consents": sorted(self.consents),
            "revealed": sorted(self.reveals),
            "refused": [
                {"phase": r.phase.value, "region": r.region, "reason": r.reason[:300]}
                for r in self.refused
            ],
        }

    # -- checks ----------------------------------------------------------------------

    def _take(
        self,
        phase: Phase,
        model: type[_M],
        replies: Iterable[object],
        allowed: Collection[str],
        taken: dict[str, _T],
        check: Callable[[str, _M], _T],
    ) -> None:
        """Take each valid, expected, first reply in ``phase``; withhold below the threshold."""
        for raw in replies:
            region = "?"
            try:
                message = parse(model, raw, phase)
                region = message.region
                if region not in allowed:
                    raise SecAggError(f"{region!r} is not expected in this phase")
                if region in taken:
                    raise SecAggError(f"a second {phase.value} from {region!r} (a replay?)")
                taken[region] = check(region, message)
            except SecAggError as err:
                self.refused.append(Refusal(phase, region, str(err)))
        if len(taken) < self.session.threshold:
            raise SumWithheld(phase, len(taken), self.session.threshold)

    def _check(
        self, phase: Phase, region: str, content: Mapping[str, object], signature: bytes
    ) -> None:
        bundle = self.bundles.get(region)
        if bundle is None or not bundle.verify(
            to_sign(self.session, phase, region, content), signature
        ):
            raise SecAggError(f"not signed by {region!r} for this session and phase")

    def _check_item(self, region: str, item: SealedItem) -> None:
        s = self.session
        if item.sender != region:
            raise SecAggError(f"an item from {item.sender!r} in the shares of {region!r}")
        owns = s.derives(region, item.to)
        if len(item.shares) != SEALED_SHARES or (item.pair is not None) != owns:
            raise SecAggError(f"the item for {item.to!r} has the wrong shape")
        if item.pair is not None and len(item.pair) != SEALED_PAIR:
            raise SecAggError(f"the pair seed for {item.to!r} has the wrong size")
        self._check(Phase.SHARES, region, sealed_content(item), item.signature)
