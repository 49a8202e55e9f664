"""Distributed DP: the accountant's epsilon against a direct numerical computation of
the Skellam mechanism's Rényi divergence (within 5%, never below it); the noise in the
decoded sum is the target's; colluding regions weaken the guarantee as accounted."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.special import ive, logsumexp
from scipy.stats import skellam as scipy_skellam

from fedciuic.secagg import Ring, from_ring, ring_sum, rotate, unrotate
from fedciuic.secagg.ddp import (
    ALIGNMENT_MARGIN,
    NEAREST_STEP,
    ORDERS,
    POISSON_LIMIT,
    DistributedDp,
    alignment,
    noised,
    normed_scale,
    rdp_epsilon,
    ring_bits,
    ring_choices,
    scale_for,
    skellam,
    skellam_rdp,
    sum_bound,
)

DELTA = 1e-5


def skellam_logpmf(reach: int, variance: float) -> np.ndarray:
    """log P(k) of Skellam(variance/2, variance/2) for k = 0..reach: e^-x I_k(x) with
    x = variance, I_k by Miller's backward recurrence of the ratios I_k / I_k+1 (stable
    far into the tails, where the pmf underflows floating point)."""
    x = float(variance)
    top = reach + 2_000
    ratio = (top + math.sqrt(top**2 + x**2)) / x  # I_top / I_top+1, asymptotically
    logs = np.empty(top)
    for k in range(top, 0, -1):  # ratio(k - 1) = 1 / ratio(k) + 2k / x
        ratio = 1 / ratio + 2 * k / x
        logs[k - 1] = math.log(ratio)
    log_i0 = math.log(ive(0, x)) + x
    log_i = log_i0 - np.concatenate([[0.0], np.cumsum(logs[:reach])])
    return log_i - x


def exact_rdp(shift: np.ndarray, variance: float, orders: list[int]) -> list[float]:
    """D_order(Sk + shift || Sk) for each order, summed over the coordinates, by direct
    summation of the Skellam pmf over its support (the terms past ``reach`` are below
    e^-800 of the sum)."""
    largest = int(np.abs(shift).max())
    reach = max(orders) * largest + int(40 * math.sqrt(variance))
    half = skellam_logpmf(reach + largest, variance)
    k = np.arange(-reach, reach + 1)
    totals = np.zeros(len(orders))
    values, counts = np.unique(np.abs(shift), return_counts=True)
    for s, count in zip(values, counts, strict=True):
        if s == 0:
            continue
        log_p, log_q = half[np.abs(k - s)], half[np.abs(k)]
        for i, a in enumerate(orders):
            totals[i] += count * logsumexp(a * log_p + (1 - a) * log_q) / (a - 1)
    return totals.tolist()


def test_the_recurrence_matches_scipy_where_scipy_is_exact():
    k = np.arange(0, 400)
    np.testing.assert_allclose(
        skellam_logpmf(399, 1e4), scipy_skellam.logpmf(k, 5e3, 5e3), rtol=1e-9
    )


@pytest.mark.parametrize(
    "shift",
    [np.array([100]), np.array([60, 80]), np.full(100, 10), np.array([1] * 400 + [0] * 4)],
    ids=["one value", "two values", "spread", "all ones"],
)
@pytest.mark.parametrize("variance", [1e4, 4e4])
def test_the_accountant_is_within_5_percent_of_the_exact_epsilon_and_never_below(shift, variance):
    orders = [a for a in ORDERS if a <= 128]
    l2 = float(np.linalg.norm(shift))
    l1 = float(np.abs(shift).sum())
    bound = rdp_epsilon(orders, skellam_rdp(orders, l1=l1, l2=l2, variance=variance), DELTA)
    exact = rdp_epsilon(orders, exact_rdp(shift, variance, orders), DELTA)
    assert exact <= bound <= 1.05 * exact


def test_the_decoded_sum_carries_the_target_noise():
    n, dim = 4, 20_000
    ddp = DistributedDp(clip=1.0, scale=2.0**10, noise_multiplier=0.5, threshold=3, dim=dim)
    ring = Ring(40)
    assert ddp.fits(n, ring)
    rng = np.random.default_rng(0)
    updates = [rng.normal(0, 1 / math.sqrt(dim), dim) * 0.9 for _ in range(n)]
    encoded = [noised(u, ddp, ring, rng) for u in updates]
    total = from_ring(ring_sum(encoded, ring), scale=ddp.scale, ring=ring)
    error = (total - np.sum(updates, axis=0)) * ddp.scale
    expected = n * ddp.share_variance + n / 6  # the shares' noise, and rounding's
    assert abs(error.var() / expected - 1) < 0.05
    assert abs(error.mean()) < 4 * math.sqrt(expected / dim)


def test_a_rounded_update_stays_within_the_accounted_norm():
    dim = 5_000
    ddp = DistributedDp(clip=1.0, scale=300.0, noise_multiplier=1.0, threshold=2, dim=dim)
    rng = np.random.default_rng(1)
    big = rng.normal(0, 10, dim)  # clipped to norm 1 first
    no_noise = DistributedDp(clip=1.0, scale=300.0, noise_multiplier=1e-9, threshold=2, dim=dim)
    ring = Ring(32)
    for _ in range(20):
        rounded = from_ring(noised(big, no_noise, ring, rng), scale=1.0, ring=ring)
        assert np.linalg.norm(rounded) <= ddp.l2


def test_without_distributed_noise_each_value_goes_to_its_nearest_integer():
    dim = 20_000
    ddp = DistributedDp(clip=1.0, scale=300.0, noise_multiplier=0.0, threshold=2, dim=dim)
    rng = np.random.default_rng(2)
    x = rng.normal(0, 1 / math.sqrt(dim), dim) * 0.9
    error = from_ring(noised(x, ddp, Ring(16), rng), scale=1.0, ring=Ring(16)) - x * ddp.scale
    assert np.abs(error).max() <= 0.5
    assert abs(error.var() * 12 - 1) < 0.05  # a uniform error: half stochastic rounding's


def test_colluding_regions_raise_epsilon_and_a_sum_without_honest_noise_has_none():
    ddp = DistributedDp(clip=1.0, scale=2.0**12, noise_multiplier=1.0, threshold=3, dim=10_000)
    alone, one, two = (ddp.epsilon(10, DELTA, honest=h) for h in (3, 2, 1))
    assert alone == ddp.epsilon(10, DELTA) < one < two < math.inf
    assert ddp.epsilon(10, DELTA, honest=0) == math.inf


def test_a_ring_too_small_for_the_sum_is_seen():
    ddp = DistributedDp(clip=1.0, scale=2.0**16, noise_multiplier=1.0, threshold=2, dim=100)
    assert not ddp.fits(8, Ring(18)) and ddp.fits(8, Ring(24))


def test_skellam_draws_have_their_variance_up_to_the_limit_and_are_refused_past_it():
    rng = np.random.default_rng(2)
    for variance in (1e4, 2 * POISSON_LIMIT):
        draws = skellam(200_000, variance, rng).astype(np.float64)
        assert abs(draws.var() / variance - 1) < 0.02
    with pytest.raises(ValueError, match="not exact; use a smaller fixed-point scale"):
        skellam(10, 4 * POISSON_LIMIT, rng)
    # the scale a session is given keeps its shares within the limit
    ring = Ring(62)
    scale = scale_for(regions=3, threshold=2, clip=10.0, noise=1.0, dim=1024, ring=ring)
    assert DistributedDp(10.0, scale, 1.0, 2, 1024).share_variance / 2 <= POISSON_LIMIT


@pytest.mark.parametrize("bits", [12, 16])
def test_the_scale_is_the_finest_that_fits_even_past_two_to_the_bits(bits):
    # 3 regions, blocks of 65,536: a rotated value is about clip * scale / 256, so a
    # small ring holds a scale well above 2**bits.
    ring = Ring(bits)
    scale = scale_for(
        regions=3, threshold=2, clip=1.0, noise=0.0, dim=262144, block=65536, ring=ring
    )
    assert scale > 2**bits
    assert DistributedDp(1.0, scale, 0.0, 2, 262144, 65536).fits(3, ring)
    assert not DistributedDp(1.0, 2 * scale, 0.0, 2, 262144, 65536).fits(3, ring)


def test_ring_bits_zero_grows_with_the_regions_and_rounds_no_coarser_than_int8():
    # Explicit bits are kept; distributed DP keeps its headroom, and so does a sum
    # without the regions' norms (its scale follows the clip).
    assert ring_bits(20, regions=3, size=245_760, distributed_dp=False, normed=True) == 20
    assert ring_bits(0, regions=3, size=245_760, distributed_dp=True, normed=False) == 24
    assert ring_bits(0, regions=3, size=245_760, distributed_dp=False, normed=False) == 24
    chosen = {
        (n, size): ring_bits(0, regions=n, size=size, distributed_dp=False, normed=True)
        for n in (2, 3, 8, 32)
        for size in (1_000, 245_760, 6_905_856)
    }
    # a bit per doubling of the regions (the sum's range), the length barely
    assert chosen[(3, 245_760)] == 11 and chosen[(8, 245_760)] == 12
    assert chosen[(32, 245_760)] == 14 and chosen[(32, 6_905_856)] == 14
    for (n, size), bits in chosen.items():
        # the scale these bits give, for n updates of norm 1, rounds each region's
        # values to the nearest with no more error than the int8 codec's stochastic
        # rounding of an update of norm 1
        scale = normed_scale(bound=n, regions=n, size=size, ring=Ring(bits))
        assert 1 / scale <= NEAREST_STEP / np.sqrt(size)


def test_once_a_sum_was_measured_the_ring_grows_half_a_bit_per_doubling_of_the_regions():
    # Scaled for as far as the last sum reached (independent updates: sqrt(n) norms,
    # with the margin), the ring grows with sqrt(n); before any, with n.
    terms = {"distributed_dp": False, "normed": True}
    measured = {
        (n, size): ring_bits(0, regions=n, size=size, **terms, measured=True)
        for n in (2, 3, 8, 16, 32)
        for size in (1_000, 245_760, 6_905_856)
    }
    assert [measured[(n, 245_760)] for n in (3, 8, 16, 32)] == [11, 11, 12, 12]
    assert measured[(32, 6_905_856)] == 12
    for (n, size), bits in measured.items():
        first = ring_bits(0, regions=n, size=size, **terms)
        assert bits <= first
        assert ring_choices(0, regions=n, size=size, **terms) == tuple(sorted({bits, first}))
        # n independent updates of norm 1 reach sqrt(n): the scale for that reach rounds
        # each region's values no coarser than int8 does
        scale = normed_scale(bound=sum_bound([1.0] * n, 1.0), regions=n, size=size, ring=Ring(bits))
        assert 1 / scale <= NEAREST_STEP / np.sqrt(size)
    # explicit bits, distributed DP and a sum without norms keep their one ring
    assert ring_choices(20, regions=32, size=1_000, **terms) == (20,)
    assert ring_choices(0, regions=32, size=1_000, distributed_dp=True, normed=False) == (24,)


def test_the_bound_follows_the_last_sums_reach_within_what_no_alignment_can_pass():
    norms = [1.0, 2.0, 2.0]
    assert sum_bound(norms, None) == 5.0  # the triangle inequality: cannot be passed
    assert sum_bound(norms, 1.0) == pytest.approx(ALIGNMENT_MARGIN * 3.0)
    # less than independent updates' reach is taken as theirs; past the total, the total
    assert sum_bound(norms, 0.1) == sum_bound(norms, 1.0)
    assert sum_bound(norms, 1.5) == 5.0
    rng = np.random.default_rng(3)
    xs = rng.normal(size=(8, 4096))
    assert alignment(
        float(np.linalg.norm(xs.sum(0))), list(np.linalg.norm(xs, axis=1))
    ) == pytest.approx(1.0, abs=0.05)
    same = np.tile(xs[0], (8, 1))
    assert alignment(
        float(np.linalg.norm(same.sum(0))), list(np.linalg.norm(same, axis=1))
    ) == pytest.approx(np.sqrt(8))
    assert alignment(0.0, [0.0, 0.0]) == 1.0


@pytest.mark.parametrize("aligned", [False, True])
def test_a_sum_scaled_for_the_last_ones_reach_holds_it_and_a_far_more_aligned_one_wraps(
    aligned,
):
    """32 regions in the 12-bit ring a measured run takes: independent updates, scaled
    for the reach of an earlier independent sum, come back within the rounding; the same
    updates all aligned reach sqrt(32) times further, and wrap (which the aggregator's
    sketch sees: tests/secagg/test_protocol.py)."""
    n, size = 32, 1 << 14
    bits = ring_bits(0, regions=n, size=size, distributed_dp=False, normed=True, measured=True)
    rng = np.random.default_rng(5)
    earlier = rng.normal(size=(n, size))
    reach = alignment(float(np.linalg.norm(earlier.sum(0))), list(np.linalg.norm(earlier, axis=1)))
    xs = np.tile(rng.normal(size=size), (n, 1)) if aligned else rng.normal(size=(n, size))
    norms = np.linalg.norm(xs, axis=1)
    sid = bytes(32)
    ring = Ring(bits)
    scale = normed_scale(bound=sum_bound(list(norms), reach), regions=n, size=size, ring=ring)
    ddp = DistributedDp(float(norms.max()), scale, 0.0, n // 2 + 1, size)
    summed = ring_sum([noised(rotate(x, sid), ddp, ring, rng) for x in xs], ring)
    back = unrotate(from_ring(summed, scale=scale, ring=ring), sid)
    error = np.linalg.norm(back - xs.sum(0)) / np.linalg.norm(xs.sum(0))
    if aligned:
        assert error > 0.5
    else:
        assert error < 0.01
