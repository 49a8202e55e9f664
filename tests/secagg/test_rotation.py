"""The secure sum's random rotation: it keeps norms (the DP sensitivity), pads nothing,
its inverse is exact, the sum of rotated updates is the rotation of their sum, and it
spreads a spike over a whole window, which is what lets few bits carry the sum."""

from __future__ import annotations

import numpy as np
import pytest

from fedciuic.secagg import Ring, Session, from_ring, ring_sum, rotate, unrotate
from fedciuic.secagg.ddp import noised, typical_spread
from fedciuic.secagg.rotation import block, sent_norm

SEED = b"session id"


@pytest.mark.parametrize("size", [1, 3, 300, 8832, 3 * 65536 + 5, 1 << 16])
def test_the_rotation_keeps_norms_pads_nothing_and_its_inverse_is_exact(size):
    x = np.random.default_rng(size).normal(size=size)
    y = rotate(x, SEED)
    assert y.size == size and block(size) <= size < 2 * block(size)
    assert np.isclose(np.linalg.norm(y), np.linalg.norm(x))
    np.testing.assert_allclose(unrotate(y, SEED), x, atol=1e-12)


def test_the_sum_of_rotations_is_the_rotation_of_the_sum():
    rng = np.random.default_rng(0)
    xs = [rng.normal(size=1000) for _ in range(4)]
    np.testing.assert_allclose(
        sum(rotate(x, SEED) for x in xs), rotate(np.sum(xs, axis=0), SEED), atol=1e-12
    )
    assert not np.allclose(rotate(xs[0], SEED), rotate(xs[0], b"another session"))


@pytest.mark.parametrize("where", [0, 100_000, 3 * 65536 - 1])
def test_a_spike_is_spread_over_a_whole_window(where):
    size = 3 * 65536
    x = np.zeros(size)
    x[where] = 1.0
    # about 1 / sqrt(window) (a few times that where the two windows overlap), wherever
    # the spike is
    assert np.abs(rotate(x, SEED)).max() <= typical_spread(size) / np.sqrt(block(size))


def test_a_lopsided_update_is_spread_evenly_and_sends_its_norm_rounded_up():
    """A layout whose second window holds most of the update: after the permutation and
    the rotation, a value is about the update's norm over sqrt(size) in both windows,
    so the norm a region sends is what the sum's scale needs."""
    size = 3 * 65536 + 7
    x = np.random.default_rng(1).normal(size=size)
    x[block(size) :] *= 10
    rotated = rotate(x, SEED)
    spread = np.linalg.norm(x) / np.sqrt(size)
    for window in (rotated[: size - block(size)], rotated[block(size) :]):
        assert np.sqrt(np.mean(window**2)) == pytest.approx(spread, rel=0.05)
    norm = np.linalg.norm(x)
    assert norm <= sent_norm(x, clip=1e9) <= norm * 2 ** (1 / 16)
    assert sent_norm(x, clip=1.0) == 1.0 and sent_norm(np.zeros(3), clip=1.0) == 0.0


@pytest.mark.parametrize(("bits", "most"), [(16, 0.02), (20, 2e-3), (24, 2e-4)])
def test_few_bits_carry_the_mean_of_eight_rotated_updates(bits, most):
    """The bar DDGauss sets: a sum at under 16 bits a value. Each update is clipped
    to norm 1; the published mean's relative error, against the exact mean."""
    size, n = 100_000, 8
    session = Session.propose(
        run_id=1,
        server_round=1,
        regions=tuple(f"r{i}" for i in range(n)),
        threshold=5,
        bits=bits,
        size=size,
        clip=1.0,
        noise=0.0,
    )
    rng = np.random.default_rng(bits)
    xs = [u / np.linalg.norm(u) for u in rng.normal(size=(n, size))]
    ring, ddp = Ring(bits), session.distributed()
    encoded = [noised(rotate(x, session.sid()), ddp, ring, rng) for x in xs]
    total = from_ring(ring_sum(encoded, ring), scale=session.scale, ring=ring)
    mean = unrotate(total / n, session.sid())
    exact = np.mean(xs, axis=0)
    assert np.linalg.norm(mean - exact) / np.linalg.norm(exact) < most
