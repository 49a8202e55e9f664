"""Long records are bounded: a record over ``max-record-bytes`` is dropped unread and
counted per file, in every format, and reading one never holds it whole."""

from __future__ import annotations

import io
import json
import secrets
import shutil
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fedciuic.agent.config import AgentConfig
from fedciuic.audit.log import AuditLog, load_records
from fedciuic.config import DEFAULT_MAX_RECORD_BYTES, Fields, ModelSpec, NodeConfig, RunConfig
from fedciuic.crypto.keys import Keypair, write_keys
from fedciuic.crypto.parties import NONCE_BYTES, TaskKind
from fedciuic.data import bounded
from fedciuic.data.check import check_data, scan_data
from fedciuic.data.corpus import load_region_data
from fedciuic.data.sources import discover, read_rows
from fedciuic.errors import ConfigError, DataError
from fedciuic.model.adapter import AdapterModel
from fedciuic.model.presets import TINY_VOCAB_SIZE, bpe_tokenizer
from fedciuic.ops.cli import main
from fedciuic.region.round import handle_instruction, read_configs
from fedciuic.stages.sealing import Clear
from fedciuic.wire import Instruction
from tests.conftest import app_config, lab_policies, unit_config
from tests.data.helpers import data_run

LIMIT = 4096
SHORT = [
    {"prompt": "Where does the data stay? ", "response": "In its region.", "user_id": "ana"},
    {"prompt": "Who checks the policy? ", "response": "Both ends.", "user_id": "ben"},
]
#: Over LIMIT, with what a scanner must not stop at: quotes, commas, brackets, newlines.
LONG_TEXT = 'a "quoted", [bracketed] {braced}\nline, and \\ more. ' * 200
LONG = {"prompt": "Summarise: ", "response": LONG_TEXT, "user_id": "cy"}


@pytest.fixture(scope="module")
def tokenizer():
    return bpe_tokenizer(TINY_VOCAB_SIZE)


def check(root: Path, tokenizer: Any, limit: int = LIMIT) -> Any:
    return check_data(
        root, tokenizer, seq_len=64, fields=Fields(), tokenizer_name="bpe", max_record_bytes=limit
    )


def _jsonl(root: Path) -> tuple[str, str, int]:
    line = json.dumps(LONG)
    (root / "a.jsonl").write_text("\n".join(json.dumps(r) for r in (SHORT[0], LONG, SHORT[1])))
    return "a.jsonl", "a.jsonl:2", len(line.encode())


def _json(root: Path) -> tuple[str, str, int]:
    (root / "a.json").write_text(json.dumps([SHORT[0], LONG, SHORT[1]], indent=1))
    return "a.json", "a.json:row 2", len(json.dumps(LONG, indent=1).replace("\n", "\n ").encode())


def _csv(root: Path) -> tuple[str, str, int]:
    field = '"' + LONG_TEXT.replace('"', '""') + '"'
    text = (
        "prompt,response,user_id\n"
        f"{SHORT[0]['prompt']},{SHORT[0]['response']},ana\r\n"
        f"Summarise: ,{field},cy\r\n"
        f"{SHORT[1]['prompt']},{SHORT[1]['response']},ben\n"
    )
    (root / "a.csv").write_text(text, newline="")
    return "a.csv", "a.csv:3", len(f"Summarise: ,{field},cy".encode())


def _parquet(root: Path) -> tuple[str, str, int]:
    turns = [
        {"role": "user", "content": "Summarise this."},
        {"role": "assistant", "content": LONG_TEXT},
    ]
    chat = {"messages": turns, "user_id": "cy"}
    rows = [{"messages": [{"role": "user", "content": r["prompt"]},
                          {"role": "assistant", "content": r["response"]}],
             "user_id": r["user_id"]} for r in SHORT]  # fmt: skip
    pq.write_table(pa.Table.from_pylist([rows[0], chat, rows[1]]), root / "a.parquet")
    size = sum(len(t["role"]) + len(t["content"].encode()) for t in turns) + 2
    return "a.parquet", "a.parquet:row 2", size


def _saved(root: Path) -> tuple[str, str, int]:
    datasets.Dataset.from_list([SHORT[0], LONG, SHORT[1]]).save_to_disk(str(root / "saved"))
    return "saved", "saved:row 2", sum(len(str(v).encode()) for v in LONG.values())


def _text(root: Path) -> tuple[str, str, int]:
    (root / "a.txt").write_text("Personal data stays in its region. " * 4)
    (root / "b.txt").write_text(LONG_TEXT)
    (root / "c.txt").write_text("And so do its people. " * 4)
    return "b.txt", "b.txt:1", len(LONG_TEXT.encode())


