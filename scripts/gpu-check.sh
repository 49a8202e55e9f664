#!/usr/bin/env bash
# The trainer on a CUDA GPU (benchmarks/gpu.py): the small preset and two random-init
# checkpoints in published distills' layouts, fewer layers (R1-Distill-Qwen, qwen2;
# R1-0528-Qwen3-8B, qwen3), LoRA on lora-targets = auto, with and without DP, in bf16
# and NF4; then one region's DP round over every GPU here with NCCL, the base whole in
# each process and then sharded across them (benchmarks/gpu_cluster.py).
# Needs a CUDA machine; installs the project (with bitsandbytes) into .venv first, at
# constraints.txt's versions (torch and bitsandbytes are not in it: the CUDA build's).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "gpu-check: no CUDA GPU here (nvidia-smi not found)" >&2
    exit 2
fi
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
.venv/bin/pip install -q -c constraints.txt -e '.[cuda]'
.venv/bin/python benchmarks/gpu.py "$@"
# A region as a cluster: NCCL, one training process per GPU (docs/cluster.md), each
# holding the whole base, then each holding a slice of it (train-sharding = "shard").
.venv/bin/python benchmarks/gpu_cluster.py --preset small
exec .venv/bin/python benchmarks/gpu_cluster.py --preset small --sharding shard
