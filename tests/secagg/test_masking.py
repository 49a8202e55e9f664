"""Secure aggregation's arithmetic: the unmasked sum is the plain sum exactly, with and
without regions that drop after masking; seeds come back from any threshold of their
shares and not from fewer."""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest

from fedciuic.secagg import Ring, RingTooSmall, from_ring, ring_sum
from fedciuic.secagg.masking import mask, to_ring, unmask
from fedciuic.secagg.shamir import (
    PRIME,
    SEED_BYTES,
    MalformedShare,
    NotEnoughShares,
    Share,
    combine,
    split,
)

RING = Ring(32)
SIZE = 1_000
CLIP, SCALE = 1.0, 2.0**16


def seed() -> bytes:
    return os.urandom(SEED_BYTES)


def federation(n: int, rng: np.random.Generator):
    """``n`` regions' float updates, their encodings, self seeds and pair seeds."""
    floats = [rng.normal(0, 0.01, SIZE) for _ in range(n)]
    encoded = [to_ring(f, clip=CLIP, scale=SCALE, regions=n, ring=RING, rng=rng) for f in floats]
    selves = {i: seed() for i in range(n)}
    pairs = {(i, j): seed() for i, j in itertools.combinations(range(n), 2)}
    return floats, encoded, selves, pairs


def masked_by(i: int, n: int, encoded, selves, pairs) -> np.ndarray:
    mine = {j: pairs[min(i, j), max(i, j)] for j in range(n) if j != i}
    return mask(encoded[i], me=i, self_seed=selves[i], pair_seeds=mine, ring=RING)


@pytest.mark.parametrize("n", range(2, 9))
def test_the_unmasked_sum_is_the_plain_sum_exactly(n):
    rng = np.random.default_rng(n)
    floats, encoded, selves, pairs = federation(n, rng)
    masked = [masked_by(i, n, encoded, selves, pairs) for i in range(n)]
    assert all(not np.array_equal(m, e) for m, e in zip(masked, encoded, strict=True))
    total = unmask(
        ring_sum(masked, RING), survivors=range(n), self_seeds=selves, dropped_pairs={}, ring=RING
    )
    np.testing.assert_array_equal(total, ring_sum(encoded, RING))
    # Back to floats: each region's rounding is off by less than 1 / SCALE per entry.
    np.testing.assert_allclose(
        from_ring(total, scale=SCALE, ring=RING), sum(floats), atol=n / SCALE
    )


@pytest.mark.parametrize(("n", "dropped"), [(3, {1}), (5, {0, 3}), (8, {2, 7})])
def test_regions_that_drop_after_masking_leave_the_survivors_sum_recoverable(n, dropped):
    """Every region shares its seeds among all (threshold t); the survivors' shares give
    back their self seeds and the dropped regions' pair seeds with them."""
    rng = np.random.default_rng(n)
    _, encoded, selves, pairs = federation(n, rng)
    masked = {i: masked_by(i, n, encoded, selves, pairs) for i in range(n)}
    survivors = [i for i in range(n) if i not in dropped]
    threshold = len(survivors)
    holders = [i + 1 for i in range(n)]
    shared_selves = {i: split(s, threshold, holders) for i, s in selves.items()}
    shared_pairs = {k: split(s, threshold, holders) for k, s in pairs.items()}

    def recovered(shares: list[Share]) -> bytes:
        return combine([s for s in shares if s.holder - 1 in survivors], threshold)

    self_seeds = {i: recovered(shared_selves[i]) for i in survivors}
    dropped_pairs = {
        (i, j): recovered(shared_pairs[min(i, j), max(i, j)]) for i in survivors for j in dropped
    }
    total = unmask(
        ring_sum([masked[i] for i in survivors], RING),
        survivors=survivors,
        self_seeds=self_seeds,
        dropped_pairs=dropped_pairs,
        ring=RING,
    )
    np.testing.assert_array_equal(total, ring_sum([encoded[i] for i in survivors], RING))