WRITERS: dict[str, Callable[[Path], tuple[str, str, int]]] = {
    "jsonl": _jsonl,
    "json": _json,
    "csv": _csv,
    "parquet": _parquet,
    "saved": _saved,
    "text": _text,
}


@pytest.mark.parametrize("kind", list(WRITERS))
def test_each_format_drops_the_long_record_keeps_the_others_and_counts_it(
    tmp_path, tokenizer, kind
):
    root = tmp_path / "eu"
    root.mkdir()
    name, where, size = WRITERS[kind](root)
    assert size > LIMIT
    checked = check(root, tokenizer)
    summary = checked.summary
    assert summary.records == 2 and summary.bad_rows == 0 and checked.ok
    assert summary.oversized == {name: 1}
    assert summary.oversized_where == [f"{where} ({size:,} bytes)"]
    lines = checked.lines("user_id")
    assert f"over max-record-bytes (4,096 bytes): 1 record(s) dropped unread ({name} 1)" in lines
    assert lines[-2:] == [
        "records over max-record-bytes (1, dropped unread):",
        f"{where} ({size:,} bytes)",
    ]
    # Under a limit it fits, the record is read like the others.
    assert check(root, tokenizer, limit=size).summary.records == 3


def test_a_folder_without_long_records_says_its_limit_and_none_dropped(tmp_path, tokenizer):
    (tmp_path / "a.jsonl").write_text(json.dumps(SHORT[0]) + "\n")
    lines = check(tmp_path, tokenizer, limit=DEFAULT_MAX_RECORD_BYTES).lines("user_id")
    assert "over max-record-bytes (1,048,576 bytes): 0 record(s) dropped unread" in lines


def test_a_record_of_exactly_the_limit_is_kept_and_one_byte_more_is_not(tmp_path, tokenizer):
    def record(size: int) -> bytes:
        head = b'{"prompt": "q? ", "response": "'
        return head + b"a" * (size - len(head) - 2) + b'"}'

    (tmp_path / "a.jsonl").write_bytes(record(LIMIT) + b"\r\n" + record(LIMIT + 1) + b"\n")
    text = b"prompt,response\n" + b"q," + b"b" * (LIMIT - 2) + b"\r\nq," + b"b" * (LIMIT - 1)
    (tmp_path / "b.csv").write_bytes(text)
    summary = check(tmp_path, tokenizer).summary
    assert summary.records == 2 and summary.oversized == {"a.jsonl": 1, "b.csv": 1}
    assert summary.oversized_where == ["a.jsonl:2 (4,097 bytes)", "b.csv:3 (4,097 bytes)"]


def test_csv_reads_on_after_a_long_multiline_record_and_names_later_lines(tmp_path, tokenizer):
    field = '"' + LONG_TEXT.replace('"', '""') + '"'  # 200 lines inside its quotes
    text = f"prompt,response\nq1? ,a1.\nq2? ,{field}\nq3? ,a3.\nalone,\n"
    (tmp_path / "a.csv").write_text(text)
    summary = check(tmp_path, tokenizer).summary
    assert summary.records == 2 and summary.oversized_where[0].startswith("a.csv:3 ")
    assert summary.bad_reasons == ["a.csv:205: response: missing"]


def test_csv_problems_name_their_line_and_a_bom_is_not_part_of_the_header(tmp_path, tokenizer):
    text = b'\xef\xbb\xbfprompt,response\nq1? ,a1.\nq2? ,a2.,more\nq3? ,"a\xff"\n"q4? ",a4.\n'
    (tmp_path / "a.csv").write_bytes(text)
    summary = check(tmp_path, tokenizer).summary
    assert summary.records == 2 and summary.bad_reasons == [
        "a.csv:3: 3 fields, and the header names 2",
        "a.csv:4: not UTF-8 text (invalid start byte at column 8); save the file as UTF-8",
    ]
    (tmp_path / "a.csv").write_text("prompt,prompt\nq,a\n")
    with pytest.raises(DataError, match=r"a\.csv:1: the header: a column named twice"):
        check(tmp_path, tokenizer)


