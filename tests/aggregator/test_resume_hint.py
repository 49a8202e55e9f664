"""An interrupted run's summary says how to resume it: its finished rounds are
checkpointed, and the regions spent their epsilon on them."""

from __future__ import annotations

from fedciuic.aggregator.checkpoint import CHECKPOINT_DIR, LATEST
from fedciuic.ops.outputs import summarize
from fedciuic.record.metrics import RunStatus
from fedciuic.record.recorder import RunRecorder


def _interrupted_after_round_one(tmp_path) -> RunRecorder:
    recorder = RunRecorder(
        tmp_path,
        {
            "run_id": 3,
            "regions": ["eu"],
            "config": {"num-server-rounds": 3, "dp": True},
            "output_dir": str(tmp_path),
        },
        summary=summarize,
    )
    recorder.record_train(1, "eu", {"status": "trained", "loss": 4.0})
    recorder.record_end(1)
    recorder.record_train(2, "eu", {"status": "trained", "loss": 3.9})
    return recorder


def test_an_interrupted_run_with_a_checkpoint_says_how_to_resume(tmp_path):
    recorder = _interrupted_after_round_one(tmp_path)
    (tmp_path / CHECKPOINT_DIR).mkdir()
    (tmp_path / CHECKPOINT_DIR / LATEST).write_text("round-0001\n")
    recorder.finish(RunStatus.INTERRUPTED, error="stopped by SIGTERM")
    text = summarize(recorder.data)
    assert "INTERRUPTED in round 2 of 3: stopped by SIGTERM" in text
    hint = f"--run-config \"resume-from='{tmp_path}'\""
    assert f"Resume it from round 2: the same run config with {hint}" in text


def test_without_a_checkpoint_there_is_nothing_to_resume_and_nothing_said(tmp_path):
    recorder = _interrupted_after_round_one(tmp_path)
    recorder.finish(RunStatus.INTERRUPTED, error="stopped by SIGTERM")
    assert "Resume" not in summarize(recorder.data)
