from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from fedciuic.data.corpus import list_data_files, load_region_data
from fedciuic.errors import DataError
from fedciuic.model.presets import byte_tokenizer

TOKENIZER = byte_tokenizer()


def load(path: Path, seq_len: int = 16):
    return load_region_data(
        "eu", path, TOKENIZER, seq_len=seq_len, eval_fraction=0.25, max_eval_examples=1000
    )


def write_region(root: Path, text: str = "Personal data stays in its region. " * 20) -> Path:
    root.mkdir(parents=True)
    (root / "a.jsonl").write_text(json.dumps({"text": text}) + "\n\n" + json.dumps({"text": text}))
    (root / "notes.txt").write_text(text)
    (root / "ignored.csv").write_text("x,y\n")
    return root


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


def test_reads_jsonl_and_txt_and_splits_train_from_eval(tmp_path):
    text = "Personal data stays in its region. " * 20
    data = load(write_region(tmp_path / "eu", text))
    assert data.files == ("a.jsonl", "notes.txt")  # the .csv is not read
    n_blocks = 3 * (len(text.encode()) + 1) // 16  # three documents, each + <eos>
    assert data.train.shape == (n_blocks - n_blocks // 4, 16)
    assert data.eval.shape == (n_blocks // 4, 16)  # every 4th block is held out


def test_split_and_fingerprint_are_deterministic(tmp_path):
    root = write_region(tmp_path / "eu")
    a, b = load(root), load(root)
    assert a.fingerprint == b.fingerprint
    assert torch.equal(a.train, b.train) and torch.equal(a.eval, b.eval)
    (root / "notes.txt").write_text("changed " * 100)
    assert load(root).fingerprint != a.fingerprint


def test_a_region_opens_only_files_under_its_own_data_path(tmp_path):
    eu = write_region(tmp_path / "eu")
    write_region(tmp_path / "cn", text="数据出境安全评估 " * 30)
    with OpenRecorder() as opened:
        load(eu)
    under_tmp = [p for p in opened if p.startswith(str(tmp_path))]
    assert under_tmp, "the loader opened no data file at all"
    for path in under_tmp:
        assert Path(path).resolve().is_relative_to(eu.resolve()), path


def test_symlink_to_another_regions_data_is_refused(tmp_path):
    eu = write_region(tmp_path / "eu")
    cn = write_region(tmp_path / "cn")
    (eu / "borrowed.jsonl").symlink_to(cn / "a.jsonl")
    with OpenRecorder() as opened, pytest.raises(DataError, match="links outside data-path"):
        load(eu)
    assert not [p for p in opened if p.startswith(str(cn))]


def test_symlinked_folder_outside_is_refused(tmp_path):
    eu = write_region(tmp_path / "eu")
    cn = write_region(tmp_path / "cn")
    (eu / "more").symlink_to(cn, target_is_directory=True)
    with pytest.raises(DataError, match="links outside data-path"):
        list_data_files(eu)


def test_missing_data_path_says_what_to_do(tmp_path):
    with pytest.raises(DataError, match=r"data-path .*nope does not exist; create it"):
        load(tmp_path / "nope")


def test_data_path_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "f.txt").write_text("x")
    with pytest.raises(DataError, match="is not a directory"):
        load(tmp_path / "f.txt")


def test_folder_without_data_files_is_refused(tmp_path):
    (tmp_path / "eu").mkdir()
    (tmp_path / "eu" / "readme.md").write_text("nothing")
    with pytest.raises(DataError, match=r"holds no \.jsonl or \.txt files"):
        load(tmp_path / "eu")


def test_too_little_text_is_refused_with_the_numbers(tmp_path):
    (tmp_path / "eu").mkdir()
    (tmp_path / "eu" / "a.txt").write_text("short")
    with pytest.raises(DataError, match=r"region eu: .* has 6 tokens, fewer than the 32"):
        load(tmp_path / "eu")


def test_malformed_jsonl_names_file_and_line(tmp_path):
    (tmp_path / "eu").mkdir()
    (tmp_path / "eu" / "a.jsonl").write_text('{"text": "ok"}\n{"txt": "no"}\n')
    with pytest.raises(DataError, match=r"a\.jsonl:2: expected an object"):
        load(tmp_path / "eu")
    (tmp_path / "eu" / "a.jsonl").write_text('{"text": "ok"}\n{broken\n')
    with pytest.raises(DataError, match=r"a\.jsonl:2: invalid JSON"):
        load(tmp_path / "eu")


def test_non_utf8_file_is_named(tmp_path):
    (tmp_path / "eu").mkdir()
    (tmp_path / "eu" / "a.txt").write_bytes(b"\xff\xfe bad")
    with pytest.raises(DataError, match=r"a\.txt: not UTF-8"):
        load(tmp_path / "eu")
