"""The round, without Flower: a region's side of it (``region``: check, train under
DP, compress; ``region_round``: the region's whole round, an instruction in and a
typed outcome out), what travels between the parties (``wire``), the aggregator's
checkpoint after each round (``checkpoint``) and the run's ``metrics.json`` (``metrics``,
written by ``record``)."""

from __future__ import annotations

from fedciuic.rounds.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from fedciuic.rounds.metrics import MetricsError, RoundRecord, RunMetrics, RunStatus, load_metrics
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
    "MetricsError",
    "Region",
    "RegionReply",
    "RoundRecord",
    "RunMetrics",
    "RunStatus",
    "Sealed",
    "TrainOutcome",
    "Witnessed",
    "handle_instruction",
    "load_checkpoint",
    "load_metrics",
    "open_region",
    "save_checkpoint",
    "witness_run_end",
]
