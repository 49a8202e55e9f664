"""Distributed DP for the secure sum: each region adds a share of Skellam noise to its
integer update before masking, so that the sum the aggregator learns carries the whole
Skellam mechanism (a sum of independent Skellam draws is Skellam), and no party sees a
region's update with less than its share of noise on it.

The privacy unit is a region's whole update in a round (clipped to L2 norm ``clip``):
this protects everything a region contributed, against the aggregator, as long as at
least ``threshold`` regions that do not collude with it add their share. A region
that trusts no one else keeps local DP-SGD (per record or per person) and adds this on
top, or not at all.

The accountant is Rényi DP: the Skellam mechanism's bound (Agarwal, Kairouz and Liu,
NeurIPS 2021, Theorem 3.5) at the L2 and L1 sensitivities that conditional stochastic
rounding guarantees (Kairouz, Liu and Steinke, ICML 2021), composed over rounds and
converted to (epsilon, delta) as Opacus does (Balle et al. 2020).
"""

from __future__ import annotations

import functools
import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from opacus.accountants.analysis.rdp import get_privacy_spent

from fedciuic.errors import FedciuicError
from fedciuic.opacus_logging import undo_opacus_basic_config
from fedciuic.secagg.masking import MIN_BITS as MIN_RING_BITS
from fedciuic.secagg.masking import Ring, RingTooSmall, clip_norm, round_stochastically

undo_opacus_basic_config()  # the aggregator's process imports Opacus here first

#: Integer Rényi orders (the Skellam bound holds for integer orders).
ORDERS: tuple[int, ...] = (*range(2, 64), *range(64, 513, 8))
#: The largest Poisson mean NumPy draws exactly enough (its variance drifts past ~1e13).
POISSON_LIMIT = 1e11
#: Conditional rounding retries until the rounded norm is within the bound that holds
#: with probability 1 - beta per try (DDGauss' choice of beta).
BETA = math.exp(-0.5)
_TRIES = 100
#: How far above 2**bits the scale search starts (as a power of two): a rotated value is
#: the norm over sqrt(window), so a ring of few bits holds a scale far past its own size.
_SCALE_HEADROOM = 24


class RoundingFailed(FedciuicError):
    """Conditional rounding did not meet its norm bound in many tries (it should in one
    or two): the update is not released."""


@dataclass(frozen=True)
class DistributedDp:
    """One secure sum's noise: ``noise_multiplier`` times ``clip`` is the standard
    deviation per value of the noise in a sum of ``threshold`` honest regions' shares."""

    clip: float
    scale: float  # ring units per unit of the update
    noise_multiplier: float
    threshold: int
    dim: int
    #: The length of the windows the update was rotated in (0: the whole ``dim``).
    block: int = 0

    @property
    def central_variance(self) -> float:
        """Per value in the sum, in ring units, from ``threshold`` regions' shares."""
        return (self.noise_multiplier * self.clip * self.scale) ** 2

    @property
    def share_variance(self) -> float:
        return self.central_variance / self.threshold

    @property
    def l2(self) -> float:
        """The L2 norm a region's rounded update is held to (ring units)."""
        c = self.clip * self.scale
        bound = (
            c**2 + self.dim / 4 + math.sqrt(2 * math.log(1 / BETA)) * (c + math.sqrt(self.dim) / 2)
        )
        return min(math.sqrt(bound), c + math.sqrt(self.dim))

    @property
    def l1(self) -> float:
        """An integer vector's L1 norm is at most its squared L2 norm, and at most
        sqrt(dim) times its L2 norm."""
        return min(self.l2**2, math.sqrt(self.dim) * self.l2)

    def fits(self, regions: int, ring: Ring) -> bool:
        """Whether a sum of ``regions`` rotated, rounded, noised updates stays inside the
        signed ring: each rotated value is about the window's norm over sqrt(its length),
        beyond :func:`spread` times that with a chance under 1e-9; rounding adds at most
        1; the noise's own spread on top. (A sum that wraps anyway fails the wrap check.)"""
        k = spread(self.dim)
        value = self.clip * self.scale / math.sqrt(self.block or self.dim)
        noise = k * math.sqrt(regions * self.share_variance)
        return bool(regions * (k * value + 1) + noise < 2 ** (ring.bits - 1))

    def rdp(self, honest: int) -> list[float]:
        """Rényi DP of one sum when ``honest`` regions' shares are noise the adversary
        does not know."""
        return skellam_rdp(ORDERS, l1=self.l1, l2=self.l2, variance=honest * self.share_variance)

    def epsilon(self, rounds: int, delta: float, honest: int | None = None) -> float:
        """Epsilon at ``delta`` of ``rounds`` sums, each with ``honest`` regions' noise
        unknown to the adversary (the aggregator alone: ``threshold``; colluding with k
        regions: ``threshold - k``)."""
        honest = self.threshold if honest is None else honest
        if honest < 1:
            return math.inf
        return rdp_epsilon(ORDERS, [rounds * r for r in self.rdp(honest)], delta)


