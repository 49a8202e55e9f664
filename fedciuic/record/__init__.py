"""A run's ``metrics.json``: its schema (``metrics``, what ``ops/`` reads) and its
writer (``recorder``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedciuic.faces import face

if TYPE_CHECKING:
    from fedciuic.record.metrics import (
        OVERALL,
        EvalEntry,
        MetricsError,
        PolicyHeld,
        ResumedFrom,
        Rounds,
        RunHeader,
        RunMetrics,
        RunStatus,
        TrainEntry,
        dump_rounds,
        load_metrics,
        parse_rounds,
    )
    from fedciuic.record.recorder import (
        ADAPTER_DIR,
        METRICS_FILE,
        SUMMARY_FILE,
        RunRecorder,
        no_aggregate_reasons,
        published_rounds,
        save_metrics,
        utc_now,
    )

#: What other packages use, and the module each lives in: imported on first use.
_WHERE = {
    "ADAPTER_DIR": "recorder",
    "EvalEntry": "metrics",
    "METRICS_FILE": "recorder",
    "MetricsError": "metrics",
    "OVERALL": "metrics",
    "PolicyHeld": "metrics",
    "ResumedFrom": "metrics",
    "Rounds": "metrics",
    "RunHeader": "metrics",
    "RunMetrics": "metrics",
    "RunRecorder": "recorder",
    "RunStatus": "metrics",
    "SUMMARY_FILE": "recorder",
    "TrainEntry": "metrics",
    "dump_rounds": "metrics",
    "load_metrics": "metrics",
    "no_aggregate_reasons": "recorder",
    "parse_rounds": "metrics",
    "published_rounds": "recorder",
    "save_metrics": "recorder",
    "utc_now": "recorder",
}
__all__ = [
    "ADAPTER_DIR",
    "METRICS_FILE",
    "OVERALL",
    "SUMMARY_FILE",
    "EvalEntry",
    "MetricsError",
    "PolicyHeld",
    "ResumedFrom",
    "Rounds",
    "RunHeader",
    "RunMetrics",
    "RunRecorder",
    "RunStatus",
    "TrainEntry",
    "dump_rounds",
    "load_metrics",
    "no_aggregate_reasons",
    "parse_rounds",
    "published_rounds",
    "save_metrics",
    "utc_now",
]
__getattr__ = face(__name__, _WHERE)
