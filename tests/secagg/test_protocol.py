"""The secure sum between real region and aggregator ends, their messages passed as JSON:
the unmasked sum is the plain sum exactly; regions that drop after masking (or while
unmasking) are recovered from; below the threshold nothing is revealed and the sum is
withheld on the record; a relay that replays, reorders, alters or drops a message is
caught; an aggregator that asks for the shares of a region that did send is refused."""

from __future__ import annotations

import numpy as np
import pytest

from fedciuic.secagg import Ring, ring_sum
from fedciuic.secagg.aggregator import SecureSum, SumWithheld
from fedciuic.secagg.lab import run_secure_sum
from fedciuic.secagg.messages import Masked, Phase, SecAggError, Session, unpack_answer
from fedciuic.secagg.region import SecureSumRegion
from tests.secagg.conftest import NAMES

RING = Ring(32)
SIZE = 256


def federation(
    keys, n: int, threshold: int, *, run_id: int = 7, server_round: int = 1, min_regions=2
):
    names = NAMES[:n]
    session = Session(
        run_id=run_id,
        server_round=server_round,
        regions=names,
        threshold=threshold,
        bits=RING.bits,
        size=SIZE,
        clip=1.0,
        scale=1.0,
        noise=0.0,
    )
    bundles = {r: keys[r].bundle for r in names}
    regions = {
        r: SecureSumRegion(
            keys[r], {p: b for p, b in bundles.items() if p != r}, min_regions=min_regions
        )
        for r in names
    }
    rng = np.random.default_rng(n)
    encoded = {r: RING.reduce(rng.integers(-(2**20), 2**20, SIZE)) for r in names}
    return session, regions, encoded, bundles


def through_masking(session, regions, encoded, bundles) -> tuple[str, ...]:
    """Adverts, shares and masked vectors, every region taking part: the survivors."""
    agg = SecureSum(session, bundles)
    adverts = agg.take_adverts([regions[r].advertise(session, encoded[r]) for r in session.regions])
    shared = agg.take_shares([regions[r].share(session, adverts) for r in session.regions])
    return agg.take_masked([regions[r].masked(session, shared, agg.items_for(r)) for r in shared])


def plain(encoded, who) -> np.ndarray:
    return ring_sum([encoded[r] for r in who], RING)


