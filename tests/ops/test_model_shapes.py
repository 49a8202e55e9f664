"""The GPU check's shaped checkpoints (benchmarks/gpu.py) are valid checkpoint folders."""

from __future__ import annotations

import sys

import torch

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))  # as run_all.py runs them: scripts, not a package
import gpu


def test_the_qwen3_shaped_checkpoint_loads_with_auto_targets(tmp_path):
    from fedciuic.model.adapter import AdapterModel, ModelSpec

    model_type, shape = gpu.SHAPED["r1-0528-qwen3-shape"]
    small = {
        **shape,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
    }
    path = gpu.shaped_checkpoint(tmp_path / "qwen3", model_type, small)
    model = AdapterModel(
        ModelSpec(path=str(path), dtype="bf16", lora_targets="auto"), device=torch.device("cpu")
    )
    assert model.model.config.model_type == "qwen3"
    # q, k, v, o of each layer: 8 x ((64 + 64) + (64 + 32) + (64 + 32) + (64 + 64))
    assert model.counts().trainable == 2 * 8 * (128 + 96 + 96 + 128)
