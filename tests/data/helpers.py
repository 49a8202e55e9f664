"""What the data tests share: a small run config for one region."""

from __future__ import annotations

from typing import Any

from fedciuic.config import RunConfig


def data_run(**changes: Any) -> RunConfig:
    """Region eu's run config with a short training; ``changes`` by kebab-case key."""
    values = {
        "regions": "eu",
        "num-server-rounds": 1,
        "seed": 0,
        "local-steps": 1,
        "batch-size": 2,
        "learning-rate": 0.1,
        "seq-len": 128,
        "max-eval-examples": 100,
        "eval-fraction": 0.3,
        "node-wait-timeout": 1.0,
        "round-timeout": 1.0,
        **changes,
    }
    return RunConfig.from_user_config(values, source="test")
