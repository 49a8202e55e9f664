"""A long record stays within a region's memory: it is dropped unread, in every format.

For each format, writes a region's folder of two short records and one long one (a
chat turn of ``--mb`` MiB in JSON Lines, a JSON array, CSV and a folder written by
``Dataset.save_to_disk``; a Parquet cell of each of ``--parquet-mb`` MiB), then loads it
as a region does (``load_region_data``: read, check, render, tokenise, cache;
de-identification off, to measure the reading), each in its own process: the peak RSS
above what the process held once its tokenizer was loaded (the region's baseline), the
records dropped for their size and kept, and the time. Writes
results/long_records.json.

    .venv/bin/python benchmarks/long_records.py [--mb 256] [--parquet-mb 64,256]

``--code DIR`` loads another checkout of fedciuic (one from before max-record-bytes, at
a small ``--mb``, shows what a long record cost then).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "long_records.json"
FORMATS = ("jsonl", "json", "csv", "parquet", "saved")
SHORT = [
    {"prompt": "Where does the data stay? ", "response": "In its region.", "user_id": "ana"},
    {"prompt": "Who checks the policy? ", "response": "Both ends.", "user_id": "ben"},
]
#: The long turn's text: what a scanner must read past (quotes, commas, brackets, line
#: breaks), as a pasted log or document holds them.
PASTE = 'log line 17: "status", [ok], {"code": 200}\n'


def _repeat(handle: object, text: bytes, size: int) -> None:
    """``text`` repeated to ``size`` bytes, written a MiB at a time."""
    write = handle.write  # type: ignore[attr-defined]
    block = text * ((1 << 20) // len(text))
    for _ in range(size // len(block)):
        write(block)


def write_region(folder: Path, kind: str, size: int) -> None:
    """Two short records and one of ``size`` bytes, in one file of ``kind``."""
    folder.mkdir(parents=True)
    first, second = (json.dumps(r).encode() for r in SHORT)
    if kind in ("jsonl", "json"):
        escaped = json.dumps(PASTE).encode()[1:-1]  # as JSON writes it inside a string
        head = b'{"messages": [{"role": "user", "content": "'
        tail = b'"}, {"role": "assistant", "content": "Noted."}], "user_id": "cy"}'
        array = kind == "json"
        with open(folder / f"a.{kind}", "wb") as handle:
            handle.write(b"[" + first + b",\n" if array else first + b"\n")
            handle.write(head)
            _repeat(handle, escaped, size)
            handle.write(tail + (b",\n" + second + b"]\n" if array else b"\n" + second + b"\n"))
    elif kind == "csv":
        with open(folder / "a.csv", "wb") as handle:
            handle.write(b"prompt,response,user_id\n")
            handle.write(b'"Where does the data stay? ",In its region.,ana\n')
            handle.write(b'Summarise this log: ,"')
            _repeat(handle, PASTE.replace('"', '""').encode(), size)
            handle.write(b'",cy\n"Who checks the policy? ",Both ends.,ben\n')
    else:
        import datasets
        import pyarrow as pa
        import pyarrow.parquet as pq

        cell = PASTE * (size // len(PASTE))
        rows = [
            {"messages": [{"role": "user", "content": r["prompt"]},
                          {"role": "assistant", "content": r["response"]}],
             "user_id": r["user_id"]} for r in SHORT
        ]  # fmt: skip
        chat = {
            "messages": [
                {"role": "user", "content": cell},
                {"role": "assistant", "content": "Noted."},
            ],
            "user_id": "cy",
        }
        table = pa.Table.from_pylist([rows[0], chat, rows[1]])
        if kind == "parquet":
            pq.write_table(table, folder / "a.parquet")
        else:
            datasets.Dataset(table).save_to_disk(str(folder / "saved"))
        del cell, chat, table


def _rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _child(data: Path, state: Path) -> dict[str, object]:
    from fedciuic.config import NodeConfig, RunConfig
    from fedciuic.data.corpus import load_region_data
    from fedciuic.model.presets import preset_tokenizer

    tokenizer = preset_tokenizer("tiny")
    run = RunConfig.model_validate(
        {
            "regions": ("eu",),
            "num_server_rounds": 1,
            "seed": 0,
            "local_steps": 1,
            "batch_size": 2,
            "learning_rate": 0.1,
            "seq_len": 256,
            "max_eval_examples": 128,
            "eval_fraction": 0.3,
            "node_wait_timeout": 1,
            "round_timeout": 1,
            "deidentify": False,
        }
    )
    node = NodeConfig(region="eu", data_path=str(data), state_path=str(state))
    baseline = _rss("VmRSS")
    try:  # the peak from here on (Linux: 5 resets VmHWM to the current RSS)
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        baseline = _rss("VmHWM")
    start = time.perf_counter()
    try:
        loaded = load_region_data(run, node, tokenizer)
        summary = loaded.summary
        kept, dropped, error = summary.records, sum(getattr(summary, "oversized", {}).values()), ""
    except Exception as err:  # a region that declines: its reason
        kept, dropped, error = 0, 0, " ".join(str(err).split())[:200]
    return {
        "seconds": time.perf_counter() - start,
        "peak_above_baseline": _rss("VmHWM") - baseline,
        "baseline": baseline,
        "kept": kept,
        "dropped": dropped,
        "error": error,
    }


def measure(kind: str, size: int, code: Path | None) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="fedciuic-long-records-") as tmp:
        data = Path(tmp) / "eu"
        write_region(data, kind, size)
        env = dict(os.environ)
        if code is not None:
            env["PYTHONPATH"] = str(code)
        argv = [sys.executable, __file__, "--child", str(data), str(Path(tmp) / "state")]
        done = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
        if done.returncode:
            return {"format": kind, "row_bytes": size, "error": f"exit {done.returncode}"}
        result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return {"format": kind, "row_bytes": size, **result}


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(_child(Path(sys.argv[2]), Path(sys.argv[3]))))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=256.0, help="the long record (MiB)")
    parser.add_argument("--parquet-mb", default="64,256", help="the Parquet cells (MiB)")
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--code", type=Path, help="another fedciuic checkout to load")
    args = parser.parse_args()
    rows = []
    print("| format | long record | peak RSS above baseline | dropped | kept | seconds |")
    print("| --- | --- | --- | --- | --- | --- |")
    runs = [
        (kind, int(mb * 2**20))
        for kind in args.formats.split(",")
        for mb in (map(float, args.parquet_mb.split(",")) if kind == "parquet" else [args.mb])
    ]
    for kind, size in runs:
        row = measure(kind, size, args.code)
        rows.append(row)
        peak = row.get("peak_above_baseline")
        shown = f"{peak / 2**20:,.0f} MiB" if isinstance(peak, int) else str(row.get("error"))
        print(
            f"| {kind} | {size / 2**20:g} MiB | {shown} | {row.get('dropped', '-')} | "
            f"{row.get('kept', '-')} | {float(row.get('seconds', 0.0)):.1f} |"  # type: ignore[arg-type]
            + (f" {row['error']}" if row.get("error") and isinstance(peak, int) else "")
        )
    if args.code is None:
        RESULTS.parent.mkdir(exist_ok=True)
        RESULTS.write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
