"""The typed metrics.json: what the recorder writes reads back as the same model, the
file keeps its shape, and anything else is refused with the file named."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from fedciuic.errors import FedciuicError
from fedciuic.policy.rules import Decision
from fedciuic.record.metrics import MetricsError, RunMetrics, RunStatus, load_metrics
from fedciuic.record.recorder import METRICS_FILE, RunRecorder, no_aggregate_reasons
from fedciuic.wire import PrivacyFigures, TrainMetrics


def _trained_entry() -> dict[str, object]:
    """A trained reply's entry with every key the aggregator writes (Judged.entry)."""
    privacy = PrivacyFigures(
        unit="user",
        epsilon=2.5,
        epsilon_budget=8.0,
        delta=1e-5,
        noise_multiplier=1.1,
        sample_rate=0.1,
        secure_mode=0,
        max_grad_norm=1.0,
    )
    figures = TrainMetrics(
        num_examples=10, train_loss=1.5, steps=3, update_bytes=64, privacy=privacy
    )
    return {
        "status": "trained",
        "reason": "",
        "norm": 0.5,
        "clipped": False,
        "loss": figures.train_loss,
        "num_examples": figures.num_examples,
        "steps": figures.steps,
        "data_fingerprint": "fp-eu",
        "upload_bytes": 900,
        "update_bytes": figures.update_bytes,
        **figures.record(),
    }


def _recorded(tmp_path):
    recorder = RunRecorder(
        tmp_path,
        {
            "run_id": 7,
            "regions": ["eu", "cn"],
            "config": {"num-server-rounds": 1, "dp": True, "keys-dir": None, "seed": 3},
            "output_dir": str(tmp_path),
        },
    )
    recorder.data.run.policies = None  # policies off: recorded as null, not left out
    recorder.record_eval(0, "eu", {"status": "evaluated", "loss": 5.0, "perplexity": 148.4})
    recorder.record_eval(0, "overall", {"loss": 5.0, "perplexity": 148.4, "num_examples": 10})
    recorder.record_end(0)
    recorder.record_train(1, "eu", _trained_entry())
    recorder.record_train(1, "cn", {"status": "declined", "reason": "budget spent"})
    recorder.record_train(1, "eu", {"status": "rejected", "reason": "a replay"})
    recorder.record_train(
        1, "node-3", {"status": "rejected", "reason": "bad", "claimed_region": "cn"}
    )
    decision = Decision("aggregator", "aggregate", "reject", ("needs 2 regions",), "ab" * 32)
    recorder.record_decision(1, decision.to_record())
    recorder.record_aggregate(1, {"published": False, "regions": ["eu"], "reasons": ["no"]})
    recorder.record_end(1)
    recorder.finish(
        RunStatus.NO_AGGREGATE, adapter=None, reasons=no_aggregate_reasons(recorder.data)
    )
    return recorder


def test_a_recorded_run_reads_back_as_the_same_model_and_the_same_file(tmp_path):
    recorder = _recorded(tmp_path)
    path = tmp_path / METRICS_FILE
    raw = json.loads(path.read_text())
    loaded = load_metrics(path)
    assert loaded == recorder.data
    assert loaded.dump() == raw
    # The file's shape: string round keys, the status string, null where the writer
    # set None, and no key the writer did not set.
    assert sorted(raw["rounds"]) == ["0", "1"]
    assert raw["run"]["status"] == "no-aggregate" and raw["run"]["adapter"] is None
    assert raw["run"]["policies"] is None and loaded.run.policies_recorded
    assert raw["run"]["config"] == {"num-server-rounds": 1, "dp": True, "keys-dir": None, "seed": 3}
    assert raw["rounds"]["1"]["train"]["cn"] == {"status": "declined", "reason": "budget spent"}
    assert raw["rounds"]["1"]["train"]["eu"] == _trained_entry()
    assert raw["rounds"]["1"]["train"]["eu"]["unit"] == "user"  # what its epsilon is per
    assert raw["rounds"]["0"]["eval"]["overall"] == {
        "loss": 5.0,
        "perplexity": 148.4,
        "num_examples": 10,
    }
    assert "aggregate" not in raw["rounds"]["0"] and "duplicates" not in raw["rounds"]["0"]
    assert raw["rounds"]["1"]["duplicates"] == [
        {"region": "eu", "status": "rejected", "reason": "a replay"}
    ]
    assert raw["rounds"]["1"]["decisions"][0]["reasons"] == ["needs 2 regions"]
    # ...and the model, by attribute.
    assert loaded.rounds[1].train["eu"].epsilon == 2.5
    assert loaded.rounds[1].train["node-3"].claimed_region == "cn"
    assert loaded.rounds[1].aggregate is not None and not loaded.rounds[1].aggregate.published
    assert loaded.run.config.num_server_rounds == 1 and loaded.run.config.dp
    assert loaded.run.status == RunStatus.NO_AGGREGATE
    assert loaded.run.reasons == no_aggregate_reasons(loaded)


