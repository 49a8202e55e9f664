"""The region's whole round, without Flower: an instruction in, a typed outcome out.

Expected problems become a decline with every reason. Everything the region decides and
sends is in its audit log, checkpointed, before the outcome is returned; a log that cannot
be written turns any outcome into a decline (fail closed).
"""

from __future__ import annotations

import json
import logging
import os
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedciuic import __version__
from fedciuic.audit import (
    OUTSIDE_DP,
    REGION_LOG,
    SENT_EVENTS,
    AuditLog,
    Event,
    code_version,
    config_hash,
)
from fedciuic.config import NodeConfig, RunConfig, SealSettings
from fedciuic.crypto import (
    AGGREGATOR,
    Keypair,
    TaskKind,
    read_update_payload,
    region_keys,
    update_payload,
)
from fedciuic.digests import installed_code
from fedciuic.errors import FedciuicError
from fedciuic.policy import (
    PolicyRefusal,
    RegionPolicy,
    enforce_region_policy,
    releases_dp_only,
)
from fedciuic.region.cache import release_freed_memory
from fedciuic.releases import (
    WITHHELD_REASON,
    EvaluationWithheld,
    data_fields,
    leaving,
    unavoidable,
    unreleased_evaluation,
    withholds_optional,
)
from fedciuic.stages import (
    AuditTrail,
    Clear,
    ClearRegion,
    NoAudit,
    RegionSealing,
    Sealed,
    SealingRegion,
)
from fedciuic.wire import (
    AGENT_CODE,
    AGENT_VERSION,
    AUDIT_COUNT,
    AUDIT_HEAD,
    EVALUATED,
    Instruction,
    MalformedInstruction,
    Records,
    RunEndNotice,
    clear,
    declined,
    evaluated,
    sealed,
    secure_answer,
    witnessed,
)

if TYPE_CHECKING:  # torch is imported where a round trains: the agent starts light
    from fedciuic.model import EvalStats
    from fedciuic.region.trainer import Region, Release

_LOG = logging.getLogger("flwr")  # the region's warnings go where Flower's do
_LOGS: dict[Path, AuditLog] = {}
_JOINED: set[tuple[Path | None, int, str]] = set()
#: One line per model load (base loaded and verified, data tokenised), in the state dir.
MODEL_LOADS = "model-loads.jsonl"
_LOADED: weakref.WeakSet[Region] = weakref.WeakSet()


@dataclass(frozen=True)
class Declined:
    """A normal outcome, not an error: the region says why it sends nothing."""

    region: str
    reason: str


@dataclass(frozen=True)
class Evaluated:
    region: str
    stats: EvalStats


@dataclass(frozen=True)
class RunEndWitnessed:
    """The answer to the run-end notice: its head is recorded, ours comes back."""

    region: str


@dataclass(frozen=True)
class SecureAnswer:
    """A region's message in one phase of a secure sum (its JSON)."""

    region: str
    data: bytes


RoundOutcome = Declined | Evaluated | Sealed | Clear | RunEndWitnessed | SecureAnswer


@dataclass(frozen=True)
class RegionReply:
    """An outcome, the head of the region's latest signed audit checkpoint (the aggregator
    records it: a later truncation shows), and the keypair that signs it (sealing on)."""

    outcome: RoundOutcome
    witness: tuple[int, str] | None = None
    keypair: Keypair | None = None
    flower_run: int = 0
    server_round: int = 0


def read_run(task: Instruction | RunEndNotice) -> RunConfig:
    """The run config the aggregator signed into ``task``: the only one a region applies."""
    return RunConfig.from_user_config(task.run_settings(), source="run config")


def read_configs(
    task: Instruction | RunEndNotice, node_config: Mapping[str, Any]
) -> tuple[RunConfig, NodeConfig]:
    """The run config from the instruction, and this node's config resolved against it."""
    run = read_run(task)
    return run, NodeConfig.resolve(node_config, run)


def region_name(run_config: Mapping[str, Any], node_config: Mapping[str, Any]) -> str:
    """The region's name for a decline, even when its config is broken."""
    try:
        run = RunConfig.from_user_config(run_config, source="run config")
        return NodeConfig.resolve(node_config, run).region
    except FedciuicError:
        return str(node_config.get("region") or f"partition-{node_config.get('partition-id', '?')}")


