"""Secure aggregation's arithmetic (issue 35, first layer): fixed-point encoding in a
ring of 2^bits, pairwise and self masks that cancel in the sum (``masking``), and
Shamir sharing of the mask seeds for dropout recovery (``shamir``). No messages yet:
the protocol rounds on Flower's Message API build on these."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedciuic.faces import face

if TYPE_CHECKING:
    from fedciuic.secagg.masking import (
        Ring,
        RingTooSmall,
        from_ring,
        mask,
        ring_sum,
        to_ring,
        unmask,
    )
    from fedciuic.secagg.shamir import (
        SEED_BYTES,
        MalformedShare,
        NotEnoughShares,
        Share,
        combine,
        split,
    )

#: What other packages use, and the module each lives in: imported on first use.
_WHERE = {
    "MalformedShare": "shamir",
    "NotEnoughShares": "shamir",
    "Ring": "masking",
    "RingTooSmall": "masking",
    "SEED_BYTES": "shamir",
    "Share": "shamir",
    "ring_sum": "masking",
    "combine": "shamir",
    "from_ring": "masking",
    "to_ring": "masking",
    "mask": "masking",
    "split": "shamir",
    "unmask": "masking",
}
__all__ = [
    "SEED_BYTES",
    "MalformedShare",
    "NotEnoughShares",
    "Ring",
    "RingTooSmall",
    "Share",
    "combine",
    "from_ring",
    "mask",
    "ring_sum",
    "split",
    "to_ring",
    "unmask",
]
__getattr__ = face(__name__, _WHERE)
