"""The round, without Flower: a region's side of it (``region``: check, train under
DP, compress; ``region_round``: the region's whole round, an instruction in and a
typed outcome out), what travels between the parties (``wire``), the aggregator's
checkpoint after each round (``checkpoint``) and the run's ``metrics.json`` (``metrics``,
written by ``record``)."""

from __future__ import annotations

from importlib import import_module
from typing import Any

#: Where each name lives; imported on first use, so that importing one module of the
#: package (``wire``, say: the relay, which imports no torch)
#: does not import torch with ``region``.
_WHERE = {
    "Checkpoint": "checkpoint",
    "load_checkpoint": "checkpoint",
    "save_checkpoint": "checkpoint",
    "MetricsError": "metrics",
    "RoundRecord": "metrics",
    "RunMetrics": "metrics",
    "RunStatus": "metrics",
    "load_metrics": "metrics",
    "Region": "region",
    "TrainOutcome": "region",
    "open_region": "region",
    "Declined": "region_round",
    "Evaluated": "region_round",
    "RegionReply": "region_round",
    "Witnessed": "region_round",
    "handle_instruction": "region_round",
    "witness_run_end": "region_round",
    "Clear": "sealing",
    "Sealed": "sealing",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_WHERE[name]}"), name)


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