@pytest.mark.parametrize("n", range(2, 9))
def test_the_unmasked_sum_is_the_plain_sum_exactly(keys, n):
    session, regions, encoded, bundles = federation(keys, n, n // 2 + 1)
    relayed = {}

    def keep(phase, region, data):
        relayed[phase, region] = data
        return data

    total, run = run_secure_sum(session, regions, encoded, bundles, relay=keep)
    np.testing.assert_array_equal(total, plain(encoded, session.regions))
    assert not run.aggregator.refused and not run.refusals
    for r in session.regions:  # what the aggregator receives of one region is masked
        masked = unpack_answer(relayed[Phase.MASKED, r], Phase.MASKED)
        assert isinstance(masked, Masked)  # its vector travels as bytes, not in its JSON
        vector = masked.vector
        assert len(relayed[Phase.MASKED, r]) < len(vector) + 1024
        assert not np.array_equal(RING.unpack(vector, session.size), encoded[r])


@pytest.mark.parametrize("n", [2, 3, 4, 7, 8, 32])
def test_each_pair_seed_has_one_deriver_and_each_region_derives_about_half(n):
    """One region of each pair derives its seed and seals it to the other; each seals
    about (n - 1) / 2 of them (a post-quantum ciphertext each), not up to n - 1."""
    names = tuple(f"r{i:02d}" for i in range(n))
    session = Session(
        run_id=7,
        server_round=1,
        regions=names,
        threshold=n // 2 + 1,
        bits=16,
        size=SIZE,
        clip=1.0,
        scale=1.0,
        noise=0.0,
    )
    for a in names:
        for b in names:
            if a != b:
                assert session.derives(a, b) != session.derives(b, a), (a, b)
    derived = [sum(session.derives(a, b) for b in names if b != a) for a in names]
    assert sum(derived) == n * (n - 1) // 2
    assert max(derived) == n // 2 and min(derived) == (n - 1) // 2


@pytest.mark.parametrize("dropped", [("cn",), ("at", "eu")])
def test_regions_dropping_after_masking_leave_the_survivors_sum(keys, dropped):
    session, regions, encoded, bundles = federation(keys, 5, 3)
    total, run = run_secure_sum(
        session, regions, encoded, bundles, silent={Phase.MASKED: set(dropped)}
    )
    survivors = [r for r in session.regions if r not in dropped]
    np.testing.assert_array_equal(total, plain(encoded, survivors))
    assert set(run.aggregator.masked) == set(survivors)


def test_a_survivor_silent_while_unmasking_is_recovered_from_the_others(keys):
    session, regions, encoded, bundles = federation(keys, 5, 3)
    silent = {Phase.MASKED: {"br"}, Phase.REVEAL: {"de"}}
    total, run = run_secure_sum(session, regions, encoded, bundles, silent=silent)
    np.testing.assert_array_equal(total, plain(encoded, ["at", "cn", "de", "eu"]))
    assert "de" not in run.aggregator.reveals


@pytest.mark.parametrize("phase", [Phase.SHARES, Phase.MASKED, Phase.CONSENT, Phase.REVEAL])
def test_fewer_than_the_threshold_withholds_the_sum_and_reveals_nothing(keys, phase):
    session, regions, encoded, bundles = federation(keys, 5, 3)
    with pytest.raises(SumWithheld, match=f"withheld at {phase.value}: 2 region"):
        run_secure_sum(session, regions, encoded, bundles, silent={phase: {"at", "br", "cn"}})
    # asked anyway, with the consents of the two left, a region reveals nothing
    if phase == Phase.REVEAL:
        return
    for r in ("de", "eu"):
        with pytest.raises(SecAggError, match="refusing"):
            regions[r].reveal(session, ("de", "eu"), ())


def test_a_replayed_message_from_another_round_is_refused(keys):
    kept = {}

    def record(phase, region, data):
        kept[phase, region] = data
        return data

    earlier, regions, encoded, bundles = federation(keys, 3, 2, server_round=2)
    run_secure_sum(earlier, regions, encoded, bundles, relay=record)
    session, regions, encoded, _ = federation(keys, 3, 2, server_round=3)

    def replay(phase, region, data):
        return kept[phase, region] if (phase, region) == (Phase.MASKED, "at") else data

    total, run = run_secure_sum(session, regions, encoded, bundles, relay=replay)
    [refusal] = run.aggregator.refused
    assert (refusal.phase, refusal.region) == (Phase.MASKED, "at")
    assert "not signed by 'at' for this session" in refusal.reason
    np.testing.assert_array_equal(total, plain(encoded, ["br", "cn"]))
    assert "named dropped" in run.refusals["at"]


def test_a_message_moved_to_another_phase_or_sent_twice_is_refused(keys):
    session, regions, encoded, bundles = federation(keys, 3, 2)
    agg = SecureSum(session, bundles)
    adverts = [regions[r].advertise(session, encoded[r]).model_dump_json() for r in session.regions]
    agg.take_adverts([*adverts, adverts[0]])
    assert agg.refused[0].reason.endswith("a second advert from 'at' (a replay?)")
    with pytest.raises(SumWithheld):
        agg.take_shares(adverts)  # adverts where shares are due
    assert all("malformed Shares" in r.reason for r in agg.refused[1:])
    # a region asked out of order refuses
    with pytest.raises(SecAggError, match="masked: this region's last phase was advert"):
        regions["at"].masked(session, session.regions, ())


@pytest.mark.parametrize(
    ("phase", "alteration", "refusal"),
    [
        (Phase.MASKED, lambda d: d[:-4] + b"\0\0\0\0", "not signed by 'br'"),
        (Phase.MASKED, lambda d: d[:-1], "bytes, not 256 values"),
        (Phase.MASKED, lambda d: d[:3], "a truncated answer"),
        (Phase.ADVERT, lambda d: d + b"x", "bytes past the answer"),
        (Phase.ADVERT, lambda d: d.replace(b'"br"', b'"cn"'), "not signed by 'cn'"),
    ],
)
def test_a_relay_that_alters_a_message_is_caught(keys, phase, alteration, refusal):
    session, regions, encoded, bundles = federation(keys, 3, 2)

    def alter(at, region, data):
        return alteration(data) if (at, region) == (phase, "br") else data

    total, run = run_secure_sum(session, regions, encoded, bundles, relay=alter)
    [refused] = run.aggregator.refused
    assert refused.phase == phase and refusal in refused.reason
    np.testing.assert_array_equal(total, plain(encoded, ["at", "cn"]))  # the sum goes on


def test_a_dropped_share_is_named_by_the_region_that_misses_it(keys):
    session, regions, encoded, bundles = federation(keys, 3, 2)
    agg = SecureSum(session, bundles)
    adverts = agg.take_adverts([regions[r].advertise(session, encoded[r]) for r in session.regions])
    shared = agg.take_shares([regions[r].share(session, adverts) for r in session.regions])
    items = [i for i in agg.items_for("cn") if i.sender != "at"]
    with pytest.raises(SecAggError, match="no shares from at: they were dropped on the way"):
        regions["cn"].masked(session, shared, items)


def test_a_region_whose_masked_vector_was_dropped_will_not_consent(keys):
    session, regions, encoded, bundles = federation(keys, 3, 2)
    _, run = run_secure_sum(
        session,
        regions,
        encoded,
        bundles,
        relay=lambda p, r, d: None if (p, r) == (Phase.MASKED, "at") else d,
    )
    assert "sent its masked vector but is named dropped" in run.refusals["at"]


def test_an_aggregator_asking_for_the_shares_of_a_region_that_sent_is_refused(keys):
    """The classic attack: unmask a region that did send (its self seed) and also
    recover its key seed (by calling it dropped), which would open its update alone."""
    session, regions, encoded, bundles = federation(keys, 5, 3)
    _, run = run_secure_sum(session, regions, encoded, bundles)
    consents = tuple(run.aggregator.consents.values())
    without_at = tuple(r for r in session.regions if r != "at")
    for r in without_at:  # a second unmasking, now calling "at" dropped
        with pytest.raises(SecAggError, match="reveal: this region's last phase was reveal"):
            regions[r].reveal(session, without_at, consents)


def test_an_aggregator_showing_regions_different_survivors_gets_no_shares(keys):
    session, regions, encoded, bundles = federation(keys, 5, 3)
    survivors = through_masking(session, regions, encoded, bundles)
    # "at", "br" are shown the full set; "cn", "de", "eu" a set without "at"
    without_at = tuple(r for r in survivors if r != "at")
    split = [regions[r].consent(session, survivors) for r in ("at", "br")]
    split += [regions[r].consent(session, without_at) for r in ("cn", "de", "eu")]
    for r in ("cn", "de", "eu"):  # shown both sets' consents: refused as mixed
        with pytest.raises(SecAggError, match="is not for this set"):
            regions[r].reveal(session, without_at, split)
    for r in ("at", "br"):  # two signatures on the full set: short of the threshold
        with pytest.raises(SecAggError, match="2 signatures on the survivors, fewer than"):
            regions[r].reveal(session, survivors, [c for c in split if c.survivors == survivors])
    # the other three can unmask the set without "at": its key seed comes back, but
    # its self seed never does (no survivor of that set holds it out), so the update
    # "at" did send stays masked
    good = [c for c in split if c.survivors == without_at]
    reveals = [regions[r].reveal(session, without_at, good) for r in ("cn", "de", "eu")]
    assert all("at" in r.key_shares and "at" not in r.self_shares for r in reveals)


def test_forged_consents_are_refused(keys):
    session, regions, encoded, bundles = federation(keys, 3, 2)
    survivors = through_masking(session, regions, encoded, bundles)
    mine = regions["at"].consent(session, survivors)
    forged = mine.model_copy(update={"region": "br"})
    with pytest.raises(SecAggError, match="the consent of 'br' is not signed by 'br'"):
        regions["at"].reveal(session, survivors, (mine, forged))


def test_a_session_a_region_does_not_agree_to_is_refused(keys):
    session, regions, encoded, bundles = federation(keys, 3, 2, min_regions=3)
    with pytest.raises(SecAggError, match="threshold 2 is below this region's minimum of 3"):
        regions["at"].advertise(session, encoded["at"])
    stranger = SecureSumRegion(keys["at"], {"br": bundles["br"]})
    with pytest.raises(
        SecAggError, match=r"no public bundle for cn; add each peer's REGION.pub.json"
    ):
        stranger.advertise(session, encoded["at"])
    with pytest.raises(ValueError, match="threshold 1 is not more than half of the 3 regions"):
        Session(
            run_id=1,
            server_round=1,
            regions=("a", "b", "c"),
            threshold=1,
            bits=32,
            size=4,
            clip=1.0,
            scale=1.0,
            noise=0.0,
        )


def test_an_altered_sealed_share_does_not_open(keys):
    session, regions, encoded, bundles = federation(keys, 3, 2)
    agg = SecureSum(session, bundles)
    adverts = agg.take_adverts([regions[r].advertise(session, encoded[r]) for r in session.regions])
    shares = [regions[r].share(session, adverts) for r in session.regions]
    item = shares[0].items[0]
    flipped = item.model_copy(update={"shares": item.shares[:-1] + bytes([item.shares[-1] ^ 1])})
    with pytest.raises(SecAggError, match="the shares of 'at' is not signed by 'at'"):
        regions[item.to].masked(session, session.regions, (flipped,))


def test_a_sum_that_wraps_around_its_ring_is_withheld_by_its_sketch(keys):
    """Each region's values fit the signed ring, their sum at one value does not: the
    unmasked sum would be silently wrong there; the sketch the regions masked beside
    their vectors finds it, and the sum is refused."""
    session, regions, encoded, bundles = federation(keys, 3, 2)
    signed = {r: v.astype(np.int64) for r, v in encoded.items()}
    for values in signed.values():
        values[values >= 2**31] -= 2**32
        values[17] = 2**30 + 5  # 3 x that is past 2**31
    wrapping = {r: RING.reduce(v.astype(np.uint64)) for r, v in signed.items()}
    with pytest.raises(SecAggError, match="wrapped around its 32-bit ring"):
        run_secure_sum(session, regions, wrapping, bundles)
