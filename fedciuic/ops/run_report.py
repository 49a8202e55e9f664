"""A run's report for people: one self-contained HTML page with plots.

The plots are embedded so that the one file can be mailed to a regulator. Unless the
aggregator's own policy sets ``audit.redact_paths: false``, nothing written shows a
local path. Identical region curves are drawn over one another with nested hollow
markers, never moved apart (which would misstate the figures), and the caption says so.
"""

from __future__ import annotations

import base64
import html
import io
import json
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedciuic import __version__
from fedciuic.audit import (
    REGION_LOG,
    AuditError,
    Event,
    PartyLog,
    Section,
    build_report,
    html_sections,
    html_table,
    open_logs,
    redaction,
    verify_logs,
    write_sections,
)
from fedciuic.errors import EXIT_AUDIT, EXIT_NO_AGGREGATE, EXIT_OK, EXIT_UNFINISHED, ConfigError
from fedciuic.ops.outputs import (
    epsilon_spent,
    fmt_epsilon,
    fmt_number,
    loss_of,
    mean_upload,
    steps_per_round,
)
from fedciuic.policy import PolicyError, load_policy
from fedciuic.record import METRICS_FILE, OVERALL, RunMetrics, RunStatus, load_metrics
from fedciuic.wire import DECLINED, FAILED, REJECTED

if TYPE_CHECKING:
    from matplotlib.figure import Figure

REPORT_FILE = "report.html"
PLOTS_DIR = "report"
SERIES_FILE = "series.json"
PLOTS = ("eval_loss", "epsilon", "upload_bytes", "decisions")

#: How each audit event reads on the timeline.
AGGREGATOR_OUTCOMES: dict[str, str] = {
    Event.UPDATE_ACCEPTED: "accepted",
    Event.UPDATE_REJECTED: REJECTED,
    Event.REGION_DECLINED: DECLINED,
    Event.REPLY_FAILED: FAILED,
    Event.AGGREGATE_PUBLISHED: "published",
    Event.AGGREGATE_WITHHELD: "withheld",
}
MARKERS = {
    "accepted": ("o", "#2ca02c"),
    "published": ("*", "#1f77b4"),
    DECLINED: ("^", "#ff7f0e"),
    REJECTED: ("X", "#d62728"),
    FAILED: ("s", "#7f7f7f"),
    "withheld": ("D", "#9467bd"),
}
REFUSALS = (DECLINED, REJECTED, FAILED, "withheld")
#: Each region's marker and dash: regions stay apart in print, in grey and where curves meet.
REGION_STYLES: tuple[tuple[str, Any], ...] = (
    ("o", "-"),
    ("s", "--"),
    ("^", "-."),
    ("D", (0, (1, 1))),
    ("v", (0, (5, 1, 1, 1, 1, 1))),
    ("P", (0, (3, 1))),
    ("X", (0, (8, 2))),
    ("*", (0, (1, 2, 4, 2))),
)
#: Plots that draw one curve per region: where two curves coincide, the caption says so.
REGION_CURVES = ("eval_loss", "epsilon")


@dataclass
class ReportedDecision:
    round: int
    subject: str  # a region, or "aggregate"
    outcome: str
    reason: str
    logged_by: str


@dataclass
class RunReport:
    html: Path
    plots: dict[str, Path]
    series: Path
    verified: bool | None  # None: no public keys to verify the logs with
    problems: list[str] = field(default_factory=list)
    logs: list[PartyLog] = field(default_factory=list)  # read and verified once
    run_id: int = 0  # the audit logs' run id
    sections: list[Section] = field(default_factory=list)  # the compliance record
    notes: list[str] = field(default_factory=list)  # what a run that did not end left
    disagreements: list[str] = field(default_factory=list)  # where the logs contradict
    status: str = RunStatus.COMPLETED  # the run's, from its metrics.json
    compliance: Path | None = None  # compliance-report-run-<id>.md (and .html), if any

    @property
    def ok(self) -> bool:
        """Every log verified (or none could be) and the logs agree."""
        return not self.problems and not self.disagreements

    @property
    def exit_code(self) -> int:
        """The audit's verdict first, then the run's outcome (OK: completed, every log verified)."""
        if not self.ok or (self.logs and self.verified is None):
            return EXIT_AUDIT
        if self.status == RunStatus.NO_AGGREGATE:
            return EXIT_NO_AGGREGATE
        return EXIT_OK if self.status == RunStatus.COMPLETED else EXIT_UNFINISHED


