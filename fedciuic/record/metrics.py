"""The typed model of ``metrics.json``: what :class:`~fedciuic.record.recorder.RunRecorder`
writes and every reader (summary, progress, report, launchers, checkpoints) reads.

Each field is named once here, so a writer and its readers cannot drift apart. Round
numbers are object keys (strings on disk), and a field never set stays absent, so
``"policies": null`` (policies off) still differs from no ``policies`` at all.
"""

from __future__ import annotations

import json
from enum import StrEnum
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from fedciuic.config import DEFAULT_PRIVACY_UNIT, PrivacyUnit
from fedciuic.errors import FedciuicError

#: The label of a round's examples-weighted evaluation, beside the regions' own.
OVERALL = "overall"


class MetricsError(FedciuicError):
    """A metrics.json that is missing, not JSON, or not what a fedciuic run writes."""


class RunStatus(StrEnum):
    """How a run ended (``run.status``); see :mod:`fedciuic.record.recorder`."""

    RUNNING = "running"
    COMPLETED = "completed"
    NO_AGGREGATE = "no-aggregate"
    FAILED = "failed"
    INTERRUPTED = "interrupted"


class _Record(BaseModel):
    """Named fields only (an unknown key is another file); assignments are validated, as
    the recorder fills records in as a run goes."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RunSettings(_Record):
    """The run config as the run saw it (hyphenated keys): every setting kept, those
    readers show named."""

    model_config = ConfigDict(
        extra="allow", populate_by_name=True, alias_generator=lambda name: name.replace("_", "-")
    )

    num_server_rounds: int | None = None
    dp: bool = False
    target_epsilon: float | None = None
    target_delta: float | None = None
    secure_mode: bool | None = None
    privacy_unit: PrivacyUnit | None = None
    codec: str | None = None
    aggregator_jurisdiction: str | None = None
    data_root: str | None = None
    keys_dir: str | None = None
    round_timeout: float | None = None

    @property
    def dp_words(self) -> str:
        """The run's DP in one phrase, worded alike wherever a run is summed up."""
        if not self.dp:
            return "DP off"
        words = f"target epsilon {self.target_epsilon} per "
        words += f"{self.privacy_unit or DEFAULT_PRIVACY_UNIT}, delta {self.target_delta}"
        if self.secure_mode is not None:  # None: not recorded
            words += f", secure-mode {'on' if self.secure_mode else 'OFF'}"
        return f"DP on ({words})"


class PolicyHeld(_Record):
    """A jurisdiction's policy as the aggregator held it."""

    file: str
    hash: str


class ResumedFrom(_Record):
    federation_run: int
    round: int
    checkpoint: str


class RunHeader(_Record):
    """The run as a whole (``run``): who, with which settings, and how it ended."""

    run_id: int
    status: RunStatus
    started: str | None = None  # UTC, ISO 8601
    finished: str | None = None
    regions: list[str] = Field(default_factory=list)
    config: RunSettings = Field(default_factory=RunSettings)
    output_dir: str | None = None
    audit_log: str | None = None
    base_fingerprint: str | None = None
    policies: dict[str, PolicyHeld] | None = None  # None: enforce-policies = false
    resumed_from: ResumedFrom | None = None
    adapter: str | None = None  # where the final adapter was saved
    reasons: list[str] | None = None  # no-aggregate: why, per region
    error: str | None = None  # failed or interrupted: why

    @property
    def policies_recorded(self) -> bool:
        """Whether the run said which policies it held (None among them: none)."""
        return "policies" in self.model_fields_set


class TrainEntry(_Record):
    """A region's training reply: its verdict and, when accepted, the update's figures."""

    status: str  # a reply status, see fedciuic.wire
    reason: str | None = None
    claimed_region: str | None = None  # the name the reply claimed, when not its label
    norm: float | None = None
    clipped: bool | None = None
    loss: float | None = None
    num_examples: int | None = None
    steps: int | None = None
    #: The global adapter's version the update was computed against, and how many
    #: versions were published since (always 0 in sync mode).
    global_version: int | None = None
    staleness: int | None = None
    data_fingerprint: str | None = None
    upload_bytes: int | None = None
    update_bytes: int | None = None
    #: In a secure round: the bytes of the region's secure-sum messages, besides its reply.
    secure_bytes: int | None = None
    #: What ``epsilon`` is per; absent in files from before units (record-level).
    unit: PrivacyUnit | None = None
    epsilon: float | None = None
    epsilon_budget: float | None = None
    delta: float | None = None
    noise_multiplier: float | None = None
    sample_rate: float | None = None
    secure_mode: int | None = None
    #: The region agent's fedciuic version and code digest, as its signed reply says.
    agent_version: str | None = None
    agent_code: str | None = None

    @property
    def sent_bytes(self) -> int | None:
        """Every byte the region sent the aggregator for the round, secure sum included."""
        if self.upload_bytes is None and self.secure_bytes is None:
            return None
        return (self.upload_bytes or 0) + (self.secure_bytes or 0)


