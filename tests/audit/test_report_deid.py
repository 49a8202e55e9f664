"""The compliance report's de-identification section: counts per entity type, the name
types labelled so that a reader sees names (and how they were found)."""

from __future__ import annotations

from fedciuic.audit.events import Event
from fedciuic.audit.report import _deid_section


def test_name_counts_show_with_what_found_them():
    identity = {"config_hash": "ab" * 32, "replacement": "placeholder", "recognizers": {}}
    counts = {"EMAIL_ADDRESS": 3, "DICTIONARY": 2, "CONTEXT_NAME": 1, "PERSON": 4}
    records = [
        {
            "event": Event.DATA_DEIDENTIFIED,
            "round": 1,
            "details": {"identity": identity, "counts": counts, "records": 5},
        },
        {"event": Event.TRAINED, "round": 1, "details": {}},
        {"event": Event.TRAINED, "round": 2, "details": {}},
    ]
    section = _deid_section({"cn": records})
    first, second = section.rows
    assert first[-1] == (
        "CONTEXT_NAME (names, by context) 1, DICTIONARY (names, dictionary) 2, "
        "EMAIL_ADDRESS 3, PERSON (names, NER) 4"
    )
    assert second[-1] == "not de-identified"
