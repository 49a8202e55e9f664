#!/usr/bin/env bash
# Set up .venv (and chromium, for the report test) if needed, then lint, type-check and
# run every test (end-to-end included), one pytest-xdist worker per core, the longest
# tests stolen by whichever worker is free. Arguments go to pytest (e.g. -m "not e2e";
# -n 0 runs in one process). See the README for the time it takes; -m "not scenario"
# skips the long e2e scenarios, -m "not e2e" runs only the unit tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if ! bash scripts/setup-browser.sh; then
  # Only the report's headless-browser test needs chromium: it is skipped, saying why
  # (tests/e2e/conftest.py), and every other test runs.
  export FEDCIUIC_NO_CHROMIUM="chromium is not installed and scripts/setup-browser.sh could not install it (it needs root or password-less sudo, and apt-get)"
  echo "fedciuic: $FEDCIUIC_NO_CHROMIUM; the report's browser test will be skipped" >&2
fi
.venv/bin/ruff check .
.venv/bin/mypy
exec .venv/bin/python -m pytest -n auto --dist worksteal "$@"
