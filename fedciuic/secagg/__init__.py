"""Secure aggregation (docs/secure-aggregation.md): the aggregator learns the sum of the
regions' updates and nothing else.

* ``masking``: fixed point in a ring of 2^bits, pair and self masks that cancel in the sum;
* ``shamir``: Shamir shares of the mask seeds, for regions that drop;
* ``messages``: the session and each phase's messages, typed and signed;
* ``rotation``: the random rotation that lets few bits carry the sum;
* ``ddp``: distributed DP (Skellam noise shares, the accountant), the fixed-point scale;
* ``store``: a region's secure sums on disk;
* ``seeds``: what a region's seeds give, sealed between regions with X-Wing;
* ``region`` / ``aggregator``: the two ends of a secure sum;
* ``local``: a secure sum in one process (tests, benchmark)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedciuic.faces import face

if TYPE_CHECKING:
    from fedciuic.secagg.aggregator import Refusal, SecureSum, SumWithheld
    from fedciuic.secagg.ddp import DistributedDp, noise_rng, noised, scale_for
    from fedciuic.secagg.local import run_secure_sum
    from fedciuic.secagg.masking import (
        Ring,
        RingTooSmall,
        from_ring,
        mask,
        ring_sum,
        to_ring,
        unmask,
    )
    from fedciuic.secagg.messages import (
        FromRegion,
        Phase,
        Request,
        SecAggError,
        Session,
        pack_answer,
        parse,
        unpack_answer,
    )
    from fedciuic.secagg.region import SecureSumRegion
    from fedciuic.secagg.rotation import padded, rotate, unrotate
    from fedciuic.secagg.shamir import (
        SEED_BYTES,
        MalformedShare,
        NotEnoughShares,
        Share,
        combine,
        split,
    )
    from fedciuic.secagg.store import SECAGG_DIR, SessionStore

#: What other packages use, and the module each lives in: imported on first use.
_WHERE = {
    "SessionStore": "store",
    "pack_answer": "messages",
    "unpack_answer": "messages",
    "padded": "rotation",
    "rotate": "rotation",
    "unrotate": "rotation",
    "DistributedDp": "ddp",
    "FromRegion": "messages",
    "Request": "messages",
    "SECAGG_DIR": "store",
    "noise_rng": "ddp",
    "noised": "ddp",
    "parse": "messages",
    "scale_for": "ddp",
    "Phase": "messages",
    "Refusal": "aggregator",
    "SecAggError": "messages",
    "SecureSum": "aggregator",
    "SecureSumRegion": "region",
    "Session": "messages",
    "SumWithheld": "aggregator",
    "run_secure_sum": "local",
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
    "SECAGG_DIR",
    "SEED_BYTES",
    "DistributedDp",
    "FromRegion",
    "MalformedShare",
    "NotEnoughShares",
    "Phase",
    "Refusal",
    "Request",
    "Ring",
    "RingTooSmall",
    "SecAggError",
    "SecureSum",
    "SecureSumRegion",
    "Session",
    "SessionStore",
    "Share",
    "SumWithheld",
    "combine",
    "from_ring",
    "mask",
    "noise_rng",
    "noised",
    "pack_answer",
    "padded",
    "parse",
    "ring_sum",
    "rotate",
    "run_secure_sum",
    "scale_for",
    "split",
    "to_ring",
    "unmask",
    "unpack_answer",
    "unrotate",
]
__getattr__ = face(__name__, _WHERE)
