"""The round, without Flower: a region's side of it (``region``: check, train under
DP, compress; ``region_round``: the region's whole round, an instruction in and a
typed outcome out), what travels between the parties (``wire``) and the aggregator's
checkpoint after each round (``checkpoint``)."""

from __future__ import annotations

from fedciuic.rounds.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from fedciuic.rounds.region import Region, TrainOutcome, open_region
from fedciuic.rounds.region_round import (
    Declined,
    Evaluated,
    RegionReply,
    Witnessed,
    handle_instruction,
    witness_run_end,
)
from fedciuic.rounds.sealing import Clear, Sealed

__all__ = [
    "Checkpoint",
    "Clear",
    "Declined",
    "Evaluated",
    "Region",
    "RegionReply",
    "Sealed",
    "TrainOutcome",
    "Witnessed",
    "handle_instruction",
    "load_checkpoint",
    "open_region",
    "save_checkpoint",
    "witness_run_end",
]
