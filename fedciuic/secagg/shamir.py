"""Shamir secret sharing of 32-byte seeds over GF(2^521 - 1): any ``threshold`` of the
shares give the seed back; fewer say nothing about it (every seed is equally likely)."""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass

from fedciuic.errors import FedciuicError

#: A Mersenne prime, so that every 32-byte seed is a field element.
PRIME = 2**521 - 1
SEED_BYTES = 32


class NotEnoughShares(FedciuicError):
    """Fewer shares than the threshold: the seed cannot be (and is not) recovered."""


class MalformedShare(FedciuicError):
    """A share outside the field, a holder named twice, or shares that disagree."""


@dataclass(frozen=True)
class Share:
    """The sharing polynomial's value at ``holder`` (never 0, where the seed is)."""

    holder: int
    value: int


def split(seed: bytes, threshold: int, holders: Sequence[int]) -> list[Share]:
    """One share of ``seed`` per holder; any ``threshold`` of them recover it."""
    if len(seed) != SEED_BYTES:
        raise ValueError(f"a seed is {SEED_BYTES} bytes, not {len(seed)}")
    _check_holders(holders)
    if not 1 <= threshold <= len(holders):
        raise ValueError(f"threshold {threshold} is not in 1..{len(holders)} (the holders)")
    coefficients = [int.from_bytes(seed, "big")]
    coefficients += [secrets.randbelow(PRIME) for _ in range(threshold - 1)]
    return [Share(x, _evaluate(coefficients, x)) for x in holders]


def combine(shares: Sequence[Share], threshold: int) -> bytes:
    """The seed from at least ``threshold`` shares, all on one polynomial."""
    _check_holders([s.holder for s in shares])
    if any(not 0 <= s.value < PRIME for s in shares):
        raise MalformedShare("a share's value is outside the field")
    if len(shares) < threshold:
        raise NotEnoughShares(
            f"{len(shares)} share(s), {threshold} needed: the seed is not recovered"
        )
    basis, rest = list(shares[:threshold]), shares[threshold:]
    for extra in rest:
        if _interpolate(basis, extra.holder) != extra.value:
            raise MalformedShare(f"the share of holder {extra.holder} disagrees with the others")
    secret = _interpolate(basis, 0)
    if secret >> (8 * SEED_BYTES):
        raise MalformedShare("the shares do not hold a seed (too large a value)")
    return secret.to_bytes(SEED_BYTES, "big")


def _check_holders(holders: Sequence[int]) -> None:
    if len(set(holders)) != len(holders):
        raise MalformedShare(f"a holder is named twice in {sorted(holders)}")
    if any(not 0 < x < PRIME for x in holders):
        raise MalformedShare("a holder is 0 or outside the field")


def _evaluate(coefficients: Sequence[int], x: int) -> int:
    value = 0
    for c in reversed(coefficients):
        value = (value * x + c) % PRIME
    return value


def _interpolate(points: Sequence[Share], at: int) -> int:
    """The value at ``at`` of the polynomial through ``points`` (Lagrange)."""
    total = 0
    for i, p in enumerate(points):
        numerator, denominator = 1, 1
        for j, q in enumerate(points):
            if i != j:
                numerator = numerator * (at - q.holder) % PRIME
                denominator = denominator * (p.holder - q.holder) % PRIME
        total = (total + p.value * numerator * pow(denominator, -1, PRIME)) % PRIME
    return total
