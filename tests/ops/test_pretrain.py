"""The pretrained base of the quality benchmarks: public text that no region's data is
made of, a learning-rate schedule over any budget, and a base that loads through
model-path, cached by its recipe."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch

from fedciuic.config import ModelSpec
from fedciuic.data.demo import FAMILIES, module_docs
from fedciuic.model.adapter import build_base
from fedciuic.model.presets import preset_tokenizer
from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))  # as run_all.py runs them: scripts, not a package
import pretrain


def test_the_public_text_holds_nothing_of_the_regions_data():
    texts = pretrain.public_text()
    regional = {doc for region in FAMILIES for doc in module_docs(FAMILIES[region])}
    assert len(texts) > 500 and sum(map(len, texts)) > 500_000
    assert not regional & set(texts) and len(set(texts)) == len(texts)
    held = [t for t in texts if pretrain.held_out(t)]
    assert 0.02 < len(held) / len(texts) < 0.1


def test_texts_are_packed_between_bos_and_eos_into_full_rows():
    tokenizer = preset_tokenizer("tiny")
    rows = pretrain.pack(["abc", "de"], tokenizer, 4)
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    a, b, c, d, e = tokenizer.encode("abcde", add_special_tokens=False)
    assert rows.tolist() == [[bos, a, b, c], [eos, bos, d, e]]  # a partial row is dropped


@pytest.mark.parametrize(("steps", "minutes"), [(40, None), (None, 2.0)])
def test_the_learning_rate_warms_up_then_decays_to_a_tenth(steps, minutes):
    recipe = pretrain.Recipe("tiny", steps, minutes)
    at = [recipe.learning_rate_at(p / 20) for p in range(21)]
    peak = recipe.learning_rate
    assert at[0] == pytest.approx(0.1 * peak) and max(at) == pytest.approx(peak)
    assert at[-1] == pytest.approx(0.1 * peak) and at.index(max(at)) == 2
    assert recipe.progress(10, 30.0) == 0.25


def test_a_pretrained_base_loads_through_model_path_and_is_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDCIUIC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(pretrain, "EVAL_ROWS", 2)
    recipe = pretrain.Recipe("tiny", steps=2, minutes=None, batch_size=2, seq_len=32)
    settings = {"regions": "eu", "seq-len": 64, "max-eval-examples": 4, "batch-size": 4}
    folder, record = pretrain.pretrained_base(recipe, settings)
    assert folder.parent == tmp_path / "cache" / "pretrained" and folder.name.startswith("tiny-")
    assert record["steps"] == 2 and record["tokens_seen"] == 2 * 2 * 32
    assert record["after"]["heldout_text_loss"] < record["before"]["heldout_text_loss"]
    assert json.loads((folder / pretrain.RECORD).read_text()) == record
    base = build_base(ModelSpec(model_path=str(folder)), torch.device("cpu"))  # the real route
    assert base.fingerprint == record["fingerprint"]
    monkeypatch.setattr(pretrain, "train", None)  # cached: nothing trains again
    assert pretrain.pretrained_base(recipe, settings) == (folder, record)


def test_the_unigram_reference_scores_the_held_out_rows_by_token_frequency():
    train, held = torch.tensor([[0, 0, 0, 1]]), torch.tensor([[2, 0, 1]])
    # add-one counts 4, 2, 1 of 7; the first token of a row is not predicted
    expected = -(math.log(4 / 7) + math.log(2 / 7)) / 2
    assert pretrain.unigram_loss(train, held, 3) == pytest.approx(expected)
