"""The aggregator's round, without Flower: replies in, one verdict per reply, then the
round's aggregate published or withheld.

Each reply goes through one boundary (``fedciuic.aggregator.judge``) where *any*
exception rejects that reply alone, and is recorded before it counts. Replies are adapter
deltas; a decline is a normal outcome; an aggregate is published only when the strictest
minimum among its regions' policies is met.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

import numpy as np

from fedciuic.aggregator.aggregation import Aggregator, make_aggregator
from fedciuic.aggregator.checkpoint import Checkpoint, save_checkpoint
from fedciuic.aggregator.journal import Filing, Journal
from fedciuic.aggregator.judge import Accepted, Judge, Judged, Task, Training, reason_of
from fedciuic.aggregator.schedule import Availability, Changes, ScheduleError, Tasks
from fedciuic.aggregator.server_optim import ServerOptimizer
from fedciuic.compression import layout_of
from fedciuic.config import RunConfig, Schedule
from fedciuic.crypto import NONCE_BYTES, TaskKind
from fedciuic.policy import Decision, NotEnforced, PolicyGate
from fedciuic.record import OVERALL, RunRecorder
from fedciuic.stages import AuditTrail, ClearReplies, NoAudit, ReplySealing
from fedciuic.wire import (
    WITNESSED,
    Arrival,
    EvalMetrics,
    Instruction,
    MalformedReply,
    Reply,
    RunEndNotice,
    Unread,
)

# Flower's logger, by name: the round's lines show with the rest of the run's output.
_logger = logging.getLogger("flwr")


@dataclass
class Collecting:
    """One aggregate being filled: accepted updates, judged replies and labels recorded."""

    accumulator: Aggregator
    n: int  # entries in the flat adapter
    labels: set[str] = field(default_factory=set)
    judged: list[Judged] = field(default_factory=list)
    accepted: list[Accepted] = field(default_factory=list)

    def check(self, policies: PolicyGate) -> Decision:
        """The policies' decision on publishing the accepted updates as they are now."""
        return policies.check_aggregate(
            {a.region: a.header.jurisdiction for a in self.accepted},
            {a.region: a.metrics.num_examples for a in self.accepted},
        )

    def train_loss(self) -> float | None:
        """Weighted by examples; None when no region reports one (every step noise only)."""
        losses = [
            (a.metrics.train_loss, a.metrics.num_examples)
            for a in self.accepted
            if a.metrics.train_loss is not None
        ]
        return sum(x * w for x, w in losses) / sum(w for _, w in losses) if losses else None


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
class EvalResult:
    replies: list[Judged]
    loss: float | None  # weighted by examples; None when no region evaluated
    num_examples: int = 0


