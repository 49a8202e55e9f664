"""Record shapes, where the loss is taken (-100 elsewhere), and documents kept apart."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from fedciuic.config import Fields, ModelSpec, NodeConfig, RunConfig
from fedciuic.data.corpus import ExampleSet, load_region_data
from fedciuic.data.records import (
    ALPACA_PROMPT,
    ALPACA_PROMPT_WITH_INPUT,
    BadRecord,
    Renderer,
    parse_record,
)
from fedciuic.data.tokenized import IGNORE
from fedciuic.errors import DataError
from fedciuic.model.adapter import AdapterModel
from fedciuic.model.presets import TINY_VOCAB_SIZE, bpe_tokenizer
from fedciuic.model.train import example_losses, shifted_logits
from tests.data.helpers import data_run


@pytest.fixture(scope="module")
def tokenizer():
    return bpe_tokenizer(TINY_VOCAB_SIZE)


def _configs(tmp_path: Path, **changes: Any) -> tuple[RunConfig, NodeConfig]:
    run = data_run(**{"seq-len": 256, "eval-fraction": 0.01, **changes})
    root = tmp_path / "eu"
    return run, NodeConfig(region="eu", data_path=str(root), state_path=str(tmp_path / "state"))


def examples(tmp_path: Path, tokenizer: Any, rows: list[dict[str, Any]], **changes: Any):
    """Every example of ``rows`` (one file), as (ids, labels) lists, in file order."""
    root = tmp_path / "eu"
    root.mkdir(exist_ok=True)
    (root / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = load_region_data(*_configs(tmp_path, **changes), tokenizer)
    table = data.train.table
    order = sorted(range(table.num_rows), key=lambda i: table[i]["record"])
    return [(table[i]["input_ids"], table[i]["labels"]) for i in order]


def trained_text(tokenizer: Any, ids: list[int], labels: list[int]) -> str:
    return str(
        tokenizer.decode([i for i, label in zip(ids, labels, strict=True) if label != IGNORE])
    )


def untrained_text(tokenizer: Any, ids: list[int], labels: list[int]) -> str:
    return str(
        tokenizer.decode([i for i, label in zip(ids, labels, strict=True) if label == IGNORE])
    )


FILLER = {"text": "filler so that the split has a second record " * 2}


def test_text_records_train_on_every_token_but_the_first(tmp_path, tokenizer):
    [(ids, labels), _] = examples(tmp_path, tokenizer, [{"text": "Data stays home."}, FILLER])
    assert labels[1:] == ids[1:]
    assert tokenizer.decode(ids) == f"{tokenizer.bos_token}Data stays home.{tokenizer.eos_token}"


def test_prompt_response_labels_are_minus_100_exactly_on_the_prompt(tmp_path, tokenizer):
    rows = [{"prompt": "Where does data stay? ", "response": "At home."}, FILLER]
    (ids, labels), _ = examples(tmp_path, tokenizer, rows)
    assert trained_text(tokenizer, ids, labels) == f"At home.{tokenizer.eos_token}"
    assert untrained_text(tokenizer, ids, labels) == f"{tokenizer.bos_token}Where does data stay? "
    # The mask is one prefix: no prompt token is trained on, no response token is not.
    first = next(i for i, label in enumerate(labels) if label != IGNORE)
    assert all(label == IGNORE for label in labels[:first])
    assert labels[first:] == ids[first:]


def test_alpaca_records_use_alpacas_prompt_and_train_on_the_output(tmp_path, tokenizer):
    rows = [
        {"instruction": "Name the law.", "input": "", "output": "GDPR"},
        {"instruction": "Translate", "input": "Daten", "output": "data"},
    ]
    (a_ids, a_labels), (b_ids, b_labels) = examples(tmp_path, tokenizer, rows)
    bos = tokenizer.bos_token
    assert untrained_text(tokenizer, a_ids, a_labels) == bos + ALPACA_PROMPT.format(
        instruction="Name the law."
    )
    assert trained_text(tokenizer, a_ids, a_labels) == "GDPR" + tokenizer.eos_token
    assert untrained_text(tokenizer, b_ids, b_labels) == bos + ALPACA_PROMPT_WITH_INPUT.format(
        instruction="Translate", input="Daten"
    )


def test_chat_records_train_on_the_assistant_turns_only(tmp_path, tokenizer):
    chat = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Who checks?"},
            {"role": "assistant", "content": "Both ends."},
            {"role": "user", "content": "And the relay?"},
            {"role": "assistant", "content": "Sees ciphertext."},
        ]
    }
    (ids, labels), _ = examples(tmp_path, tokenizer, [chat, FILLER])
    eos = tokenizer.eos_token
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(chat["messages"], tokenize=False)
    assert trained_text(tokenizer, ids, labels) == f"Both ends.{eos}Sees ciphertext.{eos}"
    untrained = untrained_text(tokenizer, ids, labels)
    for text in ("Be brief.", "Who checks?", "And the relay?"):
        assert text in untrained


def test_a_chat_record_without_a_template_is_refused_as_the_models_problem(tmp_path):
    plain = bpe_tokenizer(TINY_VOCAB_SIZE)
    plain.chat_template = None
    record = parse_record({"messages": [{"role": "assistant", "content": "hi"}]}, Fields())
    with pytest.raises(DataError, match="no usable chat template"):
        Renderer(plain).render(record)


def test_a_response_cut_off_by_seq_len_drops_the_record(tmp_path, tokenizer):
    rows = [{"prompt": "long prompt " * 40, "response": "lost"}, FILLER, {"text": "more " * 30}]
    root = tmp_path
    got = examples(root, tokenizer, rows, **{"seq-len": 32})
    assert len(got) >= 2  # the filler records (chunked text), not the prompt
    assert all("lost" not in tokenizer.decode(ids) for ids, _ in got)


@pytest.mark.parametrize(
    ("row", "field"),
    [
        ({"prompt": "p"}, "response"),
        ({"instruction": "i"}, "output"),
        ({"instruction": "i", "input": 3, "output": "o"}, "input"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "only a question"}]}, "messages"),
        ({"messages": [{"role": "user", "content": 1}]}, "messages[0].content"),
        ({"text": "t", "user_id": ["a"]}, "user_id"),
        ({"text": "   "}, "text"),
    ],
)
def test_each_bad_record_names_its_field(row, field):
    with pytest.raises(BadRecord) as err:
        parse_record(row, Fields())
    assert err.value.field == field


def test_field_names_are_configurable(tmp_path, tokenizer):
    fields = Fields(prompt_field="question", response_field="answer", user_id_field="customer")
    record = parse_record({"question": "q?", "answer": "a.", "customer": 42}, fields)
    assert record.shape == "prompt-response" and record.parts == ("q?", "a.")
    assert record.user == "42"
    rows = [{"question": "Q? ", "answer": "A."}, FILLER]
    (ids, labels), _ = examples(
        tmp_path, tokenizer, rows, **{"prompt-field": "question", "response-field": "answer"}
    )
    assert trained_text(tokenizer, ids, labels) == "A." + tokenizer.eos_token


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen2"])
def test_documents_in_one_batch_do_not_attend_to_each_other(tmp_path, tiny_checkpoints, family):
    """Each row is one document, padded: its logits are those it has alone."""
    model = AdapterModel(
        ModelSpec(model_path=str(tiny_checkpoints[family])), device=torch.device("cpu")
    )
    model.model.eval()
    rows = [
        {"text": "A short document."},
        {"text": "A much longer document about something else entirely, with more words."},
    ]
    examples(tmp_path, model.tokenizer, rows)  # tokenised into the region's cache
    data = load_region_data(*_configs(tmp_path), model.tokenizer)
    table = data.train.table
    both = ExampleSet(table, np.arange(table.num_rows), np.arange(table.num_rows), pad_id=0)
    batch = both.batch([0, 1])
    assert len(batch) == 2 and bool((batch.attention_mask == 0).any())  # one is padded
    with torch.no_grad():
        logits, _ = shifted_logits(model.model, batch)
        losses = example_losses(model.model, batch)
        for row in range(2):
            alone = both.batch([row])
            alone_logits, _ = shifted_logits(model.model, alone)
            n = alone_logits.shape[1]
            torch.testing.assert_close(logits[row, :n], alone_logits[0], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(losses[row], example_losses(model.model, alone)[0])
