"""The aggregator's journal: the one place that turns what happened in a round into its
``metrics.json`` entry and its audit event; judging and publishing only decide."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from logging import INFO, WARNING
from typing import Any

import numpy as np

from fedciuic.aggregator.judge import Judged, reason_of
from fedciuic.aggregator.schedule import Changes
from fedciuic.audit import RECEIVED_EVENT, Event
from fedciuic.crypto import model_digest
from fedciuic.policy import Decision
from fedciuic.record import RunRecorder
from fedciuic.stages import AuditTrail
from fedciuic.wire import DECLINED, EVALUATED, FAILED, POLICY_HASH, REJECTED, TRAINED, Witness

# Flower's logger, by name: the round's lines show with the rest of the run's output.
_logger = logging.getLogger("flwr")

#: How a reply's outcome is filed in metrics.json: ``record_train`` or ``record_eval``.
Filing = Callable[[int, str, dict[str, Any]], None]


@dataclass
class Journal:
    """Writes outcomes to metrics.json and the audit log; ``witnessed``: highest log counts."""

    recorder: RunRecorder
    audit: AuditTrail
    run_id: int
    witnessed: dict[str, int] = field(default_factory=dict)

    def note(self, server_round: int | None, event: str, **details: Any) -> None:
        self.audit.append(event, run_id=self.run_id, server_round=server_round, **details)

    def checkpoint(self, server_round: int | None) -> None:
        self.audit.checkpoint(run_id=self.run_id, server_round=server_round)

    def decided(self, server_round: int, decision: Decision) -> None:
        """An enforced policy decision, recorded and audited (one not enforced is not)."""
        if decision.enforced:
            self.recorder.record_decision(server_round, decision.to_record())
            self.note(server_round, Event.POLICY_DECISION, **decision.to_record())

    def witness(self, server_round: int | None, region: str, witness: Witness) -> None:
        """The log head a region's reply carries, so truncating that log shows (docs/audit.md)."""
        highest = self.witnessed.get(region, -1)
        self.audit.witness(
            region,
            witness.count,
            witness.head,
            run_id=self.run_id,
            server_round=server_round,
            late=witness.count < highest,
        )
        self.witnessed[region] = max(highest, witness.count)

    def reply(self, server_round: int, judged: Judged, filing: Filing, *, audited: bool) -> Judged:
        """One reply on the record; if that fails, rejected and recorded so (best effort)."""
        try:
            self._noted(server_round, judged)
            entry = judged.entry()
            if audited:
                self._outcome(server_round, judged, entry)
            filing(server_round, judged.label, entry)
        except Exception as err:
            judged = judged.refused(reason_of(err))
            entry = judged.entry()
            try:  # best effort
                filing(server_round, judged.label, entry)
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

    def _noted(self, server_round: int, judged: Judged) -> None:
        noted = judged.noted
        if noted.witness is not None:
            self.witness(server_round, *noted.witness)
        if noted.received is not None:
            r = noted.received
            self.note(
                r.task_round,
                RECEIVED_EVENT,
                region=r.region,
                digest=r.digest,
                bytes=r.bytes,
                suite=r.suite,
                sender_key_id=r.sender_key_id,
                **r.agent,
                **({"aggregate": r.aggregate} if r.aggregate is not None else {}),
            )
        if noted.decision is not None:
            self.decided(server_round, noted.decision)

    def _outcome(self, server_round: int, judged: Judged, entry: dict[str, Any]) -> None:
        status, region = entry["status"], judged.label
        claimed = {"claimed_region": judged.claimed} if judged.claimed != region else {}
        # Which global version a training reply was computed against (and how old it was).
        claimed |= {k: entry[k] for k in ("global_version", "staleness") if k in entry}
        if judged.accepted is not None:
            a = judged.accepted
            declared = a.metrics.declared()
            self.note(
                server_round,
                Event.UPDATE_ACCEPTED,
                **claimed,
                region=region,
                examples=a.metrics.num_examples,
                epsilon=declared["epsilon"],
                unit=declared["unit"],
                # Whose epsilon: a floor for that dataset's ledger rebuild (docs/privacy.md).
                data_fingerprint=a.info["data-fingerprint"],
                suite=a.header.suite,
                policy_hash=a.header.policy_hash,
            )
        elif status == DECLINED:
            self.note(
                server_round,
                Event.REGION_DECLINED,
                region=region,
                reason=entry["reason"],
                **claimed,
            )
        elif status in (REJECTED, FAILED):
            self.note(
                server_round,
                Event.UPDATE_REJECTED if status == REJECTED else Event.REPLY_FAILED,
                region=region,
                reason=entry.get("reason", ""),
                policy_hash=judged.reply.info.get(POLICY_HASH, ""),
                **claimed,
            )

    def secure_sum(
        self, server_round: int, details: Mapping[str, Any], sent: Mapping[str, int]
    ) -> None:
        """A secure round's sum on the record, and each region's bytes sent in it."""
        self.note(server_round, Event.SECURE_SUM, **details)
        self.recorder.record_secure_bytes(server_round, sent)

    def withheld(self, server_round: int, regions: list[str], reasons: list[str]) -> None:
        _logger.log(
            WARNING,
            "round %d: no aggregate published (%s); the global adapter is unchanged",
            server_round,
            "; ".join(reasons),
        )
        self.recorder.record_aggregate(
            server_round, {"published": False, "regions": regions, "reasons": reasons}
        )
        self.recorder.save()
        self.note(server_round, Event.AGGREGATE_WITHHELD, regions=regions, reasons=reasons)
        self.checkpoint(server_round)

    def published(
        self,
        server_round: int,
        regions: list[str],
        examples: float,
        version: int,
        adapter: dict[str, np.ndarray],
    ) -> None:
        self.recorder.record_aggregate(
            server_round, {"published": True, "regions": regions, "version": version}
        )
        self.recorder.save()
        self.note(
            server_round,
            Event.AGGREGATE_PUBLISHED,
            regions=regions,
            examples=examples,
            global_version=version,
            model_digest=model_digest(adapter).hex(),
        )
        self.checkpoint(server_round)

    def availability(self, server_round: int, changes: Changes, missed: dict[str, int]) -> None:
        """Regions newly unavailable (missed rounds in a row) or back."""
        if changes.unavailable or changes.rejoined:
            self.recorder.record_availability(server_round, changes.unavailable, changes.rejoined)
            self.recorder.save()
        for region in changes.unavailable:
            _logger.log(
                WARNING,
                "round %d: region %s is unavailable (missed %d rounds in a row); rounds no "
                "longer wait for it",
                server_round,
                region,
                missed[region],
            )
            self.note(
                server_round, Event.REGION_UNAVAILABLE, region=region, missed_rounds=missed[region]
            )
        for region in changes.rejoined:
            _logger.log(INFO, "round %d: region %s is back", server_round, region)
            self.note(server_round, Event.REGION_REJOINED, region=region)

    def receipts(self) -> str:
        """What this federation run received from each region, as canonical JSON."""
        received: dict[str, list[tuple[int, str]]] = {}
        for record in self.audit.records():
            details = record.get("details")
            if (
                record.get("event") != RECEIVED_EVENT
                or record.get("run_id") != self.run_id
                or not isinstance(details, dict)
            ):
                continue
            region, digest_hex = details.get("region"), details.get("digest")
            if isinstance(region, str) and isinstance(digest_hex, str):
                received.setdefault(region, []).append((int(record.get("round") or 0), digest_hex))
        per_region = {r: sorted(set(items)) for r, items in received.items()}
        return json.dumps(per_region, sort_keys=True, separators=(",", ":"))

    def run_end_witnessed(self, witnessed: Iterable[str]) -> None:
        self.note(None, Event.RUN_END_WITNESSED, regions=sorted(witnessed))
        self.checkpoint(None)