#: The ring distributed DP's noise gets when secure-ring-bits is 0 (its headroom), and
#: a sum whose regions sent no norm (its scale follows the clip alone).
DDP_RING_BITS = 24
#: The plain ``int8`` codec's rounding step, in standard deviations of the values it
#: codes (root mean square of max|chunk| / 127 over chunks of 256 normal values): what
#: a secure sum's mean is held to be no coarser than (through :data:`NEAREST_STEP`).
INT8_STEP = 0.0241
#: The coarsest step at which a secure sum without distributed noise, which rounds to
#: the nearest integer (error variance step**2 / 12), errs no more than ``int8``'s
#: stochastic rounding at :data:`INT8_STEP` (step**2 / 6 on average): half a bit fewer.
NEAREST_STEP = INT8_STEP * math.sqrt(2)
#: The chance, per sum, that some value of it goes past the range its norms give (a
#: randomly rotated value is sub-Gaussian); the wrap check withholds such a sum.
TYPICAL_MISS = 1e-5
#: How much further a round's sum may reach than the run's last unmasked sum did (each
#: against its regions' norms: :func:`alignment`) and still fit the ring that sum's
#: reach chose; past it the sum wraps, is withheld, and the next round takes the bound
#: that cannot wrap.
ALIGNMENT_MARGIN = 1.5


def ring_bits(
    requested: int,
    *,
    regions: int,
    size: int,
    distributed_dp: bool,
    normed: bool,
    measured: bool = False,
) -> int:
    """The ring of a secure sum: secure-ring-bits (``requested``), or with 0 the fewest
    bits at which a sum of ``regions`` updates scaled by their norms (``normed``) rounds
    no coarser than the plain ``int8`` path (:data:`NEAREST_STEP`). The sum's reach
    sets them: ``regions`` norms however the updates align, or, once a sum of the run
    was ``measured``, :data:`ALIGNMENT_MARGIN` times sqrt(``regions``) norms (how far
    independent updates reach). :data:`DDP_RING_BITS` with distributed DP (its noise
    needs the headroom) or without the regions' norms."""
    if requested:
        return requested
    if distributed_dp or not normed:
        return DDP_RING_BITS
    reach = min(regions, ALIGNMENT_MARGIN * math.sqrt(regions)) if measured else regions
    largest = typical_spread(size) * reach / NEAREST_STEP + regions
    return max(MIN_RING_BITS, 1 + math.ceil(math.log2(largest + 1)))


def ring_pair(
    requested: int, *, regions: int, size: int, distributed_dp: bool, normed: bool
) -> tuple[int, int]:
    """:func:`ring_bits` for a run's first sum, and for one after a sum was measured."""
    bits = functools.partial(
        ring_bits,
        requested,
        regions=regions,
        size=size,
        distributed_dp=distributed_dp,
        normed=normed,
    )
    return bits(measured=False), bits(measured=True)


def ring_choices(
    requested: int, *, regions: int, size: int, distributed_dp: bool, normed: bool
) -> tuple[int, ...]:
    """The rings a region takes a session in (:func:`ring_pair`: which one is the
    aggregator's to know; either gives it the sum and nothing else)."""
    pair = ring_pair(
        requested, regions=regions, size=size, distributed_dp=distributed_dp, normed=normed
    )
    return tuple(sorted(set(pair)))


def sum_bound(norms: Sequence[float], reach: float | None) -> float:
    """The norm a sum of updates with these sent norms is scaled for: their total, which
    it cannot pass however they align, or, given the ``reach`` of the run's last
    unmasked sum, :data:`ALIGNMENT_MARGIN` times that reach (at least that of
    independent updates) on these norms, if less."""
    total = math.fsum(norms)
    if reach is None:
        return total
    return min(total, ALIGNMENT_MARGIN * max(1.0, reach) * _independent(norms))


def alignment(sum_norm: float, norms: Sequence[float]) -> float:
    """How far a sum reached against its regions' sent norms: its norm over the root of
    their squares' sum (1 for independent updates, sqrt(n) for n aligned ones of one
    norm; 1 for norms of 0, which say nothing)."""
    root = _independent(norms)
    return sum_norm / root if root else 1.0


def _independent(norms: Sequence[float]) -> float:
    """How far a sum of independent updates of these norms reaches."""
    return math.sqrt(math.fsum(n * n for n in norms))


def normed_scale(*, bound: float, regions: int, size: int, ring: Ring) -> float:
    """The fixed point's scale for a sum whose regions' norms
    (:func:`~fedciuic.secagg.rotation.sent_norm`) add up to ``bound``: the sum's
    values then stay within :func:`typical_spread` times ``bound / sqrt(size)`` but for
    a chance of :data:`TYPICAL_MISS`, and each region's rounding adds at most 1."""
    room = (1 << (ring.bits - 1)) - regions - 1
    if room <= 0:
        raise RingTooSmall(f"{regions} regions' rounding alone fills {ring.bits} bits")
    return room * math.sqrt(size) / (typical_spread(size) * bound)


