from __future__ import annotations

import json

import datasets
import numpy as np
import pytest
import torch

from fedciuic.config import ModelSpec
from fedciuic.data.corpus import ExampleSet
from fedciuic.data.tokenized import BUCKET, FEATURES, INPUT_IDS, LABELS, RECORD, USER
from fedciuic.errors import ModelError
from fedciuic.model.adapter import AdapterModel, check_model_spec, save_model_checkpoint
from fedciuic.model.families import MLA as ATTENTION_TARGETS
from fedciuic.model.presets import byte_tokenizer, preset_config
from fedciuic.model.train import evaluate, unit_losses


@pytest.fixture(scope="module")
def tiny() -> AdapterModel:
    return AdapterModel(ModelSpec(model_preset="tiny"), device=torch.device("cpu"))


def test_tiny_preset_keeps_the_deepseek_v3_shape():
    config = preset_config("tiny")
    assert config.model_type == "deepseek_v3"
    assert config.q_lora_rank and config.kv_lora_rank  # MLA: low-rank q and kv
    assert config.n_routed_experts >= 4
    assert config.n_shared_experts >= 1
    assert config.first_k_dense_replace == 1 < config.num_hidden_layers


def test_tiny_model_has_a_dense_first_layer_then_moe_with_router(tiny):
    layers = tiny.model.base_model.model.model.layers
    assert type(layers[0].mlp).__name__ == "DeepseekV3MLP"
    assert type(layers[1].mlp).__name__ == "DeepseekV3MoE"
    assert type(layers[1].mlp.gate).__name__ == "DeepseekV3TopkRouter"


def test_parameter_counts_of_the_presets(tiny):
    counts = tiny.counts()
    assert counts.total == 125_632
    assert counts.trainable == 8_832
    small = preset_config("small")
    assert small.n_routed_experts == 8 and small.num_hidden_layers == 8


def test_small_preset_has_tens_of_millions_of_parameters():
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(preset_config("small"))
    total = sum(p.numel() for p in model.parameters())
    assert 10_000_000 <= total < 100_000_000


def test_only_lora_adapters_on_attention_projections_are_trainable(tiny):
    trainable = [n for n, p in tiny.model.named_parameters() if p.requires_grad]
    assert trainable
    for name in trainable:
        assert ".lora_A." in name or ".lora_B." in name
        assert any(f".{target}." in name for target in ATTENTION_TARGETS), name
    assert sorted(tiny.adapter_state()) == sorted(trainable)


def test_router_and_experts_stay_frozen(tiny):
    frozen = {n: p.requires_grad for n, p in tiny.model.named_parameters()}
    router = [n for n in frozen if n.endswith("mlp.gate.weight")]
    experts = [n for n in frozen if ".mlp.experts." in n]
    assert router and experts
    assert not any(frozen[n] for n in router + experts)


def test_same_seed_builds_the_same_base_everywhere(tiny):
    again = AdapterModel(ModelSpec(model_preset="tiny"), device=torch.device("cpu"))
    other = AdapterModel(ModelSpec(model_preset="tiny", seed=1), device=torch.device("cpu"))
    assert again.base_fingerprint == tiny.base_fingerprint
    assert other.base_fingerprint != tiny.base_fingerprint


def test_adapter_state_round_trip_and_layout_check(tiny):
    state = tiny.adapter_state()
    changed = {k: v + 1.0 for k, v in state.items()}
    tiny.load_adapter_state(changed)
    assert all(np.array_equal(tiny.adapter_state()[k], changed[k]) for k in state)
    tiny.load_adapter_state(state)
    bad = dict(state)
    name = next(iter(bad))
    bad[name] = np.zeros((3, 3), dtype=np.float32)
    with pytest.raises(ValueError, match="shape"):
        tiny.load_adapter_state(bad)
    with pytest.raises(ValueError, match="missing"):
        tiny.load_adapter_state({k: v for k, v in state.items() if k != name})


