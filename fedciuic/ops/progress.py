"""What a run is doing, round by round, for a person watching ``fedciuic simulate``.

It follows the run's ``metrics.json`` rather than Flower's log, so it shows the same
figures as the summary. Finished rounds are plain lines, so a log file reads the same
as a terminal; only a terminal also gets a live status line, redrawn in place.
"""

from __future__ import annotations

import calendar
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

from fedciuic.ops.outputs import fmt_epsilon, fmt_number, loss_of
from fedciuic.processes import STARTED_RUN
from fedciuic.record import (
    METRICS_FILE,
    OVERALL,
    MetricsError,
    RunHeader,
    RunMetrics,
    RunStatus,
    TrainEntry,
    load_metrics,
)

CLEAR_LINE = "\r\033[K"


#: How the last line says a run's status (metrics.json's ``run.status``).
ENDINGS: dict[str, str] = {
    RunStatus.NO_AGGREGATE: "ended with NO aggregate published (nothing trained)",
    RunStatus.RUNNING: "stopped before it ended",
}


class RunProgress:
    """Prints each finished round of one run as it happens."""

    def __init__(
        self,
        stream: IO[str],
        output_dir: Path,
        *,
        label: str = "",
        live: bool | None = None,
        heartbeat: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stream = stream
        self.output_dir = output_dir
        self.label = f"{label}: " if label else ""
        if live is None:  # a live line only where it can be redrawn: a terminal, not dumb
            isatty = getattr(stream, "isatty", None)
            live = bool(isatty and isatty()) and os.environ.get("TERM", "") != "dumb"
        self.live = live
        self.heartbeat = heartbeat
        self.clock = clock
        self.run_id: int | None = None
        self.started = clock()
        self.printed: set[int] = set()
        self.header_done = False
        self.phase = self.shown_phase = ""
        self.phase_since = self.last_note = self.started
        self.live_shown = False
        self.log_path: Path | None = None
        self.metrics: RunMetrics | None = None
        self.metrics_stamp: tuple[int, int] | None = None

    # -- following a run ------------------------------------------------------------

    def poll(self, log_path: Path) -> None:
        """Print what is new, then what the run waits for (redrawn, or now and then in a log)."""
        self._read(log_path)
        self._status()

    def _read(self, log_path: Path) -> None:
        """The run id from ``flwr run``'s log, then metrics.json whenever it changed (the
        ServerApp replaces it atomically)."""
        self.log_path = log_path
        if self.run_id is None:
            try:
                match = STARTED_RUN.search(log_path.read_text(encoding="utf-8", errors="replace"))
            except OSError:
                match = None
            if match:
                self.run_id = int(match.group(1))
                self._line(f"{self.label}run {self.run_id} started")
        if self.run_id is None:
            return
        path = self.output_dir / f"run-{self.run_id}" / METRICS_FILE
        try:
            stat = path.stat()
            stamp = (stat.st_mtime_ns, stat.st_size)
            if stamp == self.metrics_stamp:
                return
            self.metrics = load_metrics(path)
        except (OSError, MetricsError):
            return
        self.metrics_stamp = stamp
        self.update(self.metrics)

    def update(self, data: RunMetrics) -> None:
        """Print the header once and every round that has ended and is not printed yet."""
        if not self.header_done:
            self.header_done = True
            self._line(self.label + describe_run(data.run))
        total = data.run.config.num_server_rounds or 0
        for number, rnd in sorted(data.rounds.items()):
            if number in self.printed or rnd.ended_at is None:
                continue
            self.printed.add(number)
            first, *rest = format_round(data, number, total)
            self._line(self.label + first, *rest)
        self.phase = current_phase(data)

    def finish(self) -> None:
        """The run is over: print what is left and clear the live line."""
        if self.log_path is not None:
            self._read(self.log_path)
        self._clear()
        elapsed = self.clock() - self.started
        if self.run_id is not None:
            status = self.metrics.run.status if self.metrics is not None else "ended"
            said = ENDINGS.get(status, status)
            self._line(f"{self.label}run {self.run_id} {said} after {elapsed:.0f} s")

    # -- output ---------------------------------------------------------------------

    def _status(self) -> None:
        now = self.clock()
        phase = self.phase or ("starting the run" if self.run_id is None else "waiting for regions")
        if phase != self.shown_phase:
            self.shown_phase = phase
            self.phase_since = self.last_note = now
        waited = now - self.phase_since
        if self.live:
            # One row only: a wrapped line could not be redrawn in place.
            width = shutil.get_terminal_size().columns - 1
            self.stream.write(f"{CLEAR_LINE}{self.label}{phase} ... {waited:.0f} s"[: width + 4])
            self.stream.flush()
            self.live_shown = True
        elif now - self.last_note >= self.heartbeat:
            # In a plain log, a line now and then shows the run is alive.
            self.last_note = now
            self._line(f"{self.label}{phase} ... {waited:.0f} s so far")

    def _clear(self) -> None:
        if self.live_shown:
            self.stream.write(CLEAR_LINE)
            self.live_shown = False

    def _line(self, *lines: str) -> None:
        self._clear()
        self.stream.write("".join(f"{line}\n" for line in lines))
        self.stream.flush()


# -- formatting -------------------------------------------------------------------------


def describe_run(run: RunHeader) -> str:
    config = run.config
    return (
        f"regions {', '.join(run.regions)}; {config.num_server_rounds} "
        f"round(s); {config.dp_words}; codec {config.codec}; aggregator in "
        f"{config.aggregator_jurisdiction}; writing {run.output_dir}"
    )


def current_phase(data: RunMetrics) -> str:
    """What the run waits for now, from which steps of which round are recorded."""
    rounds = data.rounds
    total = data.run.config.num_server_rounds or "?"
    ended = [n for n, rnd in rounds.items() if rnd.ended_at is not None]
    if not ended:
        return "round 0: evaluating the initial adapter in every region"
    number = max(ended) + 1
    if number in rounds and rounds[number].train:
        return f"round {number}/{total}: evaluating the new adapter in every region"
    return f"round {number}/{total}: training in every region"


def _seconds(data: RunMetrics, number: int) -> float | None:
    end = data.rounds[number].ended_at
    begin: float | None = None
    if number == 0:
        started = data.run.started
        begin = calendar.timegm(time.strptime(started, "%Y-%m-%dT%H:%M:%SZ")) if started else None
    elif (previous := data.rounds.get(number - 1)) is not None:
        begin = previous.ended_at
    return end - begin if end is not None and begin is not None else None


def format_round(data: RunMetrics, number: int, total: int) -> list[str]:
    """A finished round as plain lines: one per region, then the overall eval loss."""
    rnd = data.rounds[number]
    evals = rnd.eval
    seconds = _seconds(data, number)
    took = f" ({seconds:.1f} s)" if seconds is not None else ""
    regions = [*data.run.regions, *sorted(set(rnd.train) - set(data.run.regions))]

    def eval_loss(region: str) -> str:
        return fmt_number(loss_of(evals.get(region)))

    if number == 0:
        losses = "  ".join(f"{r} {eval_loss(r)}" for r in [*regions, OVERALL])
        return [f"round 0/{total} initial adapter{took}: eval loss  {losses}"]
    aggregate = rnd.aggregate
    if aggregate is None:
        outcome = "no update to aggregate, the global adapter stays as it was"
    elif aggregate.published:
        order = {region: i for i, region in enumerate(regions)}
        included = sorted(aggregate.regions, key=lambda r: order.get(r, len(order)))
        outcome = "aggregate published from " + ", ".join(included)
    else:
        outcome = "aggregate WITHHELD: " + "; ".join(aggregate.reasons)
    lines = [
        f"round {number}/{total}{took}: {outcome}",
        f"  {'region':<8} {'status':<9} {'train loss':>10} {'eval loss':>9}  "
        f"{'epsilon':<22} {'upload':>8}",
    ]
    for region in regions:
        train = rnd.train.get(region) or TrainEntry(status="no reply")
        evaluated = evals.get(region)
        epsilon = fmt_epsilon(train.epsilon, train.epsilon_budget, train.unit)
        upload = f"{train.sent_bytes} B" if train.sent_bytes is not None else "-"
        row = (
            f"  {region:<8} {train.status:<9} {fmt_number(train.loss):>10} "
            f"{eval_loss(region):>9}  {epsilon:<22} {upload:>8}"
        )
        reason = train.reason or (evaluated.reason if evaluated else None)
        lines.append(row + (f"  {reason}" if reason else ""))
    lines.append(f"  {OVERALL:<8} {'':<9} {'':>10} {eval_loss(OVERALL):>9}")
    return lines
