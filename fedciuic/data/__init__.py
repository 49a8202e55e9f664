"""A region's data, read only under its own ``data-path`` (``corpus``), and the demo
corpora made locally from CPython's own documentation (``demo``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedciuic.faces import face

if TYPE_CHECKING:
    from fedciuic.data.check import SCAN_SAMPLE, check_data, scan_data
    from fedciuic.data.corpus import (
        Batch,
        ExampleSet,
        RegionData,
        bad_rows_refusal,
        load_region_data,
        users_refusal,
    )
    from fedciuic.data.demo import FAMILIES, module_docs, write_demo_corpora
    from fedciuic.data.demo_pii import DEMO_DICTIONARIES
    from fedciuic.data.records import CHAT, check_chat_template
    from fedciuic.data.scrubbing import Scrubbed, check_deid, region_scrubber
    from fedciuic.data.sources import NoDataFiles
    from fedciuic.data.tokenized import (
        IGNORE,
        dropped_for_length,
        dropped_for_size,
        oversized_details,
    )

#: What other packages use, and the module each lives in: imported on first use.
_WHERE = {
    "Batch": "corpus",
    "CHAT": "records",
    "DEMO_DICTIONARIES": "demo_pii",
    "ExampleSet": "corpus",
    "FAMILIES": "demo",
    "IGNORE": "tokenized",
    "NoDataFiles": "sources",
    "RegionData": "corpus",
    "SCAN_SAMPLE": "check",
    "Scrubbed": "scrubbing",
    "bad_rows_refusal": "corpus",
    "check_chat_template": "records",
    "check_data": "check",
    "check_deid": "scrubbing",
    "dropped_for_length": "tokenized",
    "dropped_for_size": "tokenized",
    "load_region_data": "corpus",
    "region_scrubber": "scrubbing",
    "module_docs": "demo",
    "oversized_details": "tokenized",
    "scan_data": "check",
    "users_refusal": "corpus",
    "write_demo_corpora": "demo",
}
__all__ = [
    "CHAT",
    "DEMO_DICTIONARIES",
    "FAMILIES",
    "IGNORE",
    "SCAN_SAMPLE",
    "Batch",
    "ExampleSet",
    "NoDataFiles",
    "RegionData",
    "Scrubbed",
    "bad_rows_refusal",
    "check_chat_template",
    "check_data",
    "check_deid",
    "dropped_for_length",
    "dropped_for_size",
    "load_region_data",
    "module_docs",
    "oversized_details",
    "region_scrubber",
    "scan_data",
    "users_refusal",
    "write_demo_corpora",
]
__getattr__ = face(__name__, _WHERE)
