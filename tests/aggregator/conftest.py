"""The aggregator's tests judge hand-made replies against the shipped policies, whose EU
and CN ones let out only DP releases: their runs take the DP count of units (the app's
default), so a reply's count, epsilon and rate are DP or public."""

from __future__ import annotations

import pytest

from fedciuic.config import RunConfig


@pytest.fixture
def run_config(run_config: RunConfig) -> RunConfig:
    return run_config.updated(count_noise=10.0)
