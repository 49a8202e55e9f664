"""The computed memory table (benchmarks/model_memory.py) counts the published models,
and the GPU check's shaped checkpoints (benchmarks/gpu.py) are valid checkpoint folders."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))  # as run_all.py runs them: scripts, not a package
import gpu
import model_memory

SHAPES = {shape.name.split(" (")[0]: shape for shape in model_memory.SHAPES}


@pytest.mark.parametrize(
    ("name", "published"),
    [
        ("R1-Distill-Qwen-1.5B", 1.78e9),
        ("R1-0528-Qwen3-8B", 8.19e9),
        ("DeepSeek-V2-Lite", 15.7e9),
        ("DeepSeek-V3 / R1", 671e9),
        ("DeepSeek-V4-Flash", 284e9),
    ],
)
def test_the_meta_models_have_the_published_parameter_counts(name, published):
    row = model_memory.count(SHAPES[name])
    assert row["parameters"] == pytest.approx(published, rel=0.005)
    assert row["bf16_gb"] == pytest.approx(row["parameters"] * 2 / 1e9)


def test_nf4_leaves_the_fused_routed_experts_in_bf16():
    dense = model_memory.count(SHAPES["R1-Distill-Qwen-7B"])
    moe = model_memory.count(SHAPES["DeepSeek-V3 / R1"])
    assert dense["nf4_gb"] < 0.4 * dense["bf16_gb"]
    assert moe["nf4_gb"] > 0.95 * moe["bf16_gb"]  # 654B of 671B are 3-D experts tensors
    assert moe["routed_expert_parameters"] > 0.97 * moe["parameters"]
    # LoRA r=8 on each routed expert: 256 x 58 x 8 x ((4096 + 7168) + (2048 + 7168))
    assert moe["expert_lora_r8_trainable"] == 256 * 58 * 8 * (11264 + 9216)


@pytest.mark.parametrize(
    ("name", "family"), [("r1-distill-qwen-shape", "qwen2"), ("r1-0528-qwen3-shape", "qwen3")]
)
def test_each_shaped_checkpoint_loads_with_auto_targets(tmp_path, name, family):
    """Shrunk, each loads as the GPU check loads it (its tokenizer its vocabulary's:
    a qwen2 folder's tokenizer would add an unknown token past it)."""
    from fedciuic.config import ModelSpec
    from fedciuic.model.adapter import AdapterModel

    model_type, shape = gpu.SHAPED[name]
    small = {
        **shape,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        **({"head_dim": 16} if "head_dim" in shape else {}),
    }
    path = gpu.shaped_checkpoint(tmp_path / name, model_type, small)
    model = AdapterModel(
        ModelSpec(model_path=str(path), dtype="bf16", lora_targets="auto"),
        device=torch.device("cpu"),
    )
    assert model.model.config.model_type == family
    # q, k, v, o of each layer: 8 x ((64 + 64) + (64 + 32) + (64 + 32) + (64 + 64))
    assert model.counts().trainable == 2 * 8 * (128 + 96 + 96 + 128)
