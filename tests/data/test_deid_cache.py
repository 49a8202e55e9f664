"""De-identification before tokenising: no identifier it finds reaches the region's
tokenisation cache, in any record shape, and the cache's key covers its config."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import datasets
import pytest

from fedciuic.config import NodeConfig
from fedciuic.data.corpus import RegionData, load_region_data
from fedciuic.data.tokenized import EXAMPLES_FILE, INPUT_IDS
from fedciuic.model.presets import TINY_VOCAB_SIZE, bpe_tokenizer
from tests.data.helpers import data_run
from tests.deid.test_pipeline import CN_MOBILES, PLANTED


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return bpe_tokenizer(TINY_VOCAB_SIZE)


VALUES = [value for value, _ in PLANTED.values()] + list(CN_MOBILES)
SIGNED = "Records: " + "; ".join(VALUES) + "."


def region(root: Path) -> NodeConfig:
    """A region whose every record shape holds every planted identifier."""
    data = root / "eu"
    data.mkdir(parents=True)
    chat = {
        "messages": [
            {"role": "user", "content": SIGNED},
            {"role": "assistant", "content": "Noted: " + SIGNED},
        ]
    }
    rows: dict[str, list[dict[str, Any]]] = {
        "chat.jsonl": [chat],
        "alpaca.jsonl": [{"instruction": SIGNED, "input": SIGNED, "output": SIGNED}],
    }
    for name, records in rows.items():
        (data / name).write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    # A table read through `datasets` (streamed: no Arrow copy of the raw rows is kept).
    datasets.Dataset.from_list([{"prompt": SIGNED, "response": SIGNED}]).to_csv(
        str(data / "pairs.csv"), index=False
    )
    (data / "notes.txt").write_text(SIGNED * 2, encoding="utf-8")
    names = root / "customers.txt"
    names.write_text("Zhang Wei\n", encoding="utf-8")
    return NodeConfig(
        region="eu", data_path=str(data), state_path=str(root / "state"), deid_dictionary=str(names)
    )


def load(node: NodeConfig, tokenizer: Any, **changes: Any) -> RegionData:
    # Room for the longest record in every variant: raw identifiers and pseudonyms
    # tokenise to many more tokens with a tokenizer trained per session than with a real one.
    run = data_run(**{"eval-fraction": 0.3, "seq-len": 2048, **changes})
    return load_region_data(run, node, tokenizer)


def squeezed(text: str) -> str:
    return "".join(text.split()).casefold()


def test_planted_identifiers_of_every_type_and_shape_never_reach_the_cache(tmp_path, tokenizer):
    node = region(tmp_path)
    data = load(node, tokenizer)
    assert data.summary.shapes == {"chat": 1, "alpaca": 1, "prompt-response": 1, "text": 1}
    # Read the cache back as training reads it, and the bytes of every file it holds.
    cached = datasets.Dataset.from_file(str(data.cache / EXAMPLES_FILE))
    text = squeezed(" ".join(tokenizer.decode(row[INPUT_IDS]) for row in cached))
    assert "<email>" in text and "<cn_id>" in text and "<name>" in text
    # Nothing the region keeps in its state (the cache, its scratch, file digests) holds one.
    state = Path(node.state_path)
    raw = b"".join(p.read_bytes() for p in state.rglob("*") if p.is_file())
    for value in VALUES:
        assert squeezed(value) not in text, value
        assert value.encode() not in raw, value
    # Every field of every shape was scrubbed: 8 fields hold SIGNED (chat: 2, alpaca: 3,
    # prompt-response: 2, text: 1, holding it twice) and each holds every value once.
    deid = data.summary.deid
    assert deid is not None and deid.records == 4
    expected = {entity: 9 for entity in PLANTED} | {"PHONE_NUMBER": 9 * (1 + len(CN_MOBILES))}
    assert deid.counts == expected
    assert set(deid.files) == {"chat.jsonl", "alpaca.jsonl", "pairs.csv", "notes.txt"}
    assert data.deidentified == tuple(deid.identity["entities"])


def test_the_cache_key_covers_the_deidentification_config(tmp_path, tokenizer):
    node = region(tmp_path)
    first = load(node, tokenizer)
    assert first.tokenised_now
    again = load(node, tokenizer)
    assert not again.tokenised_now and again.cache == first.cache  # read back, not redone
    for changes in (
        {"deid-replacement": "pseudonym"},
        {"deid-entities": "EMAIL_ADDRESS"},
        {"deidentify": False},
    ):
        other = load(node, tokenizer, **changes)
        assert other.tokenised_now and other.cache != first.cache, changes
    names = Path(node.deid_dictionary)
    names.write_text("Zhang Wei\nJane Roe\n", encoding="utf-8")
    assert load(node, tokenizer).cache != first.cache  # another dictionary, another key


def test_with_deidentification_off_the_identifiers_stay_and_nothing_is_counted(tmp_path, tokenizer):
    data = load(region(tmp_path), tokenizer, deidentify=False)
    assert data.summary.deid is None and data.deidentified == ()
    cached = datasets.Dataset.from_file(str(data.cache / EXAMPLES_FILE))
    text = squeezed(" ".join(tokenizer.decode(row[INPUT_IDS]) for row in cached))
    assert squeezed("jane.roe@example.org") in text
