"""benchmarks/deidentification.py: what it generates holds what it says, its scoring
recovers what each placeholder replaced, its verdicts follow the figures, and a small run
goes through the region's read path end to end."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))  # as run_all.py runs them: scripts, not a package
import deidentification as bench


def _luhn_ok(digits: str) -> bool:
    ok: bool = bench.luhn_digit(digits[:-1]) == digits[-1]
    return ok


def test_luhn_check_digit_matches_the_published_example():
    assert bench.luhn_digit("7992739871") == "3"
    assert _luhn_ok("4111111111111111")


def test_every_record_holds_its_identifier_verbatim_and_generation_is_seeded():
    docs, names = bench.generate(records=48, clean=16, seed=3)
    again, _ = bench.generate(records=48, clean=16, seed=3)
    assert [(d.rid, d.values) for d in docs] == [(d.rid, d.values) for d in again]
    assert {d.locale for d in docs} == set(bench.LOCALES)
    assert {d.shape for d in docs} == set(bench.SHAPES)
    planted = [d for d in docs if d.planted is not None]
    assert len(planted) == 48 * len(bench.LOCALES)
    for doc in planted:
        assert doc.planted is not None
        written = json.dumps(doc.values, ensure_ascii=False)
        assert doc.planted.value in written, doc
        if doc.planted.entity == "card":
            assert _luhn_ok("".join(c for c in doc.planted.value if c.isdigit())), doc.planted
    assert len(names) == sum(d.planted.entity == "name" for d in planted if d.planted)
    clean = [d for d in docs if d.planted is None]
    assert len(clean) == 16 and all(d.clean in bench.CLEAN_KINDS for d in clean)


def test_latin_words_stay_spaced_in_chinese_sentences():
    assert bench.filled("关于{label}{x}的申请", label="IP", x="10.0.0.1") == "关于IP 10.0.0.1的申请"
    assert bench.filled("关于{label}{x}的申请", label="卡号", x="4111") == "关于卡号4111的申请"
    assert bench.filled("Sehr geehrte{r|} {t} {x},", True, t="Frau", x="Weber") == (
        "Sehr geehrte Frau Weber,"
    )


def test_what_each_placeholder_replaced_is_recovered():
    original = "Call 555-0100 or mail jane@example.org, Mr. John Allen."
    scrubbed = "Call <PHONE> or mail <EMAIL>, Mr. <NAME>."
    assert bench.replaced(original, scrubbed) == [
        ("PHONE", "555-0100"),
        ("EMAIL", "jane@example.org"),
        ("NAME", "John Allen"),
    ]
    assert bench.replaced(original, original) == []
    assert bench.replaced(original, "something else <NAME>") is None


def test_a_piece_left_behind_counts_as_partial():
    template = "Please forward this to Mr. ."
    assert bench.partial("John Allen", "Please forward this to Mr. John <NAME>.", template)
    assert not bench.partial("John Allen", "Please forward this to Mr. <NAME>.", template)
    assert bench.partial("黎淑珍", "我叫<NAME>淑珍", "我叫")
    assert not bench.partial("黎淑珍", "我叫黎<NAME>", "我叫")  # one character is no piece


def _canned(recall: float, names: float, share: float) -> dict[str, Any]:
    cell = {"n": 100, "caught": round(100 * recall), "partial": 0, "recall": recall}
    return {
        "settings": {"identifiers": 100},
        "recall": [
            {"entity": "card", "kind": "visa16", "target": True, "total": cell},
            {
                "entity": "phone",
                "kind": "not a valid number",
                "target": False,
                "total": dict(cell, recall=0.1),
            },
        ],
        "names": {
            "dictionary": {"total": {"recall": names}},
            "offline": {"total": {"recall": 0.5}, "precision": {"precision": 0.99}},
        },
        "clean": {"share": share, "records": 1200},
        "letters": {"share": 0.3, "records": 138},
        "throughput": {"records_per_s": 600.0, "mb_per_s": 0.13},
    }


def test_verdicts_follow_the_figures_and_only_target_rows_count():
    met = bench.rows(_canned(recall=1.0, names=0.96, share=0.015))
    assert [row[3] for row in met] == ["met", "met", "reported", "met", "reported", "reported"]
    assert "precision 0.990" in met[2][1]
    missed = bench.rows(_canned(recall=0.98, names=0.9, share=0.03))
    assert [row[3] for row in missed][:4] == [
        "**not met**",
        "**not met**",
        "reported",
        "**not met**",
    ]


def test_a_small_run_reads_and_scrubs_every_record_as_a_region_does():
    args = argparse.Namespace(records=12, clean=12, seed=0, ner_model="")
    result = bench.measure(args)
    assert result["throughput"]["records"] == 12 * len(bench.LOCALES) + 12
    cells = [row["total"] for row in result["recall"]]
    assert sum(c["n"] for c in cells) + result["names"]["dictionary"]["total"]["n"] == 72
    assert result["clean"]["records"] + result["letters"]["records"] == 12
    report = bench.markdown(result)
    assert "| entity: kind |" in report and "## Clean text" in report
    assert len(bench.rows(result)) == 6
