"""The aggregator's round, without Flower: replies in, one verdict per reply, then the
round's aggregate published or withheld.

Each reply goes through one boundary (:meth:`AggregatorRound._guarded`): read,
authenticate (its signature names the region it is recorded under), open (sealed or
clear), validate and check against its sender's policy. *Any* exception in there
rejects that reply alone. Each outcome is then recorded (metrics.json and the audit
log) before it counts; a second reply under a label already taken is rejected.

Differences from plain FedAvg, each for a reason:

* replies are adapter *deltas*, averaged by examples and applied to the global adapter;
* a region that declines is a normal outcome: it is recorded and the round goes on;
  a reply that fails or is malformed is rejected alone instead of skipping the round;
* with policies, each update is checked against its sender's jurisdiction policy
  (named in the envelope header) and an aggregate is published only when the
  strictest minimum among its regions' policies is met; otherwise the global
  adapter stays as it was for that round.
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

import numpy as np

from fedciuic.aggregation import (
    Aggregator,
    Bounds,
    Checked,
    ImplausibleUpdate,
    check,
    make_aggregator,
)
from fedciuic.aggregator.checkpoint import Checkpoint, save_checkpoint
from fedciuic.aggregator.schedule import Availability, Changes, ScheduleError, Tasks
from fedciuic.audit.events import Event
from fedciuic.audit.log import RECEIVED_EVENT, digest
from fedciuic.compression import Codec, layout_of
from fedciuic.config import RunConfig
from fedciuic.crypto.sealing import NONCE_BYTES, EnvelopeRejected, TaskKind, model_digest
from fedciuic.policy.binding import UNSEALED, NotEnforced, PolicyGate
from fedciuic.policy.rules import Decision, UpdateFacts
from fedciuic.record.metrics import OVERALL
from fedciuic.record.recorder import RunRecorder
from fedciuic.server_optim import ServerOptimizer
from fedciuic.stages.audit import AuditTrail, NoAudit
from fedciuic.stages.sealing import ClearReplies, Header, ReplySealing
from fedciuic.wire import (
    AGENT_CODE,
    AGENT_VERSION,
    DECLINED,
    EVALUATED,
    FAILED,
    KEY_ID,
    NO_REPLY,
    POLICY_HASH,
    PRIVACY_UNIT,
    REJECTED,
    TRAINED,
    UPDATE,
    WITNESSED,
    Arrival,
    EvalMetrics,
    Instruction,
    MalformedReply,
    NoReply,
    Reply,
    RunEndNotice,
    TrainMetrics,
    Unread,
    Witness,
    failed,
    parse_eval_metrics,
    parse_train_metrics,
)

# Flower's logger, by name: the round's lines show with the rest of the run's output.
_logger = logging.getLogger("flwr")


#: Seconds a training round waits beyond twice the regions' timed local work: Flower's
#: polling, a ClientApp process per message, sealing and evaluation.
WAIT_MARGIN = 120.0


def reason_of(err: Exception) -> str:
    """A rejection's reason: the error's type and its message (or repr)."""
    return f"{type(err).__name__}: {str(err)[:500]}"


@dataclass(frozen=True)
class Task:
    """What a region was asked to train: the round its reply must be signed for (a
    buffered region's own task number), and the global version it trains from."""

    round: int
    version: int


@dataclass
class Collecting:
    """One aggregate being filled: the accepted updates so far, every judged reply, and
    the labels already recorded (a second reply under one is rejected)."""

    accumulator: Aggregator
    n: int  # entries in the flat adapter
    labels: set[str] = field(default_factory=set)
    judged: list[Judged] = field(default_factory=list)
    accepted: list[Accepted] = field(default_factory=list)


@dataclass(frozen=True)
class Accepted:
    """A trained reply once authenticated, opened, validated and checked by policy."""

    checked: Checked
    metrics: TrainMetrics
    info: dict[str, str]
    header: Header
    upload_bytes: int  # what crossed the relay: the envelope, or the clear update

    @property
    def region(self) -> str:
        return self.header.region


def agent_identity(info: Mapping[str, object]) -> dict[str, str]:
    """The code a reply says made it (its region agent's version and code digest)."""
    keys = ((AGENT_VERSION, "agent_version"), (AGENT_CODE, "agent_code"))
    return {name: str(info[key]) for key, name in keys if key in info}


@dataclass(frozen=True)
class Judged:
    """One reply's outcome, under the label it is recorded with: accepted (a trained
    update that counts), evaluated, or its reply's final status and reason (declined,
    failed, rejected)."""

    label: str
    reply: Reply  # its status and reason are final
    accepted: Accepted | None = None
    evaluated: EvalMetrics | None = None
    claimed: str = ""
    authenticated: bool = False
    task: Task | None = None  # what a training reply answers
    staleness: int = 0  # global versions published since its task was sent

    @property
    def status(self) -> str:
        return self.reply.status

    @property
    def reason(self) -> str:
        return self.reply.reason

    def entry(self) -> dict[str, Any]:
        """What metrics.json records for this reply, with the code that made it."""
        return {**self._entry(), **agent_identity(self.reply.info)}

    def _entry(self) -> dict[str, Any]:
        if self.accepted is not None:
            a = self.accepted
            return {
                "status": TRAINED,
                "reason": "",
                "norm": a.checked.norm,
                "clipped": a.checked.clipped,
                "loss": a.metrics.train_loss,
                "num_examples": a.metrics.num_examples,
                "steps": a.metrics.steps,
                "data_fingerprint": a.info["data-fingerprint"],
                "upload_bytes": a.upload_bytes,
                "update_bytes": a.metrics.update_bytes,
                **self._versions(),
                **a.metrics.record(),
            }
        if self.evaluated is not None:
            e = self.evaluated
            return {
                "status": EVALUATED,
                "loss": e.eval_loss,
                "perplexity": e.perplexity,
                "num_examples": e.num_examples,
                **({"step_seconds": e.step_seconds} if e.step_seconds is not None else {}),
            }
        entry: dict[str, Any] = {"status": self.reply.status, "reason": self.reply.reason}
        if self.claimed != self.label:
            entry["claimed_region"] = self.claimed
        return {**entry, **self._versions()}

    def _versions(self) -> dict[str, int]:
        """The global version an update was computed against, and how old it was (for an
        update that arrived: accepted or rejected; a decline or failure carries none)."""
        if self.task is None or self.reply.status not in (TRAINED, REJECTED):
            return {}
        return {"global_version": self.task.version, "staleness": self.staleness}


@dataclass(frozen=True)
class Published:
    """The round's aggregate, applied to the global adapter."""

    adapter: dict[str, np.ndarray]
    regions: list[str]
    examples: float
    train_loss: float | None  # weighted by examples, over the regions that report one


@dataclass(frozen=True)
class Withheld:
    """No aggregate this round: the global adapter is unchanged."""

    regions: list[str]
    reasons: list[str]


@dataclass(frozen=True)
class TrainResult:
    replies: list[Judged]
    aggregate: Published | Withheld


@dataclass(frozen=True)
class EvalResult:
    replies: list[Judged]
    loss: float | None  # weighted by examples; None when no region evaluated
    num_examples: int = 0


class AggregatorRound:
    """The aggregator's side of each round, over plain :class:`Reply` values."""

    def __init__(
        self,
        run: RunConfig,
        *,
        base_fingerprint: str,
        recorder: RunRecorder,
        sealing: ReplySealing | None = None,
        policies: PolicyGate | None = None,
        audit: AuditTrail | None = None,
        run_id: int = 0,
        federation_run: int = 0,
        checkpoints: Path | None = None,
    ) -> None:
        self.run = run
        #: What every instruction carries and signs: the config the regions are to apply.
        self.run_config = run.canonical_json()
        self.base_fingerprint = base_fingerprint
        self.recorder = recorder
        # The stages, chosen once: without them, a lab run (clear, no policies, no log).
        self.sealing: ReplySealing = sealing or ClearReplies()
        self.policies: PolicyGate = policies or NotEnforced()
        self.audit: AuditTrail = audit or NoAudit()
        self.run_id = run_id  # Flower's: binds envelopes and signatures
        self.federation_run = federation_run or run_id  # kept when a run is resumed
        #: The identity of the checkpoint this run resumed from ("" if it did not):
        #: signed into every instruction, so each region's log witnesses it.
        self.resumed_from = ""
        self.checkpoints = checkpoints
        self.global_adapter: dict[str, np.ndarray] = {}
        #: Aggregates published so far in this federation (the global adapter's version).
        self.version = 0
        self.regions_by_node: dict[int, str] = {}
        self.availability = Availability(run.regions, run.max_missed_rounds)
        self.tasks = Tasks(run.regions, run.num_server_rounds)  # buffered mode
        #: Each region's timed local step (from its evaluations): what train_wait sizes on.
        self.step_seconds: dict[str, float] = {}
        #: The highest checkpoint count each region's replies have shown in this run.
        self.witnessed_counts: dict[str, int] = {}
        self._wait_said = False
        # The step on each aggregate (server-optimizer); open_run restores it on resume.
        self.server_optimizer = ServerOptimizer.from_run(run)

    # -- instructions -------------------------------------------------------------

    def sign_instruction(
        self, server_round: int, kind: TaskKind, adapter: Mapping[str, np.ndarray]
    ) -> Instruction:
        """A round's instruction: the global adapter, the kind of task, this run's config
        and a fresh nonce, signed (with sealing) with the head of the audit log."""
        witness = self.audit.last_checkpoint()
        unsigned = Instruction(
            adapter=dict(adapter),
            server_round=server_round,
            base_fingerprint=self.base_fingerprint,
            kind=kind,
            run_config=self.run_config,
            nonce=secrets.token_bytes(NONCE_BYTES),
            signer=self.sealing.signer,
            federation_run=self.federation_run,
            witness=witness,
            checkpoint=self.resumed_from,
        )
        signature = self.sealing.sign_global(self.run_id, unsigned)
        return replace(unsigned, signature=signature)

    # -- the per-reply boundary ---------------------------------------------------

    def _guarded(
        self,
        server_round: int,
        item: Arrival,
        judge: Callable[[Reply, str | None], Judged],
        *,
        signed_round: int | None = None,
    ) -> Judged:
        """The one boundary per reply: *any* exception while reading, authenticating,
        opening, decoding or validating a reply rejects that reply alone (its type
        named in the record), and the round goes on with the others. ``signed_round``:
        the round the reply must be signed for, when not ``server_round`` (a buffered
        region's own task number)."""
        if isinstance(item, NoReply):
            reason = f"{NO_REPLY} ({item.waited or self.run.round_timeout:g}s)"
            return self._settle(failed(item.node_id, "", reason), None)
        reply, sender = failed(item.node_id, "", ""), None
        try:
            reply = item.read() if isinstance(item, Unread) else item
            sender = self._authenticate(reply, signed_round or server_round)
            if sender is not None:
                self._witnessed(server_round, sender, reply.witness)
            return judge(reply, sender)
        except Exception as err:  # the boundary: no reply stops the run
            return self._settle(reply, sender, error=err)

    def _settle(
        self,
        reply: Reply,
        sender: str | None,
        *,
        error: Exception | None = None,
        accepted: Accepted | None = None,
        evaluated: EvalMetrics | None = None,
    ) -> Judged:
        """The reply's outcome under its label: the region its signature authenticates;
        else the region this node authenticated as before; else ``node-ID``."""
        label = sender or self.regions_by_node.get(reply.node_id) or f"node-{reply.node_id}"
        if error is not None:
            reply = replace(reply, status=REJECTED, reason=reason_of(error))
        return Judged(
            label,
            reply,
            accepted,
            evaluated,
            claimed=reply.region or label,
            authenticated=bool(sender),
        )

    def _authenticate(self, reply: Reply, server_round: int) -> str | None:
        """The region this reply comes from, by its signature; without sealing (a lab
        run, nothing to authenticate with) the name it claims."""
        if reply.status == FAILED:
            return None
        return self.sealing.sender(reply, self.run_id, server_round)

    # -- training -----------------------------------------------------------------

    @property
    def buffered(self) -> bool:
        return self.run.buffered

    @property
    def max_staleness(self) -> int:
        """Sync rounds take an update only against the current version; buffered mode
        weighs older ones down, up to max-staleness versions."""
        return self.run.max_staleness if self.buffered else 0

    @property
    def _staleness_rule(self) -> str:
        if self.buffered:
            return f"over max-staleness {self.run.max_staleness}"
        return (
            "a sync round uses an update only against the current global adapter "
            '(aggregation-mode = "buffered" weighs older ones down)'
        )

    def collecting(self) -> Collecting:
        """An empty aggregate to fill with accepted updates (one per round or buffer)."""
        n = sum(int(np.prod(shape)) for _, shape in layout_of(self.global_adapter))
        return Collecting(make_aggregator(self.run.aggregation, n), n)

    def train(self, server_round: int, arrivals: Iterable[Arrival]) -> TrainResult:
        """Judge and record each reply, accumulate the accepted ones, then publish the
        aggregate (applied to ``global_adapter``) or withhold it."""
        into = self.collecting()
        task = Task(server_round, self.version)
        for item in arrivals:
            self.judge_train(server_round, item, task, into)
        return TrainResult(into.judged, self.publish(server_round, into))

    def judge_train(
        self,
        server_round: int,
        item: Arrival,
        task: Task,
        into: Collecting,
        *,
        after_end: bool = False,
    ) -> Judged:
        """Judge one training reply to ``task``, record it under ``server_round`` (the
        aggregate it may join) and, when accepted, add it to ``into``. ``after_end``:
        the run's last aggregate is out; the update is logged as received and refused."""
        codec = self.run.codec
        bounds = Bounds(
            self.run.max_update_norm,
            self.run.update_norm_action,
            self.run.max_examples,
            max_steps=self.run.local_steps,
            max_staleness=self.max_staleness,
        )
        staleness = self.version - task.version

        def judge(reply: Reply, sender: str | None) -> Judged:
            return self._judge_train(
                server_round, reply, sender, codec, into.n, bounds, task, staleness, after_end
            )

        judged = self._guarded(server_round, item, judge, signed_round=task.round)
        judged = replace(judged, task=task, staleness=staleness)
        judged = self._record(
            server_round, judged, into.labels, self.recorder.record_train, audited=True
        )
        into.judged.append(judged)
        if judged.accepted is not None:
            # Validated and recorded: only now does it count.
            into.accumulator.add(judged.accepted.checked)
            into.accepted.append(judged.accepted)
        return judged

    def publish(self, server_round: int, into: Collecting) -> Published | Withheld:
        """Apply the aggregate of ``into`` to the global adapter (a new version), or
        withhold it when no update was accepted or a policy's minimum is not met."""
        accepted = into.accepted
        regions = [a.region for a in accepted]
        withheld = self._withhold(server_round, accepted)
        if withheld:
            _logger.log(
                WARNING,
                "round %d: no aggregate published (%s); the global adapter is unchanged",
                server_round,
                "; ".join(withheld),
            )
            self.recorder.record_aggregate(
                server_round,
                {"published": False, "regions": regions, "reasons": withheld},
            )
            self.recorder.save()
            self._note(server_round, Event.AGGREGATE_WITHHELD, regions=regions, reasons=withheld)
            self._checkpoint(server_round)
            return Withheld(regions, withheld)

        self.global_adapter = self.server_optimizer.step(
            self.global_adapter, into.accumulator.mean()
        )
        self.version += 1
        losses = [
            (a.metrics.train_loss, a.metrics.num_examples)
            for a in accepted
            if a.metrics.train_loss is not None
        ]
        loss = sum(x * w for x, w in losses) / sum(w for _, w in losses) if losses else None
        self.recorder.record_aggregate(
            server_round, {"published": True, "regions": regions, "version": self.version}
        )
        self.recorder.save()
        self._note(
            server_round,
            Event.AGGREGATE_PUBLISHED,
            regions=regions,
            examples=into.accumulator.weight,
            global_version=self.version,
            model_digest=model_digest(self.global_adapter).hex(),
        )
        self._checkpoint(server_round)
        return Published(self.global_adapter, regions, into.accumulator.weight, loss)

    def _judge_train(
        self,
        server_round: int,
        reply: Reply,
        sender: str | None,
        codec: Codec,
        n: int,
        bounds: Bounds,
        task: Task,
        staleness: int,
        after_end: bool = False,
    ) -> Judged:
        """Open and validate one authenticated training reply into typed values; raises
        on anything wrong with it (the boundary turns that into a rejection)."""
        if reply.status in (FAILED, DECLINED):
            return self._settle(reply, sender)
        self._note_arrival(server_round, task, reply, sender or reply.region)
        if after_end:
            raise ImplausibleUpdate(
                f"arrived after the run's last aggregate (round {server_round}); not used"
            )
        update, metrics, info, header = self._open(reply, task.round, sender)
        if staleness > self.max_staleness:
            raise ImplausibleUpdate(
                f"computed against global version {task.version}, {staleness} version(s) "
                f"old; {self._staleness_rule}"
            )
        facts = UpdateFacts(
            region=header.region,
            sender_jurisdiction=header.jurisdiction,
            policy_hash=header.policy_hash,
            epsilon=metrics.privacy.epsilon if metrics.privacy else None,
            delta=metrics.privacy.delta if metrics.privacy else None,
            suite=header.suite,
            codec=self.run.codec.family,
            num_examples=metrics.num_examples,
            max_grad_norm=metrics.privacy.max_grad_norm if metrics.privacy else None,
            secure_mode=bool(metrics.privacy.secure_mode) if metrics.privacy else None,
            unit=metrics.privacy.unit if metrics.privacy else None,
            agent_version=reply.info.get(AGENT_VERSION),
        )
        decision = self.policies.check_update(facts)
        self._decided(server_round, decision)
        if not decision.accepted:
            rejected = replace(
                reply,
                status=REJECTED,
                reason="; ".join(decision.reasons),
                info={**reply.info, POLICY_HASH: header.policy_hash},
            )
            return self._settle(rejected, header.region)
        checked = check(
            codec, update, n, metrics.num_examples, bounds, steps=metrics.steps, staleness=staleness
        )
        upload = len(reply.envelope) if reply.envelope is not None else len(update)
        accepted = Accepted(checked, metrics, info, header, upload)
        return self._settle(replace(reply, status=TRAINED), header.region, accepted=accepted)

    def _open(
        self, reply: Reply, server_round: int, sender: str | None
    ) -> tuple[bytes, TrainMetrics, dict[str, str], Header]:
        """The compressed update, its metrics and info, and the facts its policy is
        checked against, as the sealing stage hands them over."""
        received = self.sealing.receive(reply, self.run_id, server_round, sender)
        info, header = received.info, received.header
        if info["region"] != header.region:
            raise EnvelopeRejected(
                f"update names region {info['region']!r} but comes from {header.region!r}"
            )
        update = self._update_bytes(received.arrays)
        return update, parse_train_metrics(received.metrics, info[PRIVACY_UNIT]), info, header

    def _update_bytes(self, arrays: Mapping[str, np.ndarray]) -> bytes:
        """The one compressed update a trained reply may carry, within the size cap."""
        if set(arrays) != {UPDATE}:
            raise MalformedReply(
                f"a trained reply carries {sorted(arrays)[:8]}, expected ['update']"
            )
        update = arrays[UPDATE]
        if update.dtype != np.uint8 or update.ndim != 1:
            raise MalformedReply(f"update is {update.dtype}{list(update.shape)}, expected uint8[n]")
        if update.nbytes > self.run.max_update_bytes:
            raise EnvelopeRejected(
                f"update of {update.nbytes} bytes is over max-update-bytes "
                f"{self.run.max_update_bytes}"
            )
        return update.tobytes()

    def may_publish(self, into: Collecting) -> bool:
        """Whether the policies would let ``into`` be published now (nothing recorded)."""
        if not into.accepted:
            return False
        decision = self.policies.check_aggregate(
            {a.region: a.header.jurisdiction for a in into.accepted},
            {a.region: a.metrics.num_examples for a in into.accepted},
        )
        return decision.accepted

    def _withhold(self, server_round: int, accepted: list[Accepted]) -> list[str]:
        """Why this round's aggregate must not be published; empty when it may be."""
        if not accepted:
            return ["no region's update was accepted"]
        decision = self.policies.check_aggregate(
            {a.region: a.header.jurisdiction for a in accepted},
            {a.region: a.metrics.num_examples for a in accepted},
        )
        self._decided(server_round, decision)
        return list(decision.reasons)

    # -- recording ----------------------------------------------------------------

    def _record(
        self,
        server_round: int,
        judged: Judged,
        labels: set[str],
        record: Callable[[int, str, dict[str, Any]], None],
        *,
        audited: bool,
    ) -> Judged:
        """Record the outcome in metrics.json (and, ``audited``, in the audit log); a
        second reply under a label already taken this round is rejected, so no reply
        displaces or doubles another's. If recording fails, the reply is rejected and
        recorded (best effort) as such."""
        if judged.label in labels:  # the recorder keeps it apart, under duplicates
            if judged.accepted is not None or judged.evaluated is not None:
                reason = f"a second reply from {judged.label} in round {server_round}"
                judged = replace(
                    judged,
                    accepted=None,
                    evaluated=None,
                    reply=replace(judged.reply, status=REJECTED, reason=reason),
                )
        elif judged.authenticated:
            # Which region a node is, for its replies that carry no signature (a
            # timeout, a process that died): only what it authenticated as first.
            self.regions_by_node.setdefault(judged.reply.node_id, judged.label)
        labels.add(judged.label)
        try:
            entry = judged.entry()
            if audited:
                self._note_outcome(server_round, judged, entry)
            record(server_round, judged.label, entry)
        except Exception as err:
            judged = replace(
                judged,
                accepted=None,
                evaluated=None,
                reply=replace(judged.reply, status=REJECTED, reason=reason_of(err)),
            )
            entry = judged.entry()
            try:
                record(server_round, judged.label, entry)
            except Exception as again:
                _logger.log(
                    WARNING, "round %d: cannot record %s: %r", server_round, judged.label, again
                )
        status = judged.reply.status
        _logger.log(
            INFO if status in (TRAINED, EVALUATED) else WARNING,
            "round %d: region %s %s %s",
            server_round,
            judged.label,
            status,
            entry.get("reason") or "",
        )
        return judged

    # -- availability -------------------------------------------------------------

    def heard(self, server_round: int, nodes: Iterable[int]) -> Changes:
        """The round is over: the regions of ``nodes`` (those that replied, with
        anything) answered it, the others missed it. Regions newly unavailable or back
        are recorded in metrics.json and the audit log."""
        answered = {self.regions_by_node[n] for n in nodes if n in self.regions_by_node}
        changes = self.availability.round_ended(answered)
        if changes.unavailable or changes.rejoined:
            self.recorder.record_availability(server_round, changes.unavailable, changes.rejoined)
            self.recorder.save()
        for region in changes.unavailable:
            missed = self.availability.missed[region]
            _logger.log(
                WARNING,
                "round %d: region %s is unavailable (missed %d rounds in a row); rounds no "
                "longer wait for it",
                server_round,
                region,
                missed,
            )
            self._note(server_round, Event.REGION_UNAVAILABLE, region=region, missed_rounds=missed)
        for region in changes.rejoined:
            _logger.log(INFO, "round %d: region %s is back", server_round, region)
            self._note(server_round, Event.REGION_REJOINED, region=region)
        return changes

    def schedule_state(self) -> dict[str, Any]:
        """What a checkpoint keeps of the schedule: the global version, who is
        unavailable, and (buffered) each region's tasks."""
        return {
            "version": self.version,
            "availability": self.availability.state(),
            "tasks": self.tasks.state(),
        }

    def restore_schedule(self, state: Mapping[str, Any]) -> None:
        """A checkpoint's schedule; one written before schedules existed has none (its
        version is the number of aggregates its records show published)."""
        if not state:
            published = [r for r in self.recorder.data.rounds.values() if r.aggregate]
            self.version = sum(1 for r in published if r.aggregate and r.aggregate.published)
            return
        try:
            self.version = int(state["version"])
            self.availability.restore(state["availability"])
            self.tasks.restore(state["tasks"])
        except (KeyError, TypeError, ValueError) as err:
            raise ScheduleError(f"checkpoint: unreadable schedule ({err!r})") from None

    def waits_for(self, node: int) -> bool:
        """Whether a round waits for this node's reply: not if its region is unavailable."""
        return self.regions_by_node.get(node) not in self.availability.unavailable

    # -- evaluation ---------------------------------------------------------------

    def _judge_eval(self, reply: Reply, sender: str | None) -> Judged:
        if reply.status == EVALUATED:
            stats = parse_eval_metrics(reply.metrics)
            return self._settle(reply, sender, evaluated=stats)
        if reply.status in (FAILED, DECLINED):
            return self._settle(reply, sender)
        raise MalformedReply(f"status {reply.status!r} in an evaluation reply")

    def evaluate(
        self, server_round: int, arrivals: Iterable[Arrival], *, overall: bool = True
    ) -> EvalResult:
        """Judge and record each evaluation, then (``overall``) the examples-weighted
        overall loss; without it, only the regions' own (a buffered aggregate's
        evaluations by regions joining late are not every region's)."""
        labels: set[str] = set()
        judged_all: list[Judged] = []
        evaluated: list[tuple[str, EvalMetrics]] = []
        for item in arrivals:
            judged = self._guarded(server_round, item, self._judge_eval)
            judged = self._record(
                server_round, judged, labels, self.recorder.record_eval, audited=False
            )
            judged_all.append(judged)
            if judged.evaluated is not None:
                evaluated.append((judged.label, judged.evaluated))
                if judged.evaluated.step_seconds is not None:
                    self.step_seconds[judged.label] = judged.evaluated.step_seconds
        if not evaluated or not overall:
            self.recorder.save()
            return EvalResult(judged_all, None)
        total = sum(stats.num_examples for _, stats in evaluated)
        loss = sum(stats.eval_loss * stats.num_examples for _, stats in evaluated) / total
        self.recorder.record_eval(
            server_round,
            OVERALL,
            {"loss": loss, "perplexity": float(np.exp(min(loss, 50.0))), "num_examples": total},
        )
        self.recorder.save()
        for label, stats in sorted(evaluated):
            _logger.log(INFO, "round %d: eval loss %-4s %.4f", server_round, label, stats.eval_loss)
        return EvalResult(judged_all, loss, total)

    def train_wait(self, timeout: float) -> float:
        """How long a training round waits for updates: ``timeout`` (round-timeout), or
        longer when the regions' timed steps say their local work takes longer (twice the slowest
        region's local steps, or its local-time-budget, plus :data:`WAIT_MARGIN` for
        Flower), so that an update a region spent privacy on is not lost to the clock.
        Said once, as a warning, when it is longer than round-timeout."""
        run = self.run
        if not self.step_seconds:
            return timeout
        region, slowest = max(self.step_seconds.items(), key=lambda item: item[1])
        work = slowest * run.local_steps
        if run.local_time_budget > 0:
            work = min(work, run.local_time_budget)
        wait = max(timeout, 2 * work + WAIT_MARGIN)
        if wait > timeout and not self._wait_said:
            self._wait_said = True
            _logger.log(
                WARNING,
                "round-timeout %gs is shorter than the regions' local work: %s takes %.1fs per "
                "DP-SGD step x %d step(s) (timed on its hardware); training rounds wait up to "
                "%.0fs for updates. Raise round-timeout, or lower local-steps or set "
                "local-time-budget, to change it",
                timeout,
                region,
                slowest,
                run.local_steps,
                wait,
            )
        return wait

    def end(self, server_round: int) -> None:
        """The round is over: close its record and, after a training round, save the
        checkpoint a run can resume from."""
        self.recorder.record_end(server_round)
        if server_round >= 1:
            self.save_checkpoint(server_round)

    # -- audit trail --------------------------------------------------------------

    def _note(self, server_round: int | None, event: str, **details: Any) -> None:
        self.audit.append(event, run_id=self.federation_run, server_round=server_round, **details)

    def _decided(self, server_round: int, decision: Decision) -> None:
        """An enforced policy decision, recorded and audited (one not enforced is not)."""
        if decision.enforced:
            self.recorder.record_decision(server_round, decision.to_record())
            self._note(server_round, Event.POLICY_DECISION, **decision.to_record())

    def _checkpoint(self, server_round: int | None) -> None:
        self.audit.checkpoint(run_id=self.federation_run, server_round=server_round)

    def _witnessed(self, server_round: int | None, region: str, witness: Witness | None) -> None:
        """Record the head of the region's log that its signed reply carries, so that
        truncating that log later shows in the cross-check (docs/audit.md)."""
        if witness is not None:
            # A late reply (kept by the courier, handled after a newer one of the region)
            # shows an older head: recorded as late, so that it is checked against the
            # region's log but not read as the region going back.
            highest = self.witnessed_counts.get(region, -1)
            self.audit.witness(
                region,
                witness.count,
                witness.head,
                run_id=self.federation_run,
                server_round=server_round,
                late=witness.count < highest,
            )
            self.witnessed_counts[region] = max(highest, witness.count)

    def _note_arrival(self, server_round: int, task: Task, reply: Reply, region: str) -> None:
        """What crossed the relay, as received: its digest is what the region logged,
        under the round the region sent it for (a buffered region's own task number;
        ``aggregate`` then names the aggregate it arrived in)."""
        if reply.envelope is not None:
            data, suite = reply.envelope, "sealed"
        elif reply.arrays and UPDATE in reply.arrays:
            data, suite = reply.arrays[UPDATE].tobytes(), UNSEALED
        else:
            return
        self._note(
            task.round,
            RECEIVED_EVENT,
            region=region,
            digest=digest(data),
            bytes=len(data),
            suite=suite,
            sender_key_id=reply.info.get(KEY_ID, ""),
            **agent_identity(reply.info),
            **({"aggregate": server_round} if task.round != server_round else {}),
        )

    def _note_outcome(self, server_round: int, judged: Judged, entry: dict[str, Any]) -> None:
        status, region = entry["status"], judged.label
        claimed = {"claimed_region": judged.claimed} if judged.claimed != region else {}
        # Which global version a training reply was computed against (and how old it was).
        claimed |= {k: entry[k] for k in ("global_version", "staleness") if k in entry}
        if judged.accepted is not None:
            a = judged.accepted
            self._note(
                server_round,
                Event.UPDATE_ACCEPTED,
                **claimed,
                region=region,
                examples=a.metrics.num_examples,
                epsilon=a.metrics.privacy.epsilon if a.metrics.privacy else None,
                unit=a.metrics.privacy.unit if a.metrics.privacy else None,
                # Whose epsilon: a floor for that dataset's ledger rebuild (docs/privacy.md).
                data_fingerprint=a.info["data-fingerprint"],
                suite=a.header.suite,
                policy_hash=a.header.policy_hash,
            )
        elif status == DECLINED:
            self._note(
                server_round,
                Event.REGION_DECLINED,
                region=region,
                reason=entry["reason"],
                **claimed,
            )
        elif status in (REJECTED, FAILED):
            self._note(
                server_round,
                Event.UPDATE_REJECTED if status == REJECTED else Event.REPLY_FAILED,
                region=region,
                reason=entry.get("reason", ""),
                policy_hash=judged.reply.info.get(POLICY_HASH, ""),
                **claimed,
            )

    # -- the end of the run -------------------------------------------------------

    def sign_run_end(self) -> RunEndNotice | None:
        """Once ``run_end`` is in the log and signed: its head, signed, for each region
        to record; None without a signed checkpoint (or any audit log)."""
        witness = self.audit.last_checkpoint()
        if witness is None:
            return None
        unsigned = RunEndNotice(
            self.federation_run,
            witness,
            run_config=self.run_config,
            nonce=secrets.token_bytes(NONCE_BYTES),
            signer=self.sealing.signer,
            receipts=self._receipts(),
        )
        return replace(unsigned, signature=self.sealing.sign_run_end(self.run_id, unsigned))

    def _receipts(self) -> str:
        """What this federation run received from each region (its log's
        ``update_received`` records, resumed runs included), as canonical JSON."""
        received: dict[str, list[tuple[int, str]]] = {}
        for record in self.audit.records():
            details = record.get("details")
            if (
                record.get("event") != RECEIVED_EVENT
                or record.get("run_id") != self.federation_run
                or not isinstance(details, dict)
            ):
                continue
            region, digest_hex = details.get("region"), details.get("digest")
            if isinstance(region, str) and isinstance(digest_hex, str):
                received.setdefault(region, []).append((int(record.get("round") or 0), digest_hex))
        return json.dumps(
            {r: sorted(set(items)) for r, items in received.items()},
            sort_keys=True,
            separators=(",", ":"),
        )

    def run_end_witnessed(self, replies: Iterable[Reply | Unread]) -> list[str]:
        """Record the head each region answers the run-end notice with, so that
        truncating any party's log back past the end of the run shows in the
        cross-check. Best effort: a reply that cannot be recorded is logged."""
        witnessed = []
        for item in replies:
            try:
                reply = item.read() if isinstance(item, Unread) else item
                sender = self._authenticate(reply, 0)
                if reply.status != WITNESSED or sender is None:
                    raise MalformedReply(f"{reply.status} {reply.reason}".strip())
                self._witnessed(None, sender, reply.witness)
                witnessed.append(sender)
            except Exception as err:  # the run has ended: note it, never fail it now
                _logger.log(
                    WARNING, "run end: a region's witness was not recorded (%s)", reason_of(err)
                )
        self._note(None, Event.RUN_END_WITNESSED, regions=sorted(witnessed))
        self._checkpoint(None)
        return witnessed

    def save_checkpoint(self, server_round: int) -> None:
        """The round is done: its adapter, records and the audit log's position."""
        if self.checkpoints is None:
            return
        seq, head = self.audit.position()
        save_checkpoint(
            self.checkpoints,
            Checkpoint(
                federation_run=self.federation_run,
                round=server_round,
                base_fingerprint=self.base_fingerprint,
                adapter=self.global_adapter,
                audit_seq=seq,
                audit_head=head,
                rounds=self.recorder.data.rounds,
                optimizer=self.server_optimizer.state(),
                extra=self.schedule_state(),
            ),
            keep=self.run.keep_checkpoints,
            keypair=self.audit.keypair,
        )
