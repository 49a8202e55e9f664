"""Distributed DP for the secure sum: each region adds a share of Skellam noise to its
integer update before masking, so the sum the aggregator learns carries the whole Skellam
mechanism, and no party sees a region's update with less than its share of noise.

The privacy unit is a region's whole update in a round (clipped to L2 norm ``clip``),
protected against the aggregator as long as ``threshold`` regions that do not collude
with it add their share; a region that trusts no one keeps local DP-SGD as well.
Accounting is Rényi DP: the Skellam bound (Agarwal, Kairouz and Liu 2021, Thm 3.5) at the
sensitivities conditional stochastic rounding guarantees (Kairouz, Liu and Steinke 2021),
converted to (epsilon, delta) as Opacus does.
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
#: Conditional rounding retries until the norm is within a bound that holds with
#: probability 1 - beta per try (DDGauss' beta).
BETA = math.exp(-0.5)
_TRIES = 100
#: How far above 2**bits the scale search starts (as a power of two): a rotated value is
#: the norm over sqrt(window), so a small ring holds a scale far past its own size.
_SCALE_HEADROOM = 24


class RoundingFailed(FedciuicError):
    """Conditional rounding missed its norm bound in many tries: the update is not released."""


@dataclass(frozen=True)
class DistributedDp:
    """One sum's noise: ``noise_multiplier * clip`` is its std per value from the shares."""

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
        """An integer vector's L1 norm: at most its squared L2 norm, and sqrt(dim) times it."""
        return min(self.l2**2, math.sqrt(self.dim) * self.l2)

    def fits(self, regions: int, ring: Ring) -> bool:
        """Whether a sum of ``regions`` rotated, rounded, noised updates stays inside the
        signed ring: a rotated value passes :func:`spread` times the window's norm over
        sqrt(its length) with a chance under 1e-9, rounding adds at most 1, then noise."""
        k = spread(self.dim)
        value = self.clip * self.scale / math.sqrt(self.block or self.dim)
        noise = k * math.sqrt(regions * self.share_variance)
        return bool(regions * (k * value + 1) + noise < 2 ** (ring.bits - 1))

    def rdp(self, honest: int) -> list[float]:
        """Rényi DP of one sum when ``honest`` regions' noise is unknown to the adversary."""
        return skellam_rdp(ORDERS, l1=self.l1, l2=self.l2, variance=honest * self.share_variance)

    def epsilon(self, rounds: int, delta: float, honest: int | None = None) -> float:
        """Epsilon at ``delta`` of ``rounds`` sums with ``honest`` regions' noise unknown
        (the aggregator alone: ``threshold``; colluding with k regions: ``threshold - k``)."""
        honest = self.threshold if honest is None else honest
        if honest < 1:
            return math.inf
        return rdp_epsilon(ORDERS, [rounds * r for r in self.rdp(honest)], delta)


#: The ring with distributed DP (its noise's headroom) or without the regions' norms,
#: when secure-ring-bits is 0.
DDP_RING_BITS = 24
#: The plain ``int8`` codec's rounding step, in standard deviations of the values it
#: codes: a secure sum's mean is held no coarser (through :data:`NEAREST_STEP`).
INT8_STEP = 0.0241
#: The coarsest step at which rounding to nearest (error variance step**2 / 12) errs no
#: more than ``int8``'s stochastic rounding at :data:`INT8_STEP` (step**2 / 6).
NEAREST_STEP = INT8_STEP * math.sqrt(2)
#: The chance per sum that a value passes the range its norms give (the wrap check
#: withholds such a sum).
TYPICAL_MISS = 1e-5
#: How much further a sum may reach than the run's last unmasked one did (:func:`alignment`)
#: and still fit its ring; past it the sum wraps, is withheld, and the next cannot wrap.
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
    """secure-ring-bits (``requested``), or with 0 the fewest bits at which a sum scaled
    by the regions' norms rounds no coarser than ``int8`` (:data:`NEAREST_STEP`), for a
    reach of ``regions`` norms, or once a sum was ``measured`` :data:`ALIGNMENT_MARGIN`
    times sqrt(``regions``); :data:`DDP_RING_BITS` with distributed DP or without norms."""
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
    """The rings a region takes a session in (either gives the aggregator the sum only)."""
    pair = ring_pair(
        requested, regions=regions, size=size, distributed_dp=distributed_dp, normed=normed
    )
    return tuple(sorted(set(pair)))


