"""The bank categorisation task (benchmarks/bank_tasks.py): deterministic, non-IID by
region, held out apart, read by a region as written, and scored on a real model."""

from __future__ import annotations

import itertools
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from fedciuic.config import Fields
from fedciuic.data.check import check_data
from fedciuic.model.presets import byte_tokenizer, preset_config
from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))  # as run_all.py runs them: scripts, not a package
from bank_tasks import (
    HELDOUT_FOLDER,
    KINDS,
    MESSAGES,
    TEST_FILE,
    TRAIN_FILE,
    USER_ID,
    VALIDATION_FILE,
    answer_of,
    chance,
    description_of,
    kind_of,
    read_records,
    reply_ids,
    scheme,
    score_exact,
    score_ranked,
    task_records,
    write_task_corpora,
)

REGIONS = ("eu", "cn", "us", "sg")


def tree(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def test_same_seed_gives_identical_files_and_different_seeds_differ(tmp_path):
    for name, seed in (("a", 3), ("b", 3), ("c", 4)):
        write_task_corpora(tmp_path / name, REGIONS, 30, 5, 10, seed=seed)
    first, again, other = (tree(tmp_path / n) for n in "abc")
    assert first == again
    assert len(first) == 4 * len(REGIONS)  # training file, validation, test, scheme
    assert first.keys() == other.keys()
    for region in REGIONS:
        for name in (TRAIN_FILE, f"{HELDOUT_FOLDER}/{VALIDATION_FILE}"):
            assert first[f"{region}/{name}"] != other[f"{region}/{name}"]
        # The scheme is the region's, whatever the seed.
        assert (
            first[f"{region}/{HELDOUT_FOLDER}/scheme.json"]
            == other[f"{region}/{HELDOUT_FOLDER}/scheme.json"]
        )


def best_relabelling(a: str, b: str) -> float:
    """The share of merchant types on which the best renaming of a's labels to b's agrees."""
    agree = 0
    for label in scheme(a).labels:
        held = Counter(scheme(b).category[k] for k in KINDS if scheme(a).category[k] == label)
        agree += held.most_common(1)[0][1]
    return agree / len(KINDS)


def test_each_region_has_its_own_scheme_and_shared_descriptions_get_different_answers():
    for region in REGIONS:
        found = scheme(region)
        assert 6 <= len(found.labels) <= 8
        assert chance(region) == pytest.approx(1 / len(found.labels))
        assert set(found.category) == set(KINDS)
        assert set(found.category.values()) == set(found.labels)  # every label is used
        assert all(label.upper() not in KINDS for label in found.labels)
    scheme.cache_clear()
    assert scheme("sg") == scheme("sg")  # an unknown region's scheme is drawn the same again
    for a, b in itertools.combinations(REGIONS, 2):
        assert not set(scheme(a).labels) & set(scheme(b).labels)
    for a, b in itertools.permutations(REGIONS, 2):
        shared = [description_of(r) for r in task_records(a, 200, seed=0)]
        differ = sum(scheme(a).answer(d) != scheme(b).answer(d) for d in shared)
        assert differ >= len(shared) / 2
        # Not just other words: no renaming of a's labels gives b's answers for half
        # the merchant types (the groupings differ).
        assert best_relabelling(a, b) < 0.6
    for a, b in itertools.permutations(("eu", "cn", "us"), 2):
        assert best_relabelling(a, b) < 0.5
    # The answer is the merchant type's category, and the label never appears in the
    # description: it cannot be copied, only learnt.
    for region in REGIONS:
        records = task_records(region, 400, seed=0)
        for record in records:
            text = description_of(record)
            assert answer_of(record) == scheme(region).category[kind_of(text)]
            assert answer_of(record).upper() not in text.upper().split()
        # Each label about as common as another: guessing one scores about chance.
        counts = Counter(answer_of(r) for r in records)
        assert set(counts) == set(scheme(region).labels)
        assert max(counts.values()) < 2 * chance(region) * len(records)


def test_train_validation_and_test_are_disjoint(tmp_path):
    splits = write_task_corpora(tmp_path, REGIONS, 120, 20, 40, seed=0)
    for region, split in splits.items():
        parts = [split.train, split.validation, split.test]
        assert [len(p) for p in parts] == [120, 20, 40]
        texts = [{description_of(r) for r in p} for p in parts]
        assert [len(t) for t in texts] == [120, 20, 40]  # no repeat within a split either
        for x, y in itertools.combinations(texts, 2):
            assert not x & y
        assert read_records(split.train_file) == split.train
        assert read_records(split.heldout / VALIDATION_FILE) == split.validation
        assert read_records(split.heldout / TEST_FILE) == split.test
        assert split.heldout == tmp_path / region / HELDOUT_FOLDER
    elsewhere = write_task_corpora(tmp_path / "data", ["eu"], 5, 2, 2, 0, tmp_path / "held")
    assert elsewhere["eu"].heldout == tmp_path / "held" / "eu"
    assert tree(tmp_path / "data") == {f"eu/{TRAIN_FILE}": elsewhere["eu"].train_file.read_bytes()}


def test_records_per_customer_sets_how_many_customers_hold_the_records(tmp_path):
    # The privacy unit is the customer: fewer records each, more units for DP-SGD.
    def customers(per_customer: int) -> int:
        return len({r[USER_ID] for r in task_records("eu", 1000, 0, per_customer)})

    assert customers(1) > 2 * customers(5)
    assert 100 < customers(5) <= 200
    # Who holds a record changes; the records themselves do not.
    many = task_records("eu", 1000, 0, 1)
    few = task_records("eu", 1000, 0, 5)
    assert [r[MESSAGES] for r in many] == [r[MESSAGES] for r in few]
    split = write_task_corpora(tmp_path, ["eu"], 100, 5, 5, seed=0, per_customer=1)["eu"]
    assert len({r[USER_ID] for r in split.train}) > 50  # of 110 ids, with replacement


def test_a_region_reads_the_training_file_as_written(tmp_path):
    splits = write_task_corpora(tmp_path, ["eu", "us"], 40, 10, 10, seed=1)
    tokenizer = byte_tokenizer()
    for region in ("eu", "us"):
        checked = check_data(
            tmp_path / region, tokenizer, seq_len=512, fields=Fields(), tokenizer_name="byte"
        )
        summary = checked.summary
        assert checked.ok
        assert summary.files == {TRAIN_FILE: "jsonl"}  # the hidden held-out folder is not read
        assert summary.records == summary.examples == len(splits[region].train) == 40
        assert summary.shapes == {"chat": 40}
        assert summary.bad_rows == summary.dropped == summary.truncated == 0
        assert summary.without_user == 0 and summary.users > 1


@pytest.fixture(scope="module")
def tiny() -> tuple[Any, Any]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(preset_config("tiny"))
    return model, byte_tokenizer()


def test_scores_run_on_the_tiny_preset_and_are_accuracies(tiny):
    model, tokenizer = tiny
    records = task_records("cn", 4, seed=0)
    labels = scheme("cn").labels
    exact = score_exact(model, tokenizer, records, labels, max_new_tokens=12)
    ranked = score_ranked(model, tokenizer, records, labels)
    assert 0.0 <= exact <= 1.0 and 0.0 <= ranked <= 1.0
    assert ranked * len(records) == round(ranked * len(records))
    assert model.training  # left as it was
    with pytest.raises(ValueError, match="not among the labels"):
        score_ranked(model, tokenizer, records, scheme("eu").labels)


class Oracle(torch.nn.Module):
    """A "model" that knows the right reply to each prompt: it predicts its tokens, and
    writes them when asked to generate."""

    def __init__(self, answers: list[list[int]], vocab: int) -> None:
        super().__init__()
        self.answers, self.vocab = answers, vocab
        self.generation_config = SimpleNamespace(eos_token_id=None)

    def _known(self, ids: list[int]) -> list[int]:
        def shared(known: list[int]) -> int:
            pairs = enumerate(zip(known, ids, strict=False))
            return next((i for i, (x, y) in pairs if x != y), len(ids))

        return max(self.answers, key=shared)

    def forward(self, input_ids: torch.Tensor) -> SimpleNamespace:
        ids = input_ids[0].tolist()
        known = self._known(ids)
        logits = torch.zeros(1, len(ids), self.vocab)
        for i in range(min(len(ids), len(known) - 1)):
            logits[0, i, known[i + 1]] = 30.0
        return SimpleNamespace(logits=logits)

    def generate(self, inputs: torch.Tensor, *, max_new_tokens: int, **_: Any) -> torch.Tensor:
        ids = inputs[0].tolist()
        return torch.tensor([self._known(ids)[: len(ids) + max_new_tokens]])


def test_a_model_that_knows_the_answers_scores_one():
    tokenizer = byte_tokenizer()
    records = task_records("eu", 4, seed=2)
    answers = []
    for record in records:
        prompt, answer = reply_ids(tokenizer, record, answer_of(record))
        answers.append(prompt + answer)
    oracle = Oracle(answers, len(tokenizer))
    labels = scheme("eu").labels
    assert score_ranked(oracle, tokenizer, records, labels) == 1.0
    # Bytes: a label of up to 12 letters and the end of the turn, and the end is cut off.
    assert score_exact(oracle, tokenizer, records, labels, max_new_tokens=40) == 1.0
    assert score_exact(oracle, tokenizer, records, labels, max_new_tokens=3) == 0.0
