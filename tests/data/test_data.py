"""A region's data: every format, bad rows, the tokenise-once cache, the split and the units."""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

import datasets
import pytest

from fedciuic.config import Fields, NodeConfig, RunConfig
from fedciuic.data import corpus, tokenized
from fedciuic.data.check import check_data
from fedciuic.data.corpus import RegionData, load_region_data, region_fingerprint
from fedciuic.data.sources import discover
from fedciuic.errors import DataError
from fedciuic.model.presets import TINY_VOCAB_SIZE, bpe_tokenizer
from tests.conftest import within
from tests.data.helpers import data_run


@pytest.fixture(scope="module")
def tokenizer():
    return bpe_tokenizer(TINY_VOCAB_SIZE)


#: One record of each shape, each from a named user.
RECORDS: list[dict[str, Any]] = [
    {"text": "Personal data stays in its region. " * 3, "user_id": "ana"},
    {"prompt": "Where does the data stay? ", "response": "In its region.", "user_id": "ben"},
    {"instruction": "Name the law.", "input": "", "output": "GDPR", "user_id": "ana"},
    {"instruction": "Translate", "input": "Daten", "output": "data", "user_id": 7},
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Who checks the policy?"},
            {"role": "assistant", "content": "Both ends."},
        ],
        "user_id": "ben",
    },
]


def run(**changes: Any) -> RunConfig:
    return data_run(**changes)


def load(root: Path, tokenizer: Any, **changes: Any) -> RegionData:
    node = NodeConfig(region="eu", data_path=str(root), state_path=str(root.parent / "state"))
    return load_region_data(run(**changes), node, tokenizer)


