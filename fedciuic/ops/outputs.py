"""A run's output folder for people: the summary, and the figures read from metrics.json
(which :mod:`fedciuic.rounds.record` writes).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fedciuic.rounds.record import (
    FAILED,
    INTERRUPTED,
    METRICS_FILE,
    NO_AGGREGATE,
    RUNNING,
    SUMMARY_FILE,
    no_aggregate_reasons,
    utc_now,
    write_json,
)


def _write_summary(directory: Path, data: dict[str, Any]) -> None:
    (directory / SUMMARY_FILE).write_text(summarize(data) + "\n", encoding="utf-8")


def mark_unfinished(run_dir: Path, reason: str) -> bool:
    """Mark a run whose metrics.json still says ``running`` as ``interrupted`` (its
    process is gone: a launcher stopped or lost it). True if it did."""
    path = run_dir / METRICS_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    run = data.get("run") if isinstance(data, dict) else None
    if not isinstance(run, dict) or run.get("status") != RUNNING:
        return False
    run.update(status=INTERRUPTED, finished=utc_now(), error=reason)
    write_json(path, data)
    _write_summary(run_dir, data)
    return True


def fmt_number(value: Any) -> str:
    """A loss or similar to 4 decimals, or "-" where there is none."""
    return f"{value:.4f}" if isinstance(value, int | float) and math.isfinite(value) else "-"


def fmt_epsilon(epsilon: Any, budget: Any) -> str:
    """Epsilon spent against the budget ("7.99 of 8"), or "-" without DP."""
    if not isinstance(epsilon, int | float):
        return "-"
    return f"{epsilon:.2f} of {budget if isinstance(budget, int | float) else float('nan'):g}"


def final_eval(data: Mapping[str, Any]) -> tuple[int, dict[str, Any]]:
    """The last round with evaluation results and those results."""
    rounds = data["rounds"]
    last = max((int(r) for r in rounds if rounds[r].get("eval")), default=0)
    return last, rounds.get(str(last), {}).get("eval", {})


def epsilon_spent(data: Mapping[str, Any], region: str) -> tuple[float | None, float | None]:
    """A region's cumulative epsilon after its last DP round in this run, and its budget."""
    rounds = data["rounds"]
    for number in sorted((int(r) for r in rounds), reverse=True):
        entry = rounds[str(number)].get("train", {}).get(region, {})
        if "epsilon" in entry:
            return float(entry["epsilon"]), float(entry.get("epsilon_budget", "nan"))
    return None, None


def upload_bytes(data: Mapping[str, Any], region: str) -> list[int]:
    """Bytes a region's accepted updates took on the wire, one entry per round."""
    return [
        int(entry["upload_bytes"])
        for _, rnd in sorted(data["rounds"].items(), key=lambda kv: int(kv[0]))
        if "upload_bytes" in (entry := rnd.get("train", {}).get(region, {}))
    ]


