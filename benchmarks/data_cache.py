"""A region's data is tokenised once: later rounds and runs read the Arrow cache.

Writes a chat corpus of ``--mb`` megabytes (JSON Lines, one user id per record), then,
each in its own process so that peak memory is its own: the first load (reads,
validates, renders with the chat template, tokenises and writes the cache) and a
second load (reads the cache). Prints both times, their ratio, each process's peak
RSS above what it held after loading the tokenizer, and the cache's size.

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


def write_corpus(folder: Path, megabytes: float, seed: int = 0) -> int:
    """Chat records from 5,000 users until the file reaches ``megabytes``."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    target = int(megabytes * 2**20)
    written = records = 0
    with open(folder / "chat.jsonl", "w", encoding="utf-8") as handle:
        while written < target:
            question = " ".join(rng.choices(WORDS, k=rng.randint(8, 40)))
            answer = " ".join(rng.choices(WORDS, k=rng.randint(20, 200)))
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
    return records


def _child(data: Path, state: Path, preset: str, seq_len: int) -> dict[str, float]:
    from fedciuic.config import NodeConfig, RunConfig
    from fedciuic.data.corpus import load_region_data
    from fedciuic.model.presets import preset_tokenizer

    tokenizer = preset_tokenizer(preset)
    before = _hwm_bytes()
    run = RunConfig(
        regions=("eu",),
        num_server_rounds=1,
        seed=0,
        local_steps=1,
        batch_size=8,
        learning_rate=0.1,
        seq_len=seq_len,
        max_eval_examples=128,
        eval_fraction=0.01,
        node_wait_timeout=1,
        round_timeout=1,
        privacy_unit="user",
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
    }


def _in_process(data: Path, state: Path, preset: str, seq_len: int) -> dict[str, float]:
    argv = [sys.executable, __file__, "--child", str(data), str(state), preset, str(seq_len)]
    done = subprocess.run(argv, capture_output=True, text=True, check=True)
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def measure(megabytes: float, preset: str, seq_len: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="fedciuic-data-bench-") as tmp:
        data, state = Path(tmp) / "data", Path(tmp) / "state"
        records = write_corpus(data, megabytes)
        first = _in_process(data, state, preset, seq_len)
        second = _in_process(data, state, preset, seq_len)
        cache = sum(p.stat().st_size for p in (state / "data-cache").rglob("*") if p.is_file())
    assert first["tokenised"] and not second["tokenised"], "the second load tokenised again"
    return {
        "corpus_mb": megabytes,
        "records": records,
        "examples": first["examples"],
        "tokens": first["tokens"],
        "users": first["users"],
        "first_load_s": first["seconds"],
        "cached_load_s": second["seconds"],
        "cached_over_first": second["seconds"] / first["seconds"],
        "first_peak_rss_growth_mb": first["peak_rss_growth"] / 2**20,
        "cached_peak_rss_growth_mb": second["peak_rss_growth"] / 2**20,
        "cache_mb": cache / 2**20,
    }


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        data, state, preset, seq_len = sys.argv[2:6]
        print(json.dumps(_child(Path(data), Path(state), preset, int(seq_len))))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=100.0)
    parser.add_argument("--preset", default="realistic")
    parser.add_argument("--seq-len", type=int, default=512)
    args = parser.parse_args()
    result = measure(args.mb, args.preset, args.seq_len)
    print(json.dumps(result, indent=1))
    print(
        f"{args.mb:g} MB corpus: first load {result['first_load_s']:.1f} s (tokenise), cached "
        f"load {result['cached_load_s']:.2f} s ({result['cached_over_first']:.3f} of it); peak "
        f"RSS growth {result['first_peak_rss_growth_mb']:.0f} MB tokenising, "
        f"{result['cached_peak_rss_growth_mb']:.0f} MB from the cache"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
