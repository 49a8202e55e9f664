#!/usr/bin/env bash
# Set up .venv (and chromium, for the report test) if needed, then lint, type-check and
# run every test (end-to-end included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/setup-browser.sh
.venv/bin/ruff check .
.venv/bin/mypy
exec .venv/bin/python -m pytest "$@"
