#!/usr/bin/env bash
# Every benchmark in one command: installs what it needs (scripts/setup.sh), then runs
# benchmarks/run_all.py, which writes benchmarks/results/{results.json,results.md,*.png}.
# Options go to run_all.py (--quick, --only dp,sealing, --out DIR).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python benchmarks/run_all.py "$@"
