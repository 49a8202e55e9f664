"""A region's data, read only under its own ``data-path`` (``corpus``), and the demo
corpora made locally from CPython's own documentation (``demo``)."""

from typing import TYPE_CHECKING

from fedciuic.faces import face

if TYPE_CHECKING:
    from fedciuic.data.check import SCAN_SAMPLE as SCAN_SAMPLE
    from fedciuic.data.check import check_data as check_data
    from fedciuic.data.check import scan_data as scan_data
    from fedciuic.data.corpus import Batch as Batch
    from fedciuic.data.corpus import ExampleSet as ExampleSet
    from fedciuic.data.corpus import RegionData as RegionData
    from fedciuic.data.corpus import bad_rows_refusal as bad_rows_refusal
    from fedciuic.data.corpus import load_region_data as load_region_data
    from fedciuic.data.corpus import users_refusal as users_refusal
    from fedciuic.data.demo import FAMILIES as FAMILIES
    from fedciuic.data.demo import module_docs as module_docs
    from fedciuic.data.demo import write_demo_corpora as write_demo_corpora
    from fedciuic.data.demo_pii import DEMO_DICTIONARIES as DEMO_DICTIONARIES
    from fedciuic.data.records import CHAT as CHAT
    from fedciuic.data.records import check_chat_template as check_chat_template
    from fedciuic.data.scrubbing import check_deid as check_deid
    from fedciuic.data.scrubbing import node_commitment as node_commitment
    from fedciuic.data.scrubbing import region_scrubber as region_scrubber
    from fedciuic.data.scrubbing import state_commitments as state_commitments
    from fedciuic.data.sources import NoDataFiles as NoDataFiles
    from fedciuic.data.tokenized import IGNORE as IGNORE
    from fedciuic.data.tokenized import dropped_for_length as dropped_for_length
    from fedciuic.data.tokenized import dropped_for_size as dropped_for_size
    from fedciuic.data.tokenized import oversized_details as oversized_details

__getattr__ = face(__name__)  # each name imported on first use
