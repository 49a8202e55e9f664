"""The compliance report prints each privacy figure to what it means (noise multiplier
to 3 significant digits, epsilon to 2 decimals, delta as 1e-05), in both its Markdown
and its HTML; the region's log keeps the exact values."""

from __future__ import annotations

from fedciuic.audit.events import Event
from fedciuic.audit.report import _privacy_section, to_html, to_markdown

NOISE, EPSILON, DELTA = 0.99365234375, 4.5296698030839195, 1e-05


def test_privacy_figures_are_rounded_to_what_they_mean():
    details = {
        "noise_multiplier": NOISE,
        "sample_rate": 0.015625,
        "max_grad_norm": 1.0,
        "steps": 12,
        "unit": "record",
        "delta": DELTA,
        "epsilon": EPSILON,
    }
    records = [{"event": Event.TRAINED, "round": 1, "details": details}]
    section = _privacy_section({"eu": records})
    (row,) = section.rows
    assert row == ("1", "eu", "0.994", "0.0156", "1.0", "12", "record", "1e-05", "4.53")
    for page in (to_markdown(1, [section]), to_html(1, [section])):
        assert "0.994" in page and "4.53" in page and "1e-05" in page
        assert str(NOISE) not in page and str(EPSILON) not in page
    assert details["noise_multiplier"] == NOISE and details["epsilon"] == EPSILON


def test_a_figure_that_is_not_a_number_prints_as_it_is():
    details = {"noise_multiplier": None, "delta": "1e-05", "epsilon": 2}
    records = [{"event": Event.TRAINED, "round": 1, "details": details}]
    (row,) = _privacy_section({"eu": records}).rows
    assert row[2] == "-" and row[7] == "1e-05" and row[8] == "2.00"