def test_any_threshold_of_the_shares_recovers_the_seed_and_fewer_do_not():
    secret = seed()
    shares = split(secret, 3, [1, 2, 3, 4, 5])
    for chosen in itertools.combinations(shares, 3):
        assert combine(list(chosen), 3) == secret
    with pytest.raises(NotEnoughShares, match="2 share\\(s\\), 3 needed"):
        combine(shares[:2], 3)


def test_fewer_shares_than_the_threshold_fit_every_seed():
    """One share of a 2-of-n sharing lies on a line through any seed at all: for a
    guessed seed there is a second share that completes it, so the one share tells
    nothing about which seed it was."""
    (one, _) = split(seed(), 2, [1, 2])
    for guess in (seed(), bytes(SEED_BYTES), b"\xff" * SEED_BYTES):
        slope = (one.value - int.from_bytes(guess, "big")) * pow(one.holder, -1, PRIME) % PRIME
        completion = Share(2, (int.from_bytes(guess, "big") + 2 * slope) % PRIME)
        assert combine([one, completion], 2) == guess


def test_a_share_that_disagrees_or_repeats_a_holder_is_refused():
    shares = split(seed(), 2, [1, 2, 3])
    bad = Share(shares[2].holder, (shares[2].value + 1) % PRIME)
    with pytest.raises(MalformedShare, match="holder 3 disagrees"):
        combine([shares[0], shares[1], bad], 2)
    with pytest.raises(MalformedShare, match="named twice"):
        combine([shares[0], shares[0]], 2)


def test_a_ring_too_small_for_the_sum_is_refused_before_anything_is_encoded():
    with pytest.raises(RingTooSmall, match="use more bits or a smaller scale"):
        to_ring(
            np.zeros(4),
            clip=CLIP,
            scale=2.0**24,
            regions=300,
            ring=RING,
            rng=np.random.default_rng(),
        )


def test_a_clipped_update_keeps_its_direction_and_the_rounding_is_unbiased():
    rng = np.random.default_rng(0)
    x = np.full(16, 1.0)  # norm 4, clipped to 1: each entry 0.25
    draws = [
        from_ring(
            to_ring(x, clip=CLIP, scale=10.0, regions=1, ring=RING, rng=rng), scale=10.0, ring=RING
        )
        for _ in range(2_000)
    ]
    mean = np.mean(draws, axis=0)
    np.testing.assert_allclose(mean, 0.25, atol=5 * 0.05 / np.sqrt(2_000))


@pytest.mark.parametrize("bits", [8, 12, 13, 16, 20, 24, 31, 32, 40, 62])
@pytest.mark.parametrize("count", [1, 7, 1000, 2**18 + 3])
def test_ring_elements_travel_in_their_own_bits_and_come_back_exactly(bits, count):
    ring = Ring(bits)
    values = ring.reduce(np.random.default_rng(bits).integers(0, 2**63, count, dtype=np.uint64))
    data = ring.pack(values)
    assert len(data) == ring.size(count) == -(-count * bits // 8)  # 12 bits: 1.5 bytes each
    np.testing.assert_array_equal(ring.unpack(data, count), values)
    # Each element's bits, least significant first, one after another.
    stream = np.unpackbits(np.frombuffer(data, np.uint8), bitorder="little")
    first = sum(int(b) << j for j, b in enumerate(stream[bits : 2 * bits])) if count > 1 else 0
    assert count == 1 or first == int(values[1])


@pytest.mark.parametrize("bits", [12, 16])
def test_a_packed_vector_of_the_wrong_size_or_with_a_set_pad_bit_is_refused(bits):
    ring = Ring(bits)
    data = ring.pack(np.arange(7, dtype=np.uint64))  # 12 bits: 84 bits, 4 of them pad
    with pytest.raises(ValueError, match="not 8 values"):
        ring.unpack(data, 8)
    with pytest.raises(ValueError, match="not 7 values"):
        ring.unpack(data + b"\0", 7)
    if bits == 12:
        with pytest.raises(ValueError, match="non-zero pad"):
            ring.unpack(data[:-1] + bytes([data[-1] | 0x80]), 7)