def test_a_broken_json_array_names_its_file_and_line(tmp_path, tokenizer):
    (tmp_path / "a.json").write_text('[\n {"text": "one"},\n {"text": "two"}\n')
    with pytest.raises(DataError, match=r"a\.json:4: not one JSON array \(the array does not end"):
        check(tmp_path, tokenizer)
    (tmp_path / "a.json").write_text('[\n {"text": "one"},\n {"text": "two",}\n]')
    summary = check(tmp_path, tokenizer).summary
    assert summary.bad_reasons[0].startswith("a.json:row 2: invalid JSON (")
    assert summary.bad_reasons[0].endswith(" at line 3)")


def test_a_json_array_of_strings_is_text_records(tmp_path, tokenizer):
    (tmp_path / "a.json").write_text(json.dumps(["Personal data stays home.", LONG_TEXT, "Yes."]))
    summary = check(tmp_path, tokenizer).summary
    assert summary.shapes == {"text": 2} and summary.oversized == {"a.json": 1}


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 64, 1 << 20])
def test_the_json_array_scanner_finds_every_element_whatever_the_chunks(monkeypatch, chunk):
    monkeypatch.setattr(bounded, "READ_BYTES", chunk)
    values: list[Any] = [
        {"text": 'a,]}"\\', "n": [1, {"x": "]"}]},
        's,]\\"{',
        1.5,
        None,
        {"text": "x" * 100},
        [],
        {"u": "\\\\"},
    ]
    data = json.dumps(values, indent=2).encode()
    pieces = list(bounded.json_array(io.BufferedReader(io.BytesIO(data)), 100))
    kept = [json.loads(p.data) if p.data is not None else "DROPPED" for p in pieces]
    assert kept == [*values[:4], "DROPPED", *values[5:]]
    assert [p.line for p in pieces] == [2, 11, 12, 13, 14, 17, 18]


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 7, 64, 1 << 20])
def test_the_csv_splitter_reads_past_a_long_record_whatever_the_chunks(monkeypatch, chunk):
    monkeypatch.setattr(bounded, "READ_BYTES", chunk)
    long = b'"' + b'say ""hi"", then\r\n""bye""' * 4 + b'"'  # quotes written twice, lines
    data = b'a,b\n1,"x\ny"\r\n2,' + long + b'\r\n3,""""\n\n4,' + long + b"\n5,end"
    pieces = list(bounded.csv_records(io.BufferedReader(io.BytesIO(data)), 20))
    assert [(p.line, p.size, p.data) for p in pieces] == [
        (1, 3, b"a,b"),
        (2, 7, b'1,"x\ny"'),
        (4, len(long) + 2, None),
        (9, 6, b'3,""""'),
        (10, 0, b""),
        (11, len(long) + 2, None),
        (16, 5, b"5,end"),
    ]


@pytest.mark.parametrize(
    ("data", "line", "message"),
    [
        (b'{"a": 1}', 1, "expected a JSON array"),
        (b"[1,\n]", 2, "expected a value before ]"),
        (b"[1]\nx", 2, "more after the array's closing ]"),
        (b"[1,\n2", 2, "the array does not end"),
        (b"[}", 1, "a } that closes nothing"),
    ],
)
def test_the_json_array_scanner_names_the_line_of_a_broken_array(data, line, message):
    with pytest.raises(bounded.Malformed, match=message) as err:
        list(bounded.json_array(io.BufferedReader(io.BytesIO(data)), 60))
    assert err.value.line == line


def test_a_long_record_counts_in_the_region_and_the_limit_keys_its_cache(tmp_path, tokenizer):
    root = tmp_path / "eu"
    root.mkdir()
    (root / "a.jsonl").write_text(
        "".join(json.dumps({**SHORT[i % 2], "prompt": f"q{i}? "}) + "\n" for i in range(12))
        + json.dumps(LONG)
        + "\n"
    )
    state = tmp_path / "state"

    def load(**node: Any) -> Any:
        config = NodeConfig(region="eu", data_path=str(root), state_path=str(state), **node)
        return load_region_data(data_run(**{"max-record-bytes": LIMIT}), config, tokenizer)

    limited = load()
    assert limited.summary.oversized == {"a.jsonl": 1} and limited.summary.records == 12
    assert limited.summary.max_record_bytes == LIMIT
    # A node's own limit wins over the run's; another limit is another cache entry.
    own = load(max_record_bytes=DEFAULT_MAX_RECORD_BYTES)
    assert own.tokenised_now and own.summary.records == 13 and not own.summary.oversized
    assert own.cache != limited.cache and not load().tokenised_now