def unreadable(
    run_config: Mapping[str, Any],
    node_config: Mapping[str, Any],
    err: FedciuicError,
    *,
    run_end: bool = False,
) -> RegionReply:
    """The decline when the configs or message cannot be read (nothing to log or sign with)."""
    what = "cannot witness the run's end" if run_end else "declines"
    _LOG.warning("fedciuic: region %s: %s", what, err)
    return RegionReply(Declined(region_name(run_config, node_config), str(err)))


@lru_cache(maxsize=4)
def _sealing(
    settings: SealSettings, aggregator_jurisdiction: str, node: NodeConfig
) -> RegionSealing:
    """The region's end of the sealing stage, its keys loaded once per process."""
    if not settings.seal:
        return ClearRegion(aggregator_jurisdiction)
    keys = region_keys(
        node.region,
        key_file=node.key_file,
        aggregator_bundle=node.aggregator_bundle,
        keys_dir=settings.keys_dir,
        suite=settings.seal_suite,
    )
    return SealingRegion(keys)


def _region(run: RunConfig, node: NodeConfig, run_id: int) -> Region:
    """The region, each build logged and counted in :data:`MODEL_LOADS`."""
    from fedciuic.region.trainer import open_region

    region = open_region(run, node)
    if region not in _LOADED:
        _LOADED.add(region)
        loads = sum(1 for r in _LOADED if r.name == region.name)
        _LOG.info("fedciuic: region %s: model loaded (%d in this process)", region.name, loads)
        try:
            node.state_dir.mkdir(parents=True, exist_ok=True)
            line = {"region": region.name, "run": run_id, "pid": os.getpid()}
            with open(node.state_dir / MODEL_LOADS, "a", encoding="utf-8") as handle:
                handle.write(json.dumps(line) + "\n")
        except OSError as err:  # a count, not a record: the round goes on
            _LOG.warning("fedciuic: region %s: cannot count the model load: %s", region.name, err)
    return region


def close_regions() -> None:
    """Stop the training processes of every region this process loaded."""
    for region in list(_LOADED):
        region.close()


def model_loads(state_dir: Path, run_id: int | None = None) -> int:
    """How many times the region in ``state_dir`` loaded its model (for ``run_id``)."""
    try:
        lines = (state_dir / MODEL_LOADS).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return 0
    runs = [json.loads(line).get("run") for line in lines if line.strip()]
    return sum(1 for r in runs if run_id is None or r == run_id)


def region_log(node: NodeConfig) -> AuditLog | None:
    """The region's audit log (one per state-path, kept open); None when its default
    place is inside a missing data-path."""
    if not node.state_path and not Path(node.data_path).is_dir():
        return None
    path = node.state_dir / REGION_LOG
    if path not in _LOGS:
        redact = [(str(node.state_dir), "<state-path>"), (node.data_path, "<data-path>")]
        _LOGS[path] = AuditLog(path, node.region, None, redact=redact)
    return _LOGS[path]


def _audit(node: NodeConfig) -> AuditTrail:
    return region_log(node) or NoAudit()


def handle_instruction(
    run: RunConfig,
    node: NodeConfig,
    task: Instruction,
    *,
    asked: TaskKind,
    flower_run: int,
    simulated: bool,
) -> RegionReply:
    """One instruction handled, from checks to reply. ``asked``: Flower's message type,
    which must be what the aggregator signed; ``simulated``: a node with a partition id."""
    return _Round(run, node, flower_run).handle(task, asked=asked, simulated=simulated)


def decline_signed(
    node: NodeConfig,
    keypair: Keypair,
    task: Instruction | RunEndNotice,
    flower_run: int,
    err: FedciuicError,
) -> RegionReply:
    """A decline before the round starts (a run the region is not part of), logged and
    signed; unsigned when the log cannot be written."""
    _LOG.warning("fedciuic: region declines: %s", err)
    server_round = task.server_round if isinstance(task, Instruction) else None
    run_id = task.federation_run or flower_run
    try:
        audit = _audit(node)
        audit.append(Event.DECLINED, run_id=run_id, server_round=server_round, reason=str(err))
        audit.checkpoint(run_id=run_id, server_round=server_round)
        head = audit.last_checkpoint()
        if head is None:
            raise FedciuicError(f"region {node.region}: no audit log")
    except FedciuicError as audit_err:
        _LOG.warning("fedciuic: cannot write the audit log: %s", audit_err)
        return RegionReply(Declined(node.region, str(err)))
    return RegionReply(
        Declined(node.region, str(err)),
        witness=head,
        keypair=keypair,
        flower_run=flower_run,
        server_round=server_round or 0,
    )


