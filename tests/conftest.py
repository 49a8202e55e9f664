"""Shared fixtures: the app's own run config, demo data, and an offline Flower env."""

from __future__ import annotations

import os
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from flwr.supercore.task_identity import TaskIdentity

from fedciuic.config import RunConfig
from fedciuic.demo_data import write_demo_corpora

ROOT = Path(__file__).resolve().parents[1]

# Flower must stay offline and quiet in every test (the launcher sets these for
# the processes it starts; this covers in-process use).
os.environ.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")


def app_config() -> dict[str, Any]:
    with open(ROOT / "pyproject.toml", "rb") as handle:
        return dict(tomllib.load(handle)["tool"]["flwr"]["app"]["config"])


@pytest.fixture(autouse=True)
def _flwr_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "flwr-home"))


@pytest.fixture(scope="session")
def demo_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("demo-data")
    write_demo_corpora(root, ("eu", "cn", "us"))
    return root


@pytest.fixture
def run_config(demo_root: Path, tmp_path: Path) -> RunConfig:
    values = {**app_config(), "data-root": str(demo_root), "output-dir": str(tmp_path / "runs")}
    return RunConfig.from_user_config(values, source="test")


@pytest.fixture
def task_identity() -> Iterator[None]:
    """Flower needs a task identity to build Messages outside its runtime."""
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 7, 1, 1
    yield
    TaskIdentity.run_id = TaskIdentity.node_id = TaskIdentity.task_id = None  # type: ignore[assignment]
