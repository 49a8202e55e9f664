"""Every supported architecture, loaded from its own checkpoint folder (its BPE
tokenizer and chat template), trains a DP round in a region: the real loading path,
Opacus' per-sample gradients on its LoRA targets, the ledger. One of them also runs
end to end through Flower (tests/e2e/test_simulation.py)."""

from __future__ import annotations

import json

import pytest

from fedciuic.config import NodeConfig, RunConfig
from fedciuic.region.trainer import Region
from tests.conftest import EXACT_RELEASES

#: The attention projections each family's adapter covers.
TARGETS = {
    "deepseek_v3": {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"},
    "deepseek_v32": {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"},
    "deepseek_v4": {"q_a_proj", "q_b_proj", "kv_proj", "o_b_proj"},
    "deepseek_v2": {"q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"},
    "qwen2": {"q_proj", "k_proj", "v_proj", "o_proj"},
    "qwen3": {"q_proj", "k_proj", "v_proj", "o_proj"},
    "llama": {"q_proj", "k_proj", "v_proj", "o_proj"},
}


@pytest.mark.parametrize("family", sorted(TARGETS))
def test_each_family_trains_a_dp_round_on_its_attention_projections(
    run_config: RunConfig, demo_root, tmp_path, tiny_checkpoints, family
):
    path = tiny_checkpoints[family]
    run = run_config.updated(  # the round alone (no DP count first: the trainer's own test)
        **{"model_path": str(path), "local_steps": 2, "seq_len": 64, "num_server_rounds": 1},
        **EXACT_RELEASES,
    )
    region = Region(
        run, NodeConfig(region="eu", data_path=str(demo_root / "eu"), state_path=str(tmp_path))
    )
    try:
        outcome = region.train_round(
            region.model.adapter_state(),
            server_round=1,
            base_fingerprint=region.model.base_fingerprint,
            run_id=5,
        )
        assert outcome.privacy is not None and outcome.privacy.epsilon > 0
        assert outcome.stats.steps == 2
        assert any(float(abs(d).max()) > 0 for d in outcome.delta.values())
        saved = region.model.save_adapter(tmp_path / "adapter").parent
    finally:
        region.close()
    config = json.loads((saved / "adapter_config.json").read_text())
    assert {name.rsplit(".", 1)[-1] for name in config["target_modules"]} == TARGETS[family]
    assert config["base_model_name_or_path"] == str(path)
