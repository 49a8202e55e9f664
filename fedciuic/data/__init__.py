"""A region's data, read only under its own ``data-path`` (``corpus``), and the demo
corpora made locally from CPython's own documentation (``demo``)."""

from __future__ import annotations

from fedciuic.data.corpus import RegionData, load_region_data
from fedciuic.data.demo import write_demo_corpora

__all__ = ["RegionData", "load_region_data", "write_demo_corpora"]