def jsonl(path: Path, rows: list[Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def flat(record: dict[str, Any]) -> dict[str, Any]:
    """A record as a CSV row holds it (no nested chat turns)."""
    return {k: (json.dumps(v) if isinstance(v, list) else v) for k, v in record.items()}


FLAT = [r for r in RECORDS if "messages" not in r]


def write_format(root: Path, kind: str) -> int:
    """``RECORDS`` (or their flat ones) in one file of ``kind``; returns how many."""
    root.mkdir(parents=True)
    # One type per column, every column in every row (as a table holds them).
    columns = sorted({k for r in RECORDS for k in r})
    rows = [{k: r.get(k) for k in columns} | {"user_id": str(r["user_id"])} for r in RECORDS]
    if kind == "jsonl":
        jsonl(root / "a.jsonl", rows)
    elif kind == "json":
        (root / "a.json").write_text(json.dumps(rows), encoding="utf-8")
    elif kind == "parquet":
        datasets.Dataset.from_list(rows).to_parquet(str(root / "a.parquet"))
    elif kind == "saved":
        datasets.Dataset.from_list(rows).save_to_disk(str(root / "saved"))
    elif kind == "csv":
        flat_columns = sorted({k for r in FLAT for k in r})
        table = [
            {k: flat(r).get(k) for k in flat_columns} | {"user_id": str(r["user_id"])} for r in FLAT
        ]
        datasets.Dataset.from_list(table).to_csv(str(root / "a.csv"), index=False)
        return len(FLAT)
    return len(rows)


@pytest.mark.parametrize("kind", ["jsonl", "json", "parquet", "saved", "csv"])
def test_each_format_gives_every_record_shape(tmp_path, tokenizer, kind):
    n = write_format(tmp_path / "eu", kind)
    data = load(tmp_path / "eu", tokenizer, **{"eval-fraction": 0.01})
    assert data.summary.records == n and data.summary.bad_rows == 0
    want = {"text": 1, "prompt-response": 1, "alpaca": 2, "chat": 1}
    if kind == "csv":
        del want["chat"]
    assert data.summary.shapes == want
    assert data.summary.users == 3  # ana, ben and "7"
    assert len(data.train) + len(data.eval) == data.summary.examples


def test_text_files_are_one_record_each_and_other_files_are_not_data(tmp_path, tokenizer):
    root = tmp_path / "eu"
    root.mkdir()
    (root / "notes.txt").write_text("Personal data stays in its region. " * 4)
    (root / "more.txt").write_text("And so do its people. " * 4)
    (root / "README.md").write_text("not data")
    (root / ".fedciuic").mkdir()
    (root / ".fedciuic" / "x.jsonl").write_text("{}")  # state, not data
    assert [s.name for s in discover(root)] == ["more.txt", "notes.txt"]
    data = load(root, tokenizer, **{"eval-fraction": 0.01, "seq-len": 16})
    assert data.summary.records == 2 and data.summary.shapes == {"text": 2}
    assert data.summary.examples > 2  # a long text record is split into seq-len chunks


def test_a_text_file_is_a_record_under_the_configured_text_field(tmp_path, tokenizer):
    root = tmp_path / "eu"
    root.mkdir()
    (root / "a.txt").write_text("Personal data stays in its region. " * 4)
    (root / "b.txt").write_text("And so do its people. " * 4)
    data = load(root, tokenizer, **{"text-field": "body", "eval-fraction": 0.01})
    assert data.summary.shapes == {"text": 2} and data.summary.bad_rows == 0


def test_datasets_never_goes_online():
    import datasets

    assert datasets.config.HF_HUB_OFFLINE and datasets.config.HF_DATASETS_OFFLINE


def test_a_dataset_dict_folder_is_refused_with_the_fix(tmp_path, tokenizer):
    d = datasets.DatasetDict({"train": datasets.Dataset.from_list([{"text": "x"}])})
    d.save_to_disk(str(tmp_path / "eu" / "splits"))
    with pytest.raises(DataError, match=r"splits: a DatasetDict .*save_to_disk"):
        discover(tmp_path / "eu")


class OpenRecorder:
    """Records every file a piece of code opens, through Python's audit hooks."""

    active: list[str] | None = None
    installed = False

    def __enter__(self) -> list[str]:
        if not OpenRecorder.installed:
            sys.addaudithook(OpenRecorder._hook)
            OpenRecorder.installed = True
        OpenRecorder.active = []
        return OpenRecorder.active

    def __exit__(self, *exc: object) -> None:
        OpenRecorder.active = None

    @staticmethod
    def _hook(event: str, args: tuple[object, ...]) -> None:
        if event == "open" and OpenRecorder.active is not None and isinstance(args[0], str):
            OpenRecorder.active.append(args[0])


def test_a_region_opens_only_files_under_its_own_data_path_and_state(tmp_path, tokenizer):
    eu = tmp_path / "regions" / "eu"
    jsonl(eu / "a.jsonl", RECORDS)
    jsonl(tmp_path / "regions" / "cn" / "a.jsonl", RECORDS)
    with OpenRecorder() as opened:
        load(eu, tokenizer)
    assert any(p.startswith(str(eu)) for p in opened), "the loader opened no data file"
    assert not [p for p in opened if p.startswith(str(tmp_path / "regions" / "cn"))]
    for path in (p for p in opened if p.startswith(str(tmp_path / "regions" / "cn"))):
        assert Path(path).resolve().is_relative_to(eu.resolve()), path


def test_symlinks_out_of_the_data_path_are_refused(tmp_path, tokenizer):
    eu = tmp_path / "eu"
    cn = tmp_path / "cn"
    jsonl(eu / "a.jsonl", RECORDS)
    jsonl(cn / "a.jsonl", RECORDS)
    (eu / "borrowed.jsonl").symlink_to(cn / "a.jsonl")
    with OpenRecorder() as opened, pytest.raises(DataError, match="links outside data-path"):
        load(eu, tokenizer)
    assert not [p for p in opened if p.startswith(str(cn))]
    (eu / "borrowed.jsonl").unlink()
    (eu / "more").symlink_to(cn, target_is_directory=True)
    with pytest.raises(DataError, match="links outside data-path"):
        discover(eu)


def test_a_fifo_named_like_a_data_file_is_refused_at_once_naming_it(tmp_path, tokenizer):
    """Old code waited forever for a writer, in `fedciuic data check` and a region's round."""
    eu = tmp_path / "eu"
    jsonl(eu / "a.jsonl", RECORDS)
    fifo = eu / "b.jsonl"
    os.mkfifo(fifo)
    fields = run().fields
    for call in (
        lambda: check_data(eu, tokenizer, seq_len=128, fields=fields, tokenizer_name="bpe"),
        lambda: load(eu, tokenizer),
    ):
        refused = within(10, call, fifo=fifo)
        assert isinstance(refused, DataError)
        message = str(refused)
        assert "\n" not in message
        assert message.startswith(f"{fifo}: a FIFO (named pipe), not a regular file; ")
        assert "put the data file itself there, or remove this entry" in message


@pytest.mark.parametrize("entry", ["loop", "dangling", "socket"])
def test_an_entry_that_is_no_data_file_is_refused_in_one_line_saying_what_it_is(
    tmp_path, tokenizer, entry
):
    """Old code: a traceback for a symlink loop; the others were listed as data, then
    "cannot read (...); check its permissions"."""
    eu = tmp_path / "eu"
    jsonl(eu / "a.jsonl", RECORDS)
    bad = eu / "b.jsonl"
    if entry == "loop":
        bad.symlink_to(bad)
        what = "a symlink loop"
    elif entry == "dangling":
        bad.symlink_to(eu / "gone.jsonl")
        what = f"a dangling symlink (to {eu / 'gone.jsonl'}: No such file or directory)"
    else:
        with socket.socket(socket.AF_UNIX) as listening:
            listening.bind(str(bad))
        what = "a socket"
    for call in (lambda: discover(eu), lambda: load(eu, tokenizer)):
        with pytest.raises(DataError) as refused:
            call()
        assert "\n" not in str(refused.value)
        assert str(refused.value).startswith(f"{bad}: {what}, not a regular file; ")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b'{"text": "ok"}\n{broken\n', r"a\.jsonl:2: invalid JSON \(Expecting property name"),
        (b'{"text": "ok"}\n\n{"prompt": "p"}\n', r"a\.jsonl:3: response: missing"),
        (b'{"text": "ok"}\n{"text": 5}\n', r"a\.jsonl:2: text: expected a string, got a number"),
        (b'{"text": "ok"}\n{"txt": "no"}\n', r"a\.jsonl:2: record: no text, prompt/response"),
        (b'{"text": "ok"}\n{"text": "\xff"}\n', r"a\.jsonl:2: not UTF-8 text .*save the file as"),
        (b'{"text": "ok"}\n[1]\n', r"a\.jsonl:2: expected a JSON object, got an array"),
        (
            b'{"messages": [{"role": "bot", "content": "x"}]}\n',
            r"a\.jsonl:1: messages\[0\]\.role: not one of system, user, assistant",
        ),
    ],
)
def test_a_bad_row_is_refused_naming_file_line_and_field(tmp_path, tokenizer, content, message):
    (tmp_path / "eu").mkdir()
    (tmp_path / "eu" / "a.jsonl").write_bytes(content)
    with pytest.raises(DataError, match=message) as err:
        load(tmp_path / "eu", tokenizer)
    text = str(err.value)
    assert "\n" not in text and 'bad-rows = "skip"' in text and "fedciuic data check" in text