def test_the_status_strings_on_disk_are_unchanged():
    assert [
        RunStatus.RUNNING,
        RunStatus.COMPLETED,
        RunStatus.NO_AGGREGATE,
        RunStatus.INTERRUPTED,
    ] == [
        "running",
        "completed",
        "no-aggregate",
        "interrupted",
    ]
    assert json.dumps(RunStatus.FAILED) == '"failed"'


def test_a_run_without_policies_recorded_leaves_them_out(tmp_path):
    recorder = RunRecorder(tmp_path, {"run_id": 1})
    raw = json.loads((tmp_path / METRICS_FILE).read_text())
    assert raw["run"].keys() == {"run_id", "status", "started"}
    assert raw["rounds"] == {}
    assert not recorder.data.run.policies_recorded


def test_the_recorder_refuses_an_entry_the_model_does_not_name(tmp_path):
    recorder = RunRecorder(tmp_path, {"run_id": 1})
    with pytest.raises(ValidationError, match="bogus"):
        recorder.record_train(1, "eu", {"status": "trained", "bogus": 1})
    with pytest.raises(ValidationError, match="loss"):
        recorder.record_eval(1, "eu", {"status": "evaluated", "loss": "low"})
    with pytest.raises(ValidationError, match="published"):
        recorder.record_aggregate(1, {"regions": ["eu"]})
    with pytest.raises(ValidationError, match="no_such_field"):
        recorder.finish(RunStatus.COMPLETED, no_such_field=1)


@pytest.mark.parametrize(
    ("content", "said"),
    [
        (None, "not found"),
        ('{"run": {"run_id": 1}, "rounds": {', "not valid JSON"),
        ("[]", "Input should be a valid dictionary"),
        ('{"rounds": {}}', "run: Field required"),
        ('{"run": {"run_id": 1, "status": "paused"}}', "run.status: Input should be"),
        (
            '{"run": {"run_id": 1, "status": "running"}, '
            '"rounds": {"1": {"train": {"eu": {"status": "trained", "bogus": 1}}}}}',
            "rounds.1.train.eu.bogus: Extra inputs are not permitted",
        ),
        (
            '{"run": {"run_id": 1, "status": "running"}, '
            '"rounds": {"1": {"train": {"eu": {"reason": "no status"}}}}}',
            "rounds.1.train.eu.status: Field required",
        ),
        (
            '{"run": {"run_id": 1, "status": "running"}, "rounds": {"one": {}}}',
            "rounds.one.[key]",
        ),
    ],
)
def test_load_metrics_names_the_file_and_what_is_wrong(tmp_path, content, said):
    path = tmp_path / METRICS_FILE
    if content is not None:
        path.write_text(content)
    with pytest.raises(MetricsError) as caught:
        load_metrics(path)
    assert isinstance(caught.value, FedciuicError)
    assert str(caught.value).startswith(f"{path}:") and said in str(caught.value)


def test_a_checkpoints_rounds_are_the_models(tmp_path):
    from fedciuic.record.metrics import dump_rounds, parse_rounds

    rounds = _recorded(tmp_path).data.rounds
    raw = json.loads((tmp_path / METRICS_FILE).read_text())["rounds"]
    assert dump_rounds(rounds) == raw
    assert parse_rounds(json.loads(json.dumps(raw))) == rounds
    assert RunMetrics.model_validate({"run": {"run_id": 1, "status": "running"}}).rounds == {}
