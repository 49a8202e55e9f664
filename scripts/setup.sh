#!/usr/bin/env bash
# Create .venv and install fedciuic into it: torch first (the CPU wheel where one is
# available locally), then the package with its dev extra, every other dependency at
# the exact version constraints.txt names (scripts/lock.sh refreshes it). Re-runs only
# when pyproject.toml, constraints.txt or this script changed. Needs nothing but
# Python >= 3.11.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${FEDCIUIC_TORCH_SPEC:-torch==2.13.0}
if [ ! -x .venv/bin/python ]; then
  echo "fedciuic: creating .venv with $($PYTHON --version)"
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.fedciuic-installed
want="$(cat pyproject.toml constraints.txt scripts/setup.sh | sha256sum | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "fedciuic: installing $TORCH_SPEC, then fedciuic[dev] (a few minutes the first time)"
  .venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
  .venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt "$TORCH_SPEC"
  .venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt -e ".[dev]"
  echo "$want" > "$stamp"
fi
# Byte-compile the project's own modules (a second or two; up-to-date files are
# skipped). Where PYTHONDONTWRITEBYTECODE is set, as in many container images, Python
# never caches them, and every process a run or the tests start (each region's agent,
# Ray actor, ClientApp, CLI call) would compile them anew: about 0.5 s of CPU each.
.venv/bin/python -m compileall -q -j 0 fedciuic clients server tests benchmarks examples >/dev/null
