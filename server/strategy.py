"""RegionalFedAvg: Flower's Message-API FedAvg over LoRA adapter deltas, one node per region.

Differences from ``FedAvg``, each for a reason:

* replies are adapter *deltas*, averaged by examples and applied to the global adapter;
* a region that declines is a normal outcome: it is recorded and the round goes on;
  a reply that fails or is malformed is rejected alone instead of skipping the round;
* waiting for regions to connect has a deadline (``node-wait-timeout``), so a run
  that expects more regions than exist stops with a message instead of hanging;
* every region evaluates the initial adapter before round 1, so the run reports
  eval loss before and after training;
* with policies, each update is checked against its sender's jurisdiction policy
  (named in the envelope header) and an aggregate is published only when the
  strictest minimum among its regions' policies is met; otherwise the global
  adapter stays as it was for that round.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg
from flwr.supercore import log

from fedciuic.aggregation import Bounds, Checked, apply_delta, check, make_aggregator
from fedciuic.audit.log import RECEIVED_EVENT, AuditLog, digest
from fedciuic.compression import Codec, get_codec, layout_of, unflatten
from fedciuic.config import RunConfig
from fedciuic.crypto.sealing import (
    AggregatorKeys,
    EnvelopeRejected,
    model_digest,
    sign_global,
    sign_run_end,
)
from fedciuic.errors import FederationError
from fedciuic.flower import protocol
from fedciuic.ops.outputs import RunRecorder
from fedciuic.policy.binding import UNSEALED, AggregatorPolicies, codec_family
from fedciuic.policy.rules import Decision, UpdateFacts
from fedciuic.rounds.checkpoint import Checkpoint, save_checkpoint

REJECTED = "rejected"


def _reason(err: Exception) -> str:
    """A rejection's reason: the error's type and its message (or repr)."""
    return f"{type(err).__name__}: {str(err)[:500]}"


@dataclass(frozen=True)
class _Header:
    """Where an update comes from and under what terms: from its authenticated
    envelope when sealed, from the clear reply in a lab run without sealing."""

    region: str
    jurisdiction: str
    policy_hash: str
    suite: str


@dataclass(frozen=True)
class _Accepted:
    """A trained reply once authenticated, opened, validated and checked by policy."""

    region: str
    checked: Checked
    metrics: protocol.TrainMetrics
    info: dict[str, str]
    header: _Header
    update_bytes: int
    upload_bytes: int


@dataclass(frozen=True)
class _Judged:
    """One reply's outcome, under the label it is recorded with."""

    label: str
    reply: protocol.Reply  # its status and reason are final
    accepted: _Accepted | None = None
    evaluated: protocol.EvalMetrics | None = None
    claimed: str = ""
    authenticated: bool = False

    def entry(self) -> dict[str, Any]:
        """What metrics.json records for this reply."""
        if self.accepted is not None:
            a = self.accepted
            return {
                "status": protocol.TRAINED,
                "reason": "",
                "norm": a.checked.norm,
                "clipped": a.checked.clipped,
                "loss": a.metrics.train_loss,
                "num_examples": a.metrics.num_examples,
                "steps": a.metrics.steps,
                "data_fingerprint": a.info["data-fingerprint"],
                "upload_bytes": a.upload_bytes,
                "update_bytes": a.update_bytes,
                **a.metrics.record(),
            }
        if self.evaluated is not None:
            e = self.evaluated
            return {
                "status": protocol.EVALUATED,
                "loss": e.eval_loss,
                "perplexity": e.perplexity,
                "num_examples": e.num_examples,
            }
        entry = {"status": self.reply.status, "reason": self.reply.reason}
        if self.claimed != self.label:
            entry["claimed_region"] = self.claimed
        return entry