def summarize(data: dict[str, Any], baseline: dict[str, Any] | None = None) -> str:
    """A short plain-text summary per region: eval loss before round 1 and after the last,
    epsilon spent against the budget and, given a ``baseline`` run without DP, the gap."""
    run = data["run"]
    rounds = data["rounds"]
    numbers = sorted(int(r) for r in rounds)
    first = rounds.get("0", {}).get("eval", {})
    last_round, last = final_eval(data)
    base = final_eval(baseline)[1] if baseline else {}
    dp = run.get("config", {}).get("dp", False)
    header = (
        f"{'region':<8} {'eval before':>11} {'after r' + str(last_round):>9} {'change':>8}"
        + (f" {'no-DP':>8} {'DP gap':>8}" if baseline else "")
        + (f" {'epsilon':>15}" if dp else "")
        + f" {'bytes/round':>11}"
        + "  rounds"
    )
    lines = [
        f"fedciuic run {run.get('run_id', '?')}: {run['status']}, "
        f"{max(numbers, default=0)} round(s), regions {', '.join(run.get('regions', []))}, "
        + (
            f"DP on (target epsilon {run['config'].get('target-epsilon')}, delta "
            f"{run['config'].get('target-delta')}, secure-mode "
            f"{'on' if run['config'].get('secure-mode') else 'OFF'})"
            if dp
            else "DP off"
        )
        + f", codec {run.get('config', {}).get('codec', 'dense')}",
        header,
    ]
    for region in [*run.get("regions", []), "overall"]:
        before = first.get(region, {}).get("loss")
        after = last.get(region, {}).get("loss")
        change = after - before if before is not None and after is not None else None
        row = f"{region:<8} {fmt_number(before):>11} {fmt_number(after):>9} {fmt_number(change):>8}"
        if baseline:
            other = base.get(region, {}).get("loss")
            gap = after - other if after is not None and other is not None else None
            row += f" {fmt_number(other):>8} {fmt_number(gap):>8}"
        if dp:
            eps, budget = epsilon_spent(data, region)
            row += f" {fmt_epsilon(eps, budget) if region != 'overall' else '':>15}"
        sent = upload_bytes(data, region)
        row += f" {(f'{sum(sent) / len(sent):.0f}' if sent and region != 'overall' else ''):>11}"
        statuses = [
            rounds[str(r)]["train"][region]["status"]
            for r in numbers
            if region in rounds[str(r)].get("train", {})
        ]
        row += "  " + ", ".join(f"{s} x{statuses.count(s)}" for s in sorted(set(statuses)))
        lines.append(row.rstrip())
    lines += _policy_notes(data)
    lines += outcome_lines(data)
    if run.get("adapter"):
        lines.append(f"adapter: {run['adapter']}")
    lines.append(f"metrics: {Path(run.get('output_dir', '.')) / METRICS_FILE}")
    return "\n".join(lines)


def _policy_notes(data: dict[str, Any]) -> list[str]:
    """The policies applied, aggregates withheld, and why regions sent nothing usable."""
    run = data["run"]
    notes = []
    if "policies" in run:
        held = run["policies"]
        where = run.get("config", {}).get("aggregator-jurisdiction", "?")
        notes.append(
            f"policies (aggregator in {where}): "
            + (
                ", ".join(f"{j} {p['hash'][:12]}" for j, p in held.items())
                if held is not None
                else "OFF (enforce-policies = false: a lab baseline)"
            )
        )
    if run.get("status") == NO_AGGREGATE:
        return notes  # outcome_lines says why, per region
    seen = set()
    for number, rnd in sorted(data["rounds"].items(), key=lambda kv: int(kv[0])):
        aggregate = rnd.get("aggregate", {})
        if aggregate and not aggregate.get("published", True):
            reasons = "; ".join(aggregate.get("reasons", []))
            notes.append(f"round {number}: aggregate withheld, global adapter unchanged: {reasons}")
        for region, entry in rnd.get("train", {}).items():
            key = (region, entry.get("status"), entry.get("reason"))
            if entry.get("reason") and key not in seen:
                seen.add(key)
                notes.append(f"round {number}: {region} {entry['status']}: {entry['reason']}")
    return notes


def outcome_lines(data: Mapping[str, Any]) -> list[str]:
    """What a run that did not complete achieved, in words (nothing for a completed one)."""
    run = data["run"]
    status = run.get("status")
    if status == NO_AGGREGATE:
        total = run.get("config", {}).get("num-server-rounds", "?")
        return [
            f"NO AGGREGATE: none was published in {total} round(s), so nothing was trained: "
            "the global adapter is still the initial one and was not saved. Why:",
            *(f"  {line}" for line in run.get("reasons") or no_aggregate_reasons(data)),
        ]
    if status in (FAILED, INTERRUPTED):
        rounds = data["rounds"]
        ended = max((int(r) for r, v in rounds.items() if v.get("ended_at")), default=None)
        begun = max((int(r) for r in rounds), default=None)
        total = run.get("config", {}).get("num-server-rounds", "?")
        where = (
            "before round 0 ended"
            if ended is None
            else f"in round {begun} of {total}"
            if begun is not None and begun > ended
            else f"after round {ended} of {total}"
        )
        return [f"{status.upper()} {where}: {run.get('error') or 'no reason recorded'}"]
    if status == RUNNING:
        return ["RUNNING: the run has not finished (or its process died without a word)"]
    return []
