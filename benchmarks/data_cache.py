"""A region's data is de-identified and tokenised once: later rounds and runs read the
Arrow cache.

Writes a chat corpus of ``--mb`` megabytes (JSON Lines, one user id per record; a share
``--identifiers`` of the questions signed with a synthetic name, e-mail address, phone
number and resident ID), then, each in its own process so that peak memory is its own:
a first load without de-identification (reads, validates, renders with the chat
template, tokenises and writes the cache), a first load with it (the run config's
default: Presidio over every text field before tokenising), and a second load with it
(reads the cache). Prints the times, de-identification's throughput in records/s (the
difference of the two first loads) and overall, each process's peak RSS above what it
held after loading the tokenizer, and the cache's size; writes results/data_cache.json.

    .venv/bin/python benchmarks/data_cache.py [--mb 100] [--preset realistic]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from aggregator_memory import _hwm_bytes  # scripts side by side

from fedciuic.deid import cn_check_character

RESULTS = Path(__file__).parent / "results" / "data_cache.json"

WORDS = (
    "account",
    "balance",
    "transfer",
    "card",
    "branch",
    "loan",
    "rate",
    "payment",
    "statement",
    "customer",
    "fee",
    "policy",
    "claim",
    "patient",
    "record",
    "consent",
    "data",
    "region",
    "model",
    "update",
    "privacy",
    "budget",
)


def _signature(rng: random.Random) -> str:
    """A synthetic name, e-mail, mainland China mobile and resident ID (valid check digit)."""
    body = f"110105{rng.randint(1950, 2005)}{rng.randint(1, 12):02d}{rng.randint(1, 28):02d}"
    body += f"{rng.randint(0, 999):03d}"
    check = cn_check_character(body)
    name = f"user{rng.randrange(10**6)}"
    return (
        f"I am {name} ({name}@example.org, +86 139 {rng.randint(1000, 9999)} "
        f"{rng.randint(1000, 9999)}), resident ID {body}{check}. "
    )


def write_corpus(
    folder: Path, megabytes: float, seed: int = 0, identifiers: float = 0.0, numbers: float = 0.0
) -> tuple[int, int]:
    """Chat records from 5,000 users until the file reaches ``megabytes``, a share
    ``identifiers`` of them signed, a share ``numbers`` of the answers with an amount and
    a date (text a scrubber must analyse: it skips text with no digit, @ or URL); the
    records and the signed records written."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    target = int(megabytes * 2**20)
    written = records = signed = 0
    with open(folder / "chat.jsonl", "w", encoding="utf-8") as handle:
        while written < target:
            question = " ".join(rng.choices(WORDS, k=rng.randint(8, 40)))
            if rng.random() < identifiers:
                question = _signature(rng) + question
                signed += 1
            answer = " ".join(rng.choices(WORDS, k=rng.randint(20, 200)))
            if rng.random() < numbers:
                answer += f" of {rng.randint(1, 99_999):,}.{rng.randint(0, 99):02d} on 2026-"
                answer += f"{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
            record = {
                "messages": [
                    {"role": "user", "content": question + "?"},
                    {"role": "assistant", "content": answer + "."},
                ],
                "user_id": f"u{rng.randrange(5000):05d}",
            }
            line = json.dumps(record) + "\n"
            handle.write(line)
            written += len(line.encode())
            records += 1
    return records, signed


def _child(
    data: Path, state: Path, preset: str, seq_len: int, deidentify: bool
) -> dict[str, float]:
    from fedciuic.config import NodeConfig, RunConfig
    from fedciuic.data.corpus import load_region_data
    from fedciuic.model.presets import preset_tokenizer

    tokenizer = preset_tokenizer(preset)
    before = _hwm_bytes()
    run = RunConfig.model_validate(
        {
            "regions": ("eu",),
            "num_server_rounds": 1,
            "seed": 0,
            "local_steps": 1,
            "batch_size": 8,
            "learning_rate": 0.1,
            "seq_len": seq_len,
            "max_eval_examples": 128,
            "eval_fraction": 0.01,
            "node_wait_timeout": 1,
            "round_timeout": 1,
            "privacy_unit": "user",
            "deidentify": deidentify,
        }
    )
    node = NodeConfig(region="eu", data_path=str(data), state_path=str(state))
    start = time.perf_counter()
    loaded = load_region_data(run, node, tokenizer)
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "peak_rss_growth": _hwm_bytes() - before,
        "tokenised": float(loaded.tokenised_now),
        "examples": float(loaded.summary.examples),
        "tokens": float(loaded.summary.tokens),
        "users": float(loaded.train.num_units),
        "identifiers": float(
            sum(loaded.summary.deid.counts.values()) if loaded.summary.deid else 0
        ),
    }


