"""A region's side of the round, without Flower: ``round`` (the region's whole round:
an instruction in, checks, keys, policy, sealing, its audit trail, and a typed outcome
out), ``trainer`` (the model, data, DP and privacy ledger, and the release of the
round's update: kept, charged to the ledger, noted), ``secure`` (its part in a secure
sum) and ``cache`` (the regions a process keeps open between rounds)."""

from typing import TYPE_CHECKING

from fedciuic.faces import face

if TYPE_CHECKING:
    from fedciuic.region.round import RegionReply as RegionReply
    from fedciuic.region.round import close_regions as close_regions
    from fedciuic.region.round import decline_signed as decline_signed
    from fedciuic.region.round import handle_instruction as handle_instruction
    from fedciuic.region.round import read_configs as read_configs
    from fedciuic.region.round import read_run as read_run
    from fedciuic.region.round import region_log as region_log
    from fedciuic.region.round import region_name as region_name
    from fedciuic.region.round import region_records as region_records
    from fedciuic.region.round import unreadable as unreadable
    from fedciuic.region.round import witness_run_end as witness_run_end

__getattr__ = face(__name__)  # each name imported on first use
