"""A release the aggregator never received is said where a person looks first: the
run's summary (the aggregator's view; the report reads the regions' own logs)."""

from __future__ import annotations

from pathlib import Path

from fedciuic.ops.outputs import summarize
from fedciuic.record.metrics import RunStatus
from fedciuic.record.recorder import RunRecorder, no_aggregate_reasons


def _timed_out(tmp_path: Path, dp: bool) -> RunRecorder:
    recorder = RunRecorder(
        tmp_path,
        {
            "run_id": 5,
            "regions": ["eu", "cn"],
            "config": {"num-server-rounds": 1, "dp": dp, "round-timeout": 600.0},
        },
        summary=summarize,
    )
    for region in ("eu", "cn"):
        recorder.record_train(
            1, region, {"status": "failed", "reason": "no reply within round-timeout (600s)"}
        )
    recorder.record_aggregate(1, {"published": False, "reasons": ["no region's update"]})
    return recorder


def test_a_round_no_region_answered_in_time_says_its_releases_may_be_spent_undelivered(
    tmp_path,
):
    recorder = _timed_out(tmp_path, dp=True)
    recorder.finish(
        RunStatus.NO_AGGREGATE, adapter=None, reasons=no_aggregate_reasons(recorder.data)
    )
    text = (tmp_path / "summary.txt").read_text()
    (line,) = [x for x in text.splitlines() if x.startswith("SPENT, NOT DELIVERED?")]
    assert "from cn in round 1, eu in round 1 within round-timeout (600s)" in line
    assert "fedciuic report" in line and "raise it" in line


def test_without_dp_nothing_is_spent_and_nothing_is_said(tmp_path):
    recorder = _timed_out(tmp_path, dp=False)
    assert "SPENT" not in summarize(recorder.data)
