"""A region's part in a secure sum, phase by phase, inside its own round (and so its
own agent in a deployment): the aggregator's signed request in, the region's signed
message out, each phase on the region's audit log (docs/secure-aggregation.md).

The session is checked against the signed run config, the kept update and the policy
before the region joins; it masks the update kept (and charged) when it trained. A region
joins one session per round: two sums over different regions would give its update away.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from fedciuic.audit import SECURE_SENT_EVENTS, digest
from fedciuic.compression import Sparse, update_entries
from fedciuic.config import NodeConfig, RunConfig
from fedciuic.crypto import AGGREGATOR, Keypair, PublicBundle, load_bundles, read_update_payload
from fedciuic.policy import RegionPolicy
from fedciuic.secagg import (
    SECAGG_DIR,
    FromRegion,
    Phase,
    Request,
    Ring,
    RingTooSmall,
    SecAggError,
    SecureSumRegion,
    Session,
    SessionStore,
    noise_rng,
    noised,
    pack_answer,
    parse,
    ring_choices,
    rotate,
)
from fedciuic.wire import SECAGG_REQUEST, UPDATE, Instruction

#: The audit events of each phase, in a region's log.
PHASE_EVENTS = dict(zip(Phase, SECURE_SENT_EVENTS, strict=True))
#: (delta) the distributed-DP epsilon is stated at.
DISTRIBUTED_DELTA = 1e-5


def request_of(task: Instruction) -> Request:
    """The request a signed secure-sum instruction carries (its one array)."""
    if set(task.adapter) != {SECAGG_REQUEST}:
        raise SecAggError(
            f"a secure-sum instruction carries {sorted(task.adapter)[:4]}, not [{SECAGG_REQUEST!r}]"
        )
    data = task.adapter[SECAGG_REQUEST]
    if data.dtype != np.uint8 or data.ndim != 1:
        raise SecAggError(f"{SECAGG_REQUEST}: uint8[n] expected")
    return parse(Request, data.tobytes(), Phase.ADVERT)


def peers_of(run: RunConfig, node: NodeConfig, me: str) -> dict[str, PublicBundle]:
    """The other regions' public bundles from node config peer-bundles, never from the
    aggregator; in simulation (one operator, every key) the run's keys-dir."""
    deployed = bool(node.key_file or node.aggregator_bundle)
    folder = node.peer_bundles or ("" if deployed else run.sealing.keys_dir)
    bundles = load_bundles(Path(folder)) if folder else {}
    return {b.party: b for b in bundles.values() if b.party not in (me, AGGREGATOR)}


def check_session(
    session: Session,
    run: RunConfig,
    *,
    run_id: int,
    server_round: int,
    kept_size: int | None = None,
) -> None:
    """The session is this round's, over the signed run's regions, on every signed term,
    the kept update's size and their scale, lest the aggregator learn more than the sum or
    weaken the noise. :class:`SecAggError` names every field that is not, and its due."""
    secure = run.secure
    wrong = []
    outside = [r for r in session.regions if r not in run.regions]
    if outside:
        wrong.append(
            f"regions: {', '.join(outside)} not among the signed run's regions "
            f"({', '.join(run.regions)})"
        )
    expected: dict[str, tuple[object, object]] = {
        "run": (session.run_id, run_id),
        "round": (session.server_round, server_round),
        "clip (max-update-norm)": (session.clip, run.compression.max_update_norm),
        "noise (distributed-noise-multiplier)": (
            session.noise,
            secure.distributed_noise_multiplier,
        ),
        "threshold (secure-threshold, or more than half of the signed regions)": (
            session.threshold,
            run.unmask_threshold,
        ),
    }
    if kept_size is not None:
        expected["size (the values of the update this region kept)"] = (session.size, kept_size)
    rings = ring_choices(
        secure.secure_ring_bits,
        regions=len(run.regions),
        size=session.size if kept_size is None else kept_size,
        distributed_dp=secure.distributed_noise_multiplier > 0,
        normed=run.secure_norms,
    )
    if session.bits not in rings:
        wrong.append(
            f"ring bits (secure-ring-bits) {session.bits!r}, not {' or '.join(map(str, rings))}"
        )
    wrong += [f"{k} {got!r}, not {want!r}" for k, (got, want) in expected.items() if got != want]
    if not wrong:  # the scale these terms give (Session.propose's own)
        try:
            scale = Session.propose(**session.terms()).scale
        except RingTooSmall as err:
            wrong.append(f"scale: none fits ({err})")
        else:
            if session.scale != scale:
                wrong.append(
                    f"scale {session.scale!r}, not {scale!r} (the finest fixed point at "
                    "which the signed ring holds the sum)"
                )
    if wrong:
        raise SecAggError(
            "the secure-sum session is not on the run's terms: " + "; ".join(wrong) + "; refusing"
        )


