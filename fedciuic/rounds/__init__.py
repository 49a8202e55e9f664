"""The round, without Flower: a region's side of it (``region``: check, train under
DP, compress) and the aggregator's checkpoint after each round (``checkpoint``)."""

from __future__ import annotations

from fedciuic.rounds.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from fedciuic.rounds.region import Region, TrainOutcome, open_region

__all__ = [
    "Checkpoint",
    "Region",
    "TrainOutcome",
    "load_checkpoint",
    "open_region",
    "save_checkpoint",
]
