"""A region's end of the secure sum: it runs in the region's own agent, with its identity
key and its peers' public bundles, and takes each phase once, in order, checking
everything the aggregator relays before using it. What protects the region's update:

* the session is one it agrees to (it is named, its peers are known, the threshold is
  more than half and at least its policy minimum);
* every advert, sealed item and consent it uses is signed by the region it names, for
  this session and phase (a relay cannot replay, reorder or inject one);
* it masks only holding an item from every other region said to have shared;
* it reveals once per session, only with a threshold of signatures on the survivor set it
  signed itself, and never both seeds' shares of one region (none that sent is unmasked).
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping, Sequence
from functools import partial
from pathlib import Path

import numpy as np

from fedciuic.crypto import Keypair, PublicBundle, XWingPrivateKey, XWingPublicKey
from fedciuic.secagg.masking import SKETCH_BITS, SKETCH_LABEL, Ring, mask, sketch
from fedciuic.secagg.messages import (
    Advert,
    Consent,
    Masked,
    Phase,
    Reveal,
    SealedItem,
    SecAggError,
    Session,
    Shares,
    consent_content,
    masked_content,
    reveal_content,
    sealed_content,
    to_sign,
)
from fedciuic.secagg.seeds import (
    PAIR,
    SHARE_BYTES,
    SHARES,
    ephemeral,
    open_with,
    pair_seed,
    seal_to,
    share_bytes,
    share_value,
)
from fedciuic.secagg.shamir import SEED_BYTES, split
from fedciuic.secagg.store import SessionStore, StoredSum


class SecureSumRegion:
    """A region's secure sums, each phase at most once (with a ``store``, across restarts)."""

    def __init__(
        self,
        keypair: Keypair,
        peers: Mapping[str, PublicBundle],
        *,
        min_regions: int = 2,
        store: Path | None = None,
    ) -> None:
        self.keypair = keypair
        self.me = keypair.bundle.party
        self.peers = dict(peers)
        self.min_regions = min_regions
        self.store = SessionStore(store) if store is not None else None
        self._sums: dict[bytes, StoredSum] = {}
        self._updates: dict[bytes, np.ndarray] = {}  # encoded, until masked

    # -- phases ----------------------------------------------------------------------

    def advertise(self, session: Session, encoded: np.ndarray) -> Advert:
        """Join ``session`` with this region's encoded (ring) update: its ephemeral key."""
        self._check_session(session, encoded)
        sid = session.sid()
        if self._known(session) is not None:
            raise self._refuse(session, Phase.ADVERT, "this session was already joined")
        state = StoredSum(
            session=session,
            done=Phase.ADVERT,
            self_seed=os.urandom(SEED_BYTES),
            key_seed=os.urandom(SEED_BYTES),
        )
        vector = Ring(session.bits).reduce(encoded)
        self._updates[sid] = vector
        if self.store is not None:
            self.store.save_update(session, vector)
        self._commit(state)
        key = ephemeral(state.key_seed, sid).public_key().raw
        return Advert(
            region=self.me, key=key, signature=self._sign(session, Phase.ADVERT, {"key": key})
        )

    def share(self, session: Session, adverts: Sequence[Advert]) -> Shares:
        """Seal this region's seed shares to each region that joined, and its pair seeds."""
        state = self._state(session, Phase.SHARES)
        sid = session.sid()
        joined = {}
        for advert in adverts:
            if advert.region in joined or advert.region not in session.regions:
                raise self._refuse(
                    session, Phase.SHARES, f"advert of {advert.region!r} is unexpected"
                )
            self._verify(
                session, Phase.ADVERT, advert.region, {"key": advert.key}, advert.signature
            )
            joined[advert.region] = XWingPublicKey(advert.key)
        mine = ephemeral(state.key_seed, sid).public_key().raw
        if self.me not in joined or joined[self.me].raw != mine:
            raise self._refuse(
                session, Phase.SHARES, "this region's own advert is missing or altered"
            )
        self._enough(session, Phase.SHARES, joined, "regions joined")
        holders = {r: session.index(r) for r in sorted(joined)}
        b_shares = split(state.self_seed, session.threshold, list(holders.values()))
        k_shares = split(state.key_seed, session.threshold, list(holders.values()))
        items = []
        held = {}
        for (region, _), b, k in zip(holders.items(), b_shares, k_shares, strict=True):
            if region == self.me:
                held[self.me] = (b.value, k.value)
                continue
            plain = share_bytes(b.value) + share_bytes(k.value)
            sealed = seal_to(
                self.peers[region].xwing, plain, sid=sid, purpose=SHARES, sender=self.me, to=region
            )
            pair = None
            if session.derives(self.me, region):
                seed = pair_seed(state.key_seed, sid, self.me, region)
                pair = seal_to(
                    joined[region], seed, sid=sid, purpose=PAIR, sender=self.me, to=region
                )
            unsigned = SealedItem(
                sender=self.me, to=region, shares=sealed, pair=pair, signature=b""
            )
            signature = self._sign(session, Phase.SHARES, sealed_content(unsigned))
            items.append(unsigned.model_copy(update={"signature": signature}))
        keys = {r: key.raw for r, key in joined.items()}
        self._commit(state.model_copy(update={"done": Phase.SHARES, "keys": keys, "held": held}))
        return Shares(region=self.me, items=tuple(items))

    def masked(
        self, session: Session, shared: Sequence[str], items: Sequence[SealedItem]
    ) -> Masked:
        """The masked vector, given who shared and the items they sealed to this region."""
        state = self._state(session, Phase.MASKED)
        sid = session.sid()
        shared = tuple(shared)
        if len(set(shared)) != len(shared) or not set(shared) <= set(state.keys):
            raise self._refuse(
                session, Phase.MASKED, "the regions said to have shared did not all join"
            )
        if self.me not in shared:
            raise self._refuse(
                session, Phase.MASKED, "this region shared, but is not named as having shared"
            )
        self._enough(session, Phase.MASKED, shared, "regions shared")
        by_sender = {}
        for item in items:
            if item.to != self.me or item.sender not in shared or item.sender in by_sender:
                raise self._refuse(
                    session,
                    Phase.MASKED,
                    f"an item from {item.sender!r} to {item.to!r} is unexpected",
                )
            self._verify(session, Phase.SHARES, item.sender, sealed_content(item), item.signature)
            by_sender[item.sender] = item
        missing = sorted(set(shared) - set(by_sender) - {self.me})
        if missing:
            raise self._refuse(
                session,
                Phase.MASKED,
                f"no shares from {', '.join(missing)}: they were dropped on the way",
            )
        eph = ephemeral(state.key_seed, sid)
        pairs = {}
        held = dict(state.held)
        for sender, item in by_sender.items():
            plain = open_with(
                self.keypair.xwing,
                item.shares,
                size=2 * SHARE_BYTES,
                sid=sid,
                purpose=SHARES,
                sender=sender,
                to=self.me,
            )
            held[sender] = (share_value(plain[:SHARE_BYTES]), share_value(plain[SHARE_BYTES:]))
            pairs[session.index(sender)] = self._pair(session, state, eph, item)
        update = self._update(session)
        masking = partial(
            mask, me=session.index(self.me), self_seed=state.self_seed, pair_seeds=pairs
        )
        vector = masking(update, ring=Ring(session.bits))
        check = masking(
            sketch(update, session.bits, sid), ring=Ring(SKETCH_BITS), label=SKETCH_LABEL
        )
        data = Ring(session.bits).pack(vector)
        hashes = check.astype("<u8").tobytes()
        self._commit(
            state.model_copy(update={"done": Phase.MASKED, "held": held, "shared": shared})
        )
        self._updates.pop(sid, None)  # masked and on its way: not needed again
        if self.store is not None:
            self.store.drop_update(session)
        return Masked(
            region=self.me,
            vector=data,
            sketch=hashes,
            signature=self._sign(session, Phase.MASKED, masked_content(data, hashes)),
        )

    def consent(self, session: Session, survivors: Sequence[str]) -> Consent:
        """Sign the survivors (U3): those whose masked vectors the aggregator summed."""
        state = self._state(session, Phase.CONSENT)
        survivors = tuple(survivors)
        if len(set(survivors)) != len(survivors) or not set(survivors) <= set(state.shared):
            raise self._refuse(
                session, Phase.CONSENT, "the survivors are not all regions that shared"
            )
        if self.me not in survivors:
            raise self._refuse(
                session,
                Phase.CONSENT,
                "this region sent its masked vector but is named dropped: the relay or the "
                "aggregator dropped it",
            )
        self._enough(session, Phase.CONSENT, survivors, "survivors")
        self._commit(state.model_copy(update={"done": Phase.CONSENT, "survivors": survivors}))
        return Consent(
            region=self.me,
            survivors=survivors,
            signature=self._sign(session, Phase.CONSENT, consent_content(survivors)),
        )

    def reveal(
        self, session: Session, survivors: Sequence[str], consents: Sequence[Consent]
    ) -> Reveal:
        """The unmasking shares, once, given a threshold of consents on the set it signed."""
        state = self._state(session, Phase.REVEAL)
        survivors = tuple(survivors)
        if survivors != state.survivors:
            raise self._refuse(
                session, Phase.REVEAL, "asked to unmask another survivor set than the one it signed"
            )
        signed = set()
        for consent in consents:
            if consent.region not in state.shared or consent.survivors != survivors:
                raise self._refuse(
                    session, Phase.REVEAL, f"the consent of {consent.region!r} is not for this set"
                )
            self._verify(
                session,
                Phase.CONSENT,
                consent.region,
                consent_content(survivors),
                consent.signature,
            )
            signed.add(consent.region)
        self._enough(session, Phase.REVEAL, signed, "signatures on the survivors")
        dropped = [r for r in state.shared if r not in survivors]
        unsigned = Reveal(
            region=self.me,
            self_shares={r: state.held[r][0] for r in survivors},
            key_shares={r: state.held[r][1] for r in dropped},
            signature=b"",
        )
        signature = self._sign(session, Phase.REVEAL, reveal_content(unsigned))
        # recorded before the shares leave: the seeds and held shares are gone for good
        self._commit(StoredSum(session=session, done=Phase.REVEAL, survivors=survivors))
        return unsigned.model_copy(update={"signature": signature})

    # -- checks ----------------------------------------------------------------------

    def _pair(
        self, session: Session, state: StoredSum, eph: XWingPrivateKey, item: SealedItem
    ) -> bytes:
        sid = session.sid()
        if session.derives(self.me, item.sender):
            if item.pair is not None:
                raise self._refuse(
                    session, Phase.MASKED, f"{item.sender} sent a pair seed it does not own"
                )
            return pair_seed(state.key_seed, sid, self.me, item.sender)
        if item.pair is None:
            raise self._refuse(session, Phase.MASKED, f"{item.sender} sent no pair seed")
        return open_with(
            eph, item.pair, size=SEED_BYTES, sid=sid, purpose=PAIR, sender=item.sender, to=self.me
        )

    def _check_session(self, session: Session, encoded: np.ndarray) -> None:
        unknown = sorted(set(session.regions) - set(self.peers) - {self.me})
        if self.me not in session.regions:
            problem = "this region is not in the session"
        elif unknown:
            problem = f"no public bundle for {', '.join(unknown)}; add each peer's REGION.pub.json"
        elif session.threshold < self.min_regions:
            problem = (
                f"threshold {session.threshold} is below this region's minimum of "
                f"{self.min_regions} regions in a secure sum"
            )
        elif encoded.shape != (session.size,):
            problem = f"the update has {encoded.size} values, not {session.size}"
        else:
            return
        raise self._refuse(session, Phase.ADVERT, problem)

    def _known(self, session: Session) -> StoredSum | None:
        sid = session.sid()
        if sid not in self._sums and self.store is not None:
            stored = self.store.load(session)
            if stored is not None:
                self._sums[sid] = stored
        return self._sums.get(sid)

    def _update(self, session: Session) -> np.ndarray:
        """The encoded update this region joined ``session`` with."""
        sid = session.sid()
        if sid not in self._updates and self.store is not None:
            try:
                found = self.store.load_update(session)
            except SecAggError as err:
                raise self._refuse(session, Phase.MASKED, str(err)) from None
            if found is not None:
                self._updates[sid] = found
        if sid not in self._updates:
            raise self._refuse(session, Phase.MASKED, "the update it joined with is gone")
        return self._updates[sid]

    def _commit(self, state: StoredSum) -> None:
        """The session's new state: on disk (with a store) before any message leaves."""
        if self.store is not None:
            self.store.save(state)
        self._sums[state.session.sid()] = state

    def _state(self, session: Session, phase: Phase) -> StoredSum:
        try:
            state = self._known(session)
        except SecAggError as err:
            raise self._refuse(session, phase, str(err)) from None
        if state is None:
            raise self._refuse(session, phase, "this region did not join this session")
        order = list(Phase)
        if order.index(phase) != order.index(state.done) + 1:
            raise self._refuse(session, phase, f"this region's last phase was {state.done.value}")
        return state

    def _enough(self, session: Session, phase: Phase, regions: Collection[str], what: str) -> None:
        if len(regions) < session.threshold:
            raise self._refuse(
                session,
                phase,
                f"{len(regions)} {what}, fewer than the threshold {session.threshold}",
            )

    def _sign(self, session: Session, phase: Phase, content: Mapping[str, object]) -> bytes:
        return self.keypair.sign(to_sign(session, phase, self.me, content))

    def _verify(
        self,
        session: Session,
        phase: Phase,
        region: str,
        content: Mapping[str, object],
        signature: bytes,
    ) -> None:
        bundle = self.keypair.bundle if region == self.me else self.peers.get(region)
        if bundle is None or not bundle.verify(to_sign(session, phase, region, content), signature):
            raise self._refuse(
                session,
                phase,
                f"the {phase.value} of {region!r} is not signed by {region!r} for this session",
            )

    def _refuse(self, session: Session, phase: Phase, reason: str) -> SecAggError:
        return SecAggError(
            f"region {self.me}: secure sum of run {session.run_id} round {session.server_round}, "
            f"{phase.value}: {reason}; refusing"
        )
