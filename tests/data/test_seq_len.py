"""Records longer than seq-len: dropped with the reason and the remedy, or (with
truncation-side = "left") kept with their prompt cut from the start."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fedciuic.config import Fields, NodeConfig
from fedciuic.data.check import check_data
from fedciuic.data.corpus import RegionData, load_region_data
from fedciuic.data.records import ALPACA_PROMPT
from fedciuic.data.tokenized import IGNORE
from fedciuic.errors import DataError
from fedciuic.model.presets import TINY_VOCAB_SIZE, bpe_tokenizer
from tests.data.helpers import data_run


@pytest.fixture(scope="module")
def tokenizer():
    return bpe_tokenizer(TINY_VOCAB_SIZE)


#: Alpaca records whose preamble alone is longer than seq-len 32.
ALPACA = [
    {"instruction": f"Name law {i}.", "input": "", "output": f"Law {i}.", "user_id": f"u{i % 3}"}
    for i in range(12)
]
#: The longest, whose output has more tokens than seq-len 32.
LONG_OUTPUT = {"instruction": "Recite.", "input": "", "output": "data stays home; " * 12}


def write(root: Path, rows: list[dict[str, Any]]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return root


def load(root: Path, tokenizer: Any, **changes: Any) -> RegionData:
    node = NodeConfig(region="eu", data_path=str(root), state_path=str(root.parent / "state"))
    return load_region_data(data_run(**changes), node, tokenizer)


def tokens(tokenizer: Any, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def prompt_of(tokenizer: Any, row: dict[str, Any]) -> str:
    return str(tokenizer.bos_token) + ALPACA_PROMPT.format(instruction=row["instruction"])


def test_records_dropped_for_length_are_declined_with_why_and_the_remedy(tmp_path, tokenizer):
    root = write(tmp_path / "eu", ALPACA)
    prompts = [tokens(tokenizer, prompt_of(tokenizer, r)) for r in ALPACA]
    assert min(prompts) > 32  # the preamble alone does not fit
    wholes = [
        p + tokens(tokenizer, r["output"] + tokenizer.eos_token)
        for p, r in zip(prompts, ALPACA, strict=True)
    ]
    with pytest.raises(DataError) as err:
        load(root, tokenizer, **{"seq-len": 32})
    text = str(err.value)
    assert f"gives 0 example(s) from {len(ALPACA)} record(s)" in text
    assert "add records" not in text
    assert (
        f"{len(ALPACA)} record(s) dropped for length: no token of their response fits in "
        f"seq-len 32 (the shortest prompt is {min(prompts)} tokens; seq-len "
        f"{max(prompts) + 1} keeps a part of every response, {max(wholes)} keeps them whole); "
        'raise seq-len, or set truncation-side = "left" to cut prompts from the start so '
        "that the responses fit (docs/data.md)"
    ) in text
    # The seq-len it names keeps them: every record gives an example.
    assert load(root, tokenizer, **{"seq-len": max(prompts) + 1}).summary.dropped == 0  # fmt: skip


def test_data_check_says_why_records_were_dropped(tmp_path, tokenizer):
    root = write(tmp_path / "eu", ALPACA)
    checked = check_data(root, tokenizer, seq_len=32, fields=Fields(), tokenizer_name="bpe")
    assert not checked.ok
    lines = checked.lines("user_id")
    dropped = [line for line in lines if "dropped for length" in line]
    assert len(dropped) == 1 and 'truncation-side = "left"' in dropped[0]
    left = check_data(
        root, tokenizer, seq_len=32, fields=Fields(), tokenizer_name="bpe", truncation_side="left"
    )
    assert left.ok and left.summary.examples == len(ALPACA) and left.summary.dropped == 0


def test_left_truncation_cuts_the_prompt_from_its_start_and_keeps_the_response(tmp_path, tokenizer):
    root = write(tmp_path / "eu", [*ALPACA, LONG_OUTPUT])
    data = load(
        root, tokenizer, **{"seq-len": 32, "truncation-side": "left", "eval-fraction": 0.01}
    )
    s = data.summary
    assert s.dropped == 0 and s.examples == len(ALPACA) + 1 and s.truncated == len(ALPACA) + 1
    table = data.train.table
    for i in range(table.num_rows):
        ids, labels = table[i]["input_ids"], table[i]["labels"]
        row = [*ALPACA, LONG_OUTPUT][table[i]["record"]]
        assert len(ids) == 32
        first = next(k for k, label in enumerate(labels) if label != IGNORE)
        assert all(label == IGNORE for label in labels[:first])
        assert labels[first:] == ids[first:]  # the response, from its first token on
        prompt, response = tokenizer.decode(ids[:first]), tokenizer.decode(ids[first:])
        assert prompt_of(tokenizer, row).endswith(prompt)  # the prompt's end
        if row is LONG_OUTPUT:
            # Longer than seq-len: half of it is the prompt's end, then the response's start.
            assert first == 16 and (row["output"] + tokenizer.eos_token).startswith(response)
        else:
            assert response == row["output"] + tokenizer.eos_token  # whole
    # The default keeps a record's first seq-len tokens: these are all prompt.
    with pytest.raises(DataError, match="dropped for length"):
        load(root, tokenizer, **{"seq-len": 32})


def test_the_truncation_side_is_part_of_the_cache_key(tmp_path, tokenizer):
    root = write(tmp_path / "eu", [*ALPACA, {"prompt": "p ", "response": "r"}, {"text": "t " * 9}])
    right = load(root, tokenizer, **{"seq-len": 32, "eval-fraction": 0.01})
    left = load(
        root, tokenizer, **{"seq-len": 32, "eval-fraction": 0.01, "truncation-side": "left"}
    )
    assert left.tokenised_now and left.cache != right.cache
    assert (right.summary.dropped, left.summary.dropped) == (len(ALPACA), 0)
