#!/usr/bin/env bash
# The main job: set up .venv if needed, then simulate eu, cn and us on the CPU, with DP,
# next to the same run without DP to show what privacy costs.
# Extra arguments go to `fedciuic simulate` (see `fedciuic simulate --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/fedciuic simulate --compare-no-dp "$@"
