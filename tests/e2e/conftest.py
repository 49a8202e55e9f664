"""End-to-end tests: each starts by timing this machine's pace (its waits follow it,
tests/e2e/pace.py); the one test that needs a headless browser is skipped, with the
reason, only where chromium is absent and scripts/test.sh could not install it."""

from __future__ import annotations

import os
import shutil

import pytest

from tests.e2e import pace

#: Set by scripts/test.sh when scripts/setup-browser.sh could not install chromium.
NO_CHROMIUM = "FEDCIUIC_NO_CHROMIUM"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = os.environ.get(NO_CHROMIUM)
    if not reason or shutil.which("chromium"):
        return  # chromium is here (or nobody tried to install it): the test runs
    for item in items:
        if "chromium" in item.name:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(autouse=True)
def paced(request: pytest.FixtureRequest) -> None:
    """Time a training step now: the test's waits are stretched by the slowdown found."""
    request.node.user_properties.append(("pace-factor", round(pace.calibrate(), 2)))