def check_distributed_epsilon(
    session: Session, *, rounds: int, max_epsilon: float | None
) -> dict[str, float]:
    """The distributed-DP epsilons of joining ``session`` (the run's ``rounds``-th sum),
    this round's and the run's, alone and with all but one region colluding;
    :class:`SecAggError` when the run's is above ``max_epsilon`` (None: no bound)."""
    if session.noise == 0:
        return {}
    ddp = session.distributed()
    figures = {
        "epsilon_distributed": ddp.epsilon(1, DISTRIBUTED_DELTA),
        "epsilon_distributed_collusion": ddp.epsilon(1, DISTRIBUTED_DELTA, 1),
        "epsilon_distributed_run": ddp.epsilon(rounds, DISTRIBUTED_DELTA),
        "epsilon_distributed_run_collusion": ddp.epsilon(rounds, DISTRIBUTED_DELTA, 1),
        "delta_distributed": DISTRIBUTED_DELTA,
    }
    run_epsilon = figures["epsilon_distributed_run"]
    if max_epsilon is not None and not run_epsilon <= max_epsilon:
        raise SecAggError(
            f"the secure sum's distributed epsilon over this run would be {run_epsilon:.3g} "
            f"(delta {DISTRIBUTED_DELTA:g}), over the policy's {max_epsilon:g} "
            "(privacy.max_epsilon_per_run); refusing to join it"
        )
    return figures


def secure_keypair(run: RunConfig, node: NodeConfig, keypair: Keypair | None) -> Keypair:
    """The keypair the region takes part in a secure sum with."""
    if keypair is None or not run.secure.secure_aggregation:
        raise SecAggError(
            f"region {node.region}: a secure-sum instruction in a run without secure "
            "aggregation (or without the region's keys); refusing it"
        )
    return keypair


def kept_values(
    run: RunConfig, node: NodeConfig, run_id: int, server_round: int
) -> tuple[Sparse, int]:
    """The update this region kept when it trained the round, decoded, and its size."""
    from fedciuic.region.trainer import SentUpdates  # torch: loaded where a region trains

    found = SentUpdates(node.state_dir).load(run_id, server_round)
    if found is None:
        raise SecAggError(
            f"region {node.region}: no update kept for round {server_round}: "
            "it did not train this round"
        )
    arrays, _, _ = read_update_payload(found.payload)
    data = arrays[UPDATE].tobytes()
    size = update_entries(data)
    return run.compression.codec.decode(data, size), size


def encoded_update(update: Sparse, session: Session) -> np.ndarray:
    """The region's update as the ring elements it masks: rotated, clipped, rounded,
    noised. A sum scaled by norms may wrap (an update past its sent norm): the aggregator
    then withholds it."""
    ddp = session.distributed()
    ring = Ring(session.bits)
    if not session.bound and not ddp.fits(len(session.regions), ring):
        raise SecAggError(
            f"a sum of {len(session.regions)} updates at scale {session.scale:g} can wrap "
            f"around {session.bits} bits; refusing"
        )
    # noised clips the rotated update: the rotation keeps its norm
    return noised(rotate(update.dense(session.size), session.sid()), ddp, ring, noise_rng())


def secure_phase(
    run: RunConfig,
    node: NodeConfig,
    task: Instruction,
    *,
    keypair: Keypair,
    policy: RegionPolicy,
    run_id: int,
    note: Callable[..., None],
) -> bytes:
    """This region's message for the phase ``task`` asks for, under ``policy``, noted on
    the region's audit log before it leaves; :class:`SecAggError` refuses."""
    request = request_of(task)
    session = request.session
    # the region's guarantee where it has no DP-SGD of its own
    max_epsilon = None if run.privacy.dp else policy.max_epsilon_per_run
    if request.phase == Phase.ADVERT:
        update, size = kept_values(run, node, run_id, task.server_round)
    else:
        update, size = None, None
    check_session(session, run, run_id=run_id, server_round=task.server_round, kept_size=size)
    folder = node.state_dir / SECAGG_DIR
    sums = SessionStore(folder)
    region = SecureSumRegion(
        keypair,
        peers_of(run, node, keypair.bundle.party),
        min_regions=policy.min_secure_regions,
        store=folder,
    )
    details: dict[str, object] = {"session": session.sid().hex(), "phase": request.phase.value}
    message: FromRegion
    match request.phase:
        case Phase.ADVERT:
            if sums.joined(session.run_id, session.server_round):
                raise SecAggError(
                    f"this region already joined a secure sum for round {session.server_round}; "
                    "it joins one per round (two sums would give its update away)"
                )
            # this round's epsilon, and the run's so far (every sum it joined composed)
            epsilons = check_distributed_epsilon(
                session, rounds=sums.rounds_joined(session.run_id) + 1, max_epsilon=max_epsilon
            )
            assert update is not None  # read above, for the advert
            message = region.advertise(session, encoded_update(update, session))
            details |= {
                "regions": list(session.regions),
                "threshold": session.threshold,
                "ring_bits": session.bits,
                "noise_multiplier": session.noise,
                **epsilons,
            }
        case Phase.SHARES:
            message = region.share(session, request.adverts)
            details["regions"] = sorted(a.region for a in request.adverts)
        case Phase.MASKED:
            message = masked = region.masked(session, request.shared, request.items)
            details |= {"shared": list(request.shared), "digest": digest(masked.vector)}
        case Phase.CONSENT:
            message = region.consent(session, request.survivors)
            details["survivors"] = list(request.survivors)
        case Phase.REVEAL:
            message = reveal = region.reveal(session, request.survivors, request.consents)
            details |= {
                "survivors": list(request.survivors),
                "consents": sorted(c.region for c in request.consents),
                "self_shares_of": sorted(reveal.self_shares),
                "key_shares_of": sorted(reveal.key_shares),
            }
    data = pack_answer(message)
    note(PHASE_EVENTS[request.phase], **details, bytes=len(data))
    return data
