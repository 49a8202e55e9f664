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
from collections.abc import Callable, Iterable
from dataclasses import replace
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg
from flwr.supercore import log

from fedciuic.aggregation import Bounds, apply_delta, check, make_aggregator
from fedciuic.audit import RECEIVED_EVENT, AuditLog, digest
from fedciuic.checkpoint import Checkpoint, save_checkpoint
from fedciuic.compliance import UNSEALED, AggregatorPolicies, codec_family
from fedciuic.compression import get_codec, layout_of, unflatten
from fedciuic.config import RunConfig
from fedciuic.errors import FederationError
from fedciuic.flower import protocol
from fedciuic.outputs import RunRecorder
from fedciuic.policy import Decision, UpdateFacts
from fedciuic.sealing import (
    AggregatorKeys,
    EnvelopeRejected,
    InvalidEnvelope,
    model_digest,
    sign_global,
)

#: Privacy figures a DP region reports with its update, recorded per round.
PRIVACY_METRICS = (
    "epsilon",
    "epsilon-budget",
    "delta",
    "noise-multiplier",
    "sample-rate",
    "secure-mode",
)


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
        if self.keys is not None:
            adapter = protocol.unpack_arrays(arrays) if adapter is None else adapter
            signature = sign_global(self.keys.keypair, self.run_id, server_round, adapter)
            signer = self.keys.keypair.bundle.key_id.hex()
        content = protocol.instruction(
            arrays,
            server_round=server_round,
            base_fingerprint=self.base_fingerprint,
            config=config,
            signature=signature,
            signer=signer,
            federation_run=self.federation_run,
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

    def _read(self, replies: Iterable[Message]) -> list[protocol.Reply]:
        """Parse the replies; a node asked this round that did not answer within
        round-timeout (its process died, say) is a failed reply of its own."""
        parsed = [protocol.read_reply(m, self.regions_by_node) for m in replies]
        for reply in parsed:
            if reply.status != "failed":
                self.regions_by_node[reply.node_id] = reply.region
        answered = {reply.node_id for reply in parsed}
        for node_id in self._asked:
            if node_id not in answered:
                region = self.regions_by_node.get(node_id, f"node-{node_id}")
                reason = f"no reply within round-timeout ({self.run.round_timeout:g}s)"
                parsed.append(protocol.Reply(node_id, region, "failed", reason=reason))
        return parsed

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
        accepted: list[protocol.Reply] = []
        for reply in self._read(replies):
            self._note_arrival(server_round, reply)
            reply, upload = self._unseal(reply, server_round)
            entry: dict[str, Any] = {"status": reply.status, "reason": reply.reason}
            if reply.status == protocol.TRAINED and self.policies is not None:
                decision = self.policies.check_update(self._facts(reply))
                self._decided(server_round, decision)
                if not decision.accepted:
                    reply = replace(reply, status="rejected", reason="; ".join(decision.reasons))
                    entry = {"status": "rejected", "reason": reply.reason}
            if reply.status == protocol.TRAINED:
                try:
                    checked = check(
                        codec,
                        self._update_bytes(reply),
                        n,
                        reply.metrics.get("num-examples", 0.0),
                        bounds,
                    )
                except ValueError as err:
                    entry = {"status": "rejected", "reason": str(err)}
                else:
                    accumulator.add(checked)
                    accepted.append(reply)
                    entry.update(norm=checked.norm, clipped=checked.clipped)
                    entry.update(
                        loss=reply.metrics["train-loss"],
                        num_examples=int(reply.metrics["num-examples"]),
                        steps=int(reply.metrics.get("steps", 0)),
                        data_fingerprint=reply.info.get("data-fingerprint", ""),
                        upload_bytes=upload,
                        update_bytes=int(reply.metrics.get("update-bytes", 0)),
                    )
                    entry.update(
                        {
                            key.replace("-", "_"): reply.metrics[key]
                            for key in PRIVACY_METRICS
                            if key in reply.metrics
                        }
                    )
            self._note_outcome(server_round, reply, entry)
            level = INFO if entry["status"] == protocol.TRAINED else WARNING
            log(
                level,
                "round %d: region %s %s %s",
                server_round,
                reply.region,
                entry["status"],
                entry.get("reason") or "",
            )
            self.recorder.record_train(server_round, reply.region, entry)

        withheld = self._withhold(server_round, accepted)
        if withheld:
            log(
                WARNING,
                "round %d: no aggregate published (%s); the global adapter is unchanged",
                server_round,
                "; ".join(withheld),
            )
            regions = [r.region for r in accepted]
            self.recorder.record_aggregate(
                server_round, {"published": False, "regions": regions, "reasons": withheld}
            )
            self.recorder.save()
            self._note(server_round, "aggregate_withheld", regions=regions, reasons=withheld)
            self._checkpoint(server_round)
            return None, None

        mean = unflatten(accumulator.mean(), layout)
        self.global_adapter = apply_delta(self.global_adapter, mean, self.run.server_learning_rate)
        weights = [r.metrics["num-examples"] for r in accepted]
        loss = sum(r.metrics["train-loss"] * w for r, w in zip(accepted, weights, strict=True))
        self.recorder.record_aggregate(
            server_round, {"published": True, "regions": [r.region for r in accepted]}
        )
        self.recorder.save()
        self._note(
            server_round,
            "aggregate_published",
            regions=[r.region for r in accepted],
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

    def _note_arrival(self, server_round: int, reply: protocol.Reply) -> None:
        """What crossed the relay, as received: its digest is what the region logged."""
        if reply.envelope is not None:
            data, suite = reply.envelope, "sealed"
        elif reply.status == protocol.TRAINED and reply.arrays and protocol.UPDATE in reply.arrays:
            data, suite = reply.arrays[protocol.UPDATE].tobytes(), UNSEALED
        else:
            return
        self._note(
            server_round,
            RECEIVED_EVENT,
            region=reply.region,
            digest=digest(data),
            bytes=len(data),
            suite=suite,
            sender_key_id=reply.info.get("key-id", ""),
        )

    def _note_outcome(
        self, server_round: int, reply: protocol.Reply, entry: dict[str, Any]
    ) -> None:
        status = entry["status"]
        if status == protocol.TRAINED:
            self._note(
                server_round,
                "update_accepted",
                region=reply.region,
                examples=entry["num_examples"],
                epsilon=entry.get("epsilon"),
                suite=reply.info.get(protocol.SUITE, ""),
                policy_hash=reply.info.get(protocol.POLICY_HASH, ""),
            )
        elif status == protocol.DECLINED:
            self._note(server_round, "region_declined", region=reply.region, reason=entry["reason"])
        else:
            self._note(
                server_round,
                "update_rejected" if status == "rejected" else "reply_failed",
                region=reply.region,
                reason=entry.get("reason", ""),
                policy_hash=reply.info.get(protocol.POLICY_HASH, ""),
            )

    def _update_bytes(self, reply: protocol.Reply) -> bytes:
        """The one compressed update a trained reply may carry, within the size cap."""
        arrays = reply.arrays or {}
        if set(arrays) != {protocol.UPDATE}:
            raise ValueError(f"a trained reply carries {sorted(arrays)}, expected ['update']")
        update = arrays[protocol.UPDATE]
        if update.dtype != np.uint8 or update.ndim != 1:
            raise ValueError(f"update is {update.dtype}{list(update.shape)}, expected uint8[n]")
        if update.nbytes > self.run.max_update_bytes:
            raise ValueError(
                f"update of {update.nbytes} bytes is over max-update-bytes "
                f"{self.run.max_update_bytes}"
            )
        return update.tobytes()

    def _facts(self, reply: protocol.Reply) -> UpdateFacts:
        """What the sender's policy is checked against; for a sealed update, the
        jurisdiction, suite and policy hash come from its authenticated envelope."""
        metrics, info = reply.metrics, reply.info
        return UpdateFacts(
            region=reply.region,
            sender_jurisdiction=info.get(protocol.JURISDICTION, ""),
            policy_hash=info.get(protocol.POLICY_HASH, ""),
            epsilon=metrics.get("epsilon"),
            delta=metrics.get("delta"),
            suite=info.get(protocol.SUITE, UNSEALED),
            codec=codec_family(self.run.codec),
            num_examples=int(metrics.get("num-examples", 0)),
            max_grad_norm=metrics.get("max-grad-norm"),
            secure_mode=bool(metrics["secure-mode"]) if "secure-mode" in metrics else None,
        )

    def _withhold(self, server_round: int, accepted: list[protocol.Reply]) -> list[str]:
        """Why this round's aggregate must not be published; empty when it may be."""
        if not accepted:
            return ["no region's update was accepted"]
        if self.policies is None:
            return []
        decision = self.policies.check_aggregate(
            {r.region: r.info.get(protocol.JURISDICTION, "") for r in accepted},
            {r.region: int(r.metrics["num-examples"]) for r in accepted},
        )
        self._decided(server_round, decision)
        return list(decision.reasons)

    def _unseal(self, reply: protocol.Reply, server_round: int) -> tuple[protocol.Reply, int]:
        """Open a sealed update (refusing clear ones when sealing is on); also return
        the bytes that crossed the relay for it."""
        if reply.envelope is not None:
            upload = len(reply.envelope)
        else:
            upload = sum(a.nbytes for a in (reply.arrays or {}).values())
        if reply.status == protocol.TRAINED and self.keys is not None:
            return replace(
                reply, status="rejected", reason="unsealed update refused", arrays=None
            ), upload
        if reply.status == protocol.TRAINED:  # in the clear, whatever its info claims
            return replace(reply, info={**reply.info, protocol.SUITE: UNSEALED}), upload
        if reply.status != protocol.SEALED:
            return reply, upload
        if self.keys is None or reply.envelope is None:
            return replace(reply, status="rejected", reason="sealed update, sealing is off"), upload
        try:
            opened = self.keys.open_update(
                reply.envelope, run_id=self.run_id, server_round=server_round
            )
        except (InvalidEnvelope, EnvelopeRejected, ValueError) as err:
            return replace(reply, status="rejected", reason=str(err)), upload
        header = {
            protocol.JURISDICTION: opened.sender.jurisdiction,
            protocol.POLICY_HASH: opened.policy_hash,
            protocol.SUITE: opened.suite,
        }
        return replace(
            reply,
            region=opened.sender.party,
            status=protocol.TRAINED,
            metrics=opened.metrics,
            info={**opened.info, **header},
            arrays=opened.arrays,
            envelope=None,
        ), upload

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        evaluated = []
        for reply in self._read(replies):
            if reply.status == protocol.EVALUATED:
                evaluated.append(reply)
                entry = {
                    "status": reply.status,
                    "loss": reply.metrics["eval-loss"],
                    "perplexity": reply.metrics["perplexity"],
                    "num_examples": int(reply.metrics["num-examples"]),
                }
            else:
                entry = {"status": reply.status, "reason": reply.reason}
                log(
                    WARNING,
                    "round %d: region %s did not evaluate: %s",
                    server_round,
                    reply.region,
                    reply.reason,
                )
            self.recorder.record_eval(server_round, reply.region, entry)
        if not evaluated:
            self.recorder.save()
            return None
        total = sum(r.metrics["num-examples"] for r in evaluated)
        loss = sum(r.metrics["eval-loss"] * r.metrics["num-examples"] for r in evaluated) / total
        overall = {
            "loss": loss,
            "perplexity": float(np.exp(min(loss, 50.0))),
            "num_examples": int(total),
        }
        self.recorder.record_eval(server_round, "overall", overall)
        self.recorder.save()
        for r in sorted(evaluated, key=lambda r: r.region):
            log(
                INFO,
                "round %d: eval loss %-4s %.4f",
                server_round,
                r.region,
                r.metrics["eval-loss"],
            )
        return MetricRecord({"eval-loss": loss, "num-examples": total})

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