def typical_spread(dim: int) -> float:
    """How many standard deviations no value of a ``dim``-value rotated sum exceeds but
    with a chance of :data:`TYPICAL_MISS` (Hoeffding, 2 exp(-k^2 / 2) per value)."""
    return math.sqrt(2 * math.log(2 * dim / TYPICAL_MISS))


def spread(dim: int) -> float:
    """How many standard deviations no value of a ``dim``-value rotated update exceeds,
    but with a chance under 1e-9 (Hoeffding: 2 exp(-k^2 / 2) per value)."""
    return math.sqrt(2 * math.log(2 * dim * 1e9))


def skellam_rdp(orders: Sequence[int], *, l1: float, l2: float, variance: float) -> list[float]:
    """The Skellam mechanism's Rényi DP at integer ``orders``, for a shift of L1 norm
    ``l1`` and L2 norm ``l2``, with noise of ``variance`` per value (Agarwal et al. 2021,
    Theorem 3.5)."""
    mu = variance
    return [
        a * l2**2 / (2 * mu) + min(((2 * a - 1) * l2**2 + 6 * l1) / (4 * mu**2), 3 * l1 / (2 * mu))
        for a in orders
    ]


def rdp_epsilon(orders: Sequence[float], rdp: Sequence[float], delta: float) -> float:
    eps, _ = get_privacy_spent(orders=list(orders), rdp=list(rdp), delta=delta)
    return float(eps)


def noise_rng() -> np.random.Generator:
    """A generator seeded with 256 bits from the operating system per use (NumPy's
    PCG64: unpredictable, not a cryptographic generator; docs/secure-aggregation.md)."""
    return np.random.default_rng(secrets.randbits(256))


def skellam(size: int, variance: float, rng: np.random.Generator) -> np.ndarray:
    """Symmetric Skellam draws of ``variance``: Poisson(variance/2) - Poisson(variance/2)."""
    half = variance / 2
    if half > POISSON_LIMIT:
        raise ValueError(
            f"Skellam noise of variance {variance:.3g}: past {2 * POISSON_LIMIT:.0e}, NumPy's "
            "Poisson draws are not exact; use a smaller fixed-point scale"
        )
    return rng.poisson(half, size).astype(np.int64) - rng.poisson(half, size).astype(np.int64)


def noised(
    values: np.ndarray, ddp: DistributedDp, ring: Ring, rng: np.random.Generator
) -> np.ndarray:
    """A region's update as ring elements with its noise share: clipped, scaled,
    conditionally rounded (to the L2 bound the accountant assumes), plus Skellam.
    Without distributed noise there is no sensitivity to hold the rounding to, and each
    value goes to its nearest integer: half the error variance of stochastic rounding,
    and its sum no less private (the updates it rounds are DP-SGD's, or not DP at all)."""
    x = np.asarray(values, np.float64).ravel()
    if x.size != ddp.dim:
        raise ValueError(f"an update of {x.size} values, the sum is over {ddp.dim}")
    scaled = clip_norm(x, ddp.clip) * ddp.scale
    if ddp.noise_multiplier == 0:
        return ring.reduce(np.rint(scaled).astype(np.int64).astype(np.uint64))
    for _ in range(_TRIES):
        rounded = round_stochastically(scaled, rng)
        if float(np.linalg.norm(rounded)) <= ddp.l2:
            break
    else:
        raise RoundingFailed(f"no rounding within the L2 bound {ddp.l2:.1f} in {_TRIES} tries")
    noisy = rounded + skellam(x.size, ddp.share_variance, rng)
    return ring.reduce(noisy.astype(np.uint64))


def scale_for(
    *,
    regions: int,
    threshold: int,
    clip: float,
    noise: float,
    dim: int,
    block: int = 0,
    ring: Ring,
) -> float:
    """The finest fixed-point scale (a power of two, searched from well above
    ``2**bits``) at which a sum of ``regions`` clipped, rounded and noised updates fits
    the signed ring and the noise shares are exact Skellam draws; :class:`RingTooSmall`
    when none does."""
    for exponent in range(ring.bits + _SCALE_HEADROOM, -31, -1):
        scale = 2.0**exponent
        ddp = DistributedDp(clip, scale, noise, threshold, dim, block)
        if ddp.fits(regions, ring) and ddp.share_variance / 2 <= POISSON_LIMIT:
            return scale
    raise RingTooSmall(
        f"a sum of {regions} updates of {dim} values clipped to {clip:g} does not fit "
        f"{ring.bits} bits at any scale; raise secure-ring-bits"
    )
