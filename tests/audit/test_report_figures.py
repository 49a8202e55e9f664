"""The compliance report prints each privacy figure to what it means (noise multiplier
to 3 significant digits, epsilon to 2 decimals, delta as 1e-05), in both its Markdown
and its HTML; the region's log keeps the exact values."""

from __future__ import annotations

from fedciuic.audit.events import Event
from fedciuic.audit.report import _outside_dp_section, _privacy_section, to_html, to_markdown

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


def test_figures_outside_dp_are_what_no_dp_release_covered():
    """An exact count, an exact held-out loss and a top-k update's size are listed; a run's
    DP count, a DP evaluation and a fixed-size update are not, and a run that sent
    only DP releases says so."""

    def record(event: str, run_id: int, **details: object) -> dict[str, object]:
        return {"event": event, "run_id": run_id, "round": 1, "details": details}

    exact = [
        record(Event.TRAINED, 1, examples=40, steps=3, size_of_data=True),
        record(Event.EVALUATED, 1, examples=8, loss=2.5),
        record(Event.UPDATE_SEALED, 1, bytes=1234),
    ]
    dp = [
        record(Event.UNITS_COUNTED, 2, count=41, ledger={}),
        record(Event.TRAINED, 2, examples=40, steps=3, size_of_data=False),
        record(Event.EVALUATED, 2, examples=8, loss=2.4, ledger={}),
        record(Event.UPDATE_SEALED, 2, bytes=1000),
    ]
    section = _outside_dp_section({"eu": exact + dp})
    assert sorted(row[2] for row in section.rows) == ["evaluated", "trained", "update size"]
    assert all(row[1] == "eu" for row in section.rows)
    only_dp = _outside_dp_section({"eu": dp})
    assert not only_dp.rows and only_dp.paragraphs[0].startswith("None:")


def test_figures_outside_dp_are_the_fields_a_region_recorded_sending_as_data():
    """Where a region's records list what it sent outside DP (outside_dp), the report
    lists exactly those fields, whatever else the record holds, and nothing for a round
    that sent none (the update's size then is listed only if the record says so)."""

    def record(event: str, server_round: int, **details: object) -> dict[str, object]:
        return {"event": event, "run_id": 3, "round": server_round, "details": details}

    records = [
        record(Event.TRAINED, 1, examples=40, size_of_data=True, outside_dp=["train-loss"]),
        record(Event.UPDATE_SEALED, 1, bytes=1234),
        record(Event.EVALUATED, 1, examples=8, loss=2.5, outside_dp=["step-seconds"]),
        record(Event.TRAINED, 2, examples=40, size_of_data=False, outside_dp=[]),
        record(Event.EVALUATED, 2, examples=8, loss=2.4, outside_dp=[]),
    ]
    section = _outside_dp_section({"us": records})
    assert sorted(map(tuple, section.rows)) == [
        ("1", "us", "evaluated", "step-seconds"),
        ("1", "us", "trained", "train-loss"),
    ]
    quiet = _outside_dp_section({"us": records[3:]})
    assert not quiet.rows and quiet.paragraphs[0].startswith("None:")