# -- reading a run ------------------------------------------------------------------------


def load_run(run_dir: Path) -> RunMetrics:
    """The run folder's metrics.json, or one clear error naming the file and the fix."""
    path = run_dir / METRICS_FILE
    if not run_dir.is_dir():
        raise ConfigError([f"{run_dir}: no such folder; pass a run folder (OUTPUT_DIR/run-<id>/)"])
    if not path.exists():
        raise ConfigError(
            [
                f"{path}: not found; {run_dir} is not a run folder (a run writes "
                f"OUTPUT_DIR/run-<id>/{METRICS_FILE})"
            ]
        )
    return load_metrics(path)


def audit_log_paths(data: RunMetrics, given: Sequence[Path]) -> list[Path]:
    """The logs given, else the aggregator's and, in a simulation, each region's."""
    if given:
        missing = [p for p in given if not p.is_file()]
        if missing:
            raise ConfigError([f"--audit-log {p}: no such file" for p in missing])
        return list(given)
    run = data.run
    if not run.audit_log:
        raise ConfigError(
            [f"{METRICS_FILE}:run.audit_log: missing; pass --audit-log PATH (and the regions')"]
        )
    aggregator = Path(run.audit_log)
    if not aggregator.is_file():
        raise ConfigError(
            [
                f"{aggregator}: the aggregator's audit log is not there; pass --audit-log "
                "PATH (and the regions' logs)"
            ]
        )
    data_root = run.config.data_root
    regions = [Path(data_root) / r / ".fedciuic" / REGION_LOG for r in run.regions if data_root]
    return [aggregator, *(p for p in regions if p.is_file())]


def decisions(logs: Sequence[PartyLog], run_id: int) -> list[ReportedDecision]:
    """Every decision of the run: the aggregator's, plus declines only a region's own log
    holds (an evaluation declined, a reply that never arrived)."""
    found: list[ReportedDecision] = []
    aggregator_saw: set[tuple[int, str]] = set()
    for log in logs:
        if log.actor != "aggregator":
            continue
        for record in log.records:
            outcome = AGGREGATOR_OUTCOMES.get(str(record.get("event")))
            if outcome is None or record.get("run_id") != run_id:
                continue
            details = record.get("details") or {}
            subject = details.get("region", "aggregate")
            if outcome in ("published", "withheld"):
                subject = "aggregate"
            reason = details.get("reason") or "; ".join(details.get("reasons", []))
            if outcome == "published":
                reason = "from " + ", ".join(details.get("regions", []))
            found.append(
                ReportedDecision(int(record["round"]), subject, outcome, reason, "aggregator")
            )
            aggregator_saw.add((int(record["round"]), subject))
    for log in logs:
        if log.actor == "aggregator":
            continue
        seen: set[tuple[int, str]] = set()
        for record in log.records:
            if record.get("event") != Event.DECLINED or record.get("run_id") != run_id:
                continue
            key = (int(record["round"]), log.actor)
            if key in aggregator_saw or key in seen:
                continue
            seen.add(key)
            reason = (record.get("details") or {}).get("reason", "")
            found.append(ReportedDecision(key[0], log.actor, DECLINED, reason, log.actor))
    return sorted(found, key=lambda d: (d.round, d.subject == "aggregate", d.subject))


def series(data: RunMetrics, timeline: Sequence[ReportedDecision]) -> dict[str, Any]:
    """The numbers behind each plot (written to series.json; the tests read them)."""
    regions = list(data.run.regions)
    numbers = sorted(data.rounds)
    loss: dict[str, list[list[float]]] = {}
    for name in [*regions, OVERALL]:
        losses = [(n, loss_of(data.rounds[n].eval.get(name))) for n in numbers]
        if points := [[n, x] for n, x in losses if x is not None]:
            loss[name] = points
    epsilon: dict[str, list[list[float]]] = {}
    budget: dict[str, float] = {}
    sent: dict[str, list[list[int]]] = {}
    for region in regions:
        trained = data.trained(region)
        spent = [(n, t.epsilon, t.epsilon_budget) for n, t in trained if t.epsilon is not None]
        if spent:
            epsilon[region] = [[n, eps] for n, eps, _ in spent]
            budget[region] = float("nan") if spent[-1][2] is None else spent[-1][2]
        if uploads := [[n, t.sent_bytes] for n, t in trained if t.sent_bytes is not None]:
            sent[region] = uploads
    return {
        "run_id": data.run.run_id,
        "regions": regions,
        "rounds": numbers,
        "eval_loss": loss,
        "epsilon": epsilon,
        "epsilon_budget": budget,
        "upload_bytes": sent,
        "decisions": [vars(d) for d in timeline],
    }