def witness_run_end(
    run: RunConfig, node: NodeConfig, notice: RunEndNotice, *, flower_run: int
) -> RegionReply:
    """Record the head of the aggregator's log after its ``run_end`` (signature checked),
    and answer with our own head, signed."""
    reply = _Round(run, node, flower_run).witness_run_end(notice)
    release_freed_memory()  # the run is over: what its rounds freed goes back
    return reply


class _Round:
    """One instruction handled by the region, from checks to reply, with its audit trail."""

    def __init__(self, run: RunConfig, node: NodeConfig, flower_run: int) -> None:
        self.run, self.node = run, node
        # Flower's run id binds signatures; the federation's (another when this run resumes
        # one) keys the ledger, audit log and kept updates.
        self.flower_run = self.run_id = flower_run
        self.audit: AuditTrail = NoAudit()
        self.signer: Keypair | None = None  # once the aggregator's signature checked out
        self.server_round: int | None = None
        self.simulated = False
        self._dp_only: bool | None = None

    def note(self, event: str, **details: object) -> None:
        self.audit.append(event, run_id=self.run_id, server_round=self.server_round, **details)

    def handle(self, task: Instruction, *, asked: TaskKind, simulated: bool) -> RegionReply:
        """The outcome, once it is in the audit log and signed (else a decline)."""
        self.simulated = simulated
        try:
            outcome = self._handle(task, asked)
            self.audit.checkpoint(run_id=self.run_id, server_round=self.server_round)
        except FedciuicError as err:
            outcome = self._decline(err)
        try:
            return self._vouch(outcome)
        except FedciuicError as err:  # cannot read our own log: decline, unsigned
            return RegionReply(self._decline(err))

    def _open(self, federation_run: int) -> RegionSealing:
        """This region's audit log and its end of the sealing stage (whose keys sign it)."""
        self.run_id = federation_run or self.flower_run
        self.audit = _audit(self.node)
        sealing = _sealing(self.run.sealing, self.run.policy.aggregator_jurisdiction, self.node)
        self.audit.keypair = sealing.keypair
        return sealing

    def witness_run_end(self, notice: RunEndNotice) -> RegionReply:
        try:
            sealing = self._open(notice.federation_run)
            sealing.check_run_end(notice, self.flower_run)
            self.signer = sealing.keypair
            if read_run(notice) != self.run:
                raise MalformedInstruction(
                    f"region {self.node.region}: the run config is not the one the "
                    "aggregator signed into the run-end notice"
                )
            self._note_undelivered(notice)
            self.audit.witness(AGGREGATOR, *notice.witness, run_id=self.run_id)
            self.audit.checkpoint(run_id=self.run_id)
            return self._vouch(RunEndWitnessed(self.node.region))
        except FedciuicError as err:
            _LOG.warning("fedciuic: region cannot witness the run's end: %s", err)
            return RegionReply(Declined(self.node.region, str(err)))  # about the notice only

    def _note_undelivered(self, notice: RunEndNotice) -> None:
        """Note each update released in the run that the aggregator's signed receipts do
        not list: its epsilon is spent, and it was never delivered."""
        received = notice.received(self.node.region)
        noted, sent = set(), []
        for record in self.audit.records():
            details = record.get("details")
            if record.get("run_id") != self.run_id or not isinstance(details, dict):
                continue
            key = (record.get("round"), details.get("digest"))
            if record.get("event") == Event.UPDATE_UNDELIVERED:
                noted.add(key)
            elif record.get("event") in SENT_EVENTS:
                sent.append(key)
        for server_round, sent_digest in sent:
            if (server_round, sent_digest) in received | noted:
                continue
            self.audit.append(
                Event.UPDATE_UNDELIVERED,
                run_id=self.run_id,
                server_round=server_round,
                digest=sent_digest,
                reason="the aggregator's signed run-end notice lists no receipt of it",
            )
            _LOG.warning(
                "fedciuic: region %s: the update of round %s left the region (its epsilon "
                "is spent) and never reached the aggregator",
                self.node.region,
                server_round,
            )

    @property
    def dp_only(self) -> bool:
        """Whether the region's policy lets out only DP releases."""
        if self._dp_only is None:
            self._dp_only = releases_dp_only(self.run, self.node, simulated=self.simulated)
        return self._dp_only

    def _reason(self, err: FedciuicError) -> str:
        """A decline's reason as it leaves: under dp_only only a ``public_reason`` does."""
        return WITHHELD_REASON if self.dp_only and not err.public_reason else str(err)

    def _released(self, outcome: RoundOutcome) -> RoundOutcome:
        """The outcome without withheld optional figures, every field checked against the
        release table (fail closed)."""
        if isinstance(outcome, Declined):  # its reason came through _reason
            return outcome
        if isinstance(outcome, Evaluated) and withholds_optional(self.run, dp_only=self.dp_only):
            outcome = Evaluated(outcome.region, replace(outcome.stats, step_seconds=None))
        records = outcome_records(outcome)
        fields = {**records.info, **records.metrics, **(records.arrays or {})}
        who = f"region {self.node.region}"
        leaving(str(records.info["status"]), fields, self.run, dp_only=self.dp_only, who=who)
        return outcome

    def _vouch(self, outcome: RoundOutcome) -> RegionReply:
        return RegionReply(
            self._released(outcome),
            witness=self.audit.last_checkpoint(),
            keypair=self.signer,
            flower_run=self.flower_run,
            server_round=self.server_round or 0,
        )

    def _decline(self, err: FedciuicError) -> Declined:
        _LOG.warning("fedciuic: region declines: %s", err)
        try:
            if isinstance(err, PolicyRefusal):
                self.note(Event.POLICY_DECISION, **err.decision.to_record())
            self.note(Event.DECLINED, reason=str(err))
            self.audit.checkpoint(run_id=self.run_id, server_round=self.server_round)
        except FedciuicError as audit_err:
            _LOG.warning("fedciuic: cannot write the audit log: %s", audit_err)
        return Declined(self.node.region, self._reason(err))

    def _handle(self, task: Instruction, asked: TaskKind) -> RoundOutcome:
        run, node = self.run, self.node
        self.server_round = task.server_round
        sealing = self._open(task.federation_run)
        sealing.check_global(task, self.flower_run)
        self.signer = sealing.keypair
        if task.kind != asked:
            raise MalformedInstruction(
                f"region {node.region}: a {asked} message carries an instruction to "
                f"{task.kind}; refusing it"
            )
        if read_run(task) != run:
            raise MalformedInstruction(
                f"region {node.region}: the run config to apply is not the one the "
                "aggregator signed into the instruction; refusing it"
            )
        if task.witness is not None:
            self.audit.witness(
                AGGREGATOR, *task.witness, run_id=self.run_id, server_round=self.server_round
            )
        if task.kind == TaskKind.SECAGG:  # a phase of the secure sum
            from fedciuic.region.secure import secure_keypair, secure_phase

            keypair = secure_keypair(run, node, sealing.keypair)
            policy = self._policy(sealing, task.checkpoint)
            data = secure_phase(
                run, node, task, keypair=keypair, policy=policy, run_id=self.run_id, note=self.note
            )
            return SecureAnswer(node.region, data)
        region = _region(run, node, self.run_id)
        if task.kind != TaskKind.TRAIN:
            return self._task(task, sealing, region, None)
        from fedciuic.region.trainer import Release

        with Release.open(
            region, self.audit, run_id=self.run_id, server_round=task.server_round
        ) as release:
            return self._task(task, sealing, region, release)

    def _task(
        self, task: Instruction, sealing: RegionSealing, region: Region, release: Release | None
    ) -> RoundOutcome:
        """The checked instruction's task under the region's policy: evaluation
        (``release``: None), or the round's update (kept or trained now), sealed."""
        if release is not None and (release.counts or (self.dp_only and unavoidable(self.run))):
            # Before the DP count is drawn (a refused run releases nothing), and before a
            # projection from an exact count could name a figure of the data in a refusal.
            self._policy(sealing, task.checkpoint)
        projected = None if release is None else release.project()
        policy = self._policy(sealing, task.checkpoint, projected)
        if policy.decision.enforced:
            self.note(Event.POLICY_DECISION, **policy.decision.to_record())
        if release is None:
            if policy.dp_only and (figures := unreleased_evaluation(self.run)):
                raise EvaluationWithheld(region.name, figures)
            stats = region.evaluate(
                task.adapter,
                base_fingerprint=task.base_fingerprint,
                run_id=self.run_id,
                server_round=task.server_round,
                step_seconds=not withholds_optional(self.run, dp_only=self.dp_only),
            )
            answer = self._released(Evaluated(region.name, stats))
            records = outcome_records(answer)
            outside = data_fields(EVALUATED, {**records.info, **records.metrics}, self.run)
            spent = stats.released or {}  # a DP evaluation: its epsilon and ledger
            self.note(
                Event.EVALUATED,
                examples=stats.num_examples,
                loss=stats.loss,
                **{OUTSIDE_DP: outside},
                **spent,
            )
            return answer
        released = release.send(task, policy)
        if released.resent:
            self.note(Event.UPDATE_RESENT, federation_run=self.run_id, flower_run=self.flower_run)
        return sealing.send(
            region.name,
            self._leaving(released.payload),
            flower_run=self.flower_run,
            server_round=self.server_round or 0,
            policy_hash=policy.hash,
            note=self.note,
        )

    def _leaving(self, payload: bytes) -> bytes:
        """What leaves after training: with secure aggregation not the update (it leaves
        masked, in the secure sum)."""
        if not self.run.secure.secure_aggregation:
            return payload
        _, metrics, info = read_update_payload(payload)
        return update_payload({}, metrics, info)  # type: ignore[arg-type]

    def _policy(
        self, sealing: RegionSealing, checkpoint: str, projected_epsilon: float | None = None
    ) -> RegionPolicy:
        """The region's policy on this run (a refusal declines), then the run joined."""
        policy = enforce_region_policy(
            self.run,
            self.node,
            simulated=self.simulated,
            aggregator_jurisdiction=sealing.destination,
            own_jurisdiction=sealing.own_jurisdiction,
            projected_epsilon=projected_epsilon,
            data_releases=unavoidable(self.run),
        )
        self._dp_only = policy.dp_only  # read with the policy: no second read
        if not policy.redacts_paths:
            self.audit.redact = ()
        self._join(sealing, policy, checkpoint)
        return policy

    def _join(self, sealing: RegionSealing, policy: RegionPolicy, checkpoint: str) -> None:
        """``run_joined`` once per run, and again when it resumes from a checkpoint."""
        if (self.audit.path, self.run_id, checkpoint) in _JOINED:
            return
        _JOINED.add((self.audit.path, self.run_id, checkpoint))
        self.note(
            Event.RUN_JOINED,
            resumed_from_checkpoint=checkpoint or None,
            config_hash=config_hash(self.run.flat()),
            code_version=code_version(),
            code=installed_code(),
            **sealing.joined(),
            policy_hash=policy.hash or None,  # none without a policy (a lab baseline)
            jurisdiction=policy.jurisdiction or None,
        )