class RegionalFedAvg(FedAvg):
    """FedAvg on adapter deltas with declines, per-region records and deadlines."""

    def __init__(
        self,
        run: RunConfig,
        *,
        base_fingerprint: str,
        recorder: RunRecorder,
        keys: AggregatorKeys | None = None,
        policies: AggregatorPolicies | None = None,
        audit: AuditLog | None = None,
        run_id: int = 0,
        federation_run: int = 0,
        checkpoints: Path | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(
            min_train_nodes=run.min_regions,
            min_evaluate_nodes=run.min_regions,
            min_available_nodes=run.min_regions,
            arrayrecord_key=protocol.ARRAYS,
            configrecord_key=protocol.CONFIG,
        )
        self.run = run
        self.base_fingerprint = base_fingerprint
        self.recorder = recorder
        self.keys = keys
        self.policies = policies
        self.audit = audit
        self.run_id = run_id  # Flower's: binds envelopes and signatures
        self.federation_run = federation_run or run_id  # kept when a run is resumed
        self.checkpoints = checkpoints
        self.clock = clock
        self.global_adapter: dict[str, np.ndarray] = {}
        self._asked: list[int] = []  # the nodes this round's instructions went to
        self.regions_by_node: dict[int, str] = {}
        self._waited = False

    # -- sampling -----------------------------------------------------------------

    def wait_for_regions(self, grid: Grid) -> list[int]:
        """All connected nodes, once every region is there or the deadline has passed.

        Only the first call waits the full ``node-wait-timeout``; later rounds take
        the regions that are connected, so one region gone does not stall each round.
        """
        expected = len(self.run.regions)
        wait = 0.0 if self._waited else self.run.node_wait_timeout
        self._waited = True
        deadline = self.clock() + wait
        nodes = list(grid.get_node_ids())
        while len(nodes) < expected and self.clock() < deadline:
            log(INFO, "Waiting for regions: %d of %d connected", len(nodes), expected)
            time.sleep(1.0)
            nodes = list(grid.get_node_ids())
        if len(nodes) < self.run.min_regions:
            raise FederationError(
                f"run config:node-wait-timeout: only {len(nodes)} of {expected} regions "
                f"connected within {wait:.0f}s (min-regions is "
                f"{self.run.min_regions}); start a SuperNode for each of "
                f"{', '.join(self.run.regions)} or lower min-regions"
            )
        return sorted(nodes)

    def _messages(
        self,
        grid: Grid,
        arrays: ArrayRecord,
        config: ConfigRecord,
        server_round: int,
        kind: str,
        adapter: dict[str, np.ndarray] | None = None,
    ) -> Iterable[Message]:
        signature, signer = b"", ""
        witness = self.audit.last_checkpoint() if self.audit is not None else None
        if self.keys is not None:
            adapter = protocol.unpack_arrays(arrays) if adapter is None else adapter
            signature = sign_global(self.keys.keypair, self.run_id, server_round, adapter, witness)
            signer = self.keys.keypair.bundle.key_id.hex()
        content = protocol.instruction(
            arrays,
            server_round=server_round,
            base_fingerprint=self.base_fingerprint,
            config=config,
            signature=signature,
            signer=signer,
            federation_run=self.federation_run,
            witness=witness,
        )
        self._asked = self.wait_for_regions(grid)
        return self._construct_messages(content, self._asked, kind)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        self.global_adapter = protocol.unpack_arrays(arrays)
        return self._messages(
            grid, arrays, config, server_round, MessageType.TRAIN, self.global_adapter
        )

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return self._messages(grid, arrays, config, server_round, MessageType.EVALUATE)

    # -- aggregation --------------------------------------------------------------

    def _replies(self, replies: Iterable[Message]) -> Iterator[Message | int]:
        """Each reply, then the id of each node asked this round that did not answer
        within round-timeout (its process died, say)."""
        answered: set[int] = set()
        for message in replies:
            answered.add(message.metadata.src_node_id)
            yield message
        yield from (node for node in self._asked if node not in answered)

    def _guarded(
        self,
        server_round: int,
        item: Message | int,
        judge: Callable[[protocol.Reply, str | None], _Judged],
    ) -> _Judged:
        """The one boundary per reply: *any* exception while reading, authenticating,
        opening, decoding or validating a reply rejects that reply alone (its type
        named in the record), and the round goes on with the others."""
        if isinstance(item, int):
            reason = f"no reply within round-timeout ({self.run.round_timeout:g}s)"
            return self._settle(protocol.failed(item, "", reason), None)
        reply, sender = protocol.failed(item.metadata.src_node_id, "", ""), None
        try:
            reply = protocol.read_reply(item)
            sender = self._authenticate(reply, server_round)
            if sender is not None:
                self._witnessed(server_round, sender, reply.witness)
            return judge(reply, sender)
        except Exception as err:  # the boundary: no reply stops the run
            return self._settle(reply, sender, error=err)

    def _settle(
        self,
        reply: protocol.Reply,
        sender: str | None,
        *,
        error: Exception | None = None,
        accepted: _Accepted | None = None,
        evaluated: protocol.EvalMetrics | None = None,
    ) -> _Judged:
        """The reply's outcome under its label: the region its signature authenticates;
        else the region this node authenticated as before; else ``node-ID``."""
        label = sender or self.regions_by_node.get(reply.node_id) or f"node-{reply.node_id}"
        if error is not None:
            reply = replace(reply, status=REJECTED, reason=_reason(error))
        return _Judged(
            label,
            reply,
            accepted,
            evaluated,
            claimed=reply.region or label,
            authenticated=bool(sender),
        )

    def _authenticate(self, reply: protocol.Reply, server_round: int) -> str | None:
        """The region this reply comes from, by its signature; without sealing (a lab
        run, nothing to authenticate with) the name it claims."""
        if reply.status == protocol.FAILED:
            return None
        if self.keys is None:
            return reply.region
        if reply.status == protocol.DECLINED and not reply.signature:
            # A region that could not load its keys declines unsigned: recorded under
            # its node (or what the node authenticated as before), its claim noted.
            return None
        sender = self.keys.reply_sender(
            reply.info.get(protocol.KEY_ID, ""),
            reply.signature,
            run_id=self.run_id,
            server_round=server_round,
            fields=reply.signed,
        )
        if sender.party != reply.region:
            raise EnvelopeRejected(
                f"reply names region {reply.region!r} but is signed by {sender.party!r}"
            )
        return sender.party

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        layout = layout_of(self.global_adapter)
        n = sum(int(np.prod(shape)) for _, shape in layout)
        accumulator = make_aggregator(self.run.aggregation, n)
        codec = get_codec(self.run.codec)
        bounds = Bounds(
            self.run.max_update_norm, self.run.update_norm_action, self.run.max_examples
        )
        labels: set[str] = set()
        accepted: list[_Accepted] = []
        for item in self._replies(replies):
            judged = self._guarded(
                server_round,
                item,
                lambda r, sender: self._judge_train(server_round, r, sender, codec, n, bounds),
            )
            judged = self._record(
                server_round, judged, labels, self.recorder.record_train, audited=True
            )
            if judged.accepted is not None:
                # Validated and recorded: only now does it count.
                accumulator.add(judged.accepted.checked)
                accepted.append(judged.accepted)

        withheld = self._withhold(server_round, accepted)
        if withheld:
            log(
                WARNING,
                "round %d: no aggregate published (%s); the global adapter is unchanged",
                server_round,
                "; ".join(withheld),
            )
            regions = [a.region for a in accepted]
            self.recorder.record_aggregate(
                server_round, {"published": False, "regions": regions, "reasons": withheld}
            )
            self.recorder.save()
            self._note(server_round, "aggregate_withheld", regions=regions, reasons=withheld)
            self._checkpoint(server_round)
            return None, None

        mean = unflatten(accumulator.mean(), layout)
        self.global_adapter = apply_delta(self.global_adapter, mean, self.run.server_learning_rate)
        loss = sum(a.metrics.train_loss * a.metrics.num_examples for a in accepted)
        self.recorder.record_aggregate(
            server_round, {"published": True, "regions": [a.region for a in accepted]}
        )
        self.recorder.save()
        self._note(
            server_round,
            "aggregate_published",
            regions=[a.region for a in accepted],
            examples=accumulator.weight,
            model_digest=model_digest(self.global_adapter).hex(),
        )
        self._checkpoint(server_round)
        metrics = MetricRecord(
            {
                "train-loss": loss / accumulator.weight,
                "num-examples": accumulator.weight,
                "regions": len(accepted),
            }
        )
        return protocol.pack_arrays(self.global_adapter), metrics

    def _judge_train(
        self,
        server_round: int,
        reply: protocol.Reply,
        sender: str | None,
        codec: Codec,
        n: int,
        bounds: Bounds,
    ) -> _Judged:
        """Open and validate one authenticated training reply into typed values; raises
        on anything wrong with it (the boundary turns that into a rejection)."""
        if reply.status in (protocol.FAILED, protocol.DECLINED):
            return self._settle(reply, sender)
        self._note_arrival(server_round, reply, sender or reply.region)
        update, metrics, info, header = self._open(reply, server_round, sender)
        facts = UpdateFacts(
            region=header.region,
            sender_jurisdiction=header.jurisdiction,
            policy_hash=header.policy_hash,
            epsilon=metrics.privacy.epsilon if metrics.privacy else None,
            delta=metrics.privacy.delta if metrics.privacy else None,
            suite=header.suite,
            codec=codec_family(self.run.codec),
            num_examples=metrics.num_examples,
            max_grad_norm=metrics.privacy.max_grad_norm if metrics.privacy else None,
            secure_mode=bool(metrics.privacy.secure_mode) if metrics.privacy else None,
        )
        if self.policies is not None:
            decision = self.policies.check_update(facts)
            self._decided(server_round, decision)
            if not decision.accepted:
                rejected = replace(
                    reply,
                    status=REJECTED,
                    reason="; ".join(decision.reasons),
                    info={**reply.info, protocol.POLICY_HASH: header.policy_hash},
                )
                return self._settle(rejected, header.region)
        checked = check(codec, update, n, metrics.num_examples, bounds)
        upload = len(reply.envelope) if reply.envelope is not None else len(update)
        accepted = _Accepted(
            header.region, checked, metrics, info, header, metrics.update_bytes, upload
        )
        return self._settle(
            replace(reply, status=protocol.TRAINED), header.region, accepted=accepted
        )

    def _open(
        self, reply: protocol.Reply, server_round: int, sender: str | None
    ) -> tuple[bytes, protocol.TrainMetrics, dict[str, str], _Header]:
        """The compressed update, its metrics and info, and the facts its policy is
        checked against: from the authenticated envelope when sealed (refusing clear
        updates when sealing is on), from the clear reply otherwise."""
        if reply.status == protocol.TRAINED:
            if self.keys is not None:
                raise EnvelopeRejected("unsealed update refused")
            info = protocol.parse_info(reply.info, protocol.TRAINED)
            header = _Header(
                sender or reply.region,
                info[protocol.JURISDICTION],
                info[protocol.POLICY_HASH],
                UNSEALED,
            )
            arrays = reply.arrays or {}
            metrics: object = reply.metrics
        elif reply.status == protocol.SEALED:
            if self.keys is None or reply.envelope is None:
                raise EnvelopeRejected("sealed update, sealing is off")
            opened = self.keys.open_update(
                reply.envelope, run_id=self.run_id, server_round=server_round
            )
            if opened.sender.party != sender:
                raise EnvelopeRejected(
                    f"envelope sealed by {opened.sender.party!r} in a reply signed by {sender!r}"
                )
            info = protocol.parse_info(opened.info, protocol.TRAINED)
            header = _Header(
                opened.sender.party, opened.sender.jurisdiction, opened.policy_hash, opened.suite
            )
            arrays, metrics = opened.arrays, opened.metrics
        else:
            raise protocol.MalformedReply(f"status {reply.status!r} in a training reply")
        if info["region"] != header.region:
            raise EnvelopeRejected(
                f"update names region {info['region']!r} but comes from {header.region!r}"
            )
        return self._update_bytes(arrays), protocol.parse_train_metrics(metrics), info, header

    def _record(
        self,
        server_round: int,
        judged: _Judged,
        labels: set[str],
        record: Callable[[int, str, dict[str, Any]], None],
        *,
        audited: bool,
    ) -> _Judged:
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
                reply=replace(judged.reply, status=REJECTED, reason=_reason(err)),
            )
            entry = judged.entry()
            try:
                record(server_round, judged.label, entry)
            except Exception as again:
                log(WARNING, "round %d: cannot record %s: %r", server_round, judged.label, again)
        status = judged.reply.status
        log(
            INFO if status in (protocol.TRAINED, protocol.EVALUATED) else WARNING,
            "round %d: region %s %s %s",
            server_round,
            judged.label,
            status,
            entry.get("reason") or "",
        )
        return judged

    # -- evaluation ---------------------------------------------------------------

    def _judge_eval(self, reply: protocol.Reply, sender: str | None) -> _Judged:
        if reply.status == protocol.EVALUATED:
            stats = protocol.parse_eval_metrics(reply.metrics)
            return self._settle(reply, sender, evaluated=stats)
        if reply.status in (protocol.FAILED, protocol.DECLINED):
            return self._settle(reply, sender)
        raise protocol.MalformedReply(f"status {reply.status!r} in an evaluation reply")

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        labels: set[str] = set()
        evaluated: list[tuple[str, protocol.EvalMetrics]] = []
        for item in self._replies(replies):
            judged = self._guarded(server_round, item, self._judge_eval)
            judged = self._record(
                server_round, judged, labels, self.recorder.record_eval, audited=False
            )
            if judged.evaluated is not None:
                evaluated.append((judged.label, judged.evaluated))
        if not evaluated:
            self.recorder.save()
            return None
        total = sum(stats.num_examples for _, stats in evaluated)
        loss = sum(stats.eval_loss * stats.num_examples for _, stats in evaluated) / total
        overall = {
            "loss": loss,
            "perplexity": float(np.exp(min(loss, 50.0))),
            "num_examples": int(total),
        }
        self.recorder.record_eval(server_round, "overall", overall)
        self.recorder.save()
        for label, stats in sorted(evaluated):
            log(INFO, "round %d: eval loss %-4s %.4f", server_round, label, stats.eval_loss)
        return MetricRecord({"eval-loss": loss, "num-examples": total})

    # -- audit trail --------------------------------------------------------------------

    def _note(self, server_round: int | None, event: str, **details: Any) -> None:
        if self.audit is not None:
            self.audit.append(
                event, run_id=self.federation_run, server_round=server_round, **details
            )

    def _decided(self, server_round: int, decision: Decision) -> None:
        self.recorder.record_decision(server_round, decision.to_record())
        self._note(server_round, "policy_decision", **decision.to_record())

    def _checkpoint(self, server_round: int | None) -> None:
        if self.audit is not None:
            self.audit.checkpoint(run_id=self.federation_run, server_round=server_round)

    def _witnessed(
        self, server_round: int | None, region: str, witness: protocol.Witness | None
    ) -> None:
        """Record the head of the region's log that its signed reply carries, so that
        truncating that log later shows in the cross-check (docs/audit.md)."""
        if self.audit is not None and witness is not None:
            self.audit.witness(
                region,
                witness.count,
                witness.head,
                run_id=self.federation_run,
                server_round=server_round,
            )

    def _note_arrival(self, server_round: int, reply: protocol.Reply, region: str) -> None:
        """What crossed the relay, as received: its digest is what the region logged."""
        if reply.envelope is not None:
            data, suite = reply.envelope, "sealed"
        elif reply.arrays and protocol.UPDATE in reply.arrays:
            data, suite = reply.arrays[protocol.UPDATE].tobytes(), UNSEALED
        else:
            return
        self._note(
            server_round,
            RECEIVED_EVENT,
            region=region,
            digest=digest(data),
            bytes=len(data),
            suite=suite,
            sender_key_id=reply.info.get(protocol.KEY_ID, ""),
        )

    def _note_outcome(self, server_round: int, judged: _Judged, entry: dict[str, Any]) -> None:
        status, region = entry["status"], judged.label
        claimed = {"claimed_region": judged.claimed} if judged.claimed != region else {}
        if judged.accepted is not None:
            a = judged.accepted
            self._note(
                server_round,
                "update_accepted",
                region=region,
                examples=a.metrics.num_examples,
                epsilon=a.metrics.privacy.epsilon if a.metrics.privacy else None,
                suite=a.header.suite,
                policy_hash=a.header.policy_hash,
            )
        elif status == protocol.DECLINED:
            self._note(
                server_round, "region_declined", region=region, reason=entry["reason"], **claimed
            )
        elif status in (REJECTED, protocol.FAILED):
            self._note(
                server_round,
                "update_rejected" if status == REJECTED else "reply_failed",
                region=region,
                reason=entry.get("reason", ""),
                policy_hash=judged.reply.info.get(protocol.POLICY_HASH, ""),
                **claimed,
            )

    def _update_bytes(self, arrays: Mapping[str, np.ndarray]) -> bytes:
        """The one compressed update a trained reply may carry, within the size cap."""
        if set(arrays) != {protocol.UPDATE}:
            raise protocol.MalformedReply(
                f"a trained reply carries {sorted(arrays)[:8]}, expected ['update']"
            )
        update = arrays[protocol.UPDATE]
        if update.dtype != np.uint8 or update.ndim != 1:
            raise protocol.MalformedReply(
                f"update is {update.dtype}{list(update.shape)}, expected uint8[n]"
            )
        if update.nbytes > self.run.max_update_bytes:
            raise EnvelopeRejected(
                f"update of {update.nbytes} bytes is over max-update-bytes "
                f"{self.run.max_update_bytes}"
            )
        return update.tobytes()

    def _withhold(self, server_round: int, accepted: list[_Accepted]) -> list[str]:
        """Why this round's aggregate must not be published; empty when it may be."""
        if not accepted:
            return ["no region's update was accepted"]
        if self.policies is None:
            return []
        decision = self.policies.check_aggregate(
            {a.region: a.header.jurisdiction for a in accepted},
            {a.region: a.metrics.num_examples for a in accepted},
        )
        self._decided(server_round, decision)
        return list(decision.reasons)

    # -- the end of the run -------------------------------------------------------

    def witness_run_end(self, grid: Grid, timeout: float) -> None:
        """Once ``run_end`` is in the aggregator's log and signed: send each region that
        head (signed), so that it records it, and record the head each one answers
        with. Truncating any party's log back past the end of the run then shows in
        the cross-check. Best effort: a region that does not answer is logged."""
        if self.audit is None:
            return
        witness = self.audit.last_checkpoint()
        if witness is None:
            return
        signature, signer = b"", ""
        if self.keys is not None:
            signature = sign_run_end(self.keys.keypair, self.run_id, witness)
            signer = self.keys.keypair.bundle.key_id.hex()
        notice = protocol.RunEndNotice(self.federation_run, witness, signature, signer)
        nodes = sorted(grid.get_node_ids())
        messages = self._construct_messages(
            protocol.run_end_notice(notice), nodes, MessageType.QUERY
        )
        witnessed = []
        for message in grid.send_and_receive(messages, timeout=timeout):
            try:
                reply = protocol.read_reply(message)
                sender = self._authenticate(reply, 0)
                if reply.status != protocol.WITNESSED or sender is None:
                    raise protocol.MalformedReply(f"{reply.status} {reply.reason}".strip())
                self._witnessed(None, sender, reply.witness)
                witnessed.append(sender)
            except Exception as err:  # the run has ended: note it, never fail it now
                log(WARNING, "run end: a region's witness was not recorded (%s)", _reason(err))
        self._note(None, "run_end_witnessed", regions=sorted(witnessed))
        self._checkpoint(None)

    # -- the loop -----------------------------------------------------------------

    def start(  # type: ignore[override]
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int,
        timeout: float,
        first_round: int = 1,
    ) -> ArrayRecord:
        """Evaluate the initial adapter in every region (unless resuming), then run
        rounds ``first_round`` to ``num_rounds``, checkpointing after each; return the
        final global adapter."""
        self.global_adapter = protocol.unpack_arrays(initial_arrays)
        arrays, empty = initial_arrays, ConfigRecord()
        if first_round == 1:
            log(INFO, "[ROUND 0] evaluating the initial adapter in every region")
            replies = grid.send_and_receive(
                self.configure_evaluate(0, arrays, empty, grid), timeout=timeout
            )
            self.aggregate_evaluate(0, replies)
            self.recorder.record_end(0)
        for server_round in range(first_round, num_rounds + 1):
            log(INFO, "[ROUND %d/%d]", server_round, num_rounds)
            replies = grid.send_and_receive(
                self.configure_train(server_round, arrays, empty, grid), timeout=timeout
            )
            aggregated, _ = self.aggregate_train(server_round, replies)
            arrays = aggregated if aggregated is not None else arrays
            replies = grid.send_and_receive(
                self.configure_evaluate(server_round, arrays, empty, grid), timeout=timeout
            )
            self.aggregate_evaluate(server_round, replies)
            self.recorder.record_end(server_round)
            self._save_checkpoint(server_round)
        return arrays

    def _save_checkpoint(self, server_round: int) -> None:
        """The round is done: its adapter, records and the audit log's position."""
        if self.checkpoints is None:
            return
        seq, head = self.audit.position() if self.audit is not None else (0, "")
        save_checkpoint(
            self.checkpoints,
            Checkpoint(
                federation_run=self.federation_run,
                round=server_round,
                base_fingerprint=self.base_fingerprint,
                adapter=self.global_adapter,
                audit_seq=seq,
                audit_head=head,
                rounds=self.recorder.data["rounds"],
            ),
        )
