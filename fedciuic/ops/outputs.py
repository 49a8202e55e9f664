"""A run's output folder for people: the summary, and the figures read from metrics.json."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from fedciuic import wire
from fedciuic.aggregator import CHECKPOINT_DIR, LATEST
from fedciuic.config import DEFAULT_PRIVACY_UNIT, PrivacyUnit
from fedciuic.record import (
    METRICS_FILE,
    OVERALL,
    SUMMARY_FILE,
    EvalEntry,
    MetricsError,
    RunMetrics,
    RunStatus,
    load_metrics,
    no_aggregate_reasons,
    save_metrics,
    utc_now,
)
from fedciuic.wire import TRAINED


def mark_unfinished(run_dir: Path, reason: str) -> bool:
    """Mark a run still ``running`` ``interrupted`` (its process is gone); True if it was."""
    path = run_dir / METRICS_FILE
    try:
        data = load_metrics(path)
    except MetricsError:
        return False
    if data.run.status != RunStatus.RUNNING:
        return False
    data.run.status, data.run.finished, data.run.error = RunStatus.INTERRUPTED, utc_now(), reason
    save_metrics(path, data)
    (run_dir / SUMMARY_FILE).write_text(summarize(data) + "\n", encoding="utf-8")
    return True


def fmt_number(value: Any) -> str:
    """A loss or similar to 4 decimals, or "-" where there is none."""
    return f"{value:.4f}" if isinstance(value, int | float) and math.isfinite(value) else "-"


def fmt_epsilon(epsilon: Any, budget: Any, unit: PrivacyUnit | None = None) -> str:
    """Epsilon spent of the budget, per unit ("7.99 of 8 per user"; older files: per record)."""
    if not isinstance(epsilon, int | float):
        return "-"
    limit = budget if isinstance(budget, int | float) else float("nan")
    return f"{epsilon:.2f} of {limit:g} per {unit or DEFAULT_PRIVACY_UNIT}"


def epsilon_spent(
    data: RunMetrics, region: str
) -> tuple[float | None, float | None, PrivacyUnit | None]:
    """A region's cumulative epsilon after its last DP round, its budget and its unit."""
    for _, entry in reversed(data.trained(region)):
        if entry.epsilon is not None:
            budget = float("nan") if entry.epsilon_budget is None else entry.epsilon_budget
            return entry.epsilon, budget, entry.unit
    return None, None, None


def upload_bytes(data: RunMetrics, region: str) -> list[int]:
    """Bytes a region sent per round it sent any (its update, or its secure-sum messages)."""
    return [e.sent_bytes for _, e in data.trained(region) if e.sent_bytes is not None]


def mean_upload(data: RunMetrics, region: str) -> str:
    """What :func:`upload_bytes` gives, on average ("" if nothing)."""
    sent = upload_bytes(data, region)
    return f"{sum(sent) / len(sent):.0f}" if sent else ""


def steps_per_round(data: RunMetrics, region: str) -> str:
    """Local steps of each accepted update, as ``30/30/12`` (a local-time-budget varies them)."""
    steps = [str(e.steps) for _, e in data.trained(region) if e.status == TRAINED]
    return "/".join(steps) or "-"


def loss_of(entry: EvalEntry | None) -> float | None:
    return entry.loss if entry is not None else None


def summarize(data: RunMetrics, baseline: RunMetrics | None = None) -> str:
    """Per region: eval loss before and after, epsilon spent and the gap to a no-DP ``baseline``."""
    run, config = data.run, data.run.config
    first = data.first_eval()
    last_round, last = data.final_eval()
    base = baseline.final_eval()[1] if baseline else {}
    header = (
        f"{'region':<8} {'eval before':>11} {'after r' + str(last_round):>9} {'change':>8}"
        + (f" {'no-DP':>8} {'DP gap':>8}" if baseline else "")
        + (f" {'epsilon':>20}" if config.dp else "")
        + f" {'bytes/round':>11} {'steps/round':>12}  rounds"
    )
    lines = [
        f"fedciuic run {run.run_id}: {run.status}, "
        f"{max(data.rounds, default=0)} round(s), regions {', '.join(run.regions)}, "
        + f"{config.dp_words}, codec {config.codec or 'dense'}",
        header,
    ]
    for region in [*run.regions, OVERALL]:
        before, after = loss_of(first.get(region)), loss_of(last.get(region))
        change = after - before if before is not None and after is not None else None
        row = f"{region:<8} {fmt_number(before):>11} {fmt_number(after):>9} {fmt_number(change):>8}"
        if baseline:
            other = loss_of(base.get(region))
            gap = after - other if after is not None and other is not None else None
            row += f" {fmt_number(other):>8} {fmt_number(gap):>8}"
        if config.dp:
            row += f" {fmt_epsilon(*epsilon_spent(data, region)) if region != OVERALL else '':>20}"
        row += f" {mean_upload(data, region) if region != OVERALL else '':>11}"
        row += f" {steps_per_round(data, region) if region != OVERALL else '':>12}"
        statuses = [entry.status for _, entry in data.trained(region)]
        row += "  " + ", ".join(f"{s} x{statuses.count(s)}" for s in sorted(set(statuses)))
        lines.append(row.rstrip())
    lines += [*_policy_notes(data), *_undelivered_notes(data), *outcome_lines(data)]
    if run.adapter:
        lines.append(f"adapter: {run.adapter}")
    lines.append(f"metrics: {Path(run.output_dir or '.') / METRICS_FILE}")
    return "\n".join(lines)