def test_a_region_whose_every_record_is_too_long_says_so(tmp_path, tokenizer):
    (tmp_path / "eu").mkdir()
    (tmp_path / "eu" / "a.jsonl").write_text(json.dumps(LONG) + "\n")
    node = NodeConfig(region="eu", data_path=str(tmp_path / "eu"), state_path=str(tmp_path / "s"))
    with pytest.raises(DataError, match=r"1 record\(s\) over max-record-bytes \(4,096 bytes\)"):
        load_region_data(data_run(**{"max-record-bytes": LIMIT}), node, tokenizer)


def test_the_launchers_scan_counts_long_records(tmp_path, tokenizer):
    _jsonl(tmp_path)
    _, scanned = scan_data(tmp_path, tokenizer, seq_len=64, fields=Fields(), max_record_bytes=LIMIT)
    assert scanned.summary.oversized == {"a.jsonl": 1} and scanned.summary.records == 2


# -- the limit ---------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, -1, "big", 2**31, 1.5])
def test_the_run_configs_limit_is_a_positive_size(value):
    with pytest.raises(ConfigError) as err:
        RunConfig.from_user_config({**unit_config(), "max-record-bytes": value}, source="run")
    [problem] = err.value.problems
    assert problem.startswith("run:max-record-bytes: ")


def test_the_default_limit_fits_a_long_chat_and_is_the_apps():
    assert DEFAULT_MAX_RECORD_BYTES == app_config()["max-record-bytes"] == 1 << 20
    run = RunConfig.from_user_config(unit_config(), source="run")
    assert run.data.max_record_bytes == DEFAULT_MAX_RECORD_BYTES
    assert NodeConfig(region="eu", data_path="d").record_limit(run) == DEFAULT_MAX_RECORD_BYTES


AGENT = {
    "region": "eu",
    "data-path": "/srv/eu/data",
    "key-file": "k",
    "aggregator-bundle": "b",
    "policy": "p",
    "socket": "s",
}


def test_a_deployed_region_goes_by_its_own_limit_never_the_runs():
    run = RunConfig.from_user_config(
        {**unit_config(), "regions": "eu", "max-record-bytes": 1 << 30}, source="run"
    )
    default = AgentConfig.from_user_config(AGENT, source="agent.toml")
    assert default.node_for(run).record_limit(run) == DEFAULT_MAX_RECORD_BYTES
    own = AgentConfig.from_user_config({**AGENT, "max-record-bytes": LIMIT}, source="agent.toml")
    assert own.node_for(run).record_limit(run) == LIMIT
    assert "max-record-bytes = 4096" in own.toml()
    with pytest.raises(ConfigError, match=r"agent\.toml:max-record-bytes: "):
        AgentConfig.from_user_config({**AGENT, "max-record-bytes": 0}, source="agent.toml")


def test_data_check_takes_the_limit_and_refuses_a_bad_one(tmp_path, capsys):
    _jsonl(tmp_path)
    assert main(["data", "check", str(tmp_path), "--max-record-bytes", str(LIMIT)]) == 0
    out = capsys.readouterr().out
    assert "over max-record-bytes (4,096 bytes): 1 record(s) dropped unread (a.jsonl 1)" in out
    assert main(["data", "check", str(tmp_path), "--max-record-bytes", "0"]) == 2
    assert "--max-record-bytes: 0 is not a size from 1 to" in capsys.readouterr().err


# -- the audit log and report ------------------------------------------------------------