def test_checkpoint_save_and_load_round_trip(tmp_path):
    spec = ModelSpec(model_preset="tiny", seed=3)
    path = save_model_checkpoint(spec, tmp_path / "ckpt")
    from_preset = AdapterModel(spec, device=torch.device("cpu"))
    from_path = AdapterModel(ModelSpec(model_path=str(path), seed=3), device=torch.device("cpu"))
    again = AdapterModel(ModelSpec(model_path=str(path), seed=3), device=torch.device("cpu"))
    assert from_path.base_fingerprint == again.base_fingerprint
    text = "Regions keep their data."
    assert from_path.tokenizer(text)["input_ids"] == from_preset.tokenizer(text)["input_ids"]
    ids = torch.tensor([from_path.tokenizer(text)["input_ids"]])
    with torch.no_grad():
        a = from_preset.model(input_ids=ids).logits
        b = from_path.model(input_ids=ids).logits
    assert torch.allclose(a, b)


def test_byte_tokenizer_round_trips_any_utf8():
    tok = byte_tokenizer()
    text = "Daten bleiben in der EU · 数据留在中国 · data stays"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == list(text.encode())
    assert tok.decode(ids) == text


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(ModelError, match=r"model-preset: unknown preset 'huge'.*small, tiny"):
        check_model_spec(ModelSpec(model_preset="huge"))


def test_model_path_that_is_not_a_checkpoint_is_refused(tmp_path):
    with pytest.raises(ModelError, match="is not a directory"):
        check_model_spec(ModelSpec(model_path=str(tmp_path / "nope")))
    with pytest.raises(ModelError, match=r"has no config\.json"):
        check_model_spec(ModelSpec(model_path=str(tmp_path)))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelError, match=r"config\.json: .*save_pretrained"):
        check_model_spec(ModelSpec(model_path=str(tmp_path)))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "vit"}))
    with pytest.raises(ModelError, match="model_type: 'vit' is not a causal language model"):
        check_model_spec(ModelSpec(model_path=str(tmp_path)))


def test_checkpoint_without_weights_is_refused_with_the_path(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(preset_config("tiny").to_dict()))
    with pytest.raises(ModelError, match=str(tmp_path)):
        AdapterModel(ModelSpec(model_path=str(tmp_path)), device=torch.device("cpu"))


def _rows(lengths: list[int]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(1, 200, (n,), generator=gen).tolist() for n in lengths]


def _ragged(ids: list[list[int]]) -> ExampleSet:
    """Examples of these tokens (each its own unit), every token trained on."""
    table = datasets.Dataset.from_dict(
        {
            INPUT_IDS: ids,
            LABELS: ids,
            RECORD: list(range(len(ids))),
            USER: list(range(len(ids))),
            BUCKET: [0.5] * len(ids),
        },
        features=FEATURES,
    )
    return ExampleSet(table, np.arange(len(ids)), np.arange(len(ids)), 0)


def test_evaluation_batches_group_examples_of_like_length_and_cover_each_once():
    lengths = [30, 4, 17, 5, 29, 16, 6]
    batches = _ragged(_rows(lengths)).batches(2)
    seen = np.concatenate([positions for positions, _ in batches])
    assert sorted(seen.tolist()) == list(range(len(lengths)))
    assert [lengths[p] for p in seen] == sorted(lengths)  # shortest first
    for positions, batch in batches:
        assert batch.input_ids.shape == (len(positions), max(lengths[p] for p in positions))


def test_each_units_held_out_loss_is_its_own_whatever_the_batch_order(tiny):
    rows = _rows([30, 4, 17, 5, 29])
    one_by_one = [unit_losses(tiny, _ragged([row]), batch_size=1)[0] for row in rows]
    assert unit_losses(tiny, _ragged(rows), batch_size=2) == pytest.approx(one_by_one, rel=1e-4)
    tokens = [len(row) - 1 for row in rows]
    want = sum(loss * t for loss, t in zip(one_by_one, tokens, strict=True)) / sum(tokens)
    assert evaluate(tiny, _ragged(rows), batch_size=2).loss == pytest.approx(want, rel=1e-4)
