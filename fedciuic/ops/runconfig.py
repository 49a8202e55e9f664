"""The app's run-config defaults and ``--run-config KEY=VALUE`` overrides, read once for
the command line and for ``fedciuic init`` alike."""

from __future__ import annotations

import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedciuic.errors import ConfigError


def app_run_config(app: Path) -> dict[str, Any]:
    """The run-config defaults declared in the app's pyproject.toml."""
    pyproject = app / "pyproject.toml"
    fix = "pass --app with the Flower app folder (the fedciuic repository)"
    try:
        with open(pyproject, "rb") as handle:
            data = tomllib.load(handle)
    except OSError as err:
        raise ConfigError([f"--app:{pyproject}: cannot read ({err.strerror}); {fix}"]) from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError([f"--app:{pyproject}: invalid TOML ({err}); {fix}"]) from None
    config = data.get("tool", {}).get("flwr", {}).get("app", {}).get("config")
    if not isinstance(config, dict):
        raise ConfigError([f"--app:{pyproject}: no [tool.flwr.app] with a config table; {fix}"])
    return dict(config)


def parse_overrides(pairs: Sequence[str]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs with TOML values (``rounds=3``, ``model-path='/x'``)."""
    values: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError([f"--run-config {pair!r}: expected KEY=VALUE"])
        try:
            values[key.strip()] = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            values[key.strip()] = raw  # a bare word is taken as a string
    return values