def _in_process(
    data: Path, state: Path, preset: str, seq_len: int, deidentify: bool = True
) -> dict[str, float]:
    argv = [sys.executable, __file__, "--child", str(data), str(state), preset, str(seq_len)]
    argv.append(str(int(deidentify)))
    done = subprocess.run(argv, capture_output=True, text=True, check=True)
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def measure(
    megabytes: float, preset: str, seq_len: int, identifiers: float, numbers: float
) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="fedciuic-data-bench-") as tmp:
        data, state = Path(tmp) / "data", Path(tmp) / "state"
        records, signed = write_corpus(data, megabytes, identifiers=identifiers, numbers=numbers)
        plain = _in_process(data, Path(tmp) / "plain-state", preset, seq_len, deidentify=False)
        first = _in_process(data, state, preset, seq_len)
        second = _in_process(data, state, preset, seq_len)
        cache = sum(p.stat().st_size for p in (state / "data-cache").rglob("*") if p.is_file())
    assert first["tokenised"] and not second["tokenised"], "the second load tokenised again"
    scrubbing = first["seconds"] - plain["seconds"]
    return {
        "corpus_mb": megabytes,
        "records": records,
        "signed_records": signed,
        "numbers_share": numbers,
        "identifiers_replaced": first["identifiers"],
        "examples": first["examples"],
        "tokens": first["tokens"],
        "users": first["users"],
        "first_load_plain_s": plain["seconds"],
        "first_load_s": first["seconds"],
        "cached_load_s": second["seconds"],
        "cached_over_first": second["seconds"] / first["seconds"],
        "deid_s": scrubbing,
        "deid_records_per_s": records / scrubbing if scrubbing > 0 else float("inf"),
        "deid_mb_per_s": megabytes / scrubbing if scrubbing > 0 else float("inf"),
        "first_load_records_per_s": records / first["seconds"],
        "first_peak_rss_growth_mb": first["peak_rss_growth"] / 2**20,
        "cached_peak_rss_growth_mb": second["peak_rss_growth"] / 2**20,
        "cache_mb": cache / 2**20,
    }


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        data, state, preset, seq_len, deidentify = sys.argv[2:7]
        print(json.dumps(_child(Path(data), Path(state), preset, int(seq_len), deidentify == "1")))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=100.0)
    parser.add_argument("--preset", default="realistic")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--identifiers", type=float, default=0.05, help="share of signed records")
    parser.add_argument(
        "--numbers", type=float, default=1.0, help="share of answers with an amount and a date"
    )
    args = parser.parse_args()
    result = measure(args.mb, args.preset, args.seq_len, args.identifiers, args.numbers)
    print(json.dumps(result, indent=1))
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(
        f"{args.mb:g} MB corpus, {result['records']:,} records: first load "
        f"{result['first_load_s']:.1f} s with de-identification "
        f"({result['first_load_plain_s']:.1f} s without: de-identification "
        f"{result['deid_records_per_s']:,.0f} records/s, {result['deid_mb_per_s']:.2f} MB/s; "
        f"{result['identifiers_replaced']:.0f} identifiers replaced), cached load "
        f"{result['cached_load_s']:.2f} s ({result['cached_over_first']:.3f} of it); peak RSS "
        f"growth {result['first_peak_rss_growth_mb']:.0f} MB tokenising, "
        f"{result['cached_peak_rss_growth_mb']:.0f} MB from the cache"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
