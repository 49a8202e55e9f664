"""The benchmark report: verdicts follow the figures, and the scaling measure means linear."""

from __future__ import annotations

import json
import sys

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))  # as run_all.py runs them: scripts, not a package
from aggregation import scaling
from run_all import table


def rows_of(results):
    return {row[0]: row for row in table(results)}


def test_verdicts_follow_the_figures_and_targets():
    results = {
        "communication": {
            "default_codec": "topk-int8:0.015",
            "codecs": {
                "dense": {
                    "update_bytes": 35000,
                    "wire_bytes": 37000,
                    "final_eval_loss": 4.45,
                    "eval_loss_per_round": [5.0, 4.45],
                },
                "topk-int8:0.015": {  # 105x fewer sealed bytes, +1.1 % loss
                    "update_bytes": 300,
                    "wire_bytes": 350,
                    "final_eval_loss": 4.50,
                    "eval_loss_per_round": [5.0, 4.50],
                },
                "topk-sign:0.01": {  # 185x, +4.5 %
                    "update_bytes": 150,
                    "wire_bytes": 200,
                    "final_eval_loss": 4.65,
                    "eval_loss_per_round": [5.0, 4.65],
                },
            },
        },
        "overhead": {
            "ratio": 1.2,
            "plain_s": 2.0,
            "fedciuic_s": 2.4,
            "plain_rounds": [2.0],
            "fedciuic_rounds": [2.4],
        },
        "audit": {"ratio": 0.001},
    }
    rows = {name.split(";")[0]: row for name, row in rows_of(results).items()}
    assert rows["quality over rounds, topk-int8:0.015 (the default)"][3] == "met"
    assert rows["quality over rounds, topk-sign:0.01 (most aggressive)"][3] == "**not met**"
    assert rows["end-to-end round vs plain Flower FedAvg"][3] == "**not met**"
    assert rows["audit log cost"][3] == "met"


def test_scaling_is_one_when_time_grows_with_regions_exactly():
    rows = [
        {"entries": n, "regions": c, "seconds": c * n * 1e-9}
        for n in (10**5, 10**6)
        for c in (10, 100, 1000)
    ]
    assert abs(scaling(rows) - 1.0) < 1e-9
    rows[-1]["seconds"] *= 3  # 1000 regions three times dearer than linear
    assert abs(scaling(rows) - 3.0) < 1e-9


def test_the_committed_results_table_is_the_one_the_script_writes():
    results = json.loads((ROOT / "benchmarks" / "results" / "results.json").read_text())
    written = (ROOT / "benchmarks" / "results" / "results.md").read_text()
    for row in table(results):
        assert "| " + " | ".join(row) + " |" in written
