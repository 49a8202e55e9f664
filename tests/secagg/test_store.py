"""A region's secure sums on disk: a region whose agent restarts between phases goes on
from its last one, answers no phase twice (the unmasking above all), keeps no seed once
it has revealed, and refuses a damaged state file naming it."""

from __future__ import annotations

import stat

import numpy as np
import pytest

from fedciuic.secagg.aggregator import SecureSum
from fedciuic.secagg.messages import SecAggError
from fedciuic.secagg.region import SecureSumRegion
from fedciuic.secagg.store import SessionStore
from tests.secagg.test_protocol import federation, plain


def restarted(regions, session, tmp_path) -> dict[str, SecureSumRegion]:
    """Each region as a new process finds it: its keys, its peers, its state folder."""
    return {
        r: SecureSumRegion(old.keypair, old.peers, min_regions=old.min_regions, store=tmp_path / r)
        for r, old in regions.items()
    }


def stored(keys, tmp_path, n=3, threshold=2):
    session, regions, encoded, bundles = federation(keys, n, threshold)
    regions = restarted(regions, session, tmp_path)
    return session, regions, encoded, bundles


def test_a_region_restarted_between_every_phase_goes_on_to_the_exact_sum(keys, tmp_path):
    session, regions, encoded, bundles = stored(keys, tmp_path)
    agg = SecureSum(session, bundles)
    adverts = agg.take_adverts([regions[r].advertise(session, encoded[r]) for r in session.regions])
    regions = restarted(regions, session, tmp_path)
    shared = agg.take_shares([regions[r].share(session, adverts) for r in session.regions])
    regions = restarted(regions, session, tmp_path)
    survivors = agg.take_masked(
        [regions[r].masked(session, shared, agg.items_for(r)) for r in shared]
    )
    regions = restarted(regions, session, tmp_path)
    consents = agg.take_consents([regions[r].consent(session, survivors) for r in survivors])
    regions = restarted(regions, session, tmp_path)
    total = agg.take_reveals([regions[r].reveal(session, survivors, consents) for r in survivors])
    np.testing.assert_array_equal(total, plain(encoded, session.regions))


def test_a_restarted_region_answers_no_phase_twice_and_keeps_no_seed_after_revealing(
    keys, tmp_path
):
    session, regions, encoded, bundles = stored(keys, tmp_path)
    agg = SecureSum(session, bundles)
    adverts = agg.take_adverts([regions[r].advertise(session, encoded[r]) for r in session.regions])
    again = restarted(regions, session, tmp_path)
    with pytest.raises(SecAggError, match="this session was already joined"):
        again["at"].advertise(session, encoded["at"])
    shared = agg.take_shares([again[r].share(session, adverts) for r in session.regions])
    survivors = agg.take_masked(
        [again[r].masked(session, shared, agg.items_for(r)) for r in shared]
    )
    consents = agg.take_consents([again[r].consent(session, survivors) for r in survivors])
    agg.take_reveals([again[r].reveal(session, survivors, consents) for r in survivors])
    for r in session.regions:
        fresh = restarted(again, session, tmp_path)[r]
        with pytest.raises(SecAggError, match="reveal: this region's last phase was reveal"):
            fresh.reveal(session, survivors, consents)
        [file] = (tmp_path / r).iterdir()  # the update it joined with went once masked
        text = file.read_text()
        assert '"self_seed":""' in text and '"key_seed":""' in text and '"held":{}' in text
        assert stat.S_IMODE(file.stat().st_mode) == 0o600


def test_a_damaged_state_file_is_refused_naming_it(keys, tmp_path):
    session, regions, encoded, bundles = stored(keys, tmp_path)
    agg = SecureSum(session, bundles)
    adverts = agg.take_adverts([regions[r].advertise(session, encoded[r]) for r in session.regions])
    [file] = (tmp_path / "at").glob("*.json")
    file.write_text(file.read_text()[:100])
    fresh = restarted(regions, session, tmp_path)["at"]
    with pytest.raises(SecAggError, match=rf"{file}: damaged .*takes no further part"):
        fresh.share(session, adverts)


def test_a_region_counts_the_rounds_of_a_run_it_joined_a_sum_in(keys, tmp_path):
    """What its distributed-DP epsilon for the run composes over."""
    for i, server_round in enumerate((1, 2, 2, 3)):  # round 2 twice: two sessions, one round
        session, regions, encoded, _ = federation(keys, 3, 2, server_round=server_round)
        if i == 2:
            session = session.model_copy(update={"threshold": 3})
        region = SecureSumRegion(keys["at"], regions["at"].peers, store=tmp_path / "at")
        region.advertise(session, encoded["at"])
    assert len(list((tmp_path / "at").glob("*.json"))) == 4
    sums = SessionStore(tmp_path / "at")
    assert sums.joined(7, 3) and sums.rounds_joined(7) == 3
    assert sums.rounds_joined(8) == 0