#: What the judge and the journal are built from (:meth:`AggregatorRound.use`).
_BUILT_FROM = frozenset({"run", "sealing", "policies", "audit", "federation_run"})


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
        #: The config every instruction carries and signs.
        self.run_config = run.canonical_json()
        self.base_fingerprint = base_fingerprint
        self.recorder = recorder
        # The stages, chosen once: without them, a lab run (clear, no policies, no log).
        self.sealing: ReplySealing = sealing or ClearReplies()
        self.policies: PolicyGate = policies or NotEnforced()
        self.audit: AuditTrail = audit or NoAudit()
        self.run_id = run_id  # Flower's: binds envelopes and signatures
        self.federation_run = federation_run or run_id  # kept when a run is resumed
        #: The checkpoint resumed from, signed into every instruction for regions to witness.
        self.resumed_from = ""
        self.checkpoints = checkpoints
        self.global_adapter: dict[str, np.ndarray] = {}
        #: Aggregates published so far in this federation (the global adapter's version).
        self.version = 0
        self.regions_by_node: dict[int, str] = {}
        self.availability = Availability(self.run.regions, self.schedule.max_missed_rounds)
        self.tasks = Tasks(self.run.regions, self.schedule.num_server_rounds)  # buffered mode
        #: Each region's timed local step (from its evaluations), for the training wait.
        self.step_seconds: dict[str, float] = {}
        #: The highest checkpoint count each region's replies have shown in this run.
        self.witnessed_counts: dict[str, int] = {}
        # The step on each aggregate (server-optimizer); open_run restores it on resume.
        self.server_optimizer = ServerOptimizer(run.server)
        self._build()

    def use(self, **parts: Any) -> None:
        """Replace parts it was built with, and build its judge and journal again."""
        for name, value in parts.items():
            if name not in _BUILT_FROM:
                raise TypeError(f"{name!r} is not one of {sorted(_BUILT_FROM)}")
            setattr(self, name, value)
        self._build()

    def _build(self) -> None:
        secure = self.run.secure
        #: The per-reply boundary (it sees ``regions_by_node`` by reference).
        self.judge = Judge(
            self.run.compression,
            self.run.model.adapter_mode,
            self.run.training.local_steps,
            self.schedule.round_timeout,
            self.sealing,
            self.policies,
            self.run_id,
            self.regions_by_node,
            self.run.unmask_threshold if secure.secure_aggregation else 0,
            secure.secure_aggregation and secure.distributed_noise_multiplier > 0,
            self.run,
        )
        #: The one writer of metrics.json and the audit log, for this federation run.
        self.journal = Journal(
            self.recorder, self.audit, self.federation_run, self.witnessed_counts
        )

    # -- instructions -------------------------------------------------------------

    def sign_instruction(
        self,
        server_round: int,
        kind: TaskKind,
        adapter: Mapping[str, np.ndarray],
        recipient: str,
        digest: bytes | None = None,
    ) -> Instruction:
        """A round's instruction for ``recipient``, with a fresh nonce and the log's head."""
        unsigned = Instruction(
            adapter=dict(adapter),
            server_round=server_round,
            base_fingerprint=self.base_fingerprint,
            kind=kind,
            run_config=self.run_config,
            nonce=secrets.token_bytes(NONCE_BYTES),
            signer=self.sealing.signer,
            federation_run=self.federation_run,
            witness=self.audit.last_checkpoint(),
            checkpoint=self.resumed_from,
            recipient=recipient,
        )
        return replace(unsigned, signature=self.sealing.sign_global(self.run_id, unsigned, digest))

    def _file(
        self, server_round: int, judged: Judged, labels: set[str], filing: Filing, *, audited: bool
    ) -> Judged:
        """A judged reply on the record; a second under one label is rejected, never displacing."""
        if judged.label in labels:
            if judged.accepted is not None or judged.evaluated is not None:
                judged = judged.refused(
                    f"a second reply from {judged.label} in round {server_round}"
                )
        elif judged.authenticated:
            # For its unsigned replies (a timeout, a dead process): what it first authenticated as.
            self.regions_by_node.setdefault(judged.reply.node_id, judged.label)
        labels.add(judged.label)
        return self.journal.reply(server_round, judged, filing, audited=audited)

    # -- training -----------------------------------------------------------------

    @property
    def schedule(self) -> Schedule:
        return self.run.schedule

    def collecting(self) -> Collecting:
        """An empty aggregate (one per round or buffer)."""
        n = sum(int(np.prod(shape)) for _, shape in layout_of(self.global_adapter))
        return Collecting(make_aggregator(self.run.compression.aggregation, n), n)

    def judge_train(
        self, server_round: int, item: Arrival, task: Task, into: Collecting, *, refuse: str = ""
    ) -> Judged:
        """Judge and record one training reply to ``task`` under ``server_round``, adding it
        to ``into`` when accepted; with ``refuse``, logged as received and refused."""
        staleness = self.version - task.version
        training = Training(server_round, into.n, task, staleness, self.schedule, refuse)
        judged = self.judge.guarded(item, signed_round=task.round, training=training)
        judged = replace(judged, task=task, staleness=staleness)
        judged = self._file(
            server_round, judged, into.labels, self.recorder.record_train, audited=True
        )
        into.judged.append(judged)
        if judged.accepted is not None:
            # Validated and recorded: only now does it count.
            if judged.accepted.checked is not None:
                into.accumulator.add(judged.accepted.checked)
            into.accepted.append(judged.accepted)
        return judged

    def publish(
        self,
        server_round: int,
        into: Collecting,
        *,
        mean: np.ndarray | None = None,
        withheld: Iterable[str] = (),
    ) -> Published | Withheld:
        """Apply the aggregate of ``into`` (or a secure ``mean``) as a new version, or withhold."""
        regions = [a.region for a in into.accepted]
        reasons = list(withheld) or self._withhold(server_round, into)
        if reasons:
            self.journal.withheld(server_round, regions, reasons)
            return Withheld(regions, reasons)

        delta = into.accumulator.mean() if mean is None else mean
        self.global_adapter = self.server_optimizer.step(self.global_adapter, delta)
        self.version += 1
        weight = into.accumulator.weight
        if mean is not None:
            weight = float(sum(a.metrics.num_examples for a in into.accepted))
        self.journal.published(server_round, regions, weight, self.version, self.global_adapter)
        return Published(self.global_adapter, regions, weight, into.train_loss())

    def may_publish(self, into: Collecting) -> bool:
        """Whether the policies would let ``into`` be published now (nothing recorded)."""
        return bool(into.accepted) and into.check(self.policies).accepted

    def _withhold(self, server_round: int, into: Collecting) -> list[str]:
        """Why this round's aggregate must not be published; empty when it may be."""
        if not into.accepted:
            return ["no region's update was accepted"]
        decision = into.check(self.policies)
        self.journal.decided(server_round, decision)
        return list(decision.reasons)

    # -- availability -------------------------------------------------------------

    def heard(self, server_round: int, nodes: Iterable[int]) -> Changes:
        """The round is over: the regions of ``nodes`` answered it, the others missed it."""
        answered = {self.regions_by_node[n] for n in nodes if n in self.regions_by_node}
        changes = self.availability.round_ended(answered)
        self.journal.availability(server_round, changes, self.availability.missed)
        return changes

    def schedule_state(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "availability": self.availability.state(),
            "tasks": self.tasks.state(),
        }

    def restore_schedule(self, state: Mapping[str, Any]) -> None:
        """A checkpoint's schedule; an older one has none (its records give the version)."""
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

    def evaluate(
        self, server_round: int, arrivals: Iterable[Arrival], *, overall: bool = True
    ) -> EvalResult:
        """Judge and record evaluations, then (``overall``) the examples-weighted loss."""
        labels: set[str] = set()
        judged_all: list[Judged] = []
        evaluated: list[tuple[str, EvalMetrics]] = []
        for item in arrivals:
            judged = self.judge.guarded(item, signed_round=server_round)
            judged = self._file(
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

    def end(self, server_round: int) -> None:
        """Close the round's record and, after a training round, save a checkpoint."""
        self.recorder.record_end(server_round)
        if server_round >= 1:
            self.save_checkpoint(server_round)

    # -- the end of the run -------------------------------------------------------

    def sign_run_end(self, recipients: Iterable[str]) -> dict[str, RunEndNotice]:
        """The log's ``run_end`` head and receipts, signed per recipient (needs a checkpoint)."""
        witness = self.audit.last_checkpoint()
        if witness is None:
            return {}
        run, signer, receipts = self.federation_run, self.sealing.signer, self.journal.receipts()
        notice = RunEndNotice(run, witness, self.run_config, signer=signer, receipts=receipts)
        signed = {}
        for region in recipients:
            unsigned = replace(notice, nonce=secrets.token_bytes(NONCE_BYTES), recipient=region)
            signature = self.sealing.sign_run_end(self.run_id, unsigned)
            signed[region] = replace(unsigned, signature=signature)
        return signed

    def save_checkpoint(self, server_round: int) -> None:
        """The round's adapter, records and the audit log's position."""
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
                adapter_mode=self.run.model.adapter_mode,
                audit_seq=seq,
                audit_head=head,
                rounds=self.recorder.data.rounds,
                optimizer=self.server_optimizer.state(),
                extra=self.schedule_state(),
            ),
            keep=self.run.output.keep_checkpoints,
            keypair=self.audit.keypair,
        )


def run_end_witnessed(aggregator: AggregatorRound, replies: Iterable[Reply | Unread]) -> list[str]:
    """Record each region's answer to the run-end notice (best effort), for the cross-check."""
    witnessed = []
    journal = aggregator.journal
    for item in replies:
        try:
            reply = item.read() if isinstance(item, Unread) else item
            sender = aggregator.judge.authenticate(reply, 0)
            if reply.status != WITNESSED or sender is None:
                raise MalformedReply(f"{reply.status} {reply.reason}".strip())
            if reply.witness is not None:
                journal.witness(None, sender, reply.witness)
            witnessed.append(sender)
        except Exception as err:  # the run has ended: note it, never fail it now
            _logger.log(
                WARNING, "run end: a region's witness was not recorded (%s)", reason_of(err)
            )
    journal.run_end_witnessed(witnessed)
    return witnessed