def test_bad_rows_can_be_skipped_and_are_counted(tmp_path, tokenizer):
    jsonl(tmp_path / "eu" / "a.jsonl", [*RECORDS, {"text": 5}, {"prompt": "p"}])
    data = load(tmp_path / "eu", tokenizer, **{"bad-rows": "skip", "eval-fraction": 0.01})
    assert data.summary.records == len(RECORDS) and data.summary.bad_rows == 2
    assert data.summary.bad_reasons == [
        "a.jsonl:6: text: expected a string, got a number",
        "a.jsonl:7: response: missing",
    ]


def test_a_csv_bad_row_names_its_line(tmp_path, tokenizer):
    (tmp_path / "eu").mkdir()
    (tmp_path / "eu" / "a.csv").write_text("prompt,response\nhi,there\nalone,\n")
    with pytest.raises(DataError, match=r"a\.csv:3: response: missing"):
        load(tmp_path / "eu", tokenizer)


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda root: None, r"data-path .*eu does not exist; create it"),
        (lambda root: root.mkdir(), r"holds no data files \(\.jsonl, \.json"),
        (lambda root: root.write_text("x"), "is not a directory"),
    ],
)
def test_a_missing_empty_or_wrong_data_path_says_what_to_do(tmp_path, tokenizer, setup, message):
    setup(tmp_path / "eu")
    with pytest.raises(DataError, match=message):
        load(tmp_path / "eu", tokenizer)


