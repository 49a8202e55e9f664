#!/usr/bin/env bash
# The main job: set up .venv if needed, then simulate eu, cn and us on the CPU.
# Extra arguments go to `fedciuic simulate` (see `fedciuic simulate --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/fedciuic simulate "$@"
