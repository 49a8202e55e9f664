"""The progress display of `fedciuic simulate`: plain lines in a log, a live line on a terminal."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

from fedciuic.ops.progress import (
    CLEAR_LINE,
    RunProgress,
    current_phase,
    describe_run,
    format_round,
)
from fedciuic.record.metrics import AggregateEntry, RunHeader, RunMetrics, RunSettings


def metrics(ended: int, *, train_of_next: bool = False) -> dict[str, Any]:
    """A run of eu and cn over 2 rounds in which cn declines, ended up to round ``ended``."""
    rounds: dict[str, Any] = {}
    for number in range(ended + 1):
        rnd: dict[str, Any] = {
            "eval": {
                "eu": {"loss": 5.0 - number / 10},
                "cn": {"status": "declined", "reason": "CN's policy allows CN, EU"},
                "overall": {"loss": 5.0 - number / 10},
            },
            "ended_at": 1000.0 + 10 * number,
        }
        if number:
            rnd["train"] = {
                "eu": {
                    "status": "trained",
                    "loss": 4.5,
                    "epsilon": 4.0 * number,
                    "epsilon_budget": 8.0,
                    "upload_bytes": 2271,
                },
                "cn": {
                    "status": "declined",
                    "reason": "aggregator in US, CN's policy allows CN, EU",
                },
            }
            rnd["aggregate"] = {"published": True, "regions": ["eu"]}
        rounds[str(number)] = rnd
    if train_of_next:
        rounds[str(ended + 1)] = {"train": {"eu": {"status": "trained"}}, "eval": {}}
    return {
        "run": {
            "run_id": 7,
            "status": "completed",
            "regions": ["eu", "cn"],
            "started": "2026-11-21T10:00:00Z",
            "output_dir": "/runs/run-7",
            "config": {
                "num-server-rounds": 2,
                "dp": True,
                "target-epsilon": 8.0,
                "target-delta": 1e-5,
                "codec": "topk-int8:0.015",
                "aggregator-jurisdiction": "US",
            },
        },
        "rounds": rounds,
    }


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_each_finished_round_is_printed_once_as_plain_lines():
    out = io.StringIO()
    progress = RunProgress(out, Path("/nowhere"), live=False, clock=Clock())
    for ended in (0, 0, 1, 1, 2):
        progress.update(RunMetrics.model_validate(metrics(ended)))
    text = out.getvalue()
    assert "\r" not in text and "\033" not in text  # readable in a plain log
    assert text.count("regions eu, cn; 2 round(s); DP on") == 1
    assert text.count("round 0/2 initial adapter") == 1
    assert text.count("round 1/2 (10.0 s): aggregate published from eu") == 1
    assert text.count("round 2/2 (10.0 s)") == 1
    eu_row = next(line for line in text.splitlines() if line.startswith("  eu ") and "8.00" in line)
    assert "trained" in eu_row and "8.00 of 8" in eu_row and "2271 B" in eu_row
    assert "  cn       declined" in text and "CN's policy allows CN, EU" in text


def test_a_withheld_aggregate_says_so_with_its_reasons():
    data = RunMetrics.model_validate(metrics(1))
    data.rounds[1].aggregate = AggregateEntry(published=False, reasons=["needs 2 regions"])
    (first, *_) = format_round(data, 1, 2)
    assert first == "round 1/2 (10.0 s): aggregate WITHHELD: needs 2 regions"


def test_the_phase_follows_what_is_recorded():
    started = {"run_id": 7, "status": "running", "config": {"num-server-rounds": 2}}
    assert current_phase(RunMetrics(run=RunHeader.model_validate(started))).startswith(
        "round 0: evaluating"
    )
    phase = current_phase(RunMetrics.model_validate(metrics(0)))
    assert phase == "round 1/2: training in every region"
    phase = current_phase(RunMetrics.model_validate(metrics(0, train_of_next=True)))
    assert phase.startswith("round 1/2: evaluating")


def test_a_plain_log_gets_a_heartbeat_not_a_redrawn_line(tmp_path):
    out, clock = io.StringIO(), Clock()
    progress = RunProgress(out, tmp_path, live=False, heartbeat=30.0, clock=clock)
    log = tmp_path / "flwr-run.log"
    log.write_text("starting\n")
    for clock.now in (0.0, 10.0, 31.0, 45.0, 62.0):
        progress.poll(log)
    lines = out.getvalue().splitlines()
    assert lines == ["starting the run ... 31 s so far", "starting the run ... 62 s so far"]


def test_a_terminal_gets_one_live_line_redrawn_in_place(tmp_path):
    out, clock = io.StringIO(), Clock()
    progress = RunProgress(out, tmp_path, live=True, clock=clock)
    log = tmp_path / "flwr-run.log"
    log.write_text("Successfully started run 7\n")
    for clock.now in (1.0, 2.0):
        progress.poll(log)
    (tmp_path / "run-7").mkdir()
    (tmp_path / "run-7" / "metrics.json").write_text(json.dumps(metrics(0)))
    clock.now = 3.0
    progress.poll(log)
    text = out.getvalue()
    assert text.startswith("run 7 started\n")
    assert f"{CLEAR_LINE}waiting for regions ... 1 s" in text
    assert f"{CLEAR_LINE}round 1/2: training in every region ... 0 s" in text
    # A permanent line first clears the live line, so the two never share a row.
    assert f"{CLEAR_LINE}regions eu, cn; 2 round(s)" in text
    progress.finish()
    assert out.getvalue().endswith(f"{CLEAR_LINE}run 7 completed after 3 s\n")


def test_the_last_line_says_plainly_when_nothing_was_published_or_the_run_was_stopped(tmp_path):
    for status, said in (
        ("no-aggregate", "run 7 ended with NO aggregate published (nothing trained) after 0 s"),
        ("running", "run 7 stopped before it ended after 0 s"),
        ("interrupted", "run 7 interrupted after 0 s"),
    ):
        out = io.StringIO()
        progress = RunProgress(out, tmp_path, live=False, clock=Clock())
        log = tmp_path / "flwr-run.log"
        log.write_text("Successfully started run 7\n")
        data = metrics(0)
        data["run"]["status"] = status
        (tmp_path / "run-7").mkdir(exist_ok=True)
        (tmp_path / "run-7" / "metrics.json").write_text(json.dumps(data))
        progress.poll(log)
        progress.finish()
        assert out.getvalue().endswith(said + "\n"), out.getvalue()


def test_the_runs_dp_is_worded_alike_in_every_summary():
    settings = {"dp": True, "target-epsilon": 4.0, "target-delta": 1e-5, "privacy-unit": "user"}
    on = RunSettings.model_validate({**settings, "secure-mode": False})
    assert on.dp_words == "DP on (target epsilon 4.0 per user, delta 1e-05, secure-mode OFF)"
    unrecorded = RunSettings.model_validate(settings)
    assert unrecorded.dp_words == "DP on (target epsilon 4.0 per user, delta 1e-05)"
    assert RunSettings.model_validate({"dp": False}).dp_words == "DP off"
    run = RunHeader.model_validate({"run_id": 1, "status": "running", "config": {**settings}})
    assert f"; {run.config.dp_words};" in describe_run(run)
