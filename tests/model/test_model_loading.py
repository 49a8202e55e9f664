"""Loading a base: targets per architecture, precision, 4-bit refusal, gradient
checkpointing under DP, the cheap base identity, and the aggregator's meta layout."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from fedciuic.config import ModelSpec
from fedciuic.data.corpus import Batch, ExampleSet
from fedciuic.digests import file_digest
from fedciuic.errors import ModelError
from fedciuic.model import adapter as adapter_module
from fedciuic.model.adapter import (
    AdapterLayout,
    AdapterModel,
    base_dtype,
    check_quantization,
    save_model_checkpoint,
)
from fedciuic.model.identity import checkpoint_fingerprint
from fedciuic.model.train import lm_loss
from fedciuic.privacy.dpsgd import PrivateTrainer
from tests.privacy.test_each_family_dp import opacus_grads
from tests.region.test_each_family import TARGETS

CPU = torch.device("cpu")


def test_auto_targets_cover_the_mla_projections_and_never_the_router_or_experts():
    model = AdapterModel(ModelSpec(model_preset="tiny"), device=CPU)
    names = {t.rsplit(".", 1)[-1] for t in model.targets}
    assert names == {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"}
    assert not any("experts" in t or t.endswith(".gate") for t in model.targets)
    assert "on 10 modules" in model.describe() and "trainable of" in model.describe()


def test_auto_mlp_adds_the_dense_and_shared_expert_mlps_only():
    model = AdapterModel(ModelSpec(model_preset="tiny", lora_targets="auto+mlp"), device=CPU)
    mlp = [t for t in model.targets if t.rsplit(".", 1)[-1] in ("gate_proj", "up_proj")]
    assert any(".shared_experts." in t for t in mlp) and any("layers.0.mlp." in t for t in mlp)
    assert not any(".experts." in t.replace("shared_experts", "") for t in model.targets)


def test_listed_targets_are_used_and_a_name_that_matches_nothing_is_refused():
    model = AdapterModel(ModelSpec(model_preset="tiny", lora_targets="o_proj"), device=CPU)
    assert {t.rsplit(".", 1)[-1] for t in model.targets} == {"o_proj"}
    with pytest.raises(
        ModelError, match=r"lora-targets: q_proj, k_proj match no adaptable nn\.Linear"
    ):
        AdapterModel(
            ModelSpec(model_preset="tiny", lora_targets="q_proj,k_proj,o_proj"), device=CPU
        )
    with pytest.raises(ModelError, match="lora-targets: empty"):
        AdapterModel(ModelSpec(model_preset="tiny", lora_targets=" , "), device=CPU)


def test_the_base_is_frozen_in_its_dtype_and_adapters_train_in_fp32():
    model = AdapterModel(ModelSpec(model_preset="tiny", dtype="bf16"), device=CPU)
    frozen = {p.dtype for p in model.model.parameters() if not p.requires_grad}
    assert frozen == {torch.bfloat16}
    assert {p.dtype for p in model.trainable_parameters()} == {torch.float32}
    batch = torch.randint(0, 256, (2, 16))
    loss = lm_loss(model.model, Batch.of_ids(batch))
    loss.backward()
    assert all(
        p.grad is not None and p.grad.dtype == torch.float32 for p in model.trainable_parameters()
    )


def test_auto_dtype_is_fp32_on_cpu_and_unknown_dtypes_are_refused():
    assert base_dtype(ModelSpec(), CPU) == torch.float32
    assert base_dtype(ModelSpec(dtype="fp16"), CPU) == torch.float16
    with pytest.raises(ModelError, match="run config:dtype: unknown 'int3'"):
        base_dtype(ModelSpec.model_construct(dtype="int3"), CPU)


def test_nf4_is_refused_without_cuda_and_without_a_checkpoint():
    with pytest.raises(
        ModelError, match=r"quantization: nf4 needs a CUDA GPU.*quantization = \"none\""
    ):
        check_quantization(ModelSpec(quantization="nf4", model_path="x"), CPU)
    with pytest.raises(ModelError, match="nf4 quantizes a checkpoint"):
        check_quantization(ModelSpec(quantization="nf4"), torch.device("cuda"))
    with pytest.raises(ModelError, match="run config:quantization"):
        AdapterModel(ModelSpec(model_preset="tiny", quantization="nf4"), device=CPU)


def _per_sample_grads(monkeypatch, checkpointing: bool, pause: bool = True):
    if not pause:
        monkeypatch.setattr(adapter_module, "_PAUSED_DURING_RECOMPUTE", [])
        monkeypatch.setattr(
            "fedciuic.privacy.dpsgd.pause_on_recompute",
            lambda hooks: contextlib.nullcontext(),
        )
    model = AdapterModel(
        ModelSpec(model_preset="tiny", gradient_checkpointing=checkpointing), device=CPU
    )
    return opacus_grads(
        model, torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
    )


def test_gradient_checkpointing_gives_opacus_the_same_per_sample_gradients(monkeypatch):
    plain = _per_sample_grads(monkeypatch, checkpointing=False)
    checkpointed = _per_sample_grads(monkeypatch, checkpointing=True)
    torch.testing.assert_close(plain, checkpointed)


def test_without_pausing_the_hooks_on_recompute_the_per_sample_gradients_break(monkeypatch):
    """The pause is what makes the test above pass (the test can fail)."""
    with pytest.raises(Exception):  # noqa: B017 - Opacus fails in one of several ways
        grads = _per_sample_grads(monkeypatch, checkpointing=True, pause=False)
        torch.testing.assert_close(_per_sample_grads(monkeypatch, checkpointing=False), grads)


def _ghost_step(checkpointing: bool) -> dict[str, np.ndarray]:
    """One ghost-clipped step (SGD, no noise, every unit clipped) on users of 2, 1 and 1
    rows; the adapters' change."""
    model = AdapterModel(
        ModelSpec(model_preset="tiny", gradient_checkpointing=checkpointing), device=CPU
    )
    start = {k: v + 0.01 if "lora_B" in k else v for k, v in model.adapter_state().items()}
    model.load_adapter_state(start)  # non-zero B: every adapter has a gradient
    rows = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
    trainer = PrivateTrainer(
        model,
        ExampleSet.of_rows(rows, units=[0, 0, 1, 2]),
        batch_size=3,
        max_examples_per_unit=4,
        learning_rate=1.0,
        noise_multiplier=0.0,
        max_grad_norm=0.05,
        mode="ghost",
        optimizer="sgd",
        secure_mode=False,
    )
    try:
        trainer.step(torch.arange(3))
    finally:
        trainer.close()
    return {k: v - start[k] for k, v in model.adapter_state().items()}


