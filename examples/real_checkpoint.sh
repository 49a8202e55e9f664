#!/usr/bin/env bash
# Fine-tune from a checkpoint directory instead of a preset: the route a real
# DeepSeek-V3 checkpoint takes. Here the checkpoint is a tiny one saved locally.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/fedciuic save-checkpoint runs/tiny-checkpoint --preset tiny
.venv/bin/fedciuic simulate --rounds 2 --run-config "model-path='$PWD/runs/tiny-checkpoint'"