class EvalEntry(_Record):
    """A region's evaluation, or the examples-weighted ``overall`` one (no status)."""

    status: str | None = None
    reason: str | None = None
    claimed_region: str | None = None
    loss: float | None = None
    perplexity: float | None = None
    num_examples: int | None = None
    #: The region's timed local DP-SGD step (what the aggregator's training wait sizes on).
    step_seconds: float | None = None
    agent_version: str | None = None
    agent_code: str | None = None


class Duplicate(TrainEntry):
    """A second reply from a region in one round: kept apart, never counted."""

    region: str
    perplexity: float | None = None  # when it was an evaluation


class AggregateEntry(_Record):
    published: bool
    regions: list[str] = Field(default_factory=list)
    version: int | None = None  # the global adapter's version once published
    reasons: list[str] = Field(default_factory=list)  # why it was withheld


class DecisionEntry(_Record):
    """A policy decision, as :meth:`fedciuic.policy.rules.Decision.to_record` gives it."""

    actor: str
    subject: str
    outcome: str
    reasons: list[str]
    policy_hash: str
    details: dict[str, Any] | None = None


class RoundRecord(_Record):
    """One round: every region's reply, the aggregate, the decisions, when it ended."""

    train: dict[str, TrainEntry] = Field(default_factory=dict)
    eval: dict[str, EvalEntry] = Field(default_factory=dict)
    aggregate: AggregateEntry | None = None
    decisions: list[DecisionEntry] = Field(default_factory=list)
    duplicates: list[Duplicate] = Field(default_factory=list)
    #: Regions marked unavailable (missed max-missed-rounds in a row) or back this round.
    unavailable: list[str] = Field(default_factory=list)
    rejoined: list[str] = Field(default_factory=list)
    ended_at: float | None = None  # Unix time


#: The records of each round by number (a checkpoint carries them too).
Rounds = dict[int, RoundRecord]
_ROUNDS: TypeAdapter[Rounds] = TypeAdapter(Rounds)


class RunMetrics(_Record):
    """The whole of ``metrics.json``."""

    run: RunHeader
    rounds: Rounds = Field(default_factory=dict)

    def dump(self) -> dict[str, Any]:
        """The JSON-ready form, as the file holds it."""
        return self.model_dump(mode="json", by_alias=True, exclude_unset=True)

    def final_eval(self) -> tuple[int, dict[str, EvalEntry]]:
        """The last round with evaluation results, and those results."""
        last = max((n for n, rnd in self.rounds.items() if rnd.eval), default=0)
        rnd = self.rounds.get(last)
        return last, rnd.eval if rnd else {}

    def first_eval(self) -> dict[str, EvalEntry]:
        """Round 0's evaluation: the initial adapter's."""
        rnd = self.rounds.get(0)
        return rnd.eval if rnd else {}

    def trained(self, region: str) -> list[tuple[int, TrainEntry]]:
        """A region's training replies, by round."""
        return [
            (n, self.rounds[n].train[region])
            for n in sorted(self.rounds)
            if region in self.rounds[n].train
        ]


def dump_rounds(rounds: Rounds) -> dict[str, Any]:
    """Rounds in the JSON-ready form metrics.json (and a checkpoint) holds them."""
    dumped: dict[str, Any] = _ROUNDS.dump_python(
        rounds, mode="json", by_alias=True, exclude_unset=True
    )
    return dumped


def parse_rounds(raw: object) -> Rounds:
    """Rounds read back (a checkpoint's); raises ``ValidationError`` (a ValueError)."""
    return _ROUNDS.validate_python(raw)


def load_metrics(path: Path) -> RunMetrics:
    """A run's metrics.json, or a :class:`MetricsError` naming the file and what is wrong."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise MetricsError(f"{path}: not found") from None
    except OSError as err:
        raise MetricsError(f"{path}: cannot read ({err.strerror})") from None
    except ValueError as err:
        raise MetricsError(f"{path}: not valid JSON ({err})") from None
    try:
        return RunMetrics.model_validate(raw)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "(top)"
        more = f" (+{err.error_count() - 1} more)" if err.error_count() > 1 else ""
        raise MetricsError(
            f"{path}:{where}: {first['msg']}{more}; not a metrics file this fedciuic writes"
        ) from None