def sum_bound(norms: Sequence[float], reach: float | None) -> float:
    """The norm a sum is scaled for: the norms' total, or if less, given the last sum's
    ``reach``, :data:`ALIGNMENT_MARGIN` times that reach (at least 1) on these norms."""
    total = math.fsum(norms)
    if reach is None:
        return total
    return min(total, ALIGNMENT_MARGIN * max(1.0, reach) * _independent(norms))


def alignment(sum_norm: float, norms: Sequence[float]) -> float:
    """A sum's norm over the root of its regions' squared norms (1 when those are 0)."""
    root = _independent(norms)
    return sum_norm / root if root else 1.0


def _independent(norms: Sequence[float]) -> float:
    """How far a sum of independent updates of these norms reaches."""
    return math.sqrt(math.fsum(n * n for n in norms))


def normed_scale(*, bound: float, regions: int, size: int, ring: Ring) -> float:
    """The scale for a sum whose regions' sent norms add up to ``bound``: its values stay
    within :func:`typical_spread` times ``bound / sqrt(size)``, plus 1 per region's rounding."""
    room = (1 << (ring.bits - 1)) - regions - 1
    if room <= 0:
        raise RingTooSmall(f"{regions} regions' rounding alone fills {ring.bits} bits")
    return room * math.sqrt(size) / (typical_spread(size) * bound)


def typical_spread(dim: int) -> float:
    """Standard deviations no value of a rotated sum passes but with :data:`TYPICAL_MISS`."""
    return math.sqrt(2 * math.log(2 * dim / TYPICAL_MISS))


def spread(dim: int) -> float:
    """Standard deviations no value of a rotated update passes but with a chance under 1e-9
    (Hoeffding: 2 exp(-k^2 / 2) per value)."""
    return math.sqrt(2 * math.log(2 * dim * 1e9))


def skellam_rdp(orders: Sequence[int], *, l1: float, l2: float, variance: float) -> list[float]:
    """The Skellam mechanism's Rényi DP (Agarwal et al. 2021, Theorem 3.5)."""
    mu = variance
    return [
        a * l2**2 / (2 * mu) + min(((2 * a - 1) * l2**2 + 6 * l1) / (4 * mu**2), 3 * l1 / (2 * mu))
        for a in orders
    ]


def rdp_epsilon(orders: Sequence[float], rdp: Sequence[float], delta: float) -> float:
    eps, _ = get_privacy_spent(orders=list(orders), rdp=list(rdp), delta=delta)
    return float(eps)


def noise_rng() -> np.random.Generator:
    """NumPy's PCG64 seeded with 256 OS bits: unpredictable, not cryptographic (docs)."""
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
    conditionally rounded (to the L2 bound the accountant assumes), plus Skellam. Without
    noise each value goes to its nearest integer: no sensitivity to hold, half the error."""
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
    """The finest power-of-two scale at which a sum of ``regions`` clipped, rounded, noised
    updates fits the ring with exact Skellam draws; :class:`RingTooSmall` when none does."""
    for exponent in range(ring.bits + _SCALE_HEADROOM, -31, -1):
        scale = 2.0**exponent
        ddp = DistributedDp(clip, scale, noise, threshold, dim, block)
        if ddp.fits(regions, ring) and ddp.share_variance / 2 <= POISSON_LIMIT:
            return scale
    raise RingTooSmall(
        f"a sum of {regions} updates of {dim} values clipped to {clip:g} does not fit "
        f"{ring.bits} bits at any scale; raise secure-ring-bits"
    )
