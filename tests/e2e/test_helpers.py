"""The end-to-end tests' shared pieces that several xdist workers use at once."""

from __future__ import annotations

import stat
import uuid
from pathlib import Path

import pytest

from tests.e2e.helpers import built_once, passable_to_others


def _passable(folder: Path) -> bool:
    return bool(folder.stat().st_mode & stat.S_IXOTH)


def test_a_folder_stays_passable_until_the_last_of_overlapping_holders_leaves(tmp_path):
    closed = tmp_path / "closed"
    target = closed / "inner" / "python"
    target.parent.mkdir(parents=True)
    closed.chmod(0o700)
    first, second = passable_to_others([target]), passable_to_others([target])
    first.__enter__()
    second.__enter__()  # another worker's test: it finds the folder already open
    assert _passable(closed)
    first.__exit__(None, None, None)
    assert _passable(closed), "the first holder closed it under the second"
    second.__exit__(None, None, None)
    assert not _passable(closed) and closed.stat().st_mode & 0o777 == 0o700


def test_built_once_builds_once_and_a_failed_build_fails_every_later_ask(tmp_path):
    built: list[Path] = []

    def build(folder: Path) -> dict[str, str]:
        built.append(folder)
        (folder / "made").write_text("x")
        return {"folder": str(folder)}

    name = f"helpers-{uuid.uuid4().hex}"
    assert built_once(name, build) == built_once(name, build) == {"folder": str(built[0])}
    assert len(built) == 1 and (built[0] / "made").exists()

    def broken(folder: Path) -> None:
        raise ValueError("no checkpoint here")

    failing = f"helpers-{uuid.uuid4().hex}"
    with pytest.raises(ValueError, match="no checkpoint here"):
        built_once(failing, broken)
    with pytest.raises(RuntimeError, match="failed in another worker:\nValueError: no checkpoint"):
        built_once(failing, build)
