"""``flwr run`` gets a staged copy of the app: the FAB Flower builds from it is the one it
builds from the app folder itself, byte for byte."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from flwr.cli.build import build_fab_from_disk

from fedciuic.errors import FederationError
from fedciuic.flower.launch import stage_app
from tests.conftest import ROOT


def _app(folder: Path, gitignore: str) -> Path:
    """An app folder with the shipped apps, an environment and files its FAB leaves out."""
    app = folder / "app"
    for part in ("clients", "server"):
        shutil.copytree(ROOT / part, app / part, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", app / "pyproject.toml")
    (app / ".gitignore").write_text(gitignore, encoding="utf-8")
    venv = app / ".venv" / "lib" / "site"
    venv.mkdir(parents=True)
    (venv / "module.py").write_text("x = 1\n", encoding="utf-8")
    (app / "clients" / "notes.txt").write_text("not code\n", encoding="utf-8")
    (app / "clients" / "scratch.log").write_text("ignored\n", encoding="utf-8")
    (app / "server" / "linked.py").symlink_to(folder / "outside.py")
    (folder / "outside.py").write_text("y = 2\n", encoding="utf-8")
    (app / ".venv" / "kept.py").write_text("z = 3\n", encoding="utf-8")
    generated = app / "clients" / "generated"
    generated.mkdir()
    for name in ("keep.py", "drop.py"):
        (generated / name).write_text("w = 4\n", encoding="utf-8")
    return app


@pytest.mark.parametrize(
    "gitignore",
    [
        ".venv/\n*.log\nclients/generated/\n",
        ".venv/\n*.log\nclients/generated/\n!clients/generated/keep.py\n",
        "",
    ],
    ids=["ignored-folder", "negated-pattern", "no-gitignore"],
)
def test_the_staged_app_gives_the_fab_flower_builds_from_the_app_folder(tmp_path, gitignore):
    app = _app(tmp_path, gitignore)
    staged = stage_app(app, tmp_path / "staged")
    assert build_fab_from_disk(staged) == build_fab_from_disk(app)
    held = sorted(p.relative_to(staged).as_posix() for p in staged.rglob("*") if p.is_file())
    assert "pyproject.toml" in held and "clients/app.py" in held and "server/app.py" in held
    assert not any(p.startswith(".venv") or p.endswith((".log", ".txt")) for p in held), held
    assert "server/linked.py" not in held  # symlinks stay out, as Flower leaves them
    # A file a negated pattern brings back from an ignored folder is in, as Flower has it.
    assert ("clients/generated/keep.py" in held) == ("!" in gitignore or not gitignore)
    assert ("clients/generated/drop.py" in held) == (not gitignore)


def test_the_shipped_app_stages_to_its_own_fab(tmp_path):
    """The repository itself, environment and all: the same FAB hash the regions see."""
    assert build_fab_from_disk(stage_app(ROOT, tmp_path / "staged")) == build_fab_from_disk(ROOT)


def test_a_folder_that_is_not_an_app_is_named_with_the_fix(tmp_path):
    (tmp_path / "notes.md").write_text("no app here\n", encoding="utf-8")
    with pytest.raises(FederationError, match=rf"app {tmp_path}: .*pyproject.toml"):
        stage_app(tmp_path, tmp_path / "staged")
