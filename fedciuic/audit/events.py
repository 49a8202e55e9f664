"""Every audit event, named once: the writers (the apps, the round code) and the readers
(the compliance report, the run report) use these names, never a string of their own.

Each event's details are listed in docs/audit.md ("Events"); a ``StrEnum`` member is its own
string, so a record written with it reads back as plain JSON.
"""

from __future__ import annotations

from enum import StrEnum


class Event(StrEnum):
    # both parties
    CHECKPOINT = "checkpoint"
    TORN_TAIL = "torn_tail_moved"
    WITNESS = "witness"
    POLICY_DECISION = "policy_decision"
    #: The signed anchor a pruned log's chain starts from (docs/audit.md, "Retention").
    PRUNED = "audit_pruned"
    # the aggregator
    RUN_START = "run_start"
    RUN_END = "run_end"
    RUN_END_WITNESSED = "run_end_witnessed"
    UPDATE_RECEIVED = "update_received"
    UPDATE_ACCEPTED = "update_accepted"
    UPDATE_REJECTED = "update_rejected"
    REGION_DECLINED = "region_declined"
    REPLY_FAILED = "reply_failed"
    AGGREGATE_PUBLISHED = "aggregate_published"
    AGGREGATE_WITHHELD = "aggregate_withheld"
    REGION_UNAVAILABLE = "region_unavailable"  # missed max-missed-rounds in a row
    REGION_REJOINED = "region_rejoined"  # answered again after being unavailable
    #: Who joined, shared, survived and revealed a secure sum, and whether it was unmasked.
    SECURE_SUM = "secure_sum"
    # a region
    RUN_JOINED = "run_joined"
    TRAINED = "trained"
    #: The de-identification pipeline's identity and counts per entity type and file, never
    #: a value (docs/deidentification.md).
    DATA_DEIDENTIFIED = "data_deidentified"
    #: Records over max-record-bytes, dropped unread: the limit, how many, per file.
    RECORDS_OVERSIZED = "records_oversized"
    UPDATE_SEALED = "update_sealed"
    UPDATE_SENT_CLEAR = "update_sent_clear"
    UPDATE_RESENT = "update_resent"
    # a region's phases of a secure sum (docs/secure-aggregation.md)
    SECURE_JOINED = "secure_joined"
    SECURE_SHARED = "secure_shared"
    SECURE_MASKED = "secure_masked"
    SECURE_CONSENTED = "secure_consented"
    SECURE_REVEALED = "secure_revealed"
    EVALUATED = "evaluated"
    DECLINED = "declined"
    #: A released update (its epsilon spent) the aggregator's run-end notice has no receipt of.
    UPDATE_UNDELIVERED = "update_undelivered"
    #: A run's DP count of privacy units, charged to the ledger (count-noise; docs/privacy.md).
    UNITS_COUNTED = "units_counted"
    # a region's agent (docs/cluster.md)
    AGENT_STARTED = "agent_started"  # its version, code digest and who the relay runs as
    REQUEST_REFUSED = "request_refused"  # a relay asked for what the aggregator did not sign


#: What a region logs when an update leaves it (sealed, or in the clear).
SENT_EVENTS = (Event.UPDATE_SEALED, Event.UPDATE_SENT_CLEAR)
#: What a region logs as each of its secure-sum messages leaves it, in phase order.
SECURE_SENT_EVENTS = (
    Event.SECURE_JOINED,
    Event.SECURE_SHARED,
    Event.SECURE_MASKED,
    Event.SECURE_CONSENTED,
    Event.SECURE_REVEALED,
)
#: The field of ``trained`` and ``evaluated`` records listing the reply's fields its release
#: table classed as figures of the data (fedciuic/releases.py): "Figures sent outside DP".
OUTSIDE_DP = "outside_dp"
#: The records that witness the privacy ledger's head (``details.ledger``) at a release.
LEDGER_WITNESSES = (Event.TRAINED, Event.UNITS_COUNTED, Event.EVALUATED)