def test_ghost_clipping_with_checkpointing_takes_the_same_step():
    """Ghost clipping's two backward passes each recompute the checkpointed layers; its
    norms come from the first pass's own activations (the recompute is skipped)."""
    plain, checkpointed = _ghost_step(False), _ghost_step(True)
    assert any(np.abs(v).max() > 1e-6 for v in plain.values())
    for name, value in plain.items():
        np.testing.assert_allclose(checkpointed[name], value, rtol=1e-4, atol=1e-7)


def test_checkpoint_identity_is_cached_and_changes_with_the_weights(tmp_path, monkeypatch):
    path = save_model_checkpoint(ModelSpec(model_preset="tiny"), tmp_path / "ckpt")
    cache = tmp_path / "digests.json"
    first = checkpoint_fingerprint(path, cache=cache)
    assert json.loads(cache.read_text())  # one digest per file, by path
    reads: list[str] = []

    def counted(file: Path) -> str:
        reads.append(file.name)
        return file_digest(file)

    monkeypatch.setattr("fedciuic.digests.file_digest", counted)
    assert checkpoint_fingerprint(path, cache=cache) == first and reads == []  # cached
    weights = path / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(1, 1))
    assert checkpoint_fingerprint(path, cache=cache) != first and reads == ["model.safetensors"]
    cache.write_text("{corrupt")  # a cache only: recomputed, never trusted
    assert checkpoint_fingerprint(path, cache=cache) != first


def test_the_aggregator_layout_matches_the_regions_model_without_loading_the_base(tmp_path):
    for spec in (
        ModelSpec(model_preset="tiny", lora_targets="auto+mlp"),
        ModelSpec(
            model_path=str(save_model_checkpoint(ModelSpec(model_preset="tiny"), tmp_path / "c"))
        ),
    ):
        layout = AdapterLayout.of(spec)
        model = AdapterModel(spec, device=CPU)
        assert layout.fingerprint == model.base_fingerprint
        assert layout.shapes == {k: v.shape for k, v in model.adapter_state().items()}
        model.load_adapter_state(layout.initial)  # regions take the initial adapter as is
        assert all(not np.any(v) for k, v in layout.initial.items() if ".lora_B." in k)


