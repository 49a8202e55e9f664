"""A region's small corpus, shared by the cluster tests."""

from __future__ import annotations

from pathlib import Path

import pytest

#: Records in the region's small corpus.
RECORDS = 40


@pytest.fixture(scope="module")
def data_root(demo_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small corpus (some of the demo's EU records), so that full batches are quick."""
    root = tmp_path_factory.mktemp("small-data")
    (root / "eu").mkdir()
    lines = (demo_root / "eu" / "docs.jsonl").read_text().splitlines()[:RECORDS]
    (root / "eu" / "docs.jsonl").write_text("\n".join(lines) + "\n")
    return root