def test_a_region_that_trains_logs_the_records_it_dropped_before_the_round(tmp_path, demo_root):
    data = tmp_path / "cn"
    shutil.copytree(demo_root / "cn", data, ignore=shutil.ignore_patterns(".*"))
    with open(data / "pasted.jsonl", "w", encoding="utf-8") as handle:
        handle.write(json.dumps({"text": "log line, " * (DEFAULT_MAX_RECORD_BYTES // 10)}) + "\n")
    run = RunConfig.from_user_config(
        {**unit_config(), "local-steps": 1, "seal": False}, source="run config"
    )
    node_config = {
        "region": "cn",
        "data-path": str(data),
        "state-path": str(tmp_path / "state"),
        "policy": str(lab_policies(tmp_path / "policies") / "cn.yaml"),
        "deid-dictionary": str(demo_root / "deid-dictionaries" / "cn.txt"),
    }
    model = AdapterModel(ModelSpec())
    task = Instruction(
        adapter=model.adapter_state(),
        server_round=1,
        base_fingerprint=model.base_fingerprint,
        kind=TaskKind.TRAIN,
        run_config=run.canonical_json(),
        nonce=secrets.token_bytes(NONCE_BYTES),
        recipient="cn",
    )
    applied, node = read_configs(task, node_config)
    reply = handle_instruction(
        applied, node, task, asked=TaskKind.TRAIN, flower_run=7, simulated=False
    )
    assert isinstance(reply.outcome, Clear), reply.outcome
    records = load_records(tmp_path / "state" / "audit.jsonl")
    [dropped] = [r for r in records if r["event"] == "records_oversized"]
    assert dropped["details"] == {
        "max_record_bytes": DEFAULT_MAX_RECORD_BYTES,
        "records": 1,
        "files": {"pasted.jsonl": 1},
    }
    events = [r["event"] for r in records]
    assert events.index("records_oversized") < events.index("trained")


# -- the audit report --------------------------------------------------------------------


def test_the_report_lists_each_regions_long_records_per_round(tmp_path):
    keys = {p: Keypair.generate(p, "EU") for p in ("aggregator", "eu")}
    for key in keys.values():
        write_keys(key, tmp_path / "keys")
    agg = AuditLog(tmp_path / "aggregator.jsonl", "aggregator", keys["aggregator"])
    eu = AuditLog(tmp_path / "eu.jsonl", "eu", keys["eu"])
    agg.append("run_start", run_id=9, regions=["eu"], config_hash="c" * 64)
    eu.append("run_joined", run_id=9, server_round=1, config_hash="c" * 64, jurisdiction="EU")
    files = {"chat.jsonl": 2, "dump.parquet": 1}
    eu.append(
        "records_oversized",
        run_id=9,
        server_round=1,
        max_record_bytes=DEFAULT_MAX_RECORD_BYTES,
        records=3,
        files=files,
    )
    eu.append("trained", run_id=9, server_round=1, epsilon=1.0, epsilon_budget=8.0)
    agg.append("run_end", run_id=9, status="completed", model_digest="m" * 64)
    for log in (agg, eu):
        log.checkpoint(run_id=9)
        log.close()
    out = tmp_path / "report"
    logs = [str(tmp_path / "aggregator.jsonl"), str(tmp_path / "eu.jsonl")]
    main(["audit", "report", *logs, "--keys", str(tmp_path / "keys"), "--out", str(out)])
    text = (out / "compliance-report-run-9.md").read_text()
    assert "| round | region | max-record-bytes | records dropped | per file |" in text
    assert "| 1 | eu | 1048576 | 3 | chat.jsonl 2, dump.parquet 1 |" in text


# -- memory ------------------------------------------------------------------------------


ROW = 64 << 20  # bytes of the long record
MEMORY_LIMIT = 1 << 20


def _repeat(handle: Any, text: bytes, size: int) -> None:
    """``text`` repeated to ``size`` bytes, written a MiB at a time."""
    block = text * ((1 << 20) // len(text))
    for _ in range(size // len(block)):
        handle.write(block)


def _long_jsonl(path: Path) -> None:
    with open(path / "a.jsonl", "wb") as handle:
        handle.write(b'{"text": "short"}\n{"text": "')
        _repeat(handle, b"long record, ", ROW)
        handle.write(b'"}\n{"text": "short"}\n')


def _long_json(path: Path) -> None:
    with open(path / "a.json", "wb") as handle:
        handle.write(b'[{"text": "short"},\n{"text": "')
        _repeat(handle, b'a \\"quoted\\" [long], {record}\\n', ROW)
        handle.write(b'"},\n{"text": "short"}]\n')


def _long_csv(path: Path) -> None:
    with open(path / "a.csv", "wb") as handle:
        handle.write(b'text\nshort\n"')
        _repeat(handle, b'a ""quoted"", long\nrecord, ', ROW)
        handle.write(b'"\nshort\n')


def _long_parquet(path: Path) -> None:
    cell = "long record, " * (ROW // 4 // 13)  # 16 MiB: pyarrow holds it, not Python
    pq.write_table(pa.table({"text": ["short", cell, "short"]}), path / "a.parquet")


@pytest.mark.parametrize("write", [_long_jsonl, _long_json, _long_csv, _long_parquet])
def test_reading_a_long_record_holds_no_copy_of_it(tmp_path, write):
    write(tmp_path)
    [source] = discover(tmp_path)
    tracemalloc.start()
    try:
        rows: Iterator[Any] = read_rows(source, text_field="text", max_bytes=MEMORY_LIMIT)
        got = [(r.values, r.oversized is not None) for r in rows]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert got == [({"text": "short"}, False), (None, True), ({"text": "short"}, False)]
    assert peak < 8 * MEMORY_LIMIT, f"{peak / 2**20:.1f} MiB held while reading"
