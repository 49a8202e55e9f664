"""A training round waits as long as the regions' timed work needs, not only the
configured round-timeout: an update a region spent privacy on is not lost to the clock."""

from __future__ import annotations

import logging

import pytest
import torch

from fedciuic.aggregator.loop import WAIT_MARGIN, loop_for
from fedciuic.config import ModelSpec
from fedciuic.model.adapter import AdapterModel
from fedciuic.privacy.dpsgd import time_private_step
from tests.aggregator.fakes import Regions
from tests.aggregator.test_aggregator import evaluated, make_round, reply


def _timed(region: str, loss: float, seconds: float):
    raw = evaluated(region, loss, 10)
    raw.metrics["step-seconds"] = seconds
    return raw


def test_the_training_wait_grows_to_twice_the_slowest_regions_timed_work(
    run_config, tmp_path, caplog
):
    # exact evaluations: a region's step time leaves only in a run that lets figures out
    run = run_config.updated(**{"local_steps": 30, "round_timeout": 60.0, "eval_noise": 0.0})
    loop = loop_for(make_round(run, tmp_path / "run"), Regions())
    a = loop.aggregator
    assert loop.train_wait() == 60.0  # nothing timed yet: round-timeout
    a.evaluate(0, [reply(11, _timed("eu", 2.0, 2.0)), reply(12, _timed("cn", 3.0, 10.0))])
    assert a.recorder.data.rounds[0].eval["cn"].step_seconds == 10.0
    with caplog.at_level(logging.WARNING):
        assert loop.train_wait() == pytest.approx(2 * 10.0 * 30 + WAIT_MARGIN)
        loop.train_wait()
    said = [r.getMessage() for r in caplog.records if "round-timeout" in r.getMessage()]
    assert len(said) == 1 and "cn takes 10.0s per DP-SGD step x 30 step(s)" in said[0]
    # Work that fits leaves round-timeout as it is; a time budget caps the work.
    loop.timeout = 3600.0
    assert loop.train_wait() == 3600.0
    budgeted = loop_for(
        make_round(run.updated(**{"local_time_budget": 100.0}), tmp_path / "budgeted"),
        Regions(),
    )
    budgeted.aggregator.evaluate(0, [reply(12, _timed("cn", 3.0, 10.0))])
    assert budgeted.train_wait() == pytest.approx(2 * 100.0 + WAIT_MARGIN)


def test_a_step_seconds_that_is_not_a_positive_number_is_rejected_alone(run_config, tmp_path):
    a = make_round(run_config.updated(eval_noise=0.0), tmp_path / "run")
    a.evaluate(0, [reply(11, _timed("eu", 2.0, -1.0)), reply(12, _timed("cn", 3.0, 1.5))])
    evals = a.recorder.data.rounds[0].eval
    assert evals["eu"].status == "rejected" and "step-seconds" in (evals["eu"].reason or "")
    assert a.step_seconds == {"cn": 1.5}


def test_timing_a_step_leaves_torchs_random_state_as_it_was(run_config, demo_root, tmp_path):
    """A reproducible run draws the same numbers whether or not a region timed a step."""
    from fedciuic.config import NodeConfig
    from fedciuic.data.corpus import load_region_data
    from fedciuic.model.presets import byte_tokenizer

    model = AdapterModel(ModelSpec())
    node = NodeConfig(region="eu", data_path=str(demo_root / "eu"), state_path=str(tmp_path))
    data = load_region_data(run_config, node, byte_tokenizer())
    torch.manual_seed(3)
    before = torch.get_rng_state()
    assert time_private_step(model, data.train, run_config.training, run_config.privacy) > 0
    assert torch.equal(torch.get_rng_state(), before)