def _policy_notes(data: RunMetrics) -> list[str]:
    """The policies applied, aggregates withheld, and why regions sent nothing usable."""
    run = data.run
    notes = []
    if run.policies_recorded:
        held = run.policies
        where = run.config.aggregator_jurisdiction or "?"
        notes.append(
            f"policies (aggregator in {where}): "
            + (
                ", ".join(f"{j} {p.hash[:12]}" for j, p in held.items())
                if held is not None
                else "OFF (enforce-policies = false: a lab baseline)"
            )
        )
    if run.status == RunStatus.NO_AGGREGATE:
        return notes  # outcome_lines says why, per region
    seen = set()
    for number, rnd in sorted(data.rounds.items()):
        aggregate = rnd.aggregate
        if aggregate is not None and not aggregate.published:
            reasons = "; ".join(aggregate.reasons)
            notes.append(f"round {number}: aggregate withheld, global adapter unchanged: {reasons}")
        for region, entry in rnd.train.items():
            key = (region, entry.status, entry.reason)
            if entry.reason and key not in seen:
                seen.add(key)
                notes.append(f"round {number}: {region} {entry.status}: {entry.reason}")
    return notes


def _undelivered_notes(data: RunMetrics) -> list[str]:
    """Rounds a region did not answer in time: under DP it may have spent epsilon for nothing."""
    missed = [
        (number, region)
        for number, rnd in sorted(data.rounds.items())
        for region, entry in sorted(rnd.train.items())
        if entry.status == wire.FAILED and (entry.reason or "").startswith(wire.NO_REPLY)
    ]
    if not missed or not data.run.config.dp:
        return []
    which = ", ".join(f"{region} in round {number}" for number, region in missed)
    timeout = data.run.config.round_timeout
    return [
        f"SPENT, NOT DELIVERED?: no update arrived from {which} within round-timeout"
        + (f" ({timeout:g}s)" if timeout else "")
        + ". A region that trained for that round spent its "
        "epsilon and the update never arrived (or arrived too late to count); its audit log "
        "records the release, and `fedciuic report` with that log lists it under Spent, not "
        "delivered. If the regions' rounds take longer than round-timeout, raise it."
    ]


def outcome_lines(data: RunMetrics) -> list[str]:
    """What a run that did not complete achieved, in words (nothing for a completed one)."""
    run, status = data.run, data.run.status
    total = run.config.num_server_rounds or "?"
    if status == RunStatus.NO_AGGREGATE:
        return [
            f"NO AGGREGATE: none was published in {total} round(s), so nothing was trained: "
            "the global adapter is still the initial one and was not saved. Why:",
            *(f"  {line}" for line in run.reasons or no_aggregate_reasons(data)),
        ]
    if status in (RunStatus.FAILED, RunStatus.INTERRUPTED):
        rounds = data.rounds
        ended = max((n for n, rnd in rounds.items() if rnd.ended_at), default=None)
        begun = max(rounds, default=None)
        where = (
            "before round 0 ended"
            if ended is None
            else f"in round {begun} of {total}"
            if begun is not None and begun > ended
            else f"after round {ended} of {total}"
        )
        lines = [f"{status.upper()} {where}: {run.error or 'no reason recorded'}"]
        # The rounds it finished are checkpointed, and the regions spent their epsilon on
        # them: a resumed run continues from there, releasing nothing twice.
        if ended and run.output_dir and (Path(run.output_dir) / CHECKPOINT_DIR / LATEST).exists():
            lines.append(
                f"Resume it from round {ended + 1}: the same run config with "
                f"--run-config \"resume-from='{run.output_dir}'\" (docs/robustness.md)"
            )
        return lines
    if status == RunStatus.RUNNING:
        return ["RUNNING: the run has not finished (or its process died without a word)"]
    return []
