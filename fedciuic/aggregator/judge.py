"""Judging one reply at the aggregator: the per-reply boundary (read, authenticate, open,
staleness, policy, validate) returns a :class:`Judged` and writes nothing (what the
record must show comes back in :class:`Noted`, for the journal). *Any* exception inside
the boundary rejects that reply alone, and the round goes on with the others.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from fedciuic.aggregator.aggregation import Bounds, Checked, ImplausibleUpdate, check
from fedciuic.audit import digest
from fedciuic.config import AdapterMode, RunConfig, Schedule, UpdateRules
from fedciuic.crypto import EnvelopeRejected
from fedciuic.policy import UNSEALED, Decision, PolicyGate, UpdateFacts
from fedciuic.releases import data_figures, releases_only_dp
from fedciuic.stages import Provenance, ReplySealing
from fedciuic.wire import (
    ADAPTER_MODE,
    AGENT_CODE,
    AGENT_VERSION,
    DECLINED,
    DEID_ENTITIES,
    EVALUATED,
    FAILED,
    KEY_ID,
    NO_REPLY,
    POLICY_HASH,
    PRIVACY_UNIT,
    REJECTED,
    TRAINED,
    UPDATE,
    Arrival,
    EvalMetrics,
    MalformedReply,
    NoReply,
    Reply,
    TrainMetrics,
    Unread,
    Witness,
    failed,
    parse_deid_entities,
    parse_eval_metrics,
    parse_train_metrics,
)


def reason_of(err: Exception) -> str:
    """A rejection's reason: the error's type and its message (or repr)."""
    return f"{type(err).__name__}: {str(err)[:500]}"


def agent_identity(info: Mapping[str, object]) -> dict[str, str]:
    """The code a reply says made it (its region agent's version and code digest)."""
    keys = ((AGENT_VERSION, "agent_version"), (AGENT_CODE, "agent_code"))
    return {name: str(info[key]) for key, name in keys if key in info}


@dataclass(frozen=True)
class Task:
    """The round a training reply must be signed for, and the global version it starts from."""

    round: int
    version: int


@dataclass(frozen=True)
class Receipt:
    """An update as it crossed the relay; ``aggregate``: where it arrived, if elsewhere."""

    task_round: int
    region: str
    digest: str
    bytes: int
    suite: str
    sender_key_id: str
    agent: dict[str, str]
    aggregate: int | None


@dataclass
class Noted:
    """What the record must show besides the outcome, in the order the journal writes it."""

    witness: tuple[str, Witness] | None = None
    received: Receipt | None = None
    decision: Decision | None = None


@dataclass(frozen=True)
class Accepted:
    """A trained reply once authenticated, opened, validated and checked by policy."""

    checked: Checked | None  # None in a secure round: the update travels masked
    metrics: TrainMetrics
    info: dict[str, str]
    header: Provenance
    upload_bytes: int  # what crossed the relay: the envelope, or the clear update

    @property
    def region(self) -> str:
        return self.header.region


@dataclass(frozen=True)
class Judged:
    """One reply's outcome under its label: accepted, evaluated, or its final status."""

    label: str
    reply: Reply  # its status and reason are final
    accepted: Accepted | None = None
    evaluated: EvalMetrics | None = None
    claimed: str = ""
    authenticated: bool = False
    task: Task | None = None  # what a training reply answers
    staleness: int = 0  # global versions published since its task was sent
    noted: Noted = field(default_factory=Noted)

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
                **({"norm": a.checked.norm, "clipped": a.checked.clipped} if a.checked else {}),
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
        """For an update that arrived (a decline or failure carries none)."""
        if self.task is None or self.reply.status not in (TRAINED, REJECTED):
            return {}
        return {"global_version": self.task.version, "staleness": self.staleness}

    def refused(self, reason: str) -> Judged:
        """This outcome turned into a rejection: it no longer counts."""
        reply = replace(self.reply, status=REJECTED, reason=reason)
        return replace(self, accepted=None, evaluated=None, reply=reply)


@dataclass(frozen=True)
class Training:
    """What a training reply is judged against; ``refuse``: why it cannot be used here."""

    server_round: int
    n: int
    task: Task
    staleness: int
    schedule: Schedule
    refuse: str = ""


@dataclass(frozen=True)
class Judge:
    """The boundary and its stages; ``labels``: each node's region, for unsigned replies."""

    rules: UpdateRules
    adapter_mode: AdapterMode
    max_steps: int
    timeout: float
    sealing: ReplySealing
    policies: PolicyGate
    run_id: int
    labels: Mapping[int, str]
    #: With secure aggregation, the fewest regions a sum is unmasked from (0: none): a
    #: trained reply then carries no update.
    secure_threshold: int = 0
    #: Whether the regions add distributed noise in the secure sum.
    distributed_dp: bool = False
    #: The run config, which says what each reply field is (fedciuic/releases.py).
    run: RunConfig | None = None

    def guarded(
        self, item: Arrival, *, signed_round: int, training: Training | None = None
    ) -> Judged:
        """The one boundary per reply; ``training`` is None for an evaluation."""
        noted = Noted()
        if isinstance(item, NoReply):
            reason = f"{NO_REPLY} ({item.waited or self.timeout:g}s)"
            return self.settle(failed(item.node_id, "", reason), None, noted)
        reply, sender = failed(item.node_id, "", ""), None
        try:
            reply = item.read() if isinstance(item, Unread) else item
            sender = self.authenticate(reply, signed_round)
            if sender is not None and reply.witness is not None:  # validated when read
                noted.witness = (sender, reply.witness)
            if training is None:
                return self.evaluation(reply, sender, noted)
            return self.update(reply, sender, noted, training)
        except Exception as err:  # the boundary: no reply stops the run
            return self.settle(reply, sender, noted, error=err)

    def settle(
        self,
        reply: Reply,
        sender: str | None,
        noted: Noted,
        *,
        error: Exception | None = None,
        accepted: Accepted | None = None,
        evaluated: EvalMetrics | None = None,
    ) -> Judged:
        """The outcome under its label: the authenticated region, the node's, or ``node-ID``."""
        label = sender or self.labels.get(reply.node_id) or f"node-{reply.node_id}"
        if error is not None:
            reply = replace(reply, status=REJECTED, reason=reason_of(error))
        return Judged(
            label,
            reply,
            accepted,
            evaluated,
            claimed=reply.region or label,
            authenticated=bool(sender),
            noted=noted,
        )

    def authenticate(self, reply: Reply, server_round: int) -> str | None:
        """The region that signed this reply; without sealing, the name it claims."""
        if reply.status == FAILED:
            return None
        return self.sealing.sender(reply, self.run_id, server_round)

    def evaluation(self, reply: Reply, sender: str | None, noted: Noted) -> Judged:
        if reply.status == EVALUATED:
            self._only_dp(EVALUATED, reply.metrics)
            return self.settle(reply, sender, noted, evaluated=parse_eval_metrics(reply.metrics))
        if reply.status in (FAILED, DECLINED):
            return self.settle(reply, sender, noted)
        raise MalformedReply(f"status {reply.status!r} in an evaluation reply")

    def _only_dp(self, status: str, names: Iterable[str]) -> None:
        """Refuse a figure of the sender's data in a run that releases only DP or public ones."""
        if self.run is None or not releases_only_dp(self.run):
            return
        if found := data_figures(status, names, self.run):
            raise MalformedReply(
                f"carries figures of its data outside DP in a run that releases only DP "
                f"figures: {'; '.join(found)}"
            )

    def update(self, reply: Reply, sender: str | None, noted: Noted, training: Training) -> Judged:
        """Open and validate one training reply; raises on anything wrong with it."""
        if reply.status in (FAILED, DECLINED):
            return self.settle(reply, sender, noted)
        noted.received = received(
            training.server_round, training.task, reply, sender or reply.region
        )
        if training.refuse:  # it arrived where it cannot be used: logged as received, refused
            raise ImplausibleUpdate(training.refuse)
        update, metrics, info, header, sent = self._open(reply, training.task.round, sender)
        self._only_dp(TRAINED, sent)
        if info[ADAPTER_MODE] != self.adapter_mode:
            raise ImplausibleUpdate(
                f"trained in adapter-mode {info[ADAPTER_MODE][:20]!r}, this run's is "
                f"{self.adapter_mode!r}: its delta is of other tensors; the region must "
                "train in the run's adapter-mode"
            )
        if training.staleness > training.schedule.staleness_allowed:
            raise ImplausibleUpdate(
                training.schedule.staleness_refused(training.task.version, training.staleness)
            )
        decision = self.policies.check_update(
            UpdateFacts(
                region=header.region,
                sender_jurisdiction=header.jurisdiction,
                policy_hash=header.policy_hash,
                suite=header.suite,
                codec=self.rules.codec.family,
                num_examples=metrics.num_examples,
                adapter_mode=info[ADAPTER_MODE],
                agent_version=reply.info.get(AGENT_VERSION),
                secure_sum=self.secure_threshold > 0,
                secure_threshold=self.secure_threshold,
                distributed_dp=self.distributed_dp,
                deid_entities=parse_deid_entities(info[DEID_ENTITIES]),
                data_fields=data_figures(TRAINED, sent, self.run) if self.run else (),
                **metrics.declared(),
            )
        )
        noted.decision = decision
        if not decision.accepted:
            rejected = replace(
                reply,
                status=REJECTED,
                reason="; ".join(decision.reasons),
                info={**reply.info, POLICY_HASH: header.policy_hash},
            )
            return self.settle(rejected, header.region, noted)
        upload = len(reply.envelope) if reply.envelope is not None else len(update)
        checked: Checked | None = None  # a secure round's update comes masked, in its sum
        if not self.secure_threshold:
            rules = self.rules
            bounds = Bounds(
                rules.max_update_norm,
                rules.update_norm_action,
                rules.max_examples,
                max_steps=self.max_steps,
                max_staleness=training.schedule.staleness_allowed,
            )
            checked = check(
                rules.codec,
                update,
                training.n,
                metrics.num_examples,
                bounds,
                steps=metrics.steps,
                staleness=training.staleness,
            )
        accepted = Accepted(checked, metrics, info, header, upload)
        return self.settle(replace(reply, status=TRAINED), header.region, noted, accepted=accepted)

    def _open(
        self, reply: Reply, server_round: int, sender: str | None
    ) -> tuple[bytes, TrainMetrics, dict[str, str], Provenance, tuple[str, ...]]:
        """The compressed update, metrics, info, provenance, and every field name it sent."""
        opened = self.sealing.receive(reply, self.run_id, server_round, sender)
        info, header = opened.info, opened.header
        if info["region"] != header.region:
            raise EnvelopeRejected(
                f"update names region {info['region']!r} but comes from {header.region!r}"
            )
        update = self._update_bytes(opened.arrays)
        metrics = parse_train_metrics(opened.metrics, info[PRIVACY_UNIT])
        sent = opened.metrics if isinstance(opened.metrics, Mapping) else {}  # parsed: one
        return update, metrics, info, header, (*sent, *info, *opened.arrays)

    def _update_bytes(self, arrays: Mapping[str, np.ndarray]) -> bytes:
        """The one compressed update a trained reply carries (none in a secure round)."""
        if self.secure_threshold:
            if arrays:
                raise MalformedReply(
                    "with secure aggregation a trained reply carries no update (it travels "
                    "masked, in the round's secure sum)"
                )
            return b""
        if set(arrays) != {UPDATE}:
            raise MalformedReply(
                f"a trained reply carries {sorted(arrays)[:8]}, expected ['update']"
            )
        update = arrays[UPDATE]
        if update.dtype != np.uint8 or update.ndim != 1:
            raise MalformedReply(f"update is {update.dtype}{list(update.shape)}, expected uint8[n]")
        if update.nbytes > self.rules.max_update_bytes:
            raise EnvelopeRejected(
                f"update of {update.nbytes} bytes is over max-update-bytes "
                f"{self.rules.max_update_bytes}"
            )
        return update.tobytes()


def received(server_round: int, task: Task, reply: Reply, region: str) -> Receipt | None:
    """What crossed the relay, as received (None for a reply that carries no update)."""
    if reply.envelope is not None:
        data, suite = reply.envelope, "sealed"
    elif reply.arrays and UPDATE in reply.arrays:
        data, suite = reply.arrays[UPDATE].tobytes(), UNSEALED
    else:
        return None
    return Receipt(
        task_round=task.round,
        region=region,
        digest=digest(data),
        bytes=len(data),
        suite=suite,
        sender_key_id=str(reply.info.get(KEY_ID, "")),
        agent=agent_identity(reply.info),
        aggregate=server_round if task.round != server_round else None,
    )