def test_the_saved_global_adapter_loads_with_peft(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ckpt = save_model_checkpoint(ModelSpec(model_preset="tiny"), tmp_path / "c")
    spec = ModelSpec(model_path=str(ckpt), lora_targets="o_proj")
    layout = AdapterLayout.of(spec)
    trained = {k: v + 0.5 for k, v in layout.initial.items()}
    layout.save(trained, tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == sorted(layout.targets)
    loaded = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(ckpt), tmp_path / "adapter"
    )
    model = AdapterModel(spec, device=CPU)
    params = dict(loaded.named_parameters())
    for name, value in trained.items():
        np.testing.assert_array_equal(params[name].detach().numpy(), value)
    assert set(params) >= set(model.adapter_state())


def test_a_checkpoint_without_its_tokenizer_is_refused_naming_the_folder(
    tmp_path, tiny_checkpoints
):
    folder = tmp_path / "no-tokenizer"
    folder.mkdir()
    for file in tiny_checkpoints["qwen2"].iterdir():
        if not file.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            (folder / file.name).write_bytes(file.read_bytes())
    with pytest.raises(ModelError, match=rf"{folder}: no usable tokenizer"):
        AdapterModel(ModelSpec(model_path=str(folder)), device=CPU)


@pytest.mark.parametrize(("family", "adapted"), sorted(TARGETS.items()))
def test_auto_targets_per_architecture(tiny_checkpoints, family, adapted):
    spec = ModelSpec(model_path=str(tiny_checkpoints[family]))
    model = AdapterModel(spec, device=CPU)
    assert {t.rsplit(".", 1)[-1] for t in model.targets} == adapted
    assert AdapterLayout.of(spec).shapes == {k: v.shape for k, v in model.adapter_state().items()}
    assert model.tokenizer.chat_template  # the checkpoint's own


def test_frozen_blocks_stay_frozen_where_their_names_are_an_attention_projections(
    tiny_checkpoints,
):
    # V4's compressors and indexers have their own kv_proj, q_b_proj and gate_proj.
    spec = ModelSpec(model_path=str(tiny_checkpoints["deepseek_v4"]), lora_targets="auto+mlp")
    model = AdapterModel(spec, device=CPU)
    assert model.targets and all(
        ".self_attn.compressor." not in t and ".mlp.experts." not in t for t in model.targets
    )
    assert {t.rsplit(".", 1)[-1] for t in model.targets if ".shared_experts." in t} == {
        "gate_proj",
        "up_proj",
        "down_proj",
    }
    assert not [n for n, _ in model.model.named_parameters() if "lora_" in n and "compressor" in n]


@pytest.mark.parametrize(
    ("family", "listed", "why"),
    [
        ("deepseek_v4", "o_a_proj", "o_a_proj is a DeepseekV4GroupedLinear, an nn.Linear with"),
        ("deepseek_v4", "kv_proj,weights_proj", "is in the sparse-attention indexer"),
        ("deepseek_v32", "wk", "indexer.wk is in the sparse-attention indexer"),
    ],
)
def test_a_listed_target_in_a_frozen_block_is_refused_saying_why(
    tiny_checkpoints, family, listed, why
):
    spec = ModelSpec(model_path=str(tiny_checkpoints[family]), lora_targets=listed)
    with pytest.raises(ModelError, match="run config:lora-targets: ") as refused:
        AdapterModel(spec, device=CPU)
    assert why in str(refused.value)


@pytest.mark.parametrize(
    ("family", "named"),
    [
        (
            "deepseek_v4",
            "frozen with it: the router, the routed experts, the sparse-attention indexer, "
            "the KV compressors, the hyper-connections",
        ),
        ("deepseek_v32", "frozen with it: the router, the routed experts, the sparse-attention"),
        ("qwen3", None),
    ],
)
def test_the_start_of_run_line_names_what_stays_frozen(tiny_checkpoints, family, named):
    line = AdapterModel(ModelSpec(model_path=str(tiny_checkpoints[family])), device=CPU).describe()
    assert (named in line) if named else ("frozen with it" not in line), line
