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
* ``lab``: a secure sum in one process, for the tests and the benchmark (never a federation)."""

from typing import TYPE_CHECKING

from fedciuic.faces import face

if TYPE_CHECKING:
    from fedciuic.secagg.aggregator import Refusal as Refusal
    from fedciuic.secagg.aggregator import SecureSum as SecureSum
    from fedciuic.secagg.aggregator import SumWithheld as SumWithheld
    from fedciuic.secagg.ddp import alignment as alignment
    from fedciuic.secagg.ddp import noise_rng as noise_rng
    from fedciuic.secagg.ddp import noised as noised
    from fedciuic.secagg.ddp import ring_bits as ring_bits
    from fedciuic.secagg.ddp import ring_choices as ring_choices
    from fedciuic.secagg.ddp import ring_pair as ring_pair
    from fedciuic.secagg.ddp import sum_bound as sum_bound
    from fedciuic.secagg.lab import run_secure_sum as run_secure_sum
    from fedciuic.secagg.masking import Ring as Ring
    from fedciuic.secagg.masking import RingTooSmall as RingTooSmall
    from fedciuic.secagg.masking import from_ring as from_ring
    from fedciuic.secagg.masking import ring_sum as ring_sum
    from fedciuic.secagg.messages import FromRegion as FromRegion
    from fedciuic.secagg.messages import Phase as Phase
    from fedciuic.secagg.messages import Request as Request
    from fedciuic.secagg.messages import SecAggError as SecAggError
    from fedciuic.secagg.messages import Session as Session
    from fedciuic.secagg.messages import pack_answer as pack_answer
    from fedciuic.secagg.messages import parse as parse
    from fedciuic.secagg.messages import unpack_answer as unpack_answer
    from fedciuic.secagg.region import SecureSumRegion as SecureSumRegion
    from fedciuic.secagg.rotation import rotate as rotate
    from fedciuic.secagg.rotation import sent_norm as sent_norm
    from fedciuic.secagg.rotation import unrotate as unrotate
    from fedciuic.secagg.store import SECAGG_DIR as SECAGG_DIR
    from fedciuic.secagg.store import SessionStore as SessionStore

__getattr__ = face(__name__)  # each name imported on first use