def test_too_few_records_for_a_held_out_split_is_refused(tmp_path, tokenizer):
    jsonl(tmp_path / "eu" / "a.jsonl", RECORDS[:1])
    with pytest.raises(DataError, match=r"region eu: .*none for (training|held-out evaluation)"):
        load(tmp_path / "eu", tokenizer)


@pytest.mark.parametrize("fraction", [0.001, 0.999])
def test_a_small_region_whose_records_all_fall_on_one_side_still_has_both(
    tmp_path, tokenizer, fraction
):
    jsonl(tmp_path / "eu" / "a.jsonl", RECORDS)
    data = load(tmp_path / "eu", tokenizer, **{"eval-fraction": fraction})
    cached = datasets.Dataset.from_file(str(data.cache / tokenized.EXAMPLES_FILE))
    buckets = cached[tokenized.BUCKET]
    below = sum(b < fraction for b in buckets)
    assert below == (0 if fraction < 0.5 else len(buckets))  # the case it names
    # The lowest record alone is held out, or the highest alone trains.
    assert data.train.num_units + data.eval.num_units == len(RECORDS)
    assert (data.eval.num_units if fraction < 0.5 else data.train.num_units) == 1


def test_user_level_privacy_needs_every_records_user_id(tmp_path, tokenizer):
    jsonl(tmp_path / "eu" / "a.jsonl", [*RECORDS, {"text": "nobody's"}])
    with pytest.raises(DataError) as err:
        load(tmp_path / "eu", tokenizer, **{"privacy-unit": "user"})
    text = str(err.value)
    assert "1 record(s)" in text and "a.jsonl:6" in text and "field user_id missing" in text
    assert 'privacy-unit = "record"' in text and "\n" not in text


def test_the_privacy_unit_groups_examples_by_record_or_by_user(tmp_path, tokenizer):
    rows = [{"text": f"record {i} " * 20, "user_id": f"u{i % 3}"} for i in range(30)]
    jsonl(tmp_path / "eu" / "a.jsonl", rows)
    by_record = load(tmp_path / "eu", tokenizer, **{"seq-len": 16})
    by_user = load(tmp_path / "eu", tokenizer, **{"seq-len": 16, "privacy-unit": "user"})
    n_train_records = len({int(u) for u in by_record.train.units})
    assert by_record.train.num_units == n_train_records > 3  # long records: several chunks
    assert len(by_record.train) > by_record.train.num_units
    assert by_user.train.num_units == 3
    assert by_user.unit == "user" and by_record.unit == "record"