def outcome_records(outcome: RoundOutcome) -> Records:
    """An outcome's own fields, as its reply carries them."""
    match outcome:
        case Declined(region, reason):
            return declined(region, reason)
        case Evaluated(region, stats):
            return evaluated(
                region, stats.num_examples, stats.loss, stats.perplexity, stats.step_seconds
            )
        case Sealed(region, envelope, key_id):
            return sealed(region, envelope, key_id)
        case Clear(arrays, metrics, info):
            return clear(arrays, metrics, info)
        case RunEndWitnessed(region):
            return witnessed(region)
        case SecureAnswer(region, data):
            return secure_answer(region, data)


def region_records(reply: RegionReply) -> Records:
    """An outcome as its reply carries it: with the head of the region's audit log, the
    code that made it, and a signature where the reply names a keypair."""
    records = outcome_records(reply.outcome)
    vouched: dict[str, str | int | bytes] = {
        **records.info,
        AGENT_VERSION: __version__,
        AGENT_CODE: installed_code(),
    }
    if reply.witness is not None:
        vouched[AUDIT_COUNT], vouched[AUDIT_HEAD] = reply.witness
    records = Records(vouched, records.metrics, records.arrays)
    if reply.keypair is None:
        return records
    return records.sign(reply.keypair, run_id=reply.flower_run, server_round=reply.server_round)
