"""A region's side of the round, without Flower: ``round`` (the region's whole round:
an instruction in, checks, keys, policy, training, sealing, its audit trail, and a typed
outcome out), ``trainer`` (the model, data and DP part of it) and ``cache`` (the regions
a process keeps open between rounds)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedciuic.faces import face

if TYPE_CHECKING:
    from fedciuic.region.round import (
        RegionReply,
        close_regions,
        decline_signed,
        handle_instruction,
        read_configs,
        read_run,
        region_log,
        region_name,
        region_records,
        unreadable,
        witness_run_end,
    )

#: What other packages use, and the module each lives in: imported on first use.
_WHERE = {
    "RegionReply": "round",
    "close_regions": "round",
    "decline_signed": "round",
    "handle_instruction": "round",
    "read_configs": "round",
    "read_run": "round",
    "region_log": "round",
    "region_name": "round",
    "region_records": "round",
    "unreadable": "round",
    "witness_run_end": "round",
}
__all__ = [
    "RegionReply",
    "close_regions",
    "decline_signed",
    "handle_instruction",
    "read_configs",
    "read_run",
    "region_log",
    "region_name",
    "region_records",
    "unreadable",
    "witness_run_end",
]
__getattr__ = face(__name__, _WHERE)