# -- plots --------------------------------------------------------------------------------


def coincident(curves: Mapping[str, Any]) -> list[list[str]]:
    """The groups of regions whose curves are the same points (drawn, they would look like one)."""
    groups: dict[str, list[str]] = {}
    for name, points in curves.items():
        if name != OVERALL:
            groups.setdefault(json.dumps(points), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def _region_curves(ax: Any, curves: Mapping[str, Any], order: dict[str, int], suffix: str) -> None:
    """Each region's curve in its own colour, marker and dash; among identical curves,
    nested hollow markers, so that every region shows at every point."""
    same = {name: group for group in coincident(curves) for name in group}
    for region, points in curves.items():
        if region == OVERALL:
            continue
        xs, ys = zip(*points, strict=True)
        index = order.get(region, len(order))
        marker, dash = REGION_STYLES[index % len(REGION_STYLES)]
        label, group, style = region + suffix, same.get(region, []), {}
        if group:
            size = 5 + 3.5 * (len(group) - 1 - group.index(region))  # the first, the largest
            style = {"markersize": size, "markerfacecolor": "none", "markeredgewidth": 1.5}
            label += f" (identical to {', '.join(r for r in group if r != region)})"
        ax.plot(xs, ys, marker=marker, linestyle=dash, color=f"C{index % 10}", label=label, **style)


def figures(values: Mapping[str, Any]) -> dict[str, Figure]:
    """One matplotlib figure per plot, drawn off-screen."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    regions = list(values["regions"])
    order = {r: i for i, r in enumerate(regions)}
    colours = {r: f"C{i % 10}" for i, r in enumerate(regions)}
    rounds = list(values["rounds"])
    out: dict[str, Figure] = {}

    ax = Figure(figsize=(7, 3.6), dpi=100).add_subplot()
    _region_curves(ax, values["eval_loss"], order, "")
    if OVERALL in values["eval_loss"]:  # (after the regions, as series() lists it)
        xs, ys = zip(*values["eval_loss"][OVERALL], strict=True)
        ax.plot(xs, ys, "k--", label="overall (by examples)")
    ax.set(xlabel="round (0 = before training)", ylabel="eval loss", title="Eval loss")
    out["eval_loss"] = _finish(ax, rounds, values["eval_loss"])

    ax = Figure(figsize=(7, 3.6), dpi=100).add_subplot()
    _region_curves(ax, values["epsilon"], order, " spent")
    by_budget: dict[float, list[str]] = {}
    for region, budget in values["epsilon_budget"].items():
        by_budget.setdefault(budget, []).append(region)
    for budget, names in sorted(by_budget.items()):
        colour = colours.get(names[0]) if len(names) == 1 else "k"
        ax.axhline(budget, color=colour, ls=":", label=f"budget {budget:g} ({', '.join(names)})")
    ax.set_ylim(bottom=0)  # spent against the whole budget, not a zoom on the last rounds
    ax.set(xlabel="round", ylabel="epsilon (cumulative)", title="Privacy spent against budget")
    out["epsilon"] = _finish(ax, rounds, values["epsilon"], empty="DP off: no epsilon spent")

    ax = Figure(figsize=(7, 3.6), dpi=100).add_subplot()
    uploads = values["upload_bytes"]
    width = 0.8 / max(len(uploads), 1)
    for i, (region, points) in enumerate(uploads.items()):
        xs, ys = zip(*points, strict=True)
        shifted = [x - 0.4 + width * (i + 0.5) for x in xs]
        ax.bar(shifted, ys, width=width, color=colours.get(region), label=region)
    ax.set(xlabel="round", ylabel="bytes sent", title="Bytes each region sent per round")
    out["upload_bytes"] = _finish(ax, rounds, uploads, empty="no update was sent")

    ax = Figure(figsize=(7, 0.9 + 0.45 * (len(regions) + 1)), dpi=100).add_subplot()
    rows = [*regions, "aggregate"]
    for outcome, (marker, colour) in MARKERS.items():
        points = [
            (d["round"], rows.index(d["subject"]))
            for d in values["decisions"]
            if d["outcome"] == outcome and d["subject"] in rows
        ]
        if points:
            xs, ys = zip(*points, strict=True)
            ax.scatter(xs, ys, marker=marker, color=colour, s=90, label=outcome, zorder=3)
    ax.set_yticks(range(len(rows)), rows)
    ax.set_ylim(-0.6, len(rows) - 0.4)
    ax.invert_yaxis()
    ax.set(xlabel="round", title="Decisions (reasons in the table below)")
    out["decisions"] = _finish(ax, rounds, values["decisions"], empty="no decision recorded")
    return out


def _finish(ax: Any, rounds: Sequence[int], drawn: Any, empty: str = "") -> Figure:
    """Ticks, the legend and the grid; ``empty`` written across a plot with nothing drawn."""
    if rounds:
        ax.set_xticks(rounds)
    if not drawn and empty:
        ax.text(0.5, 0.5, empty, ha="center", va="center", transform=ax.transAxes)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize="small", frameon=False)
    ax.grid(True, alpha=0.3)
    fig: Figure = ax.figure
    fig.tight_layout()
    return fig


def curve_notes(values: Mapping[str, Any]) -> dict[str, str]:
    """For each plot whose regions' curves coincide, what its caption adds."""
    notes = {}
    for name in REGION_CURVES:
        if groups := coincident(values.get(name, {})):
            notes[name] = " ".join(
                f"{', '.join(group)}: identical curves, drawn over one another (each region "
                "its own hollow marker)."
                for group in groups
            )
    return notes


def _png(fig: Figure) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


# -- the page -----------------------------------------------------------------------------

CAPTIONS = {
    "eval_loss": "Eval loss of the global adapter on each region's held-out split, per round.",
    "epsilon": "Cumulative epsilon of each region's dataset (its privacy ledger) against "
    "its lifetime budget.",
    "upload_bytes": (
        "Bytes each region sent per round as they crossed the relay: its sealed, compressed "
        "update, or in a secure round its sealed metrics and its secure-sum messages (the "
        "masked vector among them)."
    ),
    "decisions": "Every decision of the run, from the audit logs: updates accepted, declined "
    "by their region, rejected by the aggregator, aggregates published or withheld.",
}

STYLE = (
    "body{font-family:system-ui,sans-serif;max-width:64rem;margin:2rem auto;padding:0 1rem;"
    "color:#222}table{border-collapse:collapse;margin:.5rem 0 1rem}"
    "td,th{border:1px solid #bbb;padding:.2rem .5rem;text-align:left;vertical-align:top}"
    "th{background:#f0f0f0}figure{margin:1rem 0}img{max-width:100%}"
    ".bad{background:#fde2e2;padding:.5rem}.ok{background:#e3f4e3;padding:.5rem}"
    ".declined,.withheld{color:#b35900}.rejected,.failed{color:#b00020}"
)


def _region_rows(data: RunMetrics, timeline: Sequence[ReportedDecision]) -> list[list[str]]:
    first = data.first_eval()
    _, last = data.final_eval()
    rows = []
    for region in data.run.regions:
        mine = [d for d in timeline if d.subject == region]
        counts = ", ".join(f"{o} x{n}" for o in MARKERS if (n := sum(d.outcome == o for d in mine)))
        rows.append(
            [
                region,
                fmt_number(loss_of(first.get(region))),
                fmt_number(loss_of(last.get(region))),
                fmt_epsilon(*epsilon_spent(data, region)),
                mean_upload(data, region) or "-",
                steps_per_round(data, region),
                counts or "-",
            ]
        )
    return rows


def render(
    data: RunMetrics,
    timeline: Sequence[ReportedDecision],
    pngs: Mapping[str, bytes],
    sections: Sequence[Section],
    problems: Sequence[str],
    verified: bool | None,
    notes: Sequence[str] = (),
    redact: Callable[[str], str] | None = None,
) -> str:
    """The HTML page. ``redact`` takes local paths out of the run's own texts; the caller
    redacts what it passes."""
    e = html.escape
    run, config = data.run, data.run.config
    shown = redact or (lambda text: text)
    extra = curve_notes(series(data, timeline))
    last_round, _ = data.final_eval()
    title = f"fedciuic run report: run {run.run_id}"
    status = str(run.status)
    out = [
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{e(title)}</title><style>{STYLE}</style></head><body>",
        f"<h1>{e(title)}</h1>",
        f'<p class="{"ok" if status == RunStatus.COMPLETED else "bad"}">Status: <b>{e(status)}</b>'
        + (f": {e(shown(run.error))}" if run.error else "")
        + f" &middot; regions {e(', '.join(run.regions))} &middot; "
        f"{e(str(config.num_server_rounds))} round(s) &middot; aggregator in "
        f"{e(str(config.aggregator_jurisdiction))} &middot; "
        + e(config.dp_words)
        + f" &middot; codec {e(str(config.codec))}</p>",
    ]
    out += [f'<p class="bad">{e(note)}</p>' for note in notes]
    if verified is None:
        out.append(
            '<p class="bad">The audit logs were not verified: no public keys. '
            "Pass --keys DIR to check them.</p>"
        )
    elif not verified:
        out.append(
            '<p class="bad"><b>An audit log FAILED verification</b>: do not rely on '
            "this report. " + e(" ".join(problems)) + "</p>"
        )
    out += [
        "<h2>Regions</h2>",
        html_table(
            (
                "region",
                "eval loss before",
                f"after round {last_round}",
                "epsilon",
                "bytes per round",
                "local steps per round",
                "decisions",
            ),
            _region_rows(data, timeline),
        ),
        "<h2>Plots</h2>",
    ]
    for name in PLOTS:
        data_uri = base64.b64encode(pngs[name]).decode("ascii")
        caption = f"{CAPTIONS[name]} {extra[name]}" if name in extra else CAPTIONS[name]
        out.append(
            f'<figure id="{name}"><img alt="{e(caption)}" '
            f'src="data:image/png;base64,{data_uri}">'
            f"<figcaption>{e(caption)}</figcaption></figure>"
        )
    refused = sum(d.outcome in REFUSALS for d in timeline)
    out += [
        f"<h2>Decisions</h2><p>{len(timeline)} decision(s), {refused} refusal(s).</p>",
        html_table(
            ("round", "about", "outcome", "reasons", "logged by"),
            [[str(d.round), d.subject, d.outcome, d.reason or "-", d.logged_by] for d in timeline],
            [d.outcome for d in timeline],
        ),
        "<h2>Compliance record (from the audit logs)</h2>",
        *html_sections(sections, "h3"),
        f"<p><small>Written by fedciuic {e(__version__)} at "
        f"{e(time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime()))} from "
        f"{e(shown(run.output_dir or ''))}.</small></p></body></html>",
    ]
    return "\n".join(out) + "\n"


#: An absolute path in free text that no known folder accounts for: its folders are
#: replaced, its last part kept. Not one that opens a JSON string (a record's details,
#: which its writer redacted by its own policy; base64 may start with a slash).
_ABSOLUTE = re.compile(r"(?<![\w.~<>/:+=\"-])/(?:[^\s/\"'<>|:;,()\[\]=]+/)+(?=[^\s/\"'<>|])")


def redacts_paths(data: RunMetrics) -> bool:
    """Whether the report must leave local paths out: yes, unless the aggregator's own
    policy, as the run held it, sets ``audit.redact_paths: false``."""
    jurisdiction = data.run.config.aggregator_jurisdiction
    held = (data.run.policies or {}).get(jurisdiction) if jurisdiction else None
    if held is None:
        return True
    try:
        loaded = load_policy(Path(held.file))
    except PolicyError:
        return True
    return loaded.hash != held.hash or loaded.policy.audit.redact_paths


def path_redactor(
    data: RunMetrics, logs: Sequence[PartyLog], keys_dir: Path | None
) -> Callable[[str], str] | None:
    """What takes local paths out of the report's texts (None: the policy lets them
    show): known folders by name, files by name, other absolute paths to their last part."""
    if not redacts_paths(data):
        return None
    run = data.run
    known = [(str(log.path), log.path.name) for log in logs]
    known += [(held.file, Path(held.file).name) for held in (run.policies or {}).values()]
    known += [
        (str(folder), label)
        for folder, label in (
            (run.output_dir, "<output-dir>"),
            (run.config.data_root, "<data-root>"),
            (keys_dir or run.config.keys_dir, "<keys-dir>"),
        )
        if folder
    ]
    patterns = redaction(known)

    def redact(text: str) -> str:
        for pattern, label in patterns:
            text = pattern.sub(label, text)
        return _ABSOLUTE.sub("<path>/", text)

    return redact


def write_run_report(
    run_dir: Path,
    *,
    audit_logs: Sequence[Path] = (),
    keys_dir: Path | None = None,
    out: Path | None = None,
) -> RunReport:
    """Read the run and its audit logs, verify them when keys are at hand, write the page.
    A run that did not end gets a page of what its logs show: a missing log or unsigned
    tail is a note, not a failure; a record that fails its hash or signature is a problem
    in any run."""
    data = load_run(run_dir)
    status = data.run.status
    ended = status in (RunStatus.COMPLETED, RunStatus.NO_AGGREGATE)
    notes: list[str] = []
    if not ended:
        notes.append(
            f"This run did not end ({status}"
            + (f": {data.run.error}" if data.run.error else "")
            + "): the report shows what its metrics and audit logs hold up to where it stopped."
        )
    resumed = data.run.resumed_from  # the audit logs' run id is the first run's
    run_id = resumed.federation_run if resumed else data.run.run_id
    try:
        paths = audit_log_paths(data, audit_logs)
        logs = open_logs(paths, {})
    except (ConfigError, AuditError) as err:
        # A log that is named but gone is an error in any run; no log named (the run
        # failed before opening one) or an empty one is what a run that did not end left.
        if ended or audit_logs or (data.run.audit_log and isinstance(err, ConfigError)):
            if isinstance(err, ConfigError):
                raise
            raise ConfigError([str(err)]) from None
        paths, logs = [], []
        reason = "; ".join(err.problems) if isinstance(err, ConfigError) else str(err)
        notes.append(f"No audit log to read ({reason}): the run stopped before it wrote one.")
    configured = data.run.config.keys_dir
    if keys_dir is None and configured and Path(configured).is_dir():
        keys_dir = Path(configured)
    if logs:
        verify_logs(logs, keys_dir)
    problems = []
    for log in logs:
        if log.verdict is None or log.verdict.ok:
            continue
        if ended or log.verdict.problem:
            problems.append(log.verdict.explain())
        else:  # a tail no checkpoint covers yet: where the writer stopped
            notes.append(
                f"{log.path}: verified up to its last signed checkpoint (seq "
                f"{log.verdict.verified_through}); what follows was written before the run "
                "stopped and no signature covers it: it is listed as unverified."
            )
    verified = None if keys_dir is None or not logs else not problems
    redact = path_redactor(data, logs, keys_dir) or (lambda text: text)
    sections: list[Section] = []
    disagreements: list[str] = []
    if logs:
        try:
            built = build_report(logs, run_id).redacted(redact)
            sections, disagreements = built.sections, built.disagreements
        except AuditError as err:
            if ended:
                raise ConfigError([f"{paths[0]}: {err}; pass the audit log of this run"]) from None
            notes.append(f"The audit logs hold no record of run {run_id} ({err}).")
    timeline = [replace(d, reason=redact(d.reason)) for d in decisions(logs, run_id)]
    values = series(data, timeline)
    pngs = {name: _png(fig) for name, fig in figures(values).items()}
    page = out or run_dir / REPORT_FILE
    plots_dir = page.parent / PLOTS_DIR
    plots_dir.mkdir(parents=True, exist_ok=True)
    plots = {name: plots_dir / f"{name}.png" for name in pngs}
    for name, png in pngs.items():
        plots[name].write_bytes(png)
    series_path = plots_dir / SERIES_FILE
    series_path.write_text(json.dumps(values, indent=2), encoding="utf-8")
    # The compliance report, as `fedciuic simulate` writes it: next to the page.
    compliance = write_sections(run_id, sections, page.parent)[0] if sections else None
    kept = [s for s in sections if s.title != "Refusals"]  # the Decisions table has them all
    shown = [redact(p) for p in problems] + [f"the logs disagree: {d}" for d in disagreements]
    page.write_text(
        render(data, timeline, pngs, kept, shown, verified, [redact(n) for n in notes], redact),
        encoding="utf-8",
    )
    return RunReport(
        page,
        plots,
        series_path,
        verified,
        problems,
        logs,
        run_id,
        list(sections),
        notes,
        disagreements,
        status,
        compliance,
    )