def test_the_held_out_split_is_by_record_content_not_position(tmp_path, tokenizer):
    rows = [{"prompt": f"question {i}? ", "response": f"answer {i}."} for i in range(60)]
    rows += rows[:5]  # duplicates fall on the same side as their originals
    jsonl(tmp_path / "a" / "a.jsonl", rows)
    jsonl(tmp_path / "b" / "a.jsonl", list(reversed(rows)))

    def held_out(root: Path) -> set[str]:
        data = load(root, tokenizer)
        texts = {tokenizer.decode(data.eval.batch([i]).input_ids[0]) for i in range(len(data.eval))}
        return texts

    a, b = held_out(tmp_path / "a"), held_out(tmp_path / "b")
    assert a == b and 5 <= len(a) <= 35  # eval-fraction 0.3 of 60 distinct records


def test_the_second_load_reads_the_cache_without_tokenising(tmp_path, tokenizer, monkeypatch):
    jsonl(tmp_path / "eu" / "a.jsonl", RECORDS * 4)
    first = load(tmp_path / "eu", tokenizer)
    assert first.tokenised_now and (first.cache / tokenized.EXAMPLES_FILE).exists()

    def no_tokenising(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("tokenised again")

    monkeypatch.setattr(tokenized, "write_examples", no_tokenising)
    again = load(tmp_path / "eu", tokenizer)
    assert not again.tokenised_now and again.cache == first.cache
    assert again.train.batch(range(len(again.train))).input_ids.equal(
        first.train.batch(range(len(first.train))).input_ids
    )
    monkeypatch.undo()
    # Another seq-len, changed data, or a damaged cache: tokenised anew.
    assert load(tmp_path / "eu", tokenizer, **{"seq-len": 32}).tokenised_now
    (first.cache / tokenized.CACHE_SUMMARY).write_text("{not json")
    assert load(tmp_path / "eu", tokenizer).tokenised_now
    jsonl(tmp_path / "eu" / "a.jsonl", RECORDS * 5)
    changed = load(tmp_path / "eu", tokenizer)
    assert changed.tokenised_now and changed.fingerprint != first.fingerprint
    assert changed.fingerprint == region_fingerprint(tmp_path / "eu")
    kept = [p for p in changed.cache.parent.iterdir() if not p.name.startswith(".")]
    assert len(kept) <= tokenized.KEEP


def test_the_cache_holds_no_user_id_or_text(tmp_path, tokenizer):
    jsonl(tmp_path / "eu" / "a.jsonl", [{**r, "user_id": "secret-person-id"} for r in RECORDS])
    data = load(tmp_path / "eu", tokenizer)
    stored = (data.cache / tokenized.EXAMPLES_FILE).read_bytes()
    stored += (data.cache / tokenized.CACHE_SUMMARY).read_bytes()
    assert b"secret-person-id" not in stored and b"Personal data" not in stored


def test_the_demo_data_loads_at_user_level(demo_root, tokenizer, tmp_path):
    node = NodeConfig(region="eu", data_path=str(demo_root / "eu"), state_path=str(tmp_path))
    data = corpus.load_region_data(run(**{"privacy-unit": "user"}), node, tokenizer)
    assert data.summary.bad_rows == 0 and data.train.num_units >= 10


def test_two_loads_at_once_both_succeed_and_leave_one_cache(tmp_path, tokenizer):
    """A deployed region can tokenise in two processes at once (train and evaluate)."""
    from concurrent.futures import ThreadPoolExecutor

    jsonl(tmp_path / "eu" / "a.jsonl", RECORDS * 20)
    with ThreadPoolExecutor(2) as pool:
        loaded = list(pool.map(lambda _: load(tmp_path / "eu", tokenizer), range(2)))
    assert loaded[0].cache == loaded[1].cache
    assert len(loaded[0].train) == len(loaded[1].train) > 0
    entries = [p for p in loaded[0].cache.parent.iterdir() if not p.name.startswith(".")]
    assert entries == [loaded[0].cache]
    assert not [p for p in loaded[0].cache.parent.iterdir() if p.name.startswith(".building")]


def table(root: Path, kind: str, rows: list[dict[str, Any]]) -> Path:
    """``rows`` in one ``kind`` file (parquet or csv) under ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    dataset = datasets.Dataset.from_list(rows)
    if kind == "parquet":
        dataset.to_parquet(str(root / "a.parquet"))
    else:
        dataset.to_csv(str(root / "a.csv"), index=False)
    return root


@pytest.mark.parametrize("kind", ["parquet", "csv"])
def test_a_table_missing_a_column_is_named_once_with_its_count_of_rows(tmp_path, tokenizer, kind):
    rows = [{"prompt": f"question {i}? ", "user_id": f"u{i}"} for i in range(300)]
    root = table(tmp_path / "eu", kind, rows)
    checked = check_data(root, tokenizer, seq_len=64, fields=Fields(), tokenizer_name="bpe")
    assert checked.summary.bad_rows == 300
    assert checked.summary.bad_reasons == [
        f"a.{kind}: response: in all 300 row(s): missing: the file has no such column (its "
        "columns: prompt, user_id); add it, or name yours with the run config's text-field, "
        "prompt-field, response-field or messages-field"
    ]
    with pytest.raises(DataError) as err:
        load(root, tokenizer)
    assert str(err.value).count("response: ") == 1 and "300 bad row(s)" in str(err.value)


def test_a_table_with_no_known_column_is_named_once(tmp_path, tokenizer):
    root = table(tmp_path / "eu", "parquet", [{"body": f"text {i}"} for i in range(50)])
    checked = check_data(root, tokenizer, seq_len=64, fields=Fields(), tokenizer_name="bpe")
    [reason] = checked.summary.bad_reasons
    assert reason.startswith(
        "a.parquet: record: in all 50 row(s): no text, prompt/response, instruction/output or "
        "messages field (it has body); name your fields"
    )


def test_a_tables_null_values_and_bad_turns_are_still_named_row_by_row(tmp_path, tokenizer):
    rows = [{"prompt": "q? ", "response": None if i in (2, 5) else "a."} for i in range(8)]
    root = table(tmp_path / "eu", "parquet", rows)
    chats = [
        {"messages": [{"role": role, "content": "hi"}, {"role": "assistant", "content": "a"}]}
        for role in ("user", "bot", "user")
    ]
    datasets.Dataset.from_list(chats).to_parquet(str(root / "b.parquet"))
    checked = check_data(root, tokenizer, seq_len=64, fields=Fields(), tokenizer_name="bpe")
    assert checked.summary.bad_reasons == [
        "a.parquet:row 3: response: missing",
        "a.parquet:row 6: response: missing",
        "b.parquet:row 2: messages[0].role: not one of system, user, assistant",
    ]


def test_json_errors_say_where_without_repeating_at(tmp_path, tokenizer):
    jsonl(tmp_path / "eu" / "a.jsonl", [{"text": "ok"}])
    with open(tmp_path / "eu" / "a.jsonl", "a", encoding="utf-8") as handle:
        handle.write('{"text": "ends the line\n{"text": "ends the file')
    with pytest.raises(DataError) as err:
        load(tmp_path / "eu", tokenizer)
    assert "a.jsonl:2: invalid JSON (Unterminated string starting at column 10)" in str(err.value)
    assert "a.jsonl:3: invalid JSON (Unterminated string starting at column 10)" in str(err.value)
    assert "at at" not in str(err.value)
    (tmp_path / "eu" / "a.jsonl").unlink()
    (tmp_path / "eu" / "b.json").write_bytes(b'{"text": "ok"}\n{"text": "\xff"}\n')
    # JSON Lines in a .json file: read line by line too, each problem named by its line.
    with pytest.raises(DataError) as err:
        load(tmp_path / "eu", tokenizer)
    assert (
        "b.json:2: not UTF-8 text (invalid start byte at column 11); save the file as UTF-8"
        in str(err.value)
    )
